"""Replay a recorded request log through a candidate config's admission, retry and breaker.

The log is what the gateway wrote, raw (one JSON ``request`` line per request, with its
``priority`` class and ``deadline_ms``; the start-up banner, uvicorn's text lines and other
events are skipped and counted), or any trace with an arrival time, class, tenant, tokens,
latency and outcome per request (see :func:`~tidegate.lab.workload.load_trace`). The candidate
config is a tidegate YAML file read by the gateway's own loader (:func:`load_replay_config`):
its ``admission``, ``retry``, ``breaker``, ``server.request_timeout_s`` and the routes'
``per_try_timeout_s`` make the replay's policies, built by the gateway's own builders.

How the provider behaves is read from the log itself: a request that was answered (``ok``) says
the provider was healthy at that moment, one that failed with ``provider_<kind>`` says it was
failing that way; refusals by the gateway say nothing about it. A first attempt gets its own
request's recorded outcome and latency; a retry gets the provider's state at the moment it is
made (the latest evidence before it). Each request then goes through the real
:class:`~tidegate.policy.admission.AdmissionController`, then the gateway's own combination of
retries, retry budget and breaker (:class:`~tidegate.policy.attempts.AttemptPolicy`, driven on
the event queue by :func:`~tidegate.lab.calls.run_call`: a permit is released, not failed, when
the error says nothing about the provider), and the report compares the outcomes.
"""

from __future__ import annotations

import bisect
import functools
import math
import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tidegate.clock import Clock
from tidegate.errors import DeadlineExceeded, ProviderError, ProviderErrorKind, Rejected
from tidegate.lab.calls import run_call
from tidegate.lab.engine import EventQueue
from tidegate.lab.report import percentile
from tidegate.lab.workload import Trace, TraceRecord
from tidegate.policy.admission import AdmissionController, AdmissionOptions, Ticket, TicketState
from tidegate.policy.attempts import AttemptPolicy, Call, Stop
from tidegate.policy.breaker import BreakerOptions, CircuitBreaker
from tidegate.policy.deadline import Deadline
from tidegate.policy.retry import RetryBudget, RetryOptions
from tidegate.policy.routing import FailoverOptions, ProviderSpec, RoutePlan, retry_same

__all__ = [
    "OUTCOMES",
    "ReplayConfig",
    "ReplayResult",
    "load_replay_config",
    "replay_log",
    "sample_log",
]

_PROVIDER: Final = ProviderSpec("provider", frozenset({"internal"}))
_PLAN: Final = RoutePlan((_PROVIDER,), ())
#: Outcome groups a replayed request can end in.
OUTCOMES: Final = ("ok", "provider_error", "shed", "expired", "circuit_open", "other")

