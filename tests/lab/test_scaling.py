"""Tests for autoscaling under a lead time: the proportional law oscillates, the damped does not."""

from __future__ import annotations

from dataclasses import replace

import pytest

import tidegate.lab.scaling as scaling_module
from tidegate.lab.scaling import LAWS, AutoscaleOptions, AutoscaleResult, run_autoscale
from tidegate.policy.autoscale import DampedLaw, ProportionalLaw

OPTIONS = AutoscaleOptions(
    base_rate=8.0, surge_rate=24.0, surge_start=120.0, surge_end=900.0, duration=1500.0
)


@pytest.fixture(scope="module")
def results() -> dict[str, AutoscaleResult]:
    return {law: run_autoscale(law, OPTIONS, seed=1) for law in LAWS}


def _isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, as ruff's isort-style sort orders them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    assert scaling_module.__all__ == sorted(scaling_module.__all__, key=_isort_order)
    for name in scaling_module.__all__:
        assert hasattr(scaling_module, name)


def test_the_proportional_law_thrashes_under_a_lead_time(
    results: dict[str, AutoscaleResult],
) -> None:
    """Ignoring pending supply, the proportional law reorders, overshoots and tears down: many
    direction changes and cold starts; the damped law converges with few of either."""
    proportional, damped = results["proportional"], results["damped"]
    assert proportional.direction_changes > 5 * max(1, damped.direction_changes)
    assert proportional.cold_starts > 3 * damped.cold_starts
    assert proportional.replica_seconds > damped.replica_seconds
    assert damped.direction_changes <= 4


def test_both_laws_scale_up_for_the_surge_and_serve_it(results: dict[str, AutoscaleResult]) -> None:
    """Each law grows the fleet past what the surge needs and answers most requests in time."""
    needed = OPTIONS.surge_rate / OPTIONS.per_replica_rate
    for result in results.values():
        assert result.peak_replicas >= needed
        assert result.goodput_share > 0.8
        assert result.report.littles_law_holds()
        assert result.trace[0].serving == OPTIONS.initial_replicas


def test_new_replicas_serve_only_after_the_lead_time(results: dict[str, AutoscaleResult]) -> None:
    """Until one lead time after the first order, the serving count cannot rise."""
    trace = results["damped"].trace
    first_order = next(s.at for s in trace if s.delta > 0)
    before = [s.serving for s in trace if s.at < first_order + OPTIONS.lead_time]
    assert max(before) <= OPTIONS.initial_replicas


def test_the_scenario_drives_the_policy_laws(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decision is a call to tidegate.policy's law objects."""
    seen: list[str] = []
    for cls in (ProportionalLaw, DampedLaw):
        original = cls.decide

        def spy(
            self: object, signals: object, _o: object = original, _c: str = cls.__name__
        ) -> object:
            seen.append(_c)
            return _o(self, signals)  # type: ignore[operator]

        monkeypatch.setattr(cls, "decide", spy)
    short = replace(OPTIONS, duration=60.0)
    run_autoscale("proportional", short)
    run_autoscale("damped", short)
    assert seen == ["ProportionalLaw"] * 4 + ["DampedLaw"] * 4


def test_options_and_laws_are_checked() -> None:
    """Unknown laws and bad options are refused; the same seed repeats exactly."""
    with pytest.raises(ValueError, match="law"):
        run_autoscale("psychic", OPTIONS)
    with pytest.raises(ValueError, match="lead_time"):
        replace(OPTIONS, lead_time=0.0)
    with pytest.raises(ValueError, match="surge_start"):
        replace(OPTIONS, surge_start=1000.0)
    short = replace(OPTIONS, duration=300.0)
    assert (
        run_autoscale("damped", short, seed=2).as_dict()
        == run_autoscale("damped", short, seed=2).as_dict()
    )
