"""Tests for load sweeps (with theory beside them) and the backpressure comparison."""

from __future__ import annotations

import pytest

import tidegate.lab.load as load_module
from tidegate.lab import theory
from tidegate.lab.engine import Fleet
from tidegate.lab.load import BACKPRESSURE_SHAPES, backpressure, load_sweep, theory_for
from tidegate.lab.workload import Deterministic, Exponential
from tidegate.policy.admission import AdmissionOptions


def fleet(*, waiting: int | None = 8, cpu: float = 0.0, workers: int = 1) -> Fleet:
    return Fleet(
        admission=AdmissionOptions(
            classes=("standard",),
            slots=8,
            queue_cap=waiting,
            mode="queue_cap",
            dequeue="fifo",
            drop_expired_at_dequeue=False,
        ),
        cpu=Deterministic(value=cpu) if cpu else None,
        io=Exponential(mean=0.8),
        workers=workers,
    )


def _isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, as ruff's isort-style sort orders them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    assert load_module.__all__ == sorted(load_module.__all__, key=_isort_order)
    for name in load_module.__all__:
        assert hasattr(load_module, name)


def test_the_sweep_traces_a_saturation_curve() -> None:
    """Past the ceiling shedding and p95 rise and throughput flattens at the ceiling."""
    ticks: list[int] = []
    points = load_sweep(
        [4.0, 8.0, 14.0, 20.0],
        fleet(cpu=0.015),
        horizon=400.0,
        warmup=40.0,
        progress=lambda: ticks.append(1),
    )
    assert len(ticks) == 4
    shed = [p.shed_share for p in points]
    assert shed == sorted(shed)
    assert shed[0] == 0.0
    assert points[-1].report.throughput == pytest.approx(fleet(cpu=0.015).ceiling, rel=0.05)
    assert points[-1].report.total.latency.p95 > points[0].report.total.latency.p95
    for point in points:
        assert point.report.littles_law_holds()
        assert point.theory is None
        assert point.as_dict()["theory"] is None


def test_theory_matches_the_simulation_where_it_applies() -> None:
    """For exponential IO and no CPU part the M/M/c/K columns sit beside the simulated ones."""
    points = load_sweep([6.0, 12.0], fleet(), horizon=3000.0, warmup=100.0, with_theory=True)
    for point in points:
        assert point.theory is not None
        assert point.shed_share == pytest.approx(point.theory.shed_share, abs=0.02)
        assert point.report.in_system_mean == pytest.approx(point.theory.in_system, rel=0.06)
    expected = theory.mmck(12.0, 1.25, 8, 16)
    assert points[1].theory == load_module.TheoryPoint(
        shed_share=expected.p_block,
        in_system=expected.mean_in_system,
        time_in_system=expected.mean_response,
        throughput=expected.throughput,
    )


def test_theory_is_absent_where_the_formulas_do_not_describe_the_fleet() -> None:
    """A CPU part, a non-exponential IO or an overloaded unbounded queue gives no theory."""
    assert theory_for(4.0, fleet(cpu=0.01)) is None
    unbounded = fleet(waiting=None)
    assert theory_for(20.0, unbounded) is None
    below = theory_for(5.0, unbounded)
    assert below is not None
    assert below.shed_share == 0.0
    assert below.in_system == theory.mmc(5.0, 1.25, 8).mean_in_system
    two = theory_for(10.0, fleet(workers=2))
    assert two is not None
    assert two.in_system == 2 * theory.mmck(5.0, 1.25, 8, 16).mean_in_system


def test_backpressure_shapes_trade_refusals_for_lateness() -> None:
    """No waiting room sheds most; a bounded room sheds less; the unbounded queue sheds none
    and answers least in time."""
    reports = backpressure(14.0, io=Exponential(mean=0.8), cpu=Deterministic(value=0.015))
    assert tuple(reports) == BACKPRESSURE_SHAPES
    none, bounded, unbounded = (reports[name].total for name in BACKPRESSURE_SHAPES)
    assert none.shed_total > bounded.shed_total > unbounded.shed_total == 0
    assert unbounded.expired > 0
    assert none.expired == bounded.expired == 0
    assert unbounded.on_time < bounded.on_time
    assert unbounded.latency.p95 > none.latency.p95
    for report in reports.values():
        assert report.littles_law_holds()
        assert all(r.balanced for r in report.classes)
