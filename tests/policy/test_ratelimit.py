import math
import re
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tidegate.clock import ManualClock
from tidegate.errors import RateLimited, http_error
from tidegate.policy import ratelimit
from tidegate.policy.ratelimit import (
    BucketOptions,
    BucketState,
    RateLimitEvent,
    TakeRefused,
    TakeResult,
    TokenBucket,
    TokensTaken,
    full_bucket,
    ratelimit_headers,
    refill,
    take,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "policies" / "ratelimit.md"


def bucket(
    rate: float = 2.0, burst: float = 3.0, start: float = 0.0
) -> tuple[TokenBucket, ManualClock]:
    clock = ManualClock(start)
    return TokenBucket(BucketOptions(rate=rate, burst=burst), clock), clock


# --------------------------------------------------------------------------- behaviour


def test_burst_then_refusal_then_refill_and_a_bucket_per_user() -> None:
    """At 2/s with burst 3, three takes pass, the fourth waits 0.5 s, and another user is untouched."""
    limiter, clock = bucket(rate=2.0, burst=3.0)
    assert [limiter.take("nadia").allowed for _ in range(3)] == [True, True, True]
    refused = limiter.take("nadia")
    assert not refused.allowed
    assert refused.retry_after == 0.5
    assert refused.remaining == 0.0
    clock.set(0.5)
    assert limiter.take("nadia").allowed
    assert limiter.take("omar") == TakeResult(
        allowed=True, remaining=2.0, retry_after=0.0, reset_after=0.5
    )
    clock.set(1.0)
    assert limiter.take("nadia").allowed
    assert limiter.take("nadia").retry_after == 0.5


def test_pure_take_returns_the_refilled_state_and_the_result() -> None:
    """take() is a pure function of (state, options, now, n) returning the new state."""
    options = BucketOptions(rate=2.0, burst=3.0)
    state = BucketState(tokens=0.5, updated=10.0)
    new_state, result = take(state, options, 10.25, 1.0)
    assert new_state == BucketState(tokens=0.0, updated=10.25)
    assert result == TakeResult(allowed=True, remaining=0.0, retry_after=0.0, reset_after=1.5)
    assert state == BucketState(tokens=0.5, updated=10.0)


def test_a_refused_take_keeps_the_refill_and_takes_nothing() -> None:
    """A refusal writes back the refilled tokens and the new time, and takes nothing."""
    options = BucketOptions(rate=1.0, burst=4.0)
    new_state, result = take(BucketState(tokens=0.0, updated=0.0), options, 1.5, 2.0)
    assert new_state == BucketState(tokens=1.5, updated=1.5)
    assert result == TakeResult(allowed=False, remaining=1.5, retry_after=0.5, reset_after=2.5)


def test_refill_is_capped_at_the_burst() -> None:
    """However long a bucket rests, it holds at most burst tokens."""
    options = BucketOptions(rate=5.0, burst=3.0)
    assert refill(BucketState(tokens=1.0, updated=0.0), options, 1_000.0) == 3.0
    assert refill(BucketState(tokens=1.0, updated=0.0), options, 0.25) == 2.25


def test_a_clock_behind_the_state_adds_no_tokens_and_keeps_the_later_time() -> None:
    """Negative elapsed time (another replica's clock) refills nothing and does not move time back."""
    options = BucketOptions(rate=2.0, burst=3.0)
    state = BucketState(tokens=0.0, updated=10.0)
    assert refill(state, options, 9.0) == 0.0
    new_state, result = take(state, options, 9.0, 1.0)
    assert new_state == BucketState(tokens=0.0, updated=10.0)
    # The token arrives 0.5 s after the state's time, which is 1.5 s after this clock's now.
    assert result.retry_after == 1.5
    assert result.reset_after == 2.5


def test_fractional_takes_weigh_requests() -> None:
    """A take of 0.25 tokens uses a quarter of one; the wait for a fraction is exact."""
    limiter, clock = bucket(rate=1.0, burst=1.0)
    assert [limiter.take("k", 0.25).allowed for _ in range(5)] == [True] * 4 + [False]
    assert limiter.take("k", 0.75).retry_after == 0.75
    clock.advance(0.5)
    assert limiter.take("k", 0.5).allowed
    assert not limiter.take("k", 0.5).allowed


def test_zero_tokens_is_a_free_look() -> None:
    """Taking zero tokens always succeeds and reports the bucket as it is."""
    limiter, _ = bucket(rate=2.0, burst=3.0)
    limiter.take("k", 3.0)
    result = limiter.take("k", 0.0)
    assert result == TakeResult(allowed=True, remaining=0.0, retry_after=0.0, reset_after=1.5)


def test_a_take_larger_than_the_burst_can_never_succeed() -> None:
    """n > burst is refused with an infinite retry_after, and its error carries no Retry-After."""
    limiter, _ = bucket(rate=2.0, burst=3.0)
    result = limiter.take("k", 3.5)
    assert not result.allowed
    assert result.retry_after == math.inf
    assert limiter.take("k", 3.0).allowed
    error = limiter.rejection(result)
    assert error.retry_after is None
    status, _, headers = http_error(error)
    assert status == 429
    assert "Retry-After" not in headers


def test_rejection_is_a_typed_rate_limited_error() -> None:
    """A refused take becomes RateLimited(policy='ratelimit') with the exact retry hint."""
    limiter, _ = bucket(rate=2.0, burst=1.0)
    limiter.take("k")
    error = limiter.rejection(limiter.take("k"))
    assert isinstance(error, RateLimited)
    assert error.policy == "ratelimit"
    assert error.retry_after == 0.5
    assert http_error(error)[2] == {"Retry-After": "1"}


def test_rejection_of_an_allowed_take_is_a_programming_error() -> None:
    """Asking for the error of a take that was allowed raises ValueError."""
    limiter, _ = bucket()
    with pytest.raises(ValueError):
        limiter.rejection(limiter.take("k"))


def test_negative_or_non_finite_takes_are_refused_by_validation() -> None:
    """n must be a finite number >= 0."""
    options = BucketOptions(rate=1.0, burst=1.0)
    for n in (-0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="n must be"):
            take(full_bucket(options, 0.0), options, 0.0, n)


@pytest.mark.parametrize("field", ["rate", "burst"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_options_must_be_positive_and_finite(field: str, value: float) -> None:
    """BucketOptions rejects a rate or burst that is not a finite number > 0, naming the field."""
    values = {"rate": 1.0, "burst": 1.0, field: value}
    with pytest.raises(ValueError, match=field):
        BucketOptions(**values)


def test_options_are_frozen_and_keyword_only() -> None:
    """Options cannot be built positionally or changed after construction."""
    options = BucketOptions(rate=2.0, burst=3.0)
    assert options.window == 1.5
    with pytest.raises(TypeError):
        BucketOptions(2.0, 3.0)  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        options.rate = 1.0  # type: ignore[misc]


def test_a_new_key_starts_full() -> None:
    """full_bucket() is burst tokens as of now, and the first take sees all of them."""
    options = BucketOptions(rate=2.0, burst=3.0)
    assert full_bucket(options, 7.0) == BucketState(tokens=3.0, updated=7.0)
    limiter, clock = bucket(start=7.0)
    assert limiter.state("k") is None
    limiter.take("k", 3.0)
    assert limiter.state("k") == BucketState(tokens=0.0, updated=7.0)
    assert clock.now() == 7.0


def test_events_report_takes_and_refusals() -> None:
    """on_event receives TokensTaken for a success and TakeRefused for a refusal."""
    seen: list[RateLimitEvent] = []
    clock = ManualClock()
    limiter = TokenBucket(BucketOptions(rate=2.0, burst=1.0), clock, on_event=seen.append)
    limiter.take("a")
    limiter.take("a")
    assert seen == [
        TokensTaken(key="a", n=1.0, remaining=0.0),
        TakeRefused(key="a", n=1.0, retry_after=0.5),
    ]


def test_prune_forgets_only_full_buckets() -> None:
    """prune() drops buckets that have refilled completely and keeps the others."""
    limiter, clock = bucket(rate=1.0, burst=2.0)
    limiter.take("old", 2.0)
    clock.advance(1.0)
    limiter.take("new", 2.0)
    clock.advance(1.0)
    assert limiter.prune() == 1
    assert limiter.state("old") is None
    assert limiter.state("new") == BucketState(tokens=0.0, updated=1.0)


# --------------------------------------------------------------------------- headers


def test_headers_follow_the_structured_field_draft() -> None:
    """RateLimit-Policy carries quota and window, RateLimit carries remaining and reset."""
    options = BucketOptions(rate=2.0, burst=3.0)
    state = full_bucket(options, 0.0)
    for _ in range(3):
        state, result = take(state, options, 0.0)
    assert ratelimit_headers(options, result) == {
        "RateLimit-Policy": '"default";q=3;w=2',
        "RateLimit": '"default";r=0;t=2',
    }


def test_headers_round_in_the_cautious_direction() -> None:
    """Quota and remaining round down, window and reset round up."""
    options = BucketOptions(rate=0.4, burst=2.5)
    result = TakeResult(allowed=True, remaining=1.75, retry_after=0.0, reset_after=1.875)
    assert ratelimit_headers(options, result, policy_name="per-user") == {
        "RateLimit-Policy": '"per-user";q=2;w=7',
        "RateLimit": '"per-user";r=1;t=2',
    }


def test_headers_escape_the_policy_name_and_refuse_what_cannot_be_sent() -> None:
    """Quotes and backslashes are escaped; empty or non-ASCII names raise ValueError."""
    options = BucketOptions(rate=1.0, burst=1.0)
    result = TakeResult(allowed=True, remaining=0.0, retry_after=0.0, reset_after=1.0)
    headers = ratelimit_headers(options, result, policy_name='a"b\\c')
    assert headers["RateLimit"] == '"a\\"b\\\\c";r=0;t=1'
    for bad in ("", "caf\u00e9", "tab\there"):
        with pytest.raises(ValueError, match="policy_name"):
            ratelimit_headers(options, result, policy_name=bad)


def test_headers_clamp_to_the_largest_structured_integer() -> None:
    """A window beyond what a structured-field Integer can hold is clamped, not overflowed."""
    options = BucketOptions(rate=1e-300, burst=1e300)
    result = TakeResult(allowed=True, remaining=1e300, retry_after=0.0, reset_after=0.0)
    headers = ratelimit_headers(options, result)
    assert headers["RateLimit-Policy"] == '"default";q=999999999999999;w=999999999999999'
    assert headers["RateLimit"] == '"default";r=999999999999999;t=0'


# --------------------------------------------------------------------------- properties

# Dyadic rationals keep every sum and product exact, so the bound is checked without tolerance.
dyadic_rates = st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0, 8.0])
dyadic_bursts = st.integers(min_value=1, max_value=64).map(lambda k: k / 4)
dyadic_steps = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=48).map(lambda k: k / 16),  # clock advance
        st.integers(min_value=0, max_value=40).map(lambda k: k / 8),  # tokens asked for
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(rate=dyadic_rates, burst=dyadic_bursts, steps=dyadic_steps)
def test_never_admits_more_than_burst_plus_rate_times_elapsed(
    rate: float, burst: float, steps: list[tuple[float, float]]
) -> None:
    """Over every stretch of time, admitted tokens <= burst + rate x elapsed, and 0 <= tokens <= burst."""
    limiter, clock = bucket(rate=rate, burst=burst)
    admitted: list[tuple[float, float]] = []
    for advance, n in steps:
        clock.advance(advance)
        if limiter.take("k", n).allowed:
            admitted.append((clock.now(), n))
        state = limiter.state("k")
        assert state is not None
        assert 0.0 <= state.tokens <= burst
    for i, (start, _) in enumerate(admitted):
        total = 0.0
        for end, n in admitted[i:]:
            total += n
            assert total <= burst + rate * (end - start)


