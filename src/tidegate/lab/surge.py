"""The overload ladder: what each queue policy does in the window before new capacity arrives.

Demand jumps to ``multiplier`` times what the fleet can serve and stays there for ``duration``
seconds (the provisioning lead time, which no policy shortens). Every rung of the ladder is one
:class:`~tidegate.policy.admission.AdmissionOptions` of the real admission controller, run on
the same arrivals (common random numbers) with two classes, ``critical`` and ``standard``, and
one deadline for both:

========================  ===================================================================
rung                      options
========================  ===================================================================
unbounded_fifo            no cap, serve by arrival, never drop expired work
bounded_queue             one waiting cap for both classes (default: a deadline of service)
deadline_admission        admit only if the work ahead clears before the deadline (FIFO)
deadline_at_dequeue       admit everything, drop expired work when it reaches the front
priority_at_dequeue       deadline admission judged class-blind, critical served first
priority_at_admission     critical judged only against critical work, and served first
conditional_priority      as above, only while the offered load factor is over a threshold
weighted_share            deadline admission with a weighted share instead of a ranking
========================  ===================================================================

Callers do not tell the server when they give up (``on_deadline="stay"``), so a rung that keeps
expired work spends slots on answers nobody reads. Goodput counts completions by the deadline.

The defaults are the surge runbook's model: a fleet serving 20 requests per second (20 slots,
one second of service each), demand at ten times that, a 10 % critical share, a 30-second
deadline and a 900-second lead time. The bounded rung's cap is on the whole queue (both classes
together, enforced by the fleet in front of the controller, whose own caps are per class), one
deadline of service: 600 places.

The controller drops a ticket at dequeue once its deadline has passed; by default
``deadline_at_dequeue`` uses that literal check. Under FIFO overload the front of the queue is
always about one deadline old, so dropping only what is already late still starts work that
cannot finish in time. ``dequeue_margin`` tells the controller each deadline that much early
(the latest useful start is one service time before it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from tidegate.lab.engine import Fleet, Simulation, Traffic
from tidegate.lab.replicate import chosen, replicate
from tidegate.lab.report import Report
from tidegate.lab.workload import Deterministic, Distribution, Poisson
from tidegate.policy.admission import AdmissionOptions

__all__ = [
    "CLASSES",
    "RUNGS",
    "SurgeOptions",
    "SurgeResult",
    "ladder",
    "run_rung",
    "run_surge",
    "surge_summary",
    "sweep",
]

#: The two classes of the ladder, highest first.
CLASSES: Final = ("critical", "standard")

#: The rungs, in the order the runbook climbs them.
RUNGS: Final = (
    "unbounded_fifo",
    "bounded_queue",
    "deadline_admission",
    "deadline_at_dequeue",
    "priority_at_dequeue",
    "priority_at_admission",
    "conditional_priority",
    "weighted_share",
)

_DEFAULT_SERVICE: Final = Deterministic(value=1.0)
_SAMPLES: Final = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class SurgeOptions:
    """One surge: the fleet, the demand, the deadline and the window.

    ``capacity`` (requests per second) is ``slots / service.mean``; arrivals are Poisson at
    ``multiplier * capacity`` for ``duration`` seconds, a ``critical_share`` of them critical.
    """

    #: In-flight slots of the fleet (one controller).
    slots: int = 20
    #: Time a request holds its slot.
    service: Distribution = _DEFAULT_SERVICE
    #: Arrival rate over capacity during the surge.
    multiplier: float = 10.0
    #: Share of arrivals in the critical class.
    critical_share: float = 0.1
    #: Seconds after arrival by which an answer is still useful (both classes).
    deadline: float = 30.0
    #: Seconds until new capacity arrives: the measured window.
    duration: float = 900.0
    #: Waiting places of ``bounded_queue``, both classes together; ``None`` is one deadline of
    #: service (``capacity x deadline``).
    queue_cap: int | None = None
    #: Offered load factor above which ``conditional_priority`` applies priority.
    conditional_threshold: float = 2.0
    #: Weight of the critical class against 1 for standard, for ``weighted_share``.
    critical_weight: float = 4.0
    #: For ``deadline_at_dequeue``: the controller is told the deadline this much earlier, so it
    #: drops work that cannot finish in time. 0 (the controller's literal check) drops only work
    #: whose deadline has already passed; ``None`` is the mean service time.
    dequeue_margin: float | None = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.slots, bool) or self.slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {self.slots!r}")
        for name in ("multiplier", "deadline", "duration", "conditional_threshold"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not 0.0 <= self.critical_share <= 1.0:
            raise ValueError(f"critical_share must be in [0, 1], got {self.critical_share!r}")
        if self.queue_cap is not None and self.queue_cap < 0:
            raise ValueError(f"queue_cap must be >= 0 or None, got {self.queue_cap!r}")
        if not math.isfinite(self.critical_weight) or self.critical_weight <= 0:
            raise ValueError(f"critical_weight must be > 0, got {self.critical_weight!r}")
        if self.dequeue_margin is not None and (
            not math.isfinite(self.dequeue_margin) or self.dequeue_margin < 0
        ):
            raise ValueError(f"dequeue_margin must be >= 0 or None, got {self.dequeue_margin!r}")

    @property
    def capacity(self) -> float:
        """Requests per second the fleet serves with every slot busy."""
        return self.slots / self.service.mean

    @property
    def arrival_rate(self) -> float:
        return self.multiplier * self.capacity

    @property
    def bounded_cap(self) -> int:
        """The bounded rung's cap: given, or the requests served in one deadline."""
        if self.queue_cap is not None:
            return self.queue_cap
        return max(1, round(self.capacity * self.deadline))


