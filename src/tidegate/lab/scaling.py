"""Autoscaling under a provisioning lead time: the proportional law against the damped law.

A fleet of replicas (each one worker with its own admission controller) serves a surge that
lasts longer than the lead time. Every ``interval`` seconds a law from
:mod:`tidegate.policy.autoscale` sees the measured arrival rate, the queue, the serving and the
pending replicas, and orders or retires replicas. An ordered replica serves only after
``lead_time`` seconds, and pays a cold start.

:class:`~tidegate.policy.autoscale.ProportionalLaw` sizes from the arrival rate and ignores
pending supply, so until its first order arrives it orders the same replicas again, overshoots,
then tears the surplus down; :class:`~tidegate.policy.autoscale.DampedLaw` counts pending supply,
caps its steps and holds scale-down for a stabilisation window.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Final

from tidegate.lab.engine import Fleet, Simulation, Traffic
from tidegate.lab.replicate import replicate
from tidegate.lab.report import Report
from tidegate.lab.workload import Distribution, Exponential, Piecewise
from tidegate.policy.admission import AdmissionOptions
from tidegate.policy.autoscale import DampedLaw, DampedOptions, ProportionalLaw, ScaleSignals

__all__ = [
    "LAWS",
    "AutoscaleOptions",
    "AutoscaleResult",
    "ReplicaSample",
    "autoscale_summary",
    "run_autoscale",
]

LAWS: Final = ("proportional", "damped")

_SERVICE: Final = Exponential(mean=1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoscaleOptions:
    """The traffic (base rate, a surge), one replica's shape, and the scaling loop."""

    base_rate: float = 20.0
    surge_rate: float = 60.0
    surge_start: float = 300.0
    surge_end: float = 1800.0
    duration: float = 2700.0
    #: One replica: in-flight slots and the time a request holds one.
    slots: int = 4
    service: Distribution = _SERVICE
    #: Seconds from ordering a replica to its serving traffic.
    lead_time: float = 180.0
    #: Seconds between scaling decisions.
    interval: float = 15.0
    #: Every request's deadline, in seconds.
    deadline: float = 20.0
    target_utilisation: float = 0.7
    min_replicas: int = 1
    max_replicas: int = 40
    #: The damped law's other settings (its bounds and target are taken from above).
    damped: DampedOptions = field(default_factory=DampedOptions)

    def __post_init__(self) -> None:
        for name in ("base_rate", "surge_rate", "duration", "lead_time", "interval", "deadline"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not 0 <= self.surge_start <= self.surge_end:
            raise ValueError("surge_start must be >= 0 and not after surge_end")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots!r}")

    @property
    def per_replica_rate(self) -> float:
        return self.slots / self.service.mean

    @property
    def initial_replicas(self) -> int:
        """Enough replicas for the base rate at the target utilisation."""
        return max(
            self.min_replicas,
            math.ceil(round(self.base_rate / (self.per_replica_rate * self.target_utilisation), 9)),
        )


@dataclass(frozen=True, slots=True)
class ReplicaSample:
    """The fleet at one decision: serving and pending replicas, and the signals seen."""

    at: float
    serving: int
    pending: int
    arrival_rate: float
    queue_depth: int
    delta: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoscaleResult:
    """One law over the run."""

    law: str
    trace: tuple[ReplicaSample, ...]
    #: How often the ordered direction flipped (up after down, or down after up).
    direction_changes: int
    #: Replicas ordered, each paying a cold start.
    cold_starts: int
    peak_replicas: int
    #: Requests answered by their deadline, and the share of offered requests that is.
    goodput: int
    goodput_share: float
    #: Replica-seconds paid for (serving and pending), a proxy for cost.
    replica_seconds: float
    report: Report

    def as_dict(self) -> dict[str, Any]:
        return {
            "law": self.law,
            "direction_changes": self.direction_changes,
            "cold_starts": self.cold_starts,
            "peak_replicas": self.peak_replicas,
            "goodput": self.goodput,
            "goodput_share": self.goodput_share,
            "replica_seconds": self.replica_seconds,
            "trace": [
                {
                    "at": s.at,
                    "serving": s.serving,
                    "pending": s.pending,
                    "arrival_rate": s.arrival_rate,
                    "queue_depth": s.queue_depth,
                    "delta": s.delta,
                }
                for s in self.trace
            ],
        }