finite_steps = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=50.0),
        st.floats(min_value=0.0, max_value=1.0),  # fraction of the burst asked for
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(
    start=st.floats(min_value=0.0, max_value=1e4),
    rate=st.floats(min_value=0.01, max_value=1000.0),
    burst=st.floats(min_value=0.01, max_value=1000.0),
    steps=finite_steps,
)
def test_retry_after_is_exact(
    start: float, rate: float, burst: float, steps: list[tuple[float, float]]
) -> None:
    """Advancing the clock by a refusal's retry_after makes the same take succeed, and half of it does not."""
    limiter, clock = bucket(rate=rate, burst=burst, start=start)
    for advance, fraction in steps:
        clock.advance(advance)
        n = burst * fraction
        result = limiter.take("k", n)
        if result.allowed:
            continue
        assert 0.0 < result.retry_after < math.inf
        state = limiter.state("k")
        assert state is not None
        if n - state.tokens > 1e-3:
            assert refill(state, limiter.options, clock.now() + result.retry_after / 2) < n
        clock.advance(result.retry_after)
        assert limiter.take("k", n).allowed


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.floats(min_value=0.0, max_value=1.0),
    rate=st.floats(min_value=1e-3, max_value=1e3),
    now=st.floats(min_value=0.0, max_value=1e6),
    n=st.floats(min_value=0.0, max_value=1.0),
)
def test_pure_retry_after_is_exact_from_any_state(
    tokens: float, rate: float, now: float, n: float
) -> None:
    """For any stored state, taking again at now + retry_after succeeds."""
    options = BucketOptions(rate=rate, burst=1.0)
    state, result = take(BucketState(tokens=tokens, updated=now), options, now, n)
    assume(not result.allowed)
    assert take(state, options, now + result.retry_after, n)[1].allowed


# --------------------------------------------------------------------------- module surface


def _export_order(name: str) -> tuple[int, str]:
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_public_names_are_sorted_and_exist() -> None:
    """__all__ is sorted (constants, then classes, then functions) and every name is defined."""
    assert ratelimit.__all__ == sorted(ratelimit.__all__, key=_export_order)
    for name in ratelimit.__all__:
        assert hasattr(ratelimit, name)


def test_the_usage_example_in_the_docs_runs() -> None:
    """Every python block in docs/policies/ratelimit.md executes without error."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    assert blocks
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})