def ladder(options: SurgeOptions) -> dict[str, AdmissionOptions]:
    """Each rung's admission options, keyed by rung name, in ladder order.

    ``bounded_queue``'s options are unbounded FIFO's: its cap is on the whole queue, which the
    fleet enforces (:attr:`SurgeOptions.bounded_cap`, ``Fleet.total_queue_cap``)."""
    base: dict[str, Any] = {
        "classes": CLASSES,
        "slots": options.slots,
        "service_rate": options.capacity,
        "queue_cap": None,
        "drop_expired_at_dequeue": False,
    }
    weights = {"critical": options.critical_weight, "standard": 1.0}
    rungs: dict[str, dict[str, Any]] = {
        "unbounded_fifo": {"mode": "queue_cap", "dequeue": "fifo"},
        "bounded_queue": {"mode": "queue_cap", "dequeue": "fifo"},
        "deadline_admission": {"mode": "deadline", "dequeue": "fifo"},
        "deadline_at_dequeue": {
            "mode": "queue_cap",
            "dequeue": "fifo",
            "drop_expired_at_dequeue": True,
        },
        "priority_at_dequeue": {
            "mode": "deadline",
            "dequeue": "strict",
            "priority_at_admission": False,
        },
        "priority_at_admission": {
            "mode": "deadline",
            "dequeue": "strict",
            "priority_at_admission": True,
        },
        "conditional_priority": {
            "mode": "deadline",
            "dequeue": "strict",
            "priority_at_admission": True,
            "conditional_priority": options.conditional_threshold,
        },
        "weighted_share": {
            "mode": "deadline",
            "dequeue": "weighted",
            "weights": weights,
            "priority_at_admission": True,
        },
    }
    return {name: AdmissionOptions(**{**base, **rungs[name]}) for name in RUNGS}


@dataclass(frozen=True, slots=True, kw_only=True)
class SurgeResult:
    """What one rung did over the window."""

    rung: str
    multiplier: float
    critical_share: float
    offered: int
    #: Completions inside the window, late or not: the capacity actually used.
    served: int
    #: Completions by the deadline.
    goodput: int
    critical_offered: int
    critical_served: int
    critical_goodput: int
    standard_served: int
    standard_goodput: int
    shed: int
    expired: int
    late: int
    #: Requests still queued or in service when capacity arrives.
    backlog: int
    #: Seconds from arrival to a "no" (refusal or drop), over refused and dropped requests.
    rejection_time_mean: float
    rejection_time_max: float
    #: ``(time, requests in the system)`` sampled through the window.
    backlog_trace: tuple[tuple[float, int], ...]
    report: Report

    def mean_backlog(self, start: float = 0.0, stop: float = math.inf) -> float:
        """The mean of the backlog sampled in ``[start, stop)``; nan if no sample falls there."""
        values = [count for when, count in self.backlog_trace if start <= when < stop]
        return sum(values) / len(values) if values else math.nan

    @property
    def critical_goodput_share(self) -> float:
        """Critical requests answered in time, over critical requests offered."""
        if self.critical_offered == 0:
            return math.nan
        return self.critical_goodput / self.critical_offered

    def as_dict(self) -> dict[str, Any]:
        return {
            "rung": self.rung,
            "multiplier": self.multiplier,
            "critical_share": self.critical_share,
            "offered": self.offered,
            "served": self.served,
            "goodput": self.goodput,
            "critical_offered": self.critical_offered,
            "critical_served": self.critical_served,
            "critical_goodput": self.critical_goodput,
            "critical_goodput_share": _num(self.critical_goodput_share),
            "standard_served": self.standard_served,
            "standard_goodput": self.standard_goodput,
            "shed": self.shed,
            "expired": self.expired,
            "late": self.late,
            "backlog": self.backlog,
            "rejection_time_mean": _num(self.rejection_time_mean),
            "rejection_time_max": _num(self.rejection_time_max),
        }


def _num(value: float) -> float | None:
    return None if math.isnan(value) else value


