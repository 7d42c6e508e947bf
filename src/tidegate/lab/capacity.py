"""Capacity and cost planning: the ceiling of a fleet, the workers a peak needs, the monthly bill.

A request holds an in-flight slot for its CPU part and its IO part (the model call) and a core
for its CPU part only, so one worker completes at most ``min(slots / (cpu + io), cores / cpu)``
requests per second. Raise slots while the slot limit binds; add workers (processes) when the
core limit does.

:func:`plan_workers` sizes a fleet for a peak at a target utilisation plus spare workers and
reports the utilisation at the peak and with one worker lost: the mean-value law.
:func:`size_fleet` sizes the fleet by simulation instead: the smallest fleet whose share of
refused (or expired) requests, averaged over independent replications after an MSER-5 warm-up,
is below a target at a rate, with intervals, Little's law and a stationarity check for each size
tried, and the size that the model matching the dispatch rule gives (:func:`theory_shed`).
:func:`monthly_cost` splits the bill into compute (paid busy or idle) and tokens (which follow
traffic).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tidegate.lab.engine import Fleet, Traffic, ceiling, simulate
from tidegate.lab.replicate import (
    LittleCheck,
    Stationarity,
    littles_check,
    mser5_warmup,
    replicate,
    run_replications,
    stationarity,
    steady_metrics,
)
from tidegate.lab.stats import Interval, interval
from tidegate.lab.theory import ekmck, mmck_blocking
from tidegate.lab.workload import Deterministic, Distribution, Exponential, Poisson
from tidegate.policy.admission import AdmissionOptions

__all__ = [
    "MAX_FLEET",
    "CapacityRow",
    "MonthlyCost",
    "Plan",
    "PlanSpec",
    "Sized",
    "Sizing",
    "capacity_table",
    "check_shapes",
    "monthly_cost",
    "plan_workers",
    "simulate_peak",
    "simulate_size",
    "size_fleet",
    "theory_shed",
]

HOURS_PER_MONTH = 730.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CapacityRow:
    """One fleet shape and its ceiling, with the limit that binds."""

    workers: int
    slots: int
    cores: int
    cpu: float
    io: float
    slot_limit: float
    core_limit: float
    ceiling: float
    binding: Literal["slots", "cores"]
    #: Throughput simulated at twice the ceiling, when asked for: the engine's own check.
    simulated: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "slots": self.slots,
            "cores": self.cores,
            "cpu": self.cpu,
            "io": self.io,
            "slot_limit": self.slot_limit,
            "core_limit": None if math.isinf(self.core_limit) else self.core_limit,
            "ceiling": self.ceiling,
            "binding": self.binding,
            "simulated": self.simulated,
        }


def _admission(slots: int, queue_cap: int | None) -> AdmissionOptions:
    return AdmissionOptions(
        classes=("standard",),
        slots=slots,
        queue_cap=queue_cap,
        mode="queue_cap",
        dequeue="fifo",
        drop_expired_at_dequeue=False,
    )


def capacity_table(
    shapes: Sequence[tuple[int, int]],
    *,
    cpu: float,
    io: float,
    cores: int = 1,
    check: bool = False,
    seed: int = 0,
    horizon: float = 300.0,
) -> list[CapacityRow]:
    """The ceiling of each ``(workers, slots)`` shape; ``check`` also simulates it saturated.

    The check offers twice the ceiling (Poisson) to workers with a deterministic CPU part and an
    exponential IO part and reports the completions per second it measured.
    """
    rows = []
    for workers, slots in shapes:
        slot_limit = workers * slots / (cpu + io)
        core_limit = workers * cores / cpu if cpu > 0 else math.inf
        limit = ceiling(slots=slots, cpu=cpu, io=io, cores=cores, workers=workers)
        simulated = None
        if check:
            fleet = Fleet(
                admission=_admission(slots, queue_cap=2 * slots),
                cpu=Deterministic(value=cpu) if cpu > 0 else None,
                io=Exponential(mean=io),
                workers=workers,
                cores=cores,
            )
            report = simulate(
                Traffic(arrivals=Poisson(rate=2.0 * limit)),
                fleet,
                horizon=horizon,
                warmup=horizon / 10,
                seed=seed,
            )
            simulated = report.throughput
        rows.append(
            CapacityRow(
                workers=workers,
                slots=slots,
                cores=cores,
                cpu=cpu,
                io=io,
                slot_limit=slot_limit,
                core_limit=core_limit,
                ceiling=limit,
                binding="slots" if slot_limit <= core_limit else "cores",
                simulated=simulated,
            )
        )
    return rows


def _check_replication(
    task: tuple[tuple[tuple[int, int], ...], float, float, int, float], seed: int
) -> list[float]:
    shapes, cpu, io, cores, horizon = task
    rows = capacity_table(
        shapes, cpu=cpu, io=io, cores=cores, check=True, seed=seed, horizon=horizon
    )
    return [math.nan if r.simulated is None else r.simulated for r in rows]


def check_shapes(
    shapes: Sequence[tuple[int, int]],
    *,
    cpu: float,
    io: float,
    cores: int = 1,
    seed: int = 0,
    replications: int = 10,
    jobs: int = 1,
    horizon: float = 300.0,
    progress: Callable[[], None] | None = None,
) -> list[Interval]:
    """Each shape's completions per second, simulated saturated as :func:`capacity_table`'s
    check does, over independent replications: a mean with its 95% interval per shape."""
    summary, _ = replicate(
        _check_replication,
        (tuple(shapes), cpu, io, cores, horizon),
        seed=seed,
        replications=replications,
        workers=jobs,
        progress=progress,
    )
    result: list[Interval] = summary
    return result


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Workers for a peak: each run at ``target_utilisation`` of its ceiling, plus spares."""

    peak_rps: float
    target_utilisation: float
    spare: int
    workers: int
    per_worker_ceiling: float
    slot_limit_rps: float
    core_limit_rps: float
    utilisation_at_peak: float
    utilisation_one_down: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "peak_rps": self.peak_rps,
            "target_utilisation": self.target_utilisation,
            "spare": self.spare,
            "workers": self.workers,
            "per_worker_ceiling": self.per_worker_ceiling,
            "slot_limit_rps": self.slot_limit_rps,
            "core_limit_rps": None if math.isinf(self.core_limit_rps) else self.core_limit_rps,
            "utilisation_at_peak": self.utilisation_at_peak,
            "utilisation_one_down": (
                None if math.isinf(self.utilisation_one_down) else self.utilisation_one_down
            ),
        }


