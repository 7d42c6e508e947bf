"""Tests for tidegate.policy.rollout: cohorts, the Wilson interval, the gate and the schedule."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.policy import rollout
from tidegate.policy.rollout import (
    BUCKETS,
    CanaryHeld,
    CanaryProceeded,
    CanaryRolledBack,
    RolloutGate,
    RolloutOptions,
    Schedule,
    Verdict,
    WindowStats,
    cohort_bucket,
    decide,
    in_cohort,
    wilson_interval,
)


def isort_key(name: str) -> tuple[int, str]:
    """Constants, then classes, then functions, each alphabetical (ruff's RUF022 order)."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def stats(
    requests: int = 1_000,
    errors: int = 10,
    validation_failures: int = 10,
    p95_latency: float | None = 2.0,
    cost_per_request: float | None = 0.004,
) -> WindowStats:
    return WindowStats(
        requests=requests,
        errors=errors,
        validation_failures=validation_failures,
        p95_latency=p95_latency,
        cost_per_request=cost_per_request,
    )


BASELINE = stats()


def test_all_is_sorted_and_complete() -> None:
    """The module lists its public names in a sorted __all__, and each one exists."""
    assert list(rollout.__all__) == sorted(rollout.__all__, key=isort_key)
    for name in rollout.__all__:
        assert hasattr(rollout, name)


# --------------------------------------------------------------------------- cohorts


def test_cohort_bucket_golden_values() -> None:
    """The bucket function is pinned: changing the hash or the encoding breaks this test."""
    assert cohort_bucket("rollout-1", "user-42") == 1785
    assert cohort_bucket("prompt-v7", "alice@example.com") == 3504
    assert cohort_bucket("", "") == 3192


def test_cohort_bucket_depends_on_salt_and_user() -> None:
    """A new salt reshuffles users, so two rollouts do not land on the same people."""
    same_salt = {cohort_bucket("a", f"user-{i}") for i in range(50)}
    assert len(same_salt) > 40
    moved = sum(
        cohort_bucket("a", f"user-{i}") != cohort_bucket("b", f"user-{i}") for i in range(50)
    )
    assert moved > 40


def test_cohort_bucket_is_roughly_uniform() -> None:
    """Ten thousand users fill ten equal bucket ranges about equally (each within 20 %)."""
    counts = [0] * 10
    for i in range(10_000):
        counts[cohort_bucket("uniformity", f"user-{i}") * 10 // BUCKETS] += 1
    assert all(800 <= c <= 1_200 for c in counts), counts
    in_five_percent = sum(in_cohort("uniformity", f"user-{i}", 0.05) for i in range(10_000))
    assert 400 <= in_five_percent <= 600


def test_cohort_bucket_refuses_an_ambiguous_salt() -> None:
    """A NUL in the salt could collide with another salt and user pair, so it is refused."""
    with pytest.raises(ValueError, match="salt"):
        cohort_bucket("a\x00b", "c")


def test_in_cohort_at_zero_and_full_share() -> None:
    """Nobody is in at share 0 and everybody is in at share 1."""
    users = [f"user-{i}" for i in range(200)]
    assert not any(in_cohort("s", u, 0.0) for u in users)
    assert all(in_cohort("s", u, 1.0) for u in users)


def test_in_cohort_counts_whole_buckets() -> None:
    """A share maps to exactly round(share * BUCKETS) buckets, free of float fuzz at 7 %."""
    assert 0.07 * BUCKETS > 700  # the float product overshoots; bucket 700 must still be out
    user = next(f"u{i}" for i in range(100_000) if cohort_bucket("s", f"u{i}") == 700)
    assert in_cohort("s", user, 0.07) is False
    assert in_cohort("s", user, 0.0701) is True


@pytest.mark.parametrize("share", [-0.01, 1.01, math.nan, math.inf])
def test_in_cohort_refuses_a_share_outside_zero_to_one(share: float) -> None:
    """A share that is not a number in [0, 1] raises ValueError naming it."""
    with pytest.raises(ValueError, match="share"):
        in_cohort("s", "u", share)


@settings(max_examples=300, deadline=None)
@given(
    user=st.text(max_size=20),
    shares=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
)
def test_cohort_membership_is_monotone_in_share(user: str, shares: tuple[float, float]) -> None:
    """A user in the cohort at some share is in it at every larger share."""
    small, large = sorted(shares)
    if in_cohort("monotone", user, small):
        assert in_cohort("monotone", user, large)


# --------------------------------------------------------------------------- Wilson


@settings(max_examples=500, deadline=None)
@given(
    data=st.integers(1, 100_000).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))),
    z=st.floats(0.1, 5.0),
)
def test_wilson_interval_contains_the_rate_and_lies_in_unit_interval(
    data: tuple[int, int], z: float
) -> None:
    """The interval holds the observed rate and never leaves [0, 1]."""
    successes, n = data
    low, high = wilson_interval(successes, n, z)
    assert 0.0 <= low <= successes / n <= high <= 1.0


