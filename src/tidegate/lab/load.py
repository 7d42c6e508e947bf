"""Load tests in virtual time: a sweep of arrival rates, and the backpressure comparison.

:func:`load_sweep` offers each rate to the same fleet (open-loop Poisson arrivals, so overload
shows) and reports shed share, p95, throughput, utilisation and Little's law (L against
lambda x W) per rate. With ``with_theory=True`` and a fleet the formulas describe (no CPU part,
exponential IO), each point also carries the M/M/c/K (or M/M/c) prediction for one worker fed
``rate / workers``, exact for one worker and for a random split of Poisson traffic.
:func:`load_summary` runs one rate over independent replications after an MSER-5 warm-up, with
Little's law from both sides, a stationarity check and, with :func:`theory_matching`, the model
that matches the fleet's dispatch rule (E_k/M/c/K per worker for round-robin, M/M/c/K pooled for
shortest-queue).

:func:`backpressure` runs one overload against three admission shapes: no waiting room, a
bounded waiting room, and an unbounded queue whose expired work is dropped at dequeue.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tidegate.lab.engine import Fleet, Traffic, simulate
from tidegate.lab.replicate import (
    LittleCheck,
    Stationarity,
    aggregate,
    littles_check,
    mser5_warmup,
    plain,
    replicate,
    run_replications,
    stationarity,
    steady_metrics,
)
from tidegate.lab.report import Report
from tidegate.lab.theory import ekmck, mmc, mmck
from tidegate.lab.workload import Distribution, Exponential, Poisson
from tidegate.policy.admission import AdmissionOptions

__all__ = [
    "BACKPRESSURE_SHAPES",
    "LoadPoint",
    "LoadSummary",
    "TheoryPoint",
    "backpressure",
    "backpressure_figures",
    "backpressure_summary",
    "load_summary",
    "load_sweep",
    "theory_for",
    "theory_matching",
]

#: The three shapes :func:`backpressure` compares, in order.
BACKPRESSURE_SHAPES = ("no waiting room", "bounded waiting room", "unbounded, deadline")


@dataclass(frozen=True, slots=True, kw_only=True)
class TheoryPoint:
    """What queueing theory predicts for one rate (per worker, times the workers)."""

    shed_share: float
    in_system: float
    time_in_system: float
    throughput: float

    def as_dict(self) -> dict[str, float]:
        return {
            "shed_share": self.shed_share,
            "in_system": self.in_system,
            "time_in_system": self.time_in_system,
            "throughput": self.throughput,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadPoint:
    """One rate of a sweep: the simulated report and, when it applies, the theory."""

    rate: float
    report: Report
    theory: TheoryPoint | None = None

    @property
    def shed_share(self) -> float:
        total = self.report.total
        return total.shed_total / total.offered if total.offered else 0.0

    def as_dict(self) -> dict[str, Any]:
        total = self.report.total
        return {
            "rate": self.rate,
            "offered": total.offered,
            "shed_share": self.shed_share,
            "p95": None if math.isnan(total.latency.p95) else total.latency.p95,
            "throughput": self.report.throughput,
            "utilisation": self.report.utilisation,
            "L": self.report.in_system_mean,
            "lambda_W": self.report.littles_product,
            "theory": None if self.theory is None else self.theory.as_dict(),
        }


def _queueing(fleet: Fleet) -> tuple[int, int, float, int | None] | None:
    """What a queueing model needs of ``fleet`` (workers, slots per worker, service rate, the
    waiting cap), or ``None`` if none applies: a CPU part, non-exponential IO, several classes."""
    if fleet.cpu is not None or not isinstance(fleet.io, Exponential):
        return None
    options = fleet.admission
    if len(options.classes) != 1:
        return None
    return fleet.workers, options.slots, 1.0 / fleet.io.mean, options.cap_for(options.classes[0])


def theory_for(rate: float, fleet: Fleet) -> TheoryPoint | None:
    """The M/M/c/K or M/M/c prediction for ``fleet`` at ``rate``, or ``None`` if it does not
    apply (a CPU part, non-exponential IO, or an unbounded queue past its capacity)."""
    queueing = _queueing(fleet)
    if queueing is None:
        return None
    workers, slots, mu, cap = queueing
    lam = rate / workers
    if cap is None:
        if lam >= slots * mu:
            return None
        result = mmc(lam, mu, slots)
        return TheoryPoint(
            shed_share=0.0,
            in_system=workers * result.mean_in_system,
            time_in_system=result.mean_response,
            throughput=rate,
        )
    finite = mmck(lam, mu, slots, slots + cap)
    return TheoryPoint(
        shed_share=finite.p_block,
        in_system=workers * finite.mean_in_system,
        time_in_system=finite.mean_response,
        throughput=workers * finite.throughput,
    )


def load_sweep(
    rates: Sequence[float],
    fleet: Fleet,
    *,
    horizon: float = 600.0,
    warmup: float = 60.0,
    seed: int = 0,
    deadline: float | None = None,
    with_theory: bool = False,
    progress: Callable[[], None] | None = None,
) -> list[LoadPoint]:
    """Offer each rate to ``fleet`` for ``horizon`` seconds; ``progress`` after each rate."""
    points = []
    for rate in rates:
        report = simulate(
            Traffic(arrivals=Poisson(rate=rate), deadline=deadline),
            fleet,
            horizon=horizon,
            warmup=warmup,
            seed=seed,
        )
        points.append(
            LoadPoint(
                rate=rate, report=report, theory=theory_for(rate, fleet) if with_theory else None
            )
        )
        if progress is not None:
            progress()
    return points


def backpressure(
    rate: float,
    *,
    slots: int = 8,
    waiting_room: int = 8,
    deadline: float = 3.0,
    io: Distribution,
    cpu: Distribution | None = None,
    workers: int = 1,
    horizon: float = 120.0,
    seed: int = 0,
) -> dict[str, Report]:
    """The same overload against no waiting room, ``waiting_room`` places, and an unbounded
    queue that drops expired work at dequeue. Every request has ``deadline`` seconds; callers
    do not say when they give up."""
    base: dict[str, Any] = {
        "classes": ("standard",),
        "slots": slots,
        "mode": "queue_cap",
        "dequeue": "fifo",
    }
    shapes = {
        "no waiting room": AdmissionOptions(**base, queue_cap=0, drop_expired_at_dequeue=False),
        "bounded waiting room": AdmissionOptions(
            **base, queue_cap=waiting_room, drop_expired_at_dequeue=False
        ),
        "unbounded, deadline": AdmissionOptions(
            **base, queue_cap=None, drop_expired_at_dequeue=True
        ),
    }
    traffic = Traffic(arrivals=Poisson(rate=rate), deadline=deadline, on_deadline="stay")
    return {
        name: simulate(
            traffic,
            Fleet(admission=options, io=io, cpu=cpu, workers=workers),
            horizon=horizon,
            seed=seed,
        )
        for name, options in shapes.items()
    }


def backpressure_figures(report: Report) -> dict[str, Any]:
    """One shape's figures in one replication, as plain data."""
    total = report.total
    return {
        "shed": total.shed_total,
        "expired": total.expired,
        "late": total.late,
        "on_time": total.on_time,
        "in_system": total.in_system,
        "p95": None if math.isnan(total.latency.p95) else total.latency.p95,
    }