def plan_workers(
    peak_rps: float,
    *,
    cpu: float,
    io: float,
    slots: int,
    cores: int = 1,
    target_utilisation: float = 0.6,
    spare: int = 1,
) -> Plan:
    """The workers that serve ``peak_rps`` at ``target_utilisation`` each, plus ``spare``.

    ``utilisation_one_down`` is the load on the others when one worker is lost (infinite for a
    fleet of one).
    """
    if not math.isfinite(peak_rps) or peak_rps <= 0:
        raise ValueError(f"peak_rps must be a finite number > 0, got {peak_rps!r}")
    if not 0 < target_utilisation <= 1:
        raise ValueError(f"target_utilisation must be in (0, 1], got {target_utilisation!r}")
    if spare < 0:
        raise ValueError(f"spare must be >= 0, got {spare!r}")
    per_worker = ceiling(slots=slots, cpu=cpu, io=io, cores=cores)
    # Nine decimals: float noise in a ratio must not buy a worker.
    needed = math.ceil(round(peak_rps / (target_utilisation * per_worker), 9))
    workers = max(1, needed) + spare
    capacity = workers * per_worker
    return Plan(
        peak_rps=peak_rps,
        target_utilisation=target_utilisation,
        spare=spare,
        workers=workers,
        per_worker_ceiling=per_worker,
        slot_limit_rps=workers * slots / (cpu + io),
        core_limit_rps=workers * cores / cpu if cpu > 0 else math.inf,
        utilisation_at_peak=peak_rps / capacity,
        utilisation_one_down=(peak_rps / ((workers - 1) * per_worker) if workers > 1 else math.inf),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class MonthlyCost:
    """A month's bill: compute is paid busy or idle, tokens follow the traffic."""

    compute: float
    tokens: float

    @property
    def total(self) -> float:
        return self.compute + self.tokens

    def per_request(self, requests: float) -> float:
        return self.total / requests if requests else math.nan

    def as_dict(self) -> dict[str, float]:
        return {"compute": self.compute, "tokens": self.tokens, "total": self.total}


def monthly_cost(
    workers: int,
    *,
    requests_per_month: float,
    tokens_per_request: float,
    worker_hour_price: float,
    price_per_1k_tokens: float,
    hours: float = HOURS_PER_MONTH,
) -> MonthlyCost:
    """Compute (``workers`` x ``hours`` x price) and tokens (requests x tokens x price)."""
    for name, value in (
        ("requests_per_month", requests_per_month),
        ("tokens_per_request", tokens_per_request),
        ("worker_hour_price", worker_hour_price),
        ("price_per_1k_tokens", price_per_1k_tokens),
        ("hours", hours),
    ):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return MonthlyCost(
        compute=workers * hours * worker_hour_price,
        tokens=requests_per_month * tokens_per_request / 1000.0 * price_per_1k_tokens,
    )


def simulate_peak(
    plan: Plan,
    *,
    cpu: Distribution | None,
    io: Distribution,
    slots: int,
    cores: int = 1,
    queue_cap: int | None = None,
    workers: int | None = None,
    horizon: float = 600.0,
    seed: int = 0,
) -> tuple[float, float]:
    """Shed share and p95 latency of the planned fleet (or ``workers`` of it) at the peak."""
    fleet = Fleet(
        admission=_admission(slots, queue_cap=slots if queue_cap is None else queue_cap),
        cpu=cpu,
        io=io,
        workers=plan.workers if workers is None else workers,
        cores=cores,
    )
    report = simulate(
        Traffic(arrivals=Poisson(rate=plan.peak_rps)),
        fleet,
        horizon=horizon,
        warmup=horizon / 10,
        seed=seed,
    )
    total = report.total
    return total.shed_total / total.offered, total.latency.p95


# --------------------------------------------------------------------------- sizing by simulation


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSpec:
    """The fleet a sizing simulates, but for its number of workers and the rate."""

    slots: int
    waiting: int | None
    cpu: Distribution | None
    io: Distribution
    cores: int = 1
    deadline: float | None = None
    dispatch: Literal["round_robin", "shortest_queue"] = "round_robin"
    horizon: float = 300.0

    def fleet(self, workers: int) -> Fleet:
        return Fleet(
            admission=_admission(self.slots, queue_cap=self.waiting),
            cpu=self.cpu,
            io=self.io,
            workers=workers,
            cores=self.cores,
            dispatch=self.dispatch,
        )

    def traffic(self, rate: float) -> Traffic:
        return Traffic(arrivals=Poisson(rate=rate), deadline=self.deadline, on_deadline="leave")


def _sizing_replication(task: tuple[PlanSpec, int, float, float], seed: int) -> dict[str, Any]:
    spec, workers, rate, warmup = task
    report = simulate(
        spec.traffic(rate),
        spec.fleet(workers),
        horizon=spec.horizon,
        warmup=warmup,
        seed=seed,
        series=100,
    )
    return steady_metrics(report)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    """One fleet size simulated at one rate: the share refused or expired, p95, the checks."""

    workers: int
    rate: float
    warmup: float
    failed: Interval
    p95: Interval
    little: LittleCheck
    steady: Stationarity
    theory: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "rate": self.rate,
            "warmup": self.warmup,
            "shed_share": self.failed.as_dict(),
            "p95": self.p95.as_dict(),
            "littles_law": self.little.as_dict(),
            "stationarity": self.steady.as_dict(),
            "theory_shed_share": self.theory,
        }