def test_wilson_interval_matches_published_values() -> None:
    """Known 95 % Wilson intervals for 0 of 10 and 5 of 10 are reproduced."""
    low, high = wilson_interval(0, 10)
    assert low == 0.0
    assert high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4)
    assert high == pytest.approx(0.7634, abs=1e-4)


def test_wilson_interval_narrows_with_more_data() -> None:
    """The same rate on ten times the requests gives a narrower interval."""
    low_small, high_small = wilson_interval(3, 30)
    low_large, high_large = wilson_interval(30, 300)
    assert high_large - low_large < high_small - low_small


def test_wilson_interval_of_no_data_is_everything() -> None:
    """With no trials nothing is known: the interval is [0, 1]."""
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize(
    ("successes", "n", "z", "field"),
    [(1, 0, 1.96, "successes"), (-1, 5, 1.96, "successes"), (1, -1, 1.96, "n"), (1, 5, 0.0, "z")],
)
def test_wilson_interval_refuses_bad_input(successes: int, n: int, z: float, field: str) -> None:
    """Counts out of range and a non-positive z raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=field):
        wilson_interval(successes, n, z)


# --------------------------------------------------------------------------- the gate


def test_healthy_canary_proceeds_with_every_check_explained() -> None:
    """A canary as good as the baseline proceeds, with one passed sentence per check."""
    decision = decide(stats(errors=12, validation_failures=8, p95_latency=2.1), BASELINE)
    assert decision.verdict is Verdict.PROCEED
    assert decision.reasons == (
        "error rate 12/1000 = 1.2% (Wilson low end 0.7%) is within the baseline's "
        "10/1000 = 1.0% plus the 2.0% margin = 3.0%",
        "validation-failure rate 8/1000 = 0.8% (Wilson low end 0.4%) is within the baseline's "
        "10/1000 = 1.0% plus the 2.0% margin = 3.0%",
        "p95 latency 2.1 s is 1.05x the baseline's 2 s, within the 1.20x limit",
        "cost per request 0.004 is 1.00x the baseline's 0.004, within the 1.25x limit",
    )


def test_too_few_canary_requests_holds() -> None:
    """Below min_requests a clean canary holds, saying how many requests it has and needs."""
    decision = decide(stats(requests=150, errors=0, validation_failures=0), BASELINE)
    assert decision.verdict is Verdict.HOLD
    assert decision.reasons == (
        "only 150 canary requests in this window; 200 are needed to judge latency and cost "
        "and to proceed",
    )


def test_zero_baseline_requests_holds() -> None:
    """With no baseline requests there is nothing to compare against, so the gate holds."""
    empty = stats(requests=0, errors=0, validation_failures=0)
    decision = decide(stats(), empty)
    assert decision.verdict is Verdict.HOLD
    assert decision.reasons == (
        "only 0 baseline requests in this window; 200 are needed to compare against",
    )


def test_error_rate_confidently_worse_rolls_back() -> None:
    """When even the Wilson low end of the error rate is above baseline plus margin, roll back."""
    decision = decide(stats(requests=400, errors=40), BASELINE)
    assert decision.verdict is Verdict.ROLLBACK
    assert decision.reasons == (
        "error rate 40/400 = 10.0% (Wilson low end 7.4%) is above the baseline's "
        "10/1000 = 1.0% plus the 2.0% margin = 3.0%",
    )


def test_validation_failures_confidently_worse_roll_back() -> None:
    """Validation failures follow the same Wilson rule with their own margin."""
    decision = decide(stats(requests=400, validation_failures=40), BASELINE)
    assert decision.verdict is Verdict.ROLLBACK
    assert decision.reasons[0].startswith("validation-failure rate 40/400 = 10.0%")


def test_bad_luck_on_a_small_sample_does_not_roll_back() -> None:
    """A point rate above the limit proceeds while its Wilson low end is still within it."""
    canary = stats(requests=210, errors=9)  # 4.3 % against a 3.0 % limit
    assert canary.errors / canary.requests > 0.03
    assert decide(canary, BASELINE).verdict is Verdict.PROCEED


def test_a_clearly_broken_canary_rolls_back_before_min_requests() -> None:
    """The Wilson rule accounts for sample size, so overwhelming evidence rolls back early."""
    decision = decide(
        stats(requests=40, errors=20, validation_failures=0, p95_latency=None), BASELINE
    )
    assert decision.verdict is Verdict.ROLLBACK
    assert len(decision.reasons) == 1
    assert decision.reasons[0].startswith("error rate 20/40 = 50.0%")


def test_p95_latency_over_ratio_rolls_back() -> None:
    """A canary p95 over latency_ratio times the baseline's rolls back."""
    decision = decide(stats(p95_latency=2.5), BASELINE)
    assert decision.verdict is Verdict.ROLLBACK
    assert decision.reasons == (
        "p95 latency 2.5 s is 1.25x the baseline's 2 s, over the 1.20x limit",
    )