def run_rung(
    rung: str, options: SurgeOptions, *, seed: int = 0, admission: AdmissionOptions | None = None
) -> SurgeResult:
    """Run one rung of the ladder (or the given ``admission`` options under its name)."""
    chosen = admission if admission is not None else ladder(options)[rung]
    traffic = Traffic(
        arrivals=Poisson(rate=options.arrival_rate),
        mix={"critical": options.critical_share, "standard": 1.0 - options.critical_share},
        deadline=options.deadline,
        on_deadline="stay",
    )
    margin = 0.0
    if rung == "deadline_at_dequeue":
        margin = options.service.mean if options.dequeue_margin is None else options.dequeue_margin
    samples: list[tuple[float, int]] = []

    def sample(simulation: Simulation) -> None:
        samples.append((simulation.clock.now(), simulation.in_system))

    report = Simulation(
        traffic,
        Fleet(
            admission=chosen,
            io=options.service,
            start_margin=margin,
            total_queue_cap=options.bounded_cap if rung == "bounded_queue" else None,
        ),
        horizon=options.duration,
        seed=seed,
        tick=(options.duration / _SAMPLES, sample),
    ).run()
    total = report.total
    critical, standard = report.by_class("critical"), report.by_class("standard")
    return SurgeResult(
        rung=rung,
        multiplier=options.multiplier,
        critical_share=options.critical_share,
        offered=total.offered,
        served=total.completed,
        goodput=total.on_time,
        critical_offered=critical.offered,
        critical_served=critical.completed,
        critical_goodput=critical.on_time,
        standard_served=standard.completed,
        standard_goodput=standard.on_time,
        shed=total.shed_total,
        expired=total.expired,
        late=total.late,
        backlog=total.in_system,
        rejection_time_mean=total.rejection_time_mean,
        rejection_time_max=total.rejection_time_max,
        backlog_trace=tuple(samples),
        report=report,
    )


def run_surge(
    options: SurgeOptions, *, seed: int = 0, rungs: Iterable[str] = RUNGS
) -> list[SurgeResult]:
    """Run the chosen rungs on the same arrivals (same seed)."""
    policies = ladder(options)
    chosen = list(rungs)
    for rung in chosen:
        if rung not in policies:
            raise ValueError(f"unknown rung {rung!r}; choose from {', '.join(RUNGS)}")
    return [run_rung(rung, options, seed=seed, admission=policies[rung]) for rung in chosen]


def sweep(
    options: SurgeOptions,
    *,
    multipliers: Sequence[float],
    critical_shares: Sequence[float],
    seed: int = 0,
    rungs: Iterable[str] = RUNGS,
    progress: Callable[[], None] | None = None,
) -> Mapping[tuple[float, float], list[SurgeResult]]:
    """The ladder at every (multiplier, critical share) point; ``progress`` after each point."""
    chosen = tuple(rungs)
    results: dict[tuple[float, float], list[SurgeResult]] = {}
    for multiplier in multipliers:
        for share in critical_shares:
            point = SurgeOptions(
                slots=options.slots,
                service=options.service,
                multiplier=multiplier,
                critical_share=share,
                deadline=options.deadline,
                duration=options.duration,
                queue_cap=options.queue_cap,
                conditional_threshold=options.conditional_threshold,
                critical_weight=options.critical_weight,
                dequeue_margin=options.dequeue_margin,
            )
            results[(multiplier, share)] = run_surge(point, seed=seed, rungs=chosen)
            if progress is not None:
                progress()
    return results


def _surge_replication(
    task: tuple[SurgeOptions, tuple[float, ...], tuple[float, ...], tuple[str, ...]], seed: int
) -> list[dict[str, Any]]:
    options, multipliers, shares, rungs = task
    points = sweep(options, multipliers=multipliers, critical_shares=shares, seed=seed, rungs=rungs)
    return [{"rungs": {r.rung: _figures(r) for r in results}} for results in points.values()]


def _figures(result: SurgeResult) -> dict[str, Any]:
    figures = result.as_dict()
    del figures["multiplier"], figures["critical_share"]
    return figures


def surge_summary(
    options: SurgeOptions,
    *,
    multipliers: Sequence[float],
    critical_shares: Sequence[float],
    seed: int = 0,
    replications: int = 10,
    jobs: int = 1,
    rungs: Iterable[str] = RUNGS,
    progress: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """:func:`sweep` over independent replications (the rungs of one replication on the same
    arrivals): per point, per rung, each figure a mean with its 95% interval."""
    summary, _ = replicate(
        _surge_replication,
        (options, tuple(multipliers), tuple(critical_shares), chosen(rungs, RUNGS, "rung")),
        seed=seed,
        replications=replications,
        workers=jobs,
        progress=progress,
    )
    grid = [(m, s) for m in multipliers for s in critical_shares]
    return [
        {"multiplier": m, "critical_share": s, "rungs": point["rungs"]}
        for (m, s), point in zip(grid, summary, strict=True)
    ]