def theory_shed(spec: PlanSpec, workers: int, rate: float) -> float | None:
    """The refused share the matching model predicts, or ``None`` where none applies.

    Round-robin: each worker sees every ``workers``-th Poisson arrival, so Erlang-``workers``
    gaps at ``rate / workers``: E_k/M/c/K per worker (:func:`~tidegate.lab.theory.ekmck`).
    Shortest queue: the fleet as one M/M/c/K with ``c = workers x slots`` (exact with no waiting
    room, where a request is refused only when every slot is busy; an approximation with one,
    since a waiting request does not move to a worker that frees a slot first). Service is
    taken as exponential of the mean CPU plus IO time; a deadline or an unbounded queue gives
    ``None`` (an unbounded queue refuses nobody).
    """
    if spec.waiting is None or spec.deadline is not None:
        return None
    mean = spec.io.mean + (spec.cpu.mean if spec.cpu is not None else 0.0)
    mu = 1.0 / mean
    if spec.dispatch == "shortest_queue":
        servers = workers * spec.slots
        return mmck_blocking(rate, mu, servers, servers + workers * spec.waiting)
    return ekmck(rate / workers, mu, spec.slots, workers, spec.slots + spec.waiting).p_block


def simulate_size(
    spec: PlanSpec,
    workers: int,
    rate: float,
    *,
    seed: int,
    replications: int,
    jobs: int = 1,
    progress: Callable[[], None] | None = None,
) -> Sized:
    """``workers`` workers at ``rate``, over replications after an MSER-5 warm-up."""
    fleet, traffic = spec.fleet(workers), spec.traffic(rate)
    warmup = mser5_warmup(traffic, fleet, horizon=spec.horizon, seed=seed)
    metrics = run_replications(
        _sizing_replication,
        (spec, workers, rate, warmup),
        seed=seed,
        replications=replications,
        workers=jobs,
        progress=progress,
    )
    failed = [float(m["shed_share"]) + float(m["expired_share"]) for m in metrics]
    return Sized(
        workers=workers,
        rate=rate,
        warmup=warmup,
        failed=interval(failed),
        p95=interval([math.nan if m["p95"] is None else float(m["p95"]) for m in metrics]),
        little=littles_check(metrics),
        steady=stationarity(metrics),
        theory=theory_shed(spec, workers, rate),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizing:
    """The smallest fleet whose mean refused share is below ``target`` at ``rate``, with the
    size below it (which misses the target) for comparison, and the size theory gives."""

    rate: float
    target: float
    chosen: Sized
    below: Sized | None
    theory_workers: int | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "target": self.target,
            "workers": self.chosen.workers,
            "chosen": self.chosen.as_dict(),
            "one_fewer": None if self.below is None else self.below.as_dict(),
            "theory_workers": self.theory_workers,
        }


