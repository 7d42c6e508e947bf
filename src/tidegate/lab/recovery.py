"""A provider recovers under load: all traffic back at once, or a slow start.

One route, two providers: ``primary`` and an approved ``fallback``. Each is a pool of workers
behind its own :class:`~tidegate.policy.admission.AdmissionController` (``slots`` in flight,
``slots = capacity x mean service time``, and a bounded FIFO queue: ``mode="queue_cap"``, one
deadline of warm service by default). The primary is down (its breaker open, every request on
the fallback) until ``recover_at``; then its breaker closes and it comes back **cold**: each
request it starts takes its drawn service time times a factor that falls linearly from
``1 / cold_capacity_fraction`` at recovery to 1 after ``warmup_s`` (a cold cache, a cold replica),
so its capacity climbs from ``cold_capacity_fraction`` of warm to all of it.

Requests arrive Poisson at ``rate``, each with a ``deadline``. Each is routed as the gateway's
route step routes it: the candidates are the providers whose breaker is closed, in route order,
and the candidates a :class:`~tidegate.policy.slowstart.SlowStart` holds back
(:meth:`~tidegate.policy.slowstart.SlowStart.held_back`, one draw for a ramping provider) go
behind the others (:func:`~tidegate.policy.headroom.prefer_ample`); the request goes to the first.
The breaker's open and close reach the slow start as the gateway's do, through
:meth:`~tidegate.policy.slowstart.SlowStart.on_event`. The two arms differ only in the slow
start's options: ``window_s=0`` (off: all traffic returns to the cold primary at once) or the
configured window.

A request's fate: refused by the pool's controller (its queue full: **shed**, and final here, as
no retry or failover is modelled; the storm scenario has those), still waiting at its deadline
(the caller leaves and the ticket is cancelled: **timed out**), or served, by its deadline
(**goodput**) or after it (late, counted as timed out too: the caller had gone). Figures are kept
for the requests that arrived in the recovery window ``[recover_at, window_end)`` and over the
whole run, per provider; the queue runs until every request has its fate.

Determinism: arrivals, each pool's service times and the slow start's draws come from their own
``random.Random`` seeded from the run's seed, and the policies read the event queue's
:class:`~tidegate.clock.ManualClock`; both arms of one seed see the same arrivals.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from tidegate.errors import Rejected
from tidegate.lab.engine import EventQueue
from tidegate.lab.replicate import replicate
from tidegate.lab.report import Latency
from tidegate.lab.workload import Distribution, Exponential, Sampler
from tidegate.policy.admission import AdmissionController, AdmissionOptions, Ticket, TicketState
from tidegate.policy.breaker import CircuitClosed, CircuitOpened
from tidegate.policy.breaker.states import OpenReason
from tidegate.policy.headroom import prefer_ample
from tidegate.policy.routing import ProviderSpec, RoutePlan, Skip, SkipReason
from tidegate.policy.slowstart import SlowStart, SlowStartOptions

__all__ = [
    "ARMS",
    "PROVIDERS",
    "Figures",
    "RecoveryOptions",
    "RecoveryResult",
    "recovery_summary",
    "run_recovery",
]

#: The two arms: all traffic back at once, and a slow start.
ARMS: Final = ("no_ramp", "slow_start")
PROVIDERS: Final = ("primary", "fallback")

_PRIMARY: Final = ProviderSpec("primary", frozenset({"internal"}))
_FALLBACK: Final = ProviderSpec("fallback", frozenset({"internal"}))
_UP: Final = RoutePlan((_PRIMARY, _FALLBACK), ())
_DOWN: Final = RoutePlan((_FALLBACK,), (Skip("primary", SkipReason.BREAKER_OPEN),))
_CLASS: Final = "standard"


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryOptions:
    """The traffic, the two providers, the primary's outage and cold start, and the ramp."""

    #: New requests per second (Poisson).
    rate: float = 30.0
    #: Requests per second each provider completes when warm.
    primary_capacity: float = 40.0
    fallback_capacity: float = 40.0
    #: A warm request's service time (the primary's is stretched while it is cold).
    service: Distribution = field(default_factory=lambda: Exponential(mean=0.2))
    #: Seconds after arrival by which an answer is still useful.
    deadline: float = 2.0
    #: Waiting places of each pool; ``None`` is one deadline of its warm service.
    queue_cap: int | None = None
    #: The primary's breaker closes here (it was open from the start).
    recover_at: float = 60.0
    #: The primary's capacity right after recovery, as a share of warm, and the seconds it
    #: takes to climb back linearly in service time.
    cold_capacity_fraction: float = 0.3
    warmup_s: float = 30.0
    #: The slow start of the ``slow_start`` arm (the ``no_ramp`` arm has ``window_s = 0``).
    window_s: float = 30.0
    min_share: float = 0.1
    aggression: float = 1.0
    #: The recovery window runs this long past the end of the warm-up or the ramp, whichever is
    #: later; arrivals stop at its end.
    margin_s: float = 15.0

    def __post_init__(self) -> None:
        for name in ("rate", "primary_capacity", "fallback_capacity", "deadline", "recover_at"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("warmup_s", "margin_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 0 < self.cold_capacity_fraction <= 1:
            raise ValueError(
                f"cold_capacity_fraction must be in (0, 1], got {self.cold_capacity_fraction!r}"
            )
        if self.queue_cap is not None and (isinstance(self.queue_cap, bool) or self.queue_cap < 0):
            raise ValueError(f"queue_cap must be an integer >= 0 or None, got {self.queue_cap!r}")
        self.slow_start(ramp=True)  # checks window_s, min_share and aggression

    def slow_start(self, *, ramp: bool) -> SlowStartOptions:
        """The slow start's options for one arm: ``window_s`` 0 (off) without the ramp."""
        return SlowStartOptions(
            window_s=self.window_s if ramp else 0.0,
            min_share=self.min_share,
            aggression=self.aggression,
        )

    @property
    def window_end(self) -> float:
        """The end of the recovery window, and of the arrivals."""
        return self.recover_at + max(self.warmup_s, self.window_s) + self.margin_s

    def slots(self, provider: str) -> int:
        """A pool's in-flight slots: its warm capacity times the mean service time."""
        return max(1, round(self.capacity(provider) * self.service.mean))

    def capacity(self, provider: str) -> float:
        return self.primary_capacity if provider == "primary" else self.fallback_capacity

    def cap(self, provider: str) -> int:
        """A pool's waiting places."""
        if self.queue_cap is not None:
            return self.queue_cap
        return max(1, round(self.capacity(provider) * self.deadline))

    def slowdown(self, elapsed: float) -> float:
        """The factor on the primary's service time ``elapsed`` seconds after recovery."""
        if self.warmup_s == 0 or elapsed >= self.warmup_s:
            return 1.0
        cold = 1.0 / self.cold_capacity_fraction - 1.0
        return 1.0 + cold * (1.0 - max(0.0, elapsed) / self.warmup_s)


class _Tally:
    """The fates of one provider's requests in one scope (the recovery window, or the run)."""

    __slots__ = ("expired", "late", "latencies", "offered", "on_time", "shed")

    def __init__(self) -> None:
        self.offered = 0
        self.shed = 0
        self.expired = 0
        self.late = 0
        self.on_time = 0
        self.latencies: list[float] = []

    def merged(self, other: _Tally) -> _Tally:
        both = _Tally()
        for name in ("offered", "shed", "expired", "late", "on_time"):
            setattr(both, name, getattr(self, name) + getattr(other, name))
        both.latencies = [*self.latencies, *other.latencies]
        return both


@dataclass(frozen=True, slots=True, kw_only=True)
class Figures:
    """The fates of the requests one provider (or both) received in one scope.

    ``offered == goodput + late + expired + shed``: every request has its fate by the end.
    ``timed_out`` is ``late + expired``; ``p99`` is over the served requests, in seconds.
    """

    offered: int
    served: int
    goodput: int
    late: int
    expired: int
    shed: int
    p99: float

    @property
    def timed_out(self) -> int:
        return self.late + self.expired

    @classmethod
    def of(cls, tally: _Tally) -> Figures:
        return cls(
            offered=tally.offered,
            served=tally.on_time + tally.late,
            goodput=tally.on_time,
            late=tally.late,
            expired=tally.expired,
            shed=tally.shed,
            p99=Latency.of(tally.latencies).p99,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "offered": self.offered,
            "served": self.served,
            "goodput": self.goodput,
            "timed_out": self.timed_out,
            "shed": self.shed,
            "lost": self.timed_out + self.shed,
            "p99": None if math.isnan(self.p99) else self.p99,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryResult:
    """One arm over one run: figures per provider and in total, in the recovery window and
    over the run, and where each request that arrived after recovery was sent."""

    arm: str
    #: The slow start's window in this arm (0: off).
    window_s: float
    #: Keyed by ``"primary"``, ``"fallback"`` and ``"total"``.
    window: dict[str, Figures]
    run: dict[str, Figures]
    #: ``(arrival time, sent to the primary first)`` for each request from recovery on.
    routed: tuple[tuple[float, bool], ...]

    @property
    def primary_share(self) -> float:
        """The share of the recovery window's requests sent to the primary."""
        total = self.window["total"].offered
        return self.window["primary"].offered / total if total else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "window_s": self.window_s,
            "primary_share": _num(self.primary_share),
            "window": {name: figures.as_dict() for name, figures in self.window.items()},
            "run": {name: figures.as_dict() for name, figures in self.run.items()},
        }


def _num(value: float) -> float | None:
    return None if math.isnan(value) else value


class _Pool:
    """One provider: its admission controller, and its service times as it starts requests."""

    def __init__(
        self,
        name: str,
        options: RecoveryOptions,
        queue: EventQueue,
        service: Sampler,
        slowdown: Callable[[float], float],
        done: Callable[[_Pool, Ticket], None],
    ) -> None:
        self.name = name
        self.queue = queue
        self.service = service
        self.slowdown = slowdown
        self.done = done
        self.controller = AdmissionController(
            AdmissionOptions(
                classes=(_CLASS,),
                slots=options.slots(name),
                queue_cap=options.cap(name),
                mode="queue_cap",
                dequeue="fifo",
                drop_expired_at_dequeue=False,
                service_rate=options.capacity(name),
            ),
            queue.clock,
        )

    def offer(self, deadline_at: float) -> Ticket | None:
        """The request admitted (started or waiting), or ``None`` when the pool refused it."""
        try:
            ticket = self.controller.offer(
                request_id="lab", klass=_CLASS, tenant="default", deadline_at=deadline_at
            )
        except Rejected:
            return None
        if ticket.state is TicketState.STARTED:
            self.serve(ticket)
        return ticket

    def serve(self, ticket: Ticket) -> None:
        now = self.queue.clock.now()
        self.queue.at(now + self.service.draw() * self.slowdown(now), self.done, self, ticket)

    def fill(self) -> None:
        """Start waiting requests in every free slot, in the controller's order."""
        while (started := self.controller.start()) is not None:
            self.serve(started)


class _Recovery:
    """One run of one arm; every method is an event on the queue."""

    def __init__(self, options: RecoveryOptions, *, ramp: bool, seed: int) -> None:
        self.options = options
        self.queue = EventQueue()
        clock = self.queue.clock
        self.arrivals = random.Random(f"tidegate-lab/recovery/{seed}/arrivals")
        self.slow_start = SlowStart(
            options.slow_start(ramp=ramp),
            clock,
            random.Random(f"tidegate-lab/recovery/{seed}/slow-start"),
        )
        self.ramp = ramp
        recover_at = options.recover_at
        self.pools = {
            name: _Pool(
                name,
                options,
                self.queue,
                options.service.sampler(random.Random(f"tidegate-lab/recovery/{seed}/{name}")),
                (lambda t: options.slowdown(t - recover_at)) if name == "primary" else _warm,
                self.completed,
            )
            for name in PROVIDERS
        }
        self.plan = _DOWN
        self.tallies = {
            (scope, name): _Tally() for scope in ("window", "run") for name in PROVIDERS
        }
        self.routed: list[tuple[float, bool]] = []

    # -- the breaker

    def opened(self) -> None:
        self.plan = _DOWN
        self.slow_start.on_event(
            CircuitOpened(
                name="primary",
                at=self.queue.clock.now(),
                reason=OpenReason.CONSECUTIVE_FAILURES,
                half_open_at=self.options.recover_at,
            )
        )

    def closed(self) -> None:
        self.plan = _UP
        self.slow_start.on_event(CircuitClosed(name="primary", at=self.queue.clock.now()))

    # -- requests

    def route(self) -> str:
        """The provider a new request goes to first, as the gateway's route step picks it."""
        plan = self.plan
        if len(plan.candidates) > 1:
            behind = self.slow_start.held_back(c.name for c in plan.candidates)
            if behind:
                plan = prefer_ample(plan, behind)
        return plan.candidates[0].name

    def arrive(self) -> None:
        options = self.options
        now = self.queue.clock.now()
        name = self.route()
        if now >= options.recover_at:
            self.routed.append((now, name == "primary"))
        for tally in self._tallies(name, now):
            tally.offered += 1
        pool = self.pools[name]
        ticket = pool.offer(now + options.deadline)
        if ticket is None:
            for tally in self._tallies(name, now):
                tally.shed += 1
        elif ticket.state is TicketState.WAITING:
            self.queue.at(now + options.deadline, self.deadline, pool, ticket)
        gap = -math.log(1.0 - self.arrivals.random()) / options.rate
        if now + gap < options.window_end:
            self.queue.at(now + gap, self.arrive)

    def deadline(self, pool: _Pool, ticket: Ticket) -> None:
        """A waiting request's caller leaves at its deadline."""
        if ticket.state is not TicketState.WAITING:
            return
        pool.controller.cancel(ticket)
        for tally in self._tallies(pool.name, ticket.offered_at):
            tally.expired += 1

    def completed(self, pool: _Pool, ticket: Ticket) -> None:
        """A request was answered, by its deadline or late; its slot goes to waiting work."""
        pool.controller.finish(ticket)
        arrived = ticket.offered_at
        latency = self.queue.clock.now() - arrived
        for tally in self._tallies(pool.name, arrived):
            tally.latencies.append(latency)
            if latency <= self.options.deadline:
                tally.on_time += 1
            else:
                tally.late += 1
        pool.fill()

    def _tallies(self, name: str, arrived: float) -> list[_Tally]:
        """The tallies a request that arrived at ``arrived`` for ``name`` counts in."""
        tallies = [self.tallies["run", name]]
        if arrived >= self.options.recover_at:
            tallies.append(self.tallies["window", name])
        return tallies

    def run(self) -> RecoveryResult:
        self.queue.at(0.0, self.opened)
        self.queue.at(self.options.recover_at, self.closed)
        self.queue.at(0.0, self.arrive)
        self.queue.run()
        return RecoveryResult(
            arm="slow_start" if self.ramp else "no_ramp",
            window_s=self.slow_start.options.window_s,
            window=self._figures("window"),
            run=self._figures("run"),
            routed=tuple(self.routed),
        )

    def _figures(self, scope: str) -> dict[str, Figures]:
        primary, fallback = self.tallies[scope, "primary"], self.tallies[scope, "fallback"]
        return {
            "primary": Figures.of(primary),
            "fallback": Figures.of(fallback),
            "total": Figures.of(primary.merged(fallback)),
        }


def _warm(t: float) -> float:
    del t
    return 1.0


def run_recovery(
    options: RecoveryOptions | None = None, *, ramp: bool, seed: int = 0
) -> RecoveryResult:
    """One run: the primary recovers cold at ``recover_at``, with the slow start (``ramp``) or
    with all its traffic back at once."""
    return _Recovery(
        options if options is not None else RecoveryOptions(), ramp=ramp, seed=seed
    ).run()


def _recovery_replication(options: RecoveryOptions, seed: int) -> dict[str, dict[str, Any]]:
    figures = {}
    for arm in ARMS:
        one = run_recovery(options, ramp=arm == "slow_start", seed=seed).as_dict()
        del one["window_s"]  # an option, not a figure
        figures[arm] = one
    return figures


def recovery_summary(
    options: RecoveryOptions | None = None,
    *,
    seed: int = 0,
    replications: int = 10,
    jobs: int = 1,
    progress: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Both arms over independent replications (the arms of one replication on the same
    arrivals): per arm, each figure a mean with its 95% interval."""
    summary, _ = replicate(
        _recovery_replication,
        options if options is not None else RecoveryOptions(),
        seed=seed,
        replications=replications,
        workers=jobs,
        progress=progress,
    )
    result: dict[str, dict[str, Any]] = summary
    return result
