"""Tests for capacity planning: ceilings, worker counts, and the monthly bill."""

from __future__ import annotations

import math

import pytest

import tidegate.lab.capacity as capacity_module
from tidegate.lab.capacity import capacity_table, monthly_cost, plan_workers, simulate_peak
from tidegate.lab.workload import Deterministic, Exponential


def _isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, as ruff's isort-style sort orders them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    assert capacity_module.__all__ == sorted(capacity_module.__all__, key=_isort_order)
    for name in capacity_module.__all__:
        assert hasattr(capacity_module, name)


def test_few_slots_bind_before_the_core_and_many_slots_after() -> None:
    """Eight slots cap an IO-bound worker; with 64 the core is the limit; workers multiply."""
    rows = capacity_table([(1, 8), (1, 64), (4, 64)], cpu=0.02, io=0.98)
    assert [r.binding for r in rows] == ["slots", "cores", "cores"]
    assert [r.ceiling for r in rows] == [8.0, 50.0, 200.0]
    assert rows[0].core_limit == 50.0
    assert rows[2].slot_limit == 256.0
    assert all(r.simulated is None for r in rows)
    assert rows[0].as_dict()["binding"] == "slots"


def test_pure_io_work_has_no_core_limit() -> None:
    """With no CPU part only the slots limit; the JSON shows no core limit."""
    (row,) = capacity_table([(2, 4)], cpu=0.0, io=0.5)
    assert math.isinf(row.core_limit)
    assert row.ceiling == 16.0
    assert row.as_dict()["core_limit"] is None


def test_the_check_simulates_the_ceiling() -> None:
    """Saturated in the engine, each shape completes about its computed ceiling."""
    rows = capacity_table([(1, 8), (1, 64)], cpu=0.015, io=0.8, check=True, horizon=200.0)
    for row in rows:
        assert row.simulated == pytest.approx(row.ceiling, rel=0.06)


def test_plan_sizes_for_the_target_and_adds_a_spare() -> None:
    """40 req/s at 60% of 10 req/s per worker needs 7 workers, plus one spare."""
    plan = plan_workers(40.0, cpu=0.0, io=0.8, slots=8, target_utilisation=0.6, spare=1)
    assert plan.per_worker_ceiling == 10.0
    assert plan.workers == 8
    assert plan.utilisation_at_peak == 0.5
    assert plan.utilisation_one_down == 40.0 / 70.0
    assert plan.as_dict()["core_limit_rps"] is None


def test_plan_with_no_spare_and_one_worker_cannot_lose_one() -> None:
    """A fleet of one has no utilisation with a worker lost; bad inputs are refused."""
    plan = plan_workers(1.0, cpu=0.01, io=0.99, slots=8, spare=0)
    assert plan.workers == 1
    assert math.isinf(plan.utilisation_one_down)
    assert plan.as_dict()["utilisation_one_down"] is None
    for kwargs in ({"target_utilisation": 0.0}, {"spare": -1}):
        with pytest.raises(ValueError):
            plan_workers(1.0, cpu=0.0, io=1.0, slots=1, **kwargs)
    with pytest.raises(ValueError, match="peak_rps"):
        plan_workers(0.0, cpu=0.0, io=1.0, slots=1)


def test_monthly_cost_splits_compute_from_tokens() -> None:
    """Compute is workers x hours x price; tokens are requests x tokens x price per 1,000."""
    cost = monthly_cost(
        8,
        requests_per_month=1_000_000,
        tokens_per_request=1000,
        worker_hour_price=0.5,
        price_per_1k_tokens=0.01,
        hours=100.0,
    )
    assert cost.compute == 400.0
    assert cost.tokens == 10_000.0
    assert cost.total == 10_400.0
    assert cost.per_request(1_000_000) == 0.0104
    assert math.isnan(cost.per_request(0))
    assert cost.as_dict() == {"compute": 400.0, "tokens": 10_000.0, "total": 10_400.0}
    with pytest.raises(ValueError, match="hours"):
        monthly_cost(
            1,
            requests_per_month=1,
            tokens_per_request=1,
            worker_hour_price=1,
            price_per_1k_tokens=1,
            hours=-1,
        )


def test_the_planned_fleet_holds_the_peak_and_a_too_small_one_does_not() -> None:
    """Simulated at its peak, the planned fleet sheds almost nothing; one worker sheds a lot."""
    plan = plan_workers(20.0, cpu=0.01, io=0.8, slots=8)
    shed, p95 = simulate_peak(
        plan, cpu=Deterministic(value=0.01), io=Exponential(mean=0.8), slots=8, horizon=300.0
    )
    assert shed < 0.01
    assert p95 > 0.8
    small_shed, _ = simulate_peak(
        plan,
        cpu=Deterministic(value=0.01),
        io=Exponential(mean=0.8),
        slots=8,
        workers=1,
        horizon=300.0,
    )
    assert plan.workers == 5
    assert small_shed > 0.3