MAX_FLEET = 10_000


def size_fleet(
    spec: PlanSpec,
    rate: float,
    *,
    target: float,
    seed: int,
    replications: int,
    jobs: int = 1,
    on_size: Callable[[int, float], Callable[[], None] | None] | None = None,
) -> Sizing:
    """The smallest fleet meeting ``target`` at ``rate``, found by simulation.

    The search starts one below the fleet whose ceiling just carries ``rate`` (below that the
    fleet is overloaded) and adds a worker until the mean refused share over the replications is
    below ``target``. ``on_size(workers, rate)`` may return a progress callback for that size.
    """
    if not 0.0 < target < 1.0:
        raise ValueError(f"target must be in (0, 1), got {target!r}")
    per_worker = spec.fleet(1).ceiling
    workers = max(1, math.ceil(round(rate / per_worker, 9)) - 1)
    below: Sized | None = None
    while True:
        tick = on_size(workers, rate) if on_size is not None else None
        sized = simulate_size(
            spec, workers, rate, seed=seed, replications=replications, jobs=jobs, progress=tick
        )
        if sized.failed.mean < target:
            break
        if workers >= MAX_FLEET:
            raise ValueError(f"no fleet of up to {MAX_FLEET} workers meets the target")
        below, workers = sized, workers + 1
    theory_workers = None
    if theory_shed(spec, 1, rate) is not None:
        theory_workers = 1
        while (shed := theory_shed(spec, theory_workers, rate)) is not None and shed >= target:
            theory_workers += 1
            if theory_workers > MAX_FLEET:
                theory_workers = None
                break
    return Sizing(
        rate=rate, target=target, chosen=sized, below=below, theory_workers=theory_workers
    )
