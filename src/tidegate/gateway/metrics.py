"""Prometheus metrics of one gateway process, on a registry of its own (so tests can build many).

Names follow Prometheus conventions: ``_total`` counters, ``_seconds`` histograms; label values are
bounded sets (route aliases, provider names, classes, outcome codes), never ids.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest

__all__ = ["Metrics"]

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


class Gauge(_CachedChildren, prometheus_client.Gauge):
    pass


class Histogram(_CachedChildren, prometheus_client.Histogram):
    pass


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "tidegate_requests",
            "Requests answered, by route, serving model and outcome code.",
            ["route", "model", "served_by", "outcome"],
            registry=r,
        )
        self.latency = Histogram(
            "tidegate_request_duration_seconds",
            "Time from receiving a request to its last byte, by route and outcome.",
            ["route", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
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
        self.queue_depth = Gauge(
            "tidegate_admission_queue_depth",
            "Requests waiting for a slot, by class.",
            ["klass"],
            registry=r,
        )
        self.refusals = Counter(
            "tidegate_refusals",
            "Requests refused by a policy, by class and reason.",
            ["klass", "reason"],
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
        self.attempts = Counter(
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
        self.budget_denials = Counter(
            "tidegate_budget_denials",
            "Requests blocked by a daily budget.",
            ["dimension"],
            registry=r,
        )
        self.budget_degraded = Counter(
            "tidegate_budget_degraded", "Requests degraded by a daily budget.", registry=r
        )
        self.spend = Counter(
            "tidegate_spend_usd", "Spend in US dollars by serving model.", ["model"], registry=r
        )
        self.tokens = Counter(
            "tidegate_tokens",
            "Tokens by serving model and direction.",
            ["model", "direction"],
            registry=r,
        )
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

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