def test_cost_over_ratio_rolls_back() -> None:
    """A canary cost per request over cost_ratio times the baseline's rolls back."""
    decision = decide(stats(cost_per_request=0.006), BASELINE)
    assert decision.verdict is Verdict.ROLLBACK
    assert decision.reasons == (
        "cost per request 0.006 is 1.50x the baseline's 0.004, over the 1.25x limit",
    )


def test_ratio_exactly_at_the_limit_proceeds() -> None:
    """The ratio limits are inclusive: exactly latency_ratio times the baseline proceeds."""
    assert decide(stats(p95_latency=2.4), BASELINE).verdict is Verdict.PROCEED


@pytest.mark.parametrize(
    ("canary", "baseline", "sentence"),
    [
        (stats(p95_latency=None), BASELINE, "p95 latency is not measured for the canary"),
        (stats(), stats(p95_latency=None), "p95 latency is not measured for the baseline"),
        (
            stats(cost_per_request=None),
            stats(cost_per_request=None),
            "cost per request is not measured for the canary and baseline",
        ),
        (
            stats(cost_per_request=0.001),
            stats(cost_per_request=0.0),
            "cost per request is 0.001 for the canary but 0 for the baseline: "
            "no ratio can be formed",
        ),
    ],
)
def test_missing_data_holds(canary: WindowStats, baseline: WindowStats, sentence: str) -> None:
    """A measure that is missing, or a zero baseline, holds with a sentence saying which."""
    decision = decide(canary, baseline)
    assert decision.verdict is Verdict.HOLD
    assert decision.reasons == (sentence,)


def test_zero_cost_on_both_sides_proceeds() -> None:
    """A free model on both sides is equal, not missing."""
    free = stats(cost_per_request=0.0)
    assert decide(free, free).verdict is Verdict.PROCEED


def test_rollback_wins_over_hold() -> None:
    """When one check rolls back and another holds, the verdict is rollback."""
    decision = decide(stats(errors=200, cost_per_request=None), BASELINE)
    assert decision.verdict is Verdict.ROLLBACK
    assert all("rate" in reason for reason in decision.reasons)


def test_stricter_margin_rolls_back_sooner() -> None:
    """The same canary passes the default margin and rolls back under a stricter one."""
    canary = stats(requests=500, errors=20)
    assert decide(canary, BASELINE).verdict is Verdict.PROCEED
    strict = RolloutOptions(error_margin=0.005)
    assert decide(canary, BASELINE, strict).verdict is Verdict.ROLLBACK


optional_measure = st.one_of(st.none(), st.floats(0.0, 100.0))


@st.composite
def window(draw: st.DrawFn, measures: st.SearchStrategy[float | None]) -> WindowStats:
    requests = draw(st.integers(0, 5_000))
    return WindowStats(
        requests=requests,
        errors=draw(st.integers(0, requests)),
        validation_failures=draw(st.integers(0, requests)),
        p95_latency=draw(measures),
        cost_per_request=draw(measures),
    )


