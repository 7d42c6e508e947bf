"""Prometheus metrics of one gateway process, on a registry of its own (so tests can build many).

Names follow Prometheus conventions: ``_total`` counters, ``_seconds`` histograms; label values are
bounded sets (route aliases, provider names, classes, outcome codes), never ids.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

__all__ = ["LoopCounter", "LoopHistogram", "Metrics"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _CachedChildren:
    """``labels(*values)`` remembers each child by its values: the request path asks for the same
    few label sets on every request, and prometheus_client's own lookup (validation, string
    conversion, a lock) costs several times a dict lookup. The label values are bounded sets, so
    the cache holds exactly the children the metric holds anyway."""

    _children_by_values: dict[tuple[Any, ...], Any]

    def labels(self, *values: Any, **by_name: Any) -> Any:
        if by_name:
            return super().labels(*values, **by_name)  # type: ignore[misc]
        try:
            return self._children_by_values[values]
        except AttributeError:
            self._children_by_values = {}
        except KeyError:
            pass
        child = self._children_by_values[values] = super().labels(*values)  # type: ignore[misc]
        return child

    def remove(self, *values: Any) -> None:
        self.__dict__.pop("_children_by_values", None)
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self.__dict__.pop("_children_by_values", None)
        super().clear()  # type: ignore[misc]


class Counter(_CachedChildren, prometheus_client.Counter):
    pass


class _LoopFamily:
    """Children by label values, counted in plain attributes and read by the registry at scrape
    time through prometheus_client's collector interface.

    For the metrics every request updates (several of them per request): prometheus_client's
    own counters take a lock and check the metric on every update, which the gateway's event
    loop (the only thread that updates these) does not need; here an update is one addition.
    The exposition is prometheus_client's own, from the families :meth:`collect` returns (no
    ``_created`` series).
    """

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *, registry: Any
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        #: Children by their label values as given (the lookup of every update), and by the
        #: values as strings (what the exposition shows; two spellings share one child).
        self._by_values: dict[tuple[Any, ...], Any] = {}
        self._children: dict[tuple[str, ...], Any] = {}
        if not self._labelnames:
            self.labels()  # shown from the start, at zero, as prometheus_client shows it
        registry.register(self)

    def _new_child(self) -> Any:
        raise NotImplementedError

    def labels(self, *values: Any, **by_name: Any) -> Any:
        """The child for these label values (positional, or all by name), made on first use."""
        if not by_name:  # the request path's call: values in order, of a child already made
            try:
                return self._by_values[values]
            except KeyError:
                pass
        else:
            if values or sorted(by_name) != sorted(self._labelnames):
                raise ValueError(f"{self._name}: the labels are {list(self._labelnames)}")
            values = tuple(by_name[name] for name in self._labelnames)
        if len(values) != len(self._labelnames):
            raise ValueError(
                f"{self._name}: {len(self._labelnames)} label values expected, got {len(values)}"
            )
        key = tuple(str(value) for value in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        self._by_values[values] = child
        return child

    def remove(self, *values: Any) -> None:
        key = tuple(str(value) for value in values)
        child = self._children.pop(key, None)
        self._by_values = {k: c for k, c in self._by_values.items() if c is not child}

    def clear(self) -> None:
        self._children.clear()
        self._by_values.clear()
        if not self._labelnames:
            self.labels()

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _family(self) -> Any:
        raise NotImplementedError


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class LoopCounter(_LoopFamily):
    """A counter updated from the event loop only (see :class:`_LoopFamily`)."""

    def _new_child(self) -> _CounterChild:
        return _CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        """Count on the metric itself (one without labels)."""
        self.labels().inc(amount)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def items(self) -> list[tuple[tuple[str, ...], float]]:
        """Each child's label values (as strings) and count, in this process."""
        return [(key, child.value) for key, child in self._children.items()]

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for key, child in self._children.items():
            family.add_metric(key, child.value)
        return [family]


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        #: Observations per bucket, not cumulative; the last bucket is +Inf.
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.counts[bisect_left(self.bounds, amount)] += 1