def _backpressure_replication(task: dict[str, Any], seed: int) -> dict[str, Any]:
    reports = backpressure(**task, seed=seed)
    return {name: backpressure_figures(report) for name, report in reports.items()}


def backpressure_summary(
    rate: float,
    *,
    seed: int = 0,
    replications: int = 10,
    jobs: int = 1,
    progress: Callable[[], None] | None = None,
    **settings: Any,
) -> dict[str, dict[str, Any]]:
    """:func:`backpressure` over independent replications: per shape, each figure a mean with
    its 95% interval (``settings`` are :func:`backpressure`'s keywords)."""
    summary, _ = replicate(
        _backpressure_replication,
        {"rate": rate, **settings},
        seed=seed,
        replications=replications,
        workers=jobs,
        progress=progress,
    )
    result: dict[str, dict[str, Any]] = summary
    return result


# --------------------------------------------------------------------------- replicated sweep


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSummary:
    """One rate of a replicated sweep: every figure a mean with its 95% interval, the warm-up
    MSER-5 chose, Little's law from both sides and the stationarity check."""

    rate: float
    warmup: float
    figures: dict[str, Any]
    little: LittleCheck
    steady: Stationarity
    theory: TheoryPoint | None

    def as_dict(self) -> dict[str, Any]:
        figures = {key: value for key, value in plain(self.figures).items() if key != "batches"}
        return {
            "rate": self.rate,
            "warmup": self.warmup,
            **figures,
            "littles_law": self.little.as_dict(),
            "stationarity": self.steady.as_dict(),
            "theory": None if self.theory is None else self.theory.as_dict(),
        }