@settings(max_examples=300, deadline=None)
@given(canary=window(optional_measure), baseline=window(optional_measure))
def test_missing_data_never_proceeds(canary: WindowStats, baseline: WindowStats) -> None:
    """With a None measure, too few requests or a zero baseline measure, it never proceeds."""
    decision = decide(canary, baseline)
    assert decision.reasons
    missing = (
        None
        in (
            canary.p95_latency,
            canary.cost_per_request,
            baseline.p95_latency,
            baseline.cost_per_request,
        )
        or canary.requests < 200
        or baseline.requests < 200
        or baseline.p95_latency == 0 != canary.p95_latency
        or baseline.cost_per_request == 0 != canary.cost_per_request
    )
    if missing:
        assert decision.verdict is not Verdict.PROCEED


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_requests": 0}, "min_requests"),
        ({"min_baseline_requests": 1.5}, "min_baseline_requests"),
        ({"error_margin": -0.01}, "error_margin"),
        ({"validation_margin": 1.0}, "validation_margin"),
        ({"latency_ratio": 0.9}, "latency_ratio"),
        ({"cost_ratio": math.inf}, "cost_ratio"),
        ({"z": 0}, "z"),
    ],
)
def test_gate_rules_validate_each_field(kwargs: dict[str, float], field: str) -> None:
    """A bad threshold raises ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        RolloutOptions(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"requests": -1, "errors": 0}, "requests"),
        ({"requests": 5, "errors": 6}, "errors"),
        ({"requests": 5, "errors": 0, "validation_failures": 6}, "validation_failures"),
        ({"requests": 5, "errors": 0, "p95_latency": -1.0}, "p95_latency"),
        ({"requests": 5, "errors": 0, "cost_per_request": math.nan}, "cost_per_request"),
    ],
)
def test_window_stats_validate_each_field(kwargs: dict[str, float], field: str) -> None:
    """Impossible counts and negative or non-finite measures raise ValueError naming the field."""
    values: dict[str, float | None] = {
        "validation_failures": 0,
        "p95_latency": None,
        "cost_per_request": None,
        **kwargs,
    }
    with pytest.raises(ValueError, match=field):
        WindowStats(**values)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the schedule


def test_schedule_next_share_walks_the_steps() -> None:
    """next_share gives the first step above the current share and None past the last."""
    schedule = Schedule()
    assert schedule.shares == (0.05, 0.25, 0.5, 1.0)
    assert [schedule.next_share(s) for s in (0.0, 0.05, 0.1, 0.25, 0.5, 1.0)] == [
        0.05,
        0.25,
        0.25,
        0.5,
        1.0,
        None,
    ]


@pytest.mark.parametrize(
    "shares", [(), (0.0, 1.0), (0.5, 0.25), (0.25, 0.25), (0.5, 1.5), (math.nan,)]
)
def test_schedule_refuses_bad_steps(shares: tuple[float, ...]) -> None:
    """Steps must be non-empty, strictly increasing and in (0, 1]."""
    with pytest.raises(ValueError, match="shares"):
        Schedule(shares)


def test_rollout_gate_moves_the_share_by_verdict() -> None:
    """Proceed steps up, hold stays, rollback goes to 0, and the end of the schedule stays put."""
    events: list[CanaryProceeded | CanaryHeld | CanaryRolledBack] = []
    gate = RolloutGate(on_event=events.append)
    good, few, bad = stats(), stats(requests=10, errors=0, validation_failures=0), stats(errors=300)
    steps = [
        gate.evaluate(0.05, good, BASELINE),
        gate.evaluate(0.25, few, BASELINE),
        gate.evaluate(0.5, bad, BASELINE),
        gate.evaluate(1.0, good, BASELINE),
    ]
    assert [(s.old_share, s.new_share) for s in steps] == [
        (0.05, 0.25),
        (0.25, 0.25),
        (0.5, 0.0),
        (1.0, 1.0),
    ]
    assert [type(e) for e in events] == [
        CanaryProceeded,
        CanaryHeld,
        CanaryRolledBack,
        CanaryProceeded,
    ]
    assert events[2] == CanaryRolledBack(0.5, steps[2].decision.reasons)