class LoopHistogram(_LoopFamily):
    """A histogram updated from the event loop only (see :class:`_LoopFamily`); an
    observation goes in the first bucket whose upper bound it does not exceed."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: Any,
    ) -> None:
        bounds = sorted(float(b) for b in buckets)
        if bounds[-1] != float("inf"):
            bounds.append(float("inf"))
        self._bounds = tuple(bounds)
        self._les = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry=registry)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self._bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def totals(self) -> tuple[int, float]:
        """The number and the sum of the observations of every child, in this process."""
        children = list(self._children.values())
        return sum(sum(c.counts) for c in children), sum(c.sum for c in children)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for key, child in self._children.items():
            cumulative, buckets = 0, []
            for le, count in zip(self._les, child.counts, strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(key, buckets, child.sum)
        return [family]


class Gauge(_CachedChildren, prometheus_client.Gauge):
    pass


class Metrics:
    """Every metric of one gateway process, on a registry of its own.

    Defined a family at a time, in the order ``/metrics`` lists them (the registry's order):
    the requests, admission, the providers, budgets and spend, the shared state, and the
    answers given some other way than a model's first stream.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        #: The exposition of every worker process's metrics together (set when they share).
        self.merged: Callable[[], bytes] | None = None
        self._by_model: dict[str, tuple[Any, Any, Any]] = {}
        self._define_requests(self.registry)
        self._define_admission(self.registry)
        self._define_providers(self.registry)
        self._define_budgets(self.registry)
        self._define_state(self.registry)
        self._define_rescues(self.registry)

    def _define_requests(self, r: CollectorRegistry) -> None:
        self.requests = LoopCounter(
            "tidegate_requests",
            "Requests answered, by route, serving model and outcome code.",
            ["route", "model", "served_by", "outcome"],
            registry=r,
        )
        self.latency = LoopHistogram(
            "tidegate_request_duration_seconds",
            "Time from receiving a request to its last byte, by route and outcome.",
            ["route", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = LoopHistogram(
            "tidegate_time_to_first_token_seconds",
            "Time from receiving a streaming request to its first content chunk.",
            ["route", "served_by"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        #: Set from ``Runtime.in_flight`` when /metrics is scraped, not on every request.
        self.in_flight = Gauge(
            "tidegate_in_flight_requests", "Requests being handled now.", registry=r
        )

    def _define_admission(self, r: CollectorRegistry) -> None:
        self.queue_depth = Gauge(
            "tidegate_admission_queue_depth",
            "Requests waiting for a slot, by class.",
            ["klass"],
            registry=r,
        )
        self.refusals = LoopCounter(
            "tidegate_refusals",
            "Requests refused by a policy, by class and reason.",
            ["klass", "reason"],
            registry=r,
        )

    def _define_providers(self, r: CollectorRegistry) -> None:
        #: Set from the providers' latest reports when /metrics is scraped.
        self.headroom_remaining = Gauge(
            "tidegate_provider_headroom_remaining",
            "What a provider last reported left of its rate limit, by resource"
            " (requests, tokens, input_tokens, output_tokens).",
            ["provider", "resource"],
            registry=r,
        )
        self.breaker_state = Gauge(
            "tidegate_breaker_state",
            "Circuit breaker state per provider: 0 closed, 1 half-open, 2 open.",
            ["provider"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "tidegate_breaker_transitions",
            "Circuit breaker state changes per provider.",
            ["provider", "to"],
            registry=r,
        )
        self.attempts = LoopCounter(
            "tidegate_provider_attempts",
            "Calls to providers, by provider and result (ok or an error kind).",
            ["provider", "result"],
            registry=r,
        )
        self.failovers = Counter(
            "tidegate_failovers",
            "Times a request moved on to the next provider, by the provider left and why.",
            ["provider", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "tidegate_retries", "Retries scheduled on the same provider.", ["provider"], registry=r
        )
        self.retry_budget_denials = Counter(
            "tidegate_retry_budget_denials", "Retries the retry budget refused.", registry=r
        )

    def _define_budgets(self, r: CollectorRegistry) -> None:
        self.budget_denials = Counter(
            "tidegate_budget_denials",
            "Requests blocked by a daily budget.",
            ["dimension"],
            registry=r,
        )
        self.budget_degraded = Counter(
            "tidegate_budget_degraded", "Requests degraded by a daily budget.", registry=r
        )
        self.spend = LoopCounter(
            "tidegate_spend_usd", "Spend in US dollars by serving model.", ["model"], registry=r
        )
        self.tokens = LoopCounter(
            "tidegate_tokens",
            "Tokens by serving model and direction.",
            ["model", "direction"],
            registry=r,
        )

    def _define_state(self, r: CollectorRegistry) -> None:
        self.cache = Counter(
            "tidegate_cache_lookups", "Response cache lookups by result.", ["result"], registry=r
        )
        self.single_flight = Counter(
            "tidegate_single_flight_followers",
            "Requests that shared another identical request's upstream call.",
            registry=r,
        )
        self.store_errors = Counter(
            "tidegate_store_errors",
            "State store failures by store and what was done (fail_open or fail_closed).",
            ["store", "action"],
            registry=r,
        )

    def _define_rescues(self, r: CollectorRegistry) -> None:
        self.stream_rescues = Counter(
            "tidegate_stream_rescues",
            "Streams that broke after the first chunk, by what rescued them (or none).",
            ["strategy"],
            registry=r,
        )
        self.malformed_chunks = Counter(
            "tidegate_malformed_chunks",
            "Upstream stream chunks that could not be parsed and were skipped.",
            ["provider"],
            registry=r,
        )
        self.degraded = Counter(
            "tidegate_degraded_answers",
            "Answers given without a model, by source (stale_cache or corpus).",
            ["source"],
            registry=r,
        )

    def model_children(self, model: str) -> tuple[Any, Any, Any]:
        """The spend, prompt-token and completion-token counters of ``model``, looked up once."""
        try:
            return self._by_model[model]
        except KeyError:
            pass
        children = self._by_model[model] = (
            self.spend.labels(model),
            self.tokens.labels(model, "prompt"),
            self.tokens.labels(model, "completion"),
        )
        return children

    def exposition(self) -> bytes:
        """The text exposition: this process's, or every worker's merged when serving with
        ``--workers N`` (:mod:`tidegate.gateway.worker_metrics` sets :attr:`merged`)."""
        if self.merged is not None:
            return self.merged()
        return generate_latest(self.registry)