class _Scaler:
    """The scaling loop: a tick hook that reads the gauges and drives a law."""

    def __init__(self, law: str, options: AutoscaleOptions) -> None:
        if law not in LAWS:
            raise ValueError(f"unknown law {law!r}; choose from {', '.join(LAWS)}")
        self.options = options
        self.decide: Callable[[ScaleSignals], Any]
        if law == "proportional":
            self.decide = ProportionalLaw(
                target_utilisation=options.target_utilisation,
                min_replicas=options.min_replicas,
                max_replicas=options.max_replicas,
            ).decide
        else:
            damped = options.damped
            self.decide = DampedLaw(
                DampedOptions(
                    target_utilisation=options.target_utilisation,
                    queue_drain_seconds=damped.queue_drain_seconds,
                    max_step_up=damped.max_step_up,
                    max_step_up_fraction=damped.max_step_up_fraction,
                    max_step_down=damped.max_step_down,
                    max_step_down_fraction=damped.max_step_down_fraction,
                    stabilisation_seconds=damped.stabilisation_seconds,
                    tolerance=damped.tolerance,
                    min_replicas=options.min_replicas,
                    max_replicas=options.max_replicas,
                )
            ).decide
        self.counts_pending = law == "damped"
        self.pending = 0
        self.cancelled = 0
        self.cold_starts = 0
        self.last_offered = 0
        self.trace: list[ReplicaSample] = []
        self.replica_seconds = 0.0

    def _arrive(self, simulation: Simulation) -> None:
        if self.cancelled:
            self.cancelled -= 1  # an order withdrawn while it was provisioning
            return
        self.pending -= 1
        simulation.add_worker()

    def tick(self, simulation: Simulation) -> None:
        options = self.options
        now = simulation.clock.now()
        serving = simulation.active_workers
        self.replica_seconds += (serving + self.pending) * options.interval
        rate = (simulation.offered - self.last_offered) / options.interval
        self.last_offered = simulation.offered
        depth = simulation.queue_depth()
        decision = self.decide(
            ScaleSignals(
                now=now,
                current_replicas=serving,
                pending_replicas=self.pending,
                queue_depth=float(depth),
                arrival_rate=rate,
                per_replica_rate=options.per_replica_rate,
            )
        )
        delta = decision.delta
        if delta > 0:
            for _ in range(delta):
                simulation.call_at(now + options.lead_time, self._arrive)
            self.pending += delta
            self.cold_starts += delta
        elif delta < 0:
            retire = -delta
            withdrawn = 0
            if self.counts_pending:
                # The damped law's delta is from serving plus pending: withdraw orders still
                # provisioning before retiring serving replicas. The proportional law's delta is
                # from serving alone, so it retires serving replicas while its orders arrive.
                withdrawn = min(retire, self.pending)
                self.pending -= withdrawn
                self.cancelled += withdrawn
            for _ in range(retire - withdrawn):
                if simulation.retire_worker() is None:
                    break
        self.trace.append(
            ReplicaSample(now, simulation.active_workers, self.pending, rate, depth, delta)
        )


def _direction_changes(deltas: list[int]) -> int:
    signs = [1 if d > 0 else -1 for d in deltas if d != 0]
    return sum(1 for a, b in pairwise(signs) if a != b)


def run_autoscale(
    law: str, options: AutoscaleOptions | None = None, *, seed: int = 0
) -> AutoscaleResult:
    """Run the surge with ``law`` (``"proportional"`` or ``"damped"``) scaling the fleet."""
    opts = options if options is not None else AutoscaleOptions()
    scaler = _Scaler(law, opts)
    steps = [(0.0, opts.base_rate)]
    if opts.surge_end > opts.surge_start:
        if opts.surge_start > 0:
            steps.append((opts.surge_start, opts.surge_rate))
        else:
            steps = [(0.0, opts.surge_rate)]
        steps.append((opts.surge_end, opts.base_rate))
    admission = AdmissionOptions(
        classes=("standard",),
        slots=opts.slots,
        queue_cap=None,
        mode="deadline",
        dequeue="fifo",
        service_rate=opts.per_replica_rate,
    )
    simulation = Simulation(
        Traffic(arrivals=Piecewise(steps=tuple(steps)), deadline=opts.deadline),
        Fleet(admission=admission, io=opts.service, workers=opts.initial_replicas),
        horizon=opts.duration,
        seed=seed,
        tick=(opts.interval, scaler.tick),
    )
    report = simulation.run()
    total = report.total
    return AutoscaleResult(
        law=law,
        trace=tuple(scaler.trace),
        direction_changes=_direction_changes([s.delta for s in scaler.trace]),
        cold_starts=scaler.cold_starts,
        peak_replicas=max((s.serving for s in scaler.trace), default=opts.initial_replicas),
        goodput=total.on_time,
        goodput_share=total.on_time / total.offered if total.offered else math.nan,
        replica_seconds=scaler.replica_seconds,
        report=report,
    )


def _autoscale_replication(options: AutoscaleOptions, seed: int) -> list[dict[str, Any]]:
    results = []
    for law in LAWS:
        figures = run_autoscale(law, options, seed=seed).as_dict()
        del figures["trace"]
        results.append(figures)
    return results


def autoscale_summary(
    options: AutoscaleOptions | None = None,
    *,
    seed: int = 0,
    replications: int = 10,
    jobs: int = 1,
    progress: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Both laws over independent replications (the laws of one replication on the same
    arrivals): per law, each figure a mean with its 95% interval."""
    summary, _ = replicate(
        _autoscale_replication,
        options if options is not None else AutoscaleOptions(),
        seed=seed,
        replications=replications,
        workers=jobs,
        progress=progress,
    )
    result: list[dict[str, Any]] = summary
    return result
