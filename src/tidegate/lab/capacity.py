"""Capacity and cost planning: the ceiling of a fleet, the workers a peak needs, the monthly bill.

A request holds an in-flight slot for its CPU part and its IO part (the model call) and a core
for its CPU part only, so one worker completes at most ``min(slots / (cpu + io), cores / cpu)``
requests per second. Raise slots while the slot limit binds; add workers (processes) when the
core limit does.

:func:`plan_workers` sizes a fleet for a peak at a target utilisation plus spare workers and
reports the utilisation at the peak and with one worker lost. :func:`monthly_cost` splits the
bill into compute (paid busy or idle) and tokens (which follow traffic).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tidegate.lab.engine import Fleet, Traffic, ceiling, simulate
from tidegate.lab.workload import Deterministic, Distribution, Exponential, Poisson
from tidegate.policy.admission import AdmissionOptions

__all__ = [
    "CapacityRow",
    "MonthlyCost",
    "Plan",
    "capacity_table",
    "monthly_cost",
    "plan_workers",
    "simulate_peak",
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