def theory_matching(rate: float, fleet: Fleet) -> TheoryPoint | None:
    """The prediction of the model that matches the fleet's dispatch, or ``None``.

    One worker, or round-robin dispatch: each of ``k`` workers sees every ``k``-th Poisson
    arrival, so Erlang-``k`` gaps at ``rate / k``: E_k/M/c/K per worker. Shortest-queue
    dispatch: the fleet as one M/M/c/K of ``workers x slots`` servers (exact with no waiting
    room). Needs no CPU part, exponential IO and one class.
    """
    queueing = _queueing(fleet)
    if queueing is None:
        return None
    workers, slots, mu, cap = queueing
    if fleet.dispatch == "shortest_queue" and workers > 1:
        servers = workers * slots
        if cap is None:
            if rate >= servers * mu:
                return None
            pooled = mmc(rate, mu, servers)
            return TheoryPoint(
                shed_share=0.0,
                in_system=pooled.mean_in_system,
                time_in_system=pooled.mean_response,
                throughput=rate,
            )
        finite = mmck(rate, mu, servers, servers + workers * cap)
        return TheoryPoint(
            shed_share=finite.p_block,
            in_system=finite.mean_in_system,
            time_in_system=finite.mean_response,
            throughput=finite.throughput,
        )
    lam = rate / workers
    if cap is None and lam >= slots * mu:
        return None
    result = ekmck(lam, mu, slots, workers, None if cap is None else slots + cap)
    return TheoryPoint(
        shed_share=result.p_block,
        in_system=workers * result.mean_in_system,
        time_in_system=result.mean_response,
        throughput=workers * result.throughput,
    )


def _load_replication(task: tuple[Traffic, Fleet, float, float], seed: int) -> dict[str, Any]:
    traffic, fleet, horizon, warmup = task
    report = simulate(traffic, fleet, horizon=horizon, warmup=warmup, seed=seed, series=100)
    return steady_metrics(report)


def load_summary(
    rate: float,
    fleet: Fleet,
    *,
    horizon: float = 600.0,
    warmup: float | None = None,
    seed: int = 0,
    replications: int = 10,
    jobs: int = 1,
    deadline: float | None = None,
    with_theory: bool = False,
    progress: Callable[[], None] | None = None,
) -> LoadSummary:
    """``rate`` against ``fleet`` over independent replications; ``warmup=None`` lets MSER-5
    choose it on a pilot run."""
    traffic = Traffic(arrivals=Poisson(rate=rate), deadline=deadline)
    if warmup is None:
        warmup = mser5_warmup(traffic, fleet, horizon=horizon, seed=seed)
    metrics = run_replications(
        _load_replication,
        (traffic, fleet, horizon, warmup),
        seed=seed,
        replications=replications,
        workers=jobs,
        progress=progress,
    )
    return LoadSummary(
        rate=rate,
        warmup=warmup,
        figures=aggregate(metrics),
        little=littles_check(metrics),
        steady=stationarity(metrics),
        theory=theory_matching(rate, fleet) if with_theory else None,
    )