_REFUSALS: Final = frozenset(
    {
        "queue_full",
        "deadline_unmeetable",
        "bulkhead_full",
        "rate_limited",
        "budget_exceeded",
        "unavailable",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayConfig:
    """The candidate settings a log is replayed through."""

    admission: AdmissionOptions = field(
        default_factory=lambda: AdmissionOptions(classes=("critical", "standard", "batch"))
    )
    retry: RetryOptions = field(default_factory=RetryOptions)
    budget_ratio: float = 0.1
    budget_floor_per_s: float = 1.0
    breaker: BreakerOptions = field(default_factory=BreakerOptions)
    #: The failover table's options (``retry.retry_timeouts_on_same_provider``).
    failover: FailoverOptions = field(default_factory=FailoverOptions)
    #: Seconds a request may take in all (the gateway's ``server.request_timeout_s``); a
    #: logged request's own deadline (``deadline_ms``) shortens it, never lengthens it.
    deadline: float = 60.0
    #: Seconds one provider attempt may take (the gateway's route ``per_try_timeout_s``).
    per_try: float = 15.0

    def attempt_policy(
        self,
        clock: Clock,
        providers: tuple[str, ...],
        *,
        rng: random.Random,
        breaker_rng: random.Random | None = None,
    ) -> AttemptPolicy:
        """The combination of retries, retry budget, breakers and failover these settings make,
        built as the gateway builds its own: one breaker per provider (drawing its recovery
        jitter from ``breaker_rng``, or from ``rng`` as the gateway's do), the retry budget and
        the failover table's rule for retrying the same provider."""
        breakers = {
            name: CircuitBreaker(name, self.breaker, clock=clock, rng=breaker_rng or rng)
            for name in providers
        }
        budget = RetryBudget(
            clock, ratio=self.budget_ratio, min_retries_per_second=self.budget_floor_per_s
        )
        return AttemptPolicy(
            self.retry,
            breakers=breakers,
            rng=rng,
            budget=budget,
            retry_on=functools.partial(retry_same, options=self.failover),
        )


def load_replay_config(path: str | Path) -> ReplayConfig:
    """Read a tidegate YAML config as the gateway reads it, for a replay.

    The file goes through the gateway's own loader and the gateway's own builders of the
    policies' options (:mod:`tidegate.ops.replay_config`, the one place the lab reaches the
    gateway: its engine and scenarios never do): every key, default and refusal is the
    gateway's, so the per-try timeout defaults to the gateway's 15 s and ``queue_cap: 0`` is
    refused with the gateway's message. The environment's ``TIDEGATE_*`` overrides are not
    applied, and the secret files the config names need not exist on the machine running the
    lab (a replay reads no secret; the live config's files are usually only on its pods): every
    other refusal holds, the profile's rules included. Raises ``ValueError`` naming the file
    and the key.
    """
    from tidegate.ops.replay_config import replay_settings  # the gateway's reading

    settings = replay_settings(path)
    return ReplayConfig(
        admission=settings.admission,
        retry=settings.retry,
        budget_ratio=settings.budget_ratio,
        budget_floor_per_s=settings.budget_floor_per_s,
        breaker=settings.breaker,
        failover=settings.failover,
        deadline=settings.deadline,
        per_try=settings.per_try,
    )


def _group(outcome: str) -> str:
    if outcome == "ok":
        return "ok"
    if outcome.startswith("provider_") or outcome in ("stream_incomplete",):
        return "provider_error"
    if outcome in _REFUSALS:
        return "shed"
    if outcome == "deadline_exceeded":
        return "expired"
    if outcome == "circuit_open":
        return "circuit_open"
    return "other"


def _provider_kind(outcome: str) -> ProviderErrorKind | None:
    """The provider failure an outcome records, or None if it is not one."""
    if not outcome.startswith("provider_"):
        return None
    try:
        return ProviderErrorKind(outcome.removeprefix("provider_"))
    except ValueError:
        return ProviderErrorKind.SERVER


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayResult:
    """Outcome counts as recorded and as replayed, their transitions, and latency."""

    requests: int
    recorded: Mapping[str, int]
    replayed: Mapping[str, int]
    #: ``(recorded group, replayed group) -> requests``, only where they differ.
    changed: Mapping[tuple[str, str], int]
    recorded_p95: float
    replayed_p95: float
    calls: int
    retries: int
    by_class: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    #: Lines of the log that were not requests (a start-up banner, uvicorn's text lines, other
    #: events), skipped.
    skipped: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "recorded": dict(self.recorded),
            "replayed": dict(self.replayed),
            "changed": [
                {"from": a, "to": b, "requests": n} for (a, b), n in sorted(self.changed.items())
            ],
            "recorded_p95": None if math.isnan(self.recorded_p95) else self.recorded_p95,
            "replayed_p95": None if math.isnan(self.replayed_p95) else self.replayed_p95,
            "calls": self.calls,
            "retries": self.retries,
            "by_class": {k: dict(v) for k, v in self.by_class.items()},
            "skipped": self.skipped,
        }


class _Health:
    """The provider's state over time, as the log's answered and failed requests show it."""

    def __init__(self, records: tuple[TraceRecord, ...]) -> None:
        evidence = [
            (r.at + (r.latency or 0.0), r.outcome)
            for r in records
            if r.outcome == "ok" or _provider_kind(r.outcome) is not None
        ]
        evidence.sort(key=lambda e: e[0])
        self.times = [t for t, _ in evidence]
        self.outcomes = [o for _, o in evidence]
        ok = sorted(r.latency for r in records if r.outcome == "ok" and r.latency is not None)
        self.typical_latency = percentile(ok, 0.5) if ok else 1.0

    def at(self, when: float) -> ProviderErrorKind | None:
        """The failure the provider was showing at ``when``, or None if it was healthy."""
        index = bisect.bisect_right(self.times, when) - 1
        if index < 0:
            return None
        return _provider_kind(self.outcomes[index])


class _Replay:
    def __init__(self, trace: Trace, config: ReplayConfig, seed: int) -> None:
        self.config = config
        self.queue = EventQueue()
        clock = self.queue.clock
        self.clock = clock
        self.health = _Health(trace.records)
        self.controller = AdmissionController(config.admission, clock)
        self.policy = config.attempt_policy(
            clock,
            (_PROVIDER.name,),
            rng=random.Random(f"tidegate-lab/replay/{seed}"),
            breaker_rng=random.Random(f"tidegate-lab/replay/{seed}/breaker"),
        )
        self.records = trace.records
        self.skipped = trace.skipped
        # Each request's own deadline as logged (the caller's, or the live default), never
        # longer than the candidate's request timeout: a header shortens it, as in the gateway.
        self.budget = [
            config.deadline if r.deadline is None else min(r.deadline, config.deadline)
            for r in trace.records
        ]
        self.outcome: list[str] = ["other"] * len(trace.records)
        self.latency: list[float | None] = [None] * len(trace.records)
        self.tickets: dict[Ticket, int] = {}
        self.calls = 0
        self.retries = 0
        classes = config.admission.classes
        self.klass = [r.klass if r.klass in classes else classes[-1] for r in trace.records]

    def arrive(self, index: int) -> None:
        record = self.records[index]
        now = self.clock.now()
        try:
            ticket = self.controller.offer(
                request_id=record.request_id or str(index),
                klass=self.klass[index],
                tenant=record.tenant,
                deadline_at=now + self.budget[index],
            )
        except Rejected:
            self.outcome[index] = "shed"
            return
        self.tickets[ticket] = index
        if ticket.state is TicketState.STARTED:
            self.call(ticket, index)
        else:
            self.queue.at(now + self.budget[index], self.give_up_waiting, ticket)

    def give_up_waiting(self, ticket: Ticket) -> None:
        # The caller's deadline passed while it waited: it goes away. The controller may have
        # dropped the ticket at dequeue already; either way the request expired.
        if ticket.state is TicketState.WAITING:
            self.controller.cancel(ticket)
        elif ticket.state is not TicketState.EXPIRED:
            return
        self.outcome[self.tickets.pop(ticket)] = "expired"

    def call(self, ticket: Ticket, index: int) -> None:
        deadline = Deadline.at_time(self.clock, self.records[index].at + self.budget[index])
        attempts = self.policy.start(_PLAN, deadline, self._per_try, [])

        def provider(call: Call) -> tuple[float, ProviderError | None]:
            return self.provider(index, call)

        def ended(stop: Stop | None) -> None:
            self.done(ticket, index, "ok" if stop is None else _stopped(stop))

        run_call(self.queue, attempts, provider, ended)

    def _per_try(self, spec: ProviderSpec) -> float:
        return self.config.per_try

    def provider(self, index: int, call: Call) -> tuple[float, ProviderError | None]:
        """How the provider answers this call: a first attempt as the log recorded it, a retry
        as the provider was doing at that moment."""
        self.calls += 1
        if call.attempt > 1:
            self.retries += 1
        record = self.records[index]
        if call.attempt == 1 and (record.outcome == "ok" or _provider_kind(record.outcome)):
            kind = _provider_kind(record.outcome)
            latency = record.latency if record.latency is not None else self.health.typical_latency
        else:
            kind = self.health.at(self.clock.now())
            latency = (
                record.latency
                if record.latency is not None and record.outcome == "ok"
                else self.health.typical_latency
            )
        if kind is None:
            return latency, None
        return latency, ProviderError(kind, "replayed failure", provider="provider")

    def done(self, ticket: Ticket, index: int, outcome: str) -> None:
        self.outcome[index] = outcome
        self.latency[index] = self.clock.now() - self.records[index].at
        self.tickets.pop(ticket, None)
        self.controller.finish(ticket)
        while (started := self.controller.start()) is not None:
            self.call(started, self.tickets[started])

    def run(self) -> ReplayResult:
        for index, record in enumerate(self.records):
            self.queue.at(record.at, self.arrive, index)
        self.queue.run()
        recorded = Counter(_group(r.outcome) for r in self.records)
        replayed = Counter(self.outcome)
        changed: Counter[tuple[str, str]] = Counter()
        by_class: dict[str, Counter[str]] = {}
        for record, outcome, klass in zip(self.records, self.outcome, self.klass, strict=True):
            before = _group(record.outcome)
            if before != outcome:
                changed[(before, outcome)] += 1
            by_class.setdefault(klass, Counter())[outcome] += 1
        recorded_latency = sorted(
            r.latency for r in self.records if r.outcome == "ok" and r.latency is not None
        )
        replayed_latency = sorted(
            lat
            for lat, outcome in zip(self.latency, self.outcome, strict=True)
            if outcome == "ok" and lat is not None
        )
        order = {name: i for i, name in enumerate(OUTCOMES)}
        return ReplayResult(
            requests=len(self.records),
            recorded=dict(sorted(recorded.items(), key=lambda kv: order[kv[0]])),
            replayed=dict(sorted(replayed.items(), key=lambda kv: order[kv[0]])),
            changed=dict(changed),
            recorded_p95=percentile(recorded_latency, 0.95),
            replayed_p95=percentile(replayed_latency, 0.95),
            calls=self.calls,
            retries=self.retries,
            by_class={k: dict(sorted(v.items())) for k, v in sorted(by_class.items())},
            skipped=self.skipped,
        )


def _stopped(stop: Stop) -> str:
    """The outcome group of a call that gave up."""
    if stop.reason == "circuit_open":
        return "circuit_open"
    if isinstance(stop.error, DeadlineExceeded):
        return "expired"
    return "provider_error"


def replay_log(trace: Trace, config: ReplayConfig, *, seed: int = 0) -> ReplayResult:
    """Run every logged request through ``config`` and compare the outcomes with the log's."""
    return _Replay(trace, config, seed).run()


def sample_log(*, seed: int = 0, duration: float = 600.0) -> Trace:
    """A recorded-looking log for demonstrations: steady traffic, a burst, a provider outage.

    Four requests a second, ten a second from 240 s to 300 s, and the provider failing every
    call from 360 s to 420 s; 20 % critical, 70 % standard, 10 % batch, from three tenants.
    It was "recorded" behind a gateway that queued without bound and never retried, so its
    durations include queueing and its outages show as ``provider_server``.
    """
    rng = random.Random(f"tidegate-lab/sample-log/{seed}")
    records = []
    now = 0.0
    index = 0
    while True:
        rate = 10.0 if 240.0 <= now < 300.0 else 4.0
        now += -math.log(1.0 - rng.random()) / rate
        if now >= duration:
            break
        index += 1
        draw = rng.random()
        klass = "critical" if draw < 0.2 else "standard" if draw < 0.9 else "batch"
        if 360.0 <= now < 420.0:
            outcome, latency = "provider_server", 0.2 + 0.3 * rng.random()
        else:
            outcome, latency = "ok", 1.5 * math.exp(0.5 * rng.gauss(0.0, 1.0))
        records.append(
            TraceRecord(
                at=round(now, 3),
                klass=klass,
                tenant=("acme", "globex", "initech")[int(rng.random() * 3)],
                user=f"user-{int(rng.random() * 500)}",
                tokens=800 + int(rng.random() * 1200),
                latency=round(latency, 3),
                outcome=outcome,
                request_id=f"r{index:06d}",
            )
        )
    return Trace(records=tuple(records))
