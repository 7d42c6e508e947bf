"""Tests for the recovery scenario: a cold provider back under load, at once or by slow start."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import replace

import pytest
from typer.testing import CliRunner

import tidegate.lab.recovery as recovery_module
from tidegate.lab.cli import lab_app
from tidegate.lab.recovery import ARMS, RecoveryOptions, RecoveryResult, run_recovery
from tidegate.policy.slowstart import SlowStart, ramp_share

SEEDS = range(10)


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, int], RecoveryResult]:
    """Both arms with the defaults on ten seeds."""
    return {
        (arm, seed): run_recovery(ramp=arm == "slow_start", seed=seed)
        for arm in ARMS
        for seed in SEEDS
    }


def _lost(result: RecoveryResult) -> int:
    total = result.window["total"]
    return total.timed_out + total.shed


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    order = sorted(
        recovery_module.__all__,
        key=lambda n: (0 if n.isupper() else 1 if n[:1].isupper() else 2, n),
    )
    assert recovery_module.__all__ == order
    for name in recovery_module.__all__:
        assert hasattr(recovery_module, name)


def test_a_seed_gives_the_same_run_and_another_seed_another() -> None:
    """Same seed, same figures and routing, bit for bit; another seed changes them."""
    for ramp in (False, True):
        first = run_recovery(ramp=ramp, seed=3)
        again = run_recovery(ramp=ramp, seed=3)
        assert first.as_dict() == again.as_dict()
        assert first.routed == again.routed
        assert run_recovery(ramp=ramp, seed=4).as_dict() != first.as_dict()


def test_every_request_has_its_fate_and_both_arms_see_the_same_arrivals(
    runs: dict[tuple[str, int], RecoveryResult],
) -> None:
    """offered == goodput + late + expired + shed per provider and scope; the totals add up;
    and the arms of one seed are offered the same requests (common random numbers)."""
    for seed in SEEDS:
        no_ramp, ramp = runs["no_ramp", seed], runs["slow_start", seed]
        assert no_ramp.window["total"].offered == ramp.window["total"].offered
        assert no_ramp.run["total"].offered == ramp.run["total"].offered
        for result in (no_ramp, ramp):
            for scope in (result.window, result.run):
                for figures in scope.values():
                    fates = figures.goodput + figures.late + figures.expired + figures.shed
                    assert figures.offered == fates
                    assert figures.served == figures.goodput + figures.late
                assert (
                    scope["total"].offered == scope["primary"].offered + scope["fallback"].offered
                )


def test_the_slow_start_loses_fewer_requests_in_every_seed(
    runs: dict[tuple[str, int], RecoveryResult],
) -> None:
    """With the defaults, in each of ten seeds: the ramp times out and sheds fewer requests of
    the recovery window than all traffic back at once (by far: a burst against about none),
    and answers at least as many in time."""
    for seed in SEEDS:
        no_ramp, ramp = runs["no_ramp", seed], runs["slow_start", seed]
        assert _lost(ramp) < _lost(no_ramp)
        assert _lost(no_ramp) > 0.2 * no_ramp.window["total"].offered
        assert _lost(ramp) < 0.02 * ramp.window["total"].offered
        assert ramp.window["total"].goodput >= no_ramp.window["total"].goodput
        assert ramp.window["total"].p99 < no_ramp.window["total"].p99
        # Before recovery the arms are the same: the fallback alone, nothing lost.
        assert ramp.run["total"].goodput >= no_ramp.run["total"].goodput


def test_without_the_ramp_the_primary_takes_everything_at_recovery(
    runs: dict[tuple[str, int], RecoveryResult],
) -> None:
    """``window_s=0``: nothing goes to the primary while its breaker is open, and from the
    moment it closes every request goes to it first (its share jumps from 0 to 1)."""
    options = RecoveryOptions()
    for seed in SEEDS:
        result = runs["no_ramp", seed]
        assert result.window_s == 0
        assert result.run["primary"].offered == result.window["primary"].offered
        assert result.routed
        assert all(to_primary for _, to_primary in result.routed)
        assert result.routed[0][0] >= options.recover_at
        assert result.primary_share == 1.0


def test_the_ramp_share_follows_ramp_share_within_binomial_noise(
    runs: dict[tuple[str, int], RecoveryResult],
) -> None:
    """In the first 5 s after recovery, pooled over ten seeds (about 1500 requests), the count
    sent to the primary is within 4 standard deviations of the sum of ``ramp_share`` at each
    arrival (each request a Bernoulli draw with that probability), and its share lies in
    ``min_share .. 5 / window_s`` up to the same noise; after the window every request goes to
    the primary again."""
    options = RecoveryOptions()
    ramp = options.slow_start(ramp=True)
    start, stop = options.recover_at, options.recover_at + 5.0
    sent = expected = variance = 0.0
    count = 0
    for seed in SEEDS:
        result = runs["slow_start", seed]
        assert result.window_s == options.window_s
        for at, to_primary in result.routed:
            if at >= start + options.window_s:
                assert to_primary
            if not start <= at < stop:
                continue
            p = ramp_share(at - start, ramp)
            count += 1
            sent += to_primary
            expected += p
            variance += p * (1.0 - p)
    assert count > 1000
    sd = math.sqrt(variance)
    assert abs(sent - expected) <= 4 * sd
    share, noise = sent / count, 4 * sd / count
    assert options.min_share - noise <= share <= 5.0 / options.window_s + noise


def test_each_request_asks_the_slow_start_once_after_recovery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Routing goes through the policy object itself: one ``held_back`` per request whose
    route has the primary on it, none while its breaker is open."""
    calls: list[list[str]] = []

    class Counting(SlowStart):
        def held_back(self, candidates: Iterable[str]) -> list[str]:
            names = list(candidates)
            calls.append(names)
            return super().held_back(names)

    monkeypatch.setattr(recovery_module, "SlowStart", Counting)
    result = run_recovery(ramp=True, seed=1)
    assert len(calls) == len(result.routed)
    assert all(names == ["primary", "fallback"] for names in calls)


