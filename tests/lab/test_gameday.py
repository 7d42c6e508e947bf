"""Tests for the release game day: strategies, the real rollout gate, and scenario files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import tidegate.lab.gameday as gameday_module
from tidegate.lab.gameday import (
    STRATEGIES,
    GamedayScenario,
    VersionSpec,
    load_scenario,
    run_gameday,
    run_release,
)
from tidegate.policy.rollout import RolloutGate


@pytest.fixture(scope="module")
def scenario() -> GamedayScenario:
    return load_scenario()


@pytest.fixture(scope="module")
def results(scenario: GamedayScenario) -> dict[tuple[str, bool], gameday_module.ReleaseResult]:
    return {(r.strategy, r.gated): r for r in run_gameday(scenario, seed=0)}


def _isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, as ruff's isort-style sort orders them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    assert gameday_module.__all__ == sorted(gameday_module.__all__, key=_isort_order)
    for name in gameday_module.__all__:
        assert hasattr(gameday_module, name)


def test_the_built_in_scenario_has_a_defect_that_grows_with_traffic(
    scenario: GamedayScenario,
) -> None:
    """The shipped candidate looks like the baseline at a small share and fails at scale."""
    assert scenario.candidate.error_at(0.05) < scenario.baseline.error_rate + 0.01
    assert scenario.candidate.error_at(1.0) > 3 * scenario.baseline.error_rate
    assert scenario.schedule("canary").shares == scenario.canary_shares
    assert scenario.schedule("rolling").shares[0] == 1 / scenario.rolling_instances
    assert scenario.schedule("blue_green").shares == (1.0,)


def test_the_gate_exposes_fewer_requests_and_rolls_back_sooner(
    results: dict[tuple[str, bool], gameday_module.ReleaseResult],
) -> None:
    """For every strategy the gate rolls back earlier and exposes fewer requests than the
    alert and a person do."""
    for strategy in STRATEGIES:
        off, on = results[(strategy, False)], results[(strategy, True)]
        assert off.outcome == on.outcome == "rolled_back"
        assert on.exposed < off.exposed
        assert on.failed < off.failed
        assert on.rolled_back_at is not None
        assert off.rolled_back_at is not None
        assert on.rolled_back_at < off.rolled_back_at


def test_a_load_dependent_defect_passes_the_first_canary_steps(
    results: dict[tuple[str, bool], gameday_module.ReleaseResult],
) -> None:
    """The gated canary proceeds at 5% and rolls back only once the share is large enough,
    with the Wilson sentence as its reason."""
    steps = results[("canary", True)].steps
    assert steps[0].action == "proceed"
    assert steps[0].share == 0.05
    assert steps[-1].action == "rollback"
    assert steps[-1].share > 0.05
    assert "Wilson low end" in steps[-1].reasons[0]


def test_blue_green_exposes_everyone_at_once_but_flips_back_fastest(
    results: dict[tuple[str, bool], gameday_module.ReleaseResult],
) -> None:
    """Blue-green's first window is the whole traffic; the gate flips it back after one window."""
    gated = results[("blue_green", True)]
    assert gated.steps[0].share == 1.0
    assert gated.rolled_back_at == load_scenario().window
    assert gated.rolled_back_at <= min(results[(s, True)].rolled_back_at or 0 for s in STRATEGIES)


def test_a_good_release_completes(scenario: GamedayScenario) -> None:
    """A candidate as good as the baseline proceeds through every step with the gate on."""
    good = replace(scenario, candidate=replace(scenario.baseline, cost_per_request=0.001))
    result = run_release(good, "canary", gated=True, seed=3)
    assert result.outcome == "completed"
    assert result.rolled_back_at is None
    assert [s.action for s in result.steps][:3] == ["proceed"] * 3


def test_a_costly_release_is_stopped_on_cost(scenario: GamedayScenario) -> None:
    """No new errors but twice the cost: the gate rolls back at the first step, on cost."""
    costly = replace(
        scenario,
        candidate=replace(
            scenario.baseline, cost_per_request=2 * scenario.baseline.cost_per_request
        ),
    )
    result = run_release(costly, "canary", gated=True, seed=1)
    assert result.outcome == "rolled_back"
    assert len(result.steps) == 1
    assert "cost per request" in result.steps[0].reasons[0]


def test_the_game_day_asks_the_real_rollout_gate(
    monkeypatch: pytest.MonkeyPatch, scenario: GamedayScenario
) -> None:
    """Every gated decision comes from tidegate.policy's RolloutGate.evaluate."""
    calls: list[float] = []
    original = RolloutGate.evaluate

    def spy(self: RolloutGate, share: float, *args: object) -> object:
        calls.append(share)
        return original(self, share, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(RolloutGate, "evaluate", spy)
    result = run_release(scenario, "canary", gated=True)
    assert calls == [s.share for s in result.steps]
    calls.clear()
    run_release(scenario, "canary", gated=False)
    assert calls == []


def test_the_same_seed_gives_the_same_game_day(scenario: GamedayScenario) -> None:
    """Runs with one seed agree exactly and turn into JSON."""
    first = run_release(scenario, "rolling", gated=True, seed=5)
    assert first == run_release(scenario, "rolling", gated=True, seed=5)
    json.dumps(first.as_dict())


def test_scenario_files_are_read_and_checked(tmp_path: Path) -> None:
    """A scenario file sets what it names; unknown keys and bad values are refused by name."""
    path = tmp_path / "release.json"
    base = {"error_rate": 0.01}
    path.write_text(
        json.dumps(
            {
                "baseline": base,
                "candidate": {**base, "defect_slope": 0.2},
                "rate": 2.0,
                "rules": {"min_requests": 50},
                "canary_shares": [0.1, 1.0],
            }
        )
    )
    loaded = load_scenario(path)
    assert loaded.rate == 2.0
    assert loaded.rules.min_requests == 50
    assert loaded.canary_shares == (0.1, 1.0)
    assert loaded.candidate == VersionSpec(error_rate=0.01, defect_slope=0.2)
    for content, message in (
        ({"baseline": base, "candidate": base, "speed": 1}, "speed"),
        ({"baseline": base}, "candidate"),
        ({"baseline": base, "candidate": {"error_rate": 2.0}}, "error_rate"),
        ({"baseline": base, "candidate": {"colour": 1}}, "colour"),
        ({"baseline": base, "candidate": base, "rules": {"zz": 1}}, "rules"),
        ({"baseline": base, "candidate": base, "canary_shares": [0.5, 0.2]}, "shares"),
        ([1], "object"),
    ):
        path.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=message):
            load_scenario(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_scenario(path)
    with pytest.raises(ValueError, match="strategy"):
        loaded.schedule("big_bang")