def test_a_ramp_shorter_than_the_warm_up_still_overloads_the_primary(
    runs: dict[tuple[str, int], RecoveryResult],
) -> None:
    """Over five seeds, a 10-second ramp into a 30-second warm-up loses more of the window than
    a ramp as long as the warm-up (and less than no ramp)."""
    short = replace(RecoveryOptions(), window_s=10.0)
    seeds = range(5)
    lost_short = sum(_lost(run_recovery(short, ramp=True, seed=seed)) for seed in seeds)
    lost_matched = sum(_lost(runs["slow_start", seed]) for seed in seeds)
    lost_none = sum(_lost(runs["no_ramp", seed]) for seed in seeds)
    assert lost_matched < lost_short < lost_none


@pytest.mark.parametrize(
    "changes",
    [
        {"rate": 0.0},
        {"cold_capacity_fraction": 0.0},
        {"cold_capacity_fraction": 1.5},
        {"warmup_s": -1.0},
        {"window_s": -1.0},
        {"min_share": 0.0},
        {"queue_cap": -1},
    ],
)
def test_bad_options_are_refused(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(changes))):
        RecoveryOptions(**changes)  # type: ignore[arg-type]


runner = CliRunner()
SMALL = ("recovery", "--replications", "3", "--jobs", "1", "--seed", "2")


def test_the_cli_prints_both_arms_and_json_parses() -> None:
    """``tidegate lab recovery`` prints a row per arm; ``--json`` gives intervals per arm."""
    table = runner.invoke(lab_app, [*SMALL, "--window-s", "20"])
    assert table.exit_code == 0, table.output
    assert "no ramp" in table.stdout
    assert "slow start 20s" in table.stdout
    result = runner.invoke(lab_app, [*SMALL, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["replications"] == 3
    assert [arm["arm"] for arm in data["arms"]] == list(ARMS)
    no_ramp, ramp = (arm["window"]["total"] for arm in data["arms"])
    assert ramp["lost"]["n"] == 3
    assert ramp["lost"]["mean"] < no_ramp["lost"]["mean"]
    assert runner.invoke(lab_app, [*SMALL, "--json"]).stdout == result.stdout


@pytest.mark.parametrize(
    "args", [("--rate", "0"), ("--window-s", "-1"), ("--warmup-s", "-1"), ("--jobs", "0")]
)
def test_the_cli_refuses_bad_input(args: tuple[str, ...]) -> None:
    result = runner.invoke(lab_app, ["recovery", *args])
    assert result.exit_code == 2
