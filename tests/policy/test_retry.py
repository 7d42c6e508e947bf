import asyncio
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tidegate.policy.retry as retry_module
from tidegate.clock import ManualClock
from tidegate.errors import DeadlineExceeded, InvalidRequest, ProviderError, ProviderErrorKind
from tidegate.policy.deadline import Deadline
from tidegate.policy.retry import (
    Attempt,
    GiveUp,
    GiveUpReason,
    Jitter,
    Retry,
    RetryBudget,
    RetryBudgetDenied,
    RetryEvent,
    RetryGaveUp,
    RetryOptions,
    RetryPlanner,
    RetryScheduled,
    acall_with_deadline,
    backoff_ceiling,
    call_with_deadline,
    provider_layer,
)

K = ProviderErrorKind
R = GiveUpReason


def timeout_error() -> ProviderError:
    return ProviderError(K.TIMEOUT, "no answer in time")


def failure(kind: ProviderErrorKind, retry_after: float | None = None) -> ProviderError:
    return ProviderError(kind, f"simulated {kind.value}", retry_after=retry_after)


def test_all_is_sorted() -> None:
    """The module's __all__ is sorted and names only things the module defines."""
    assert retry_module.__all__ == sorted(retry_module.__all__)
    assert all(hasattr(retry_module, name) for name in retry_module.__all__)


def test_default_policy() -> None:
    """The defaults are three tries, 0.5 s base doubling to an 8 s cap, full jitter."""
    policy = RetryOptions()
    assert (policy.attempts, policy.base, policy.factor, policy.cap) == (3, 0.5, 2.0, 8.0)
    assert policy.jitter is Jitter.FULL
    assert policy.min_attempt == 0.01


@pytest.mark.parametrize(
    ("field_name", "value"),
    [
        ("attempts", 0),
        ("attempts", 2.5),
        ("base", -0.1),
        ("base", math.nan),
        ("factor", 0.5),
        ("factor", math.inf),
        ("cap", 0.25),
        ("min_attempt", -1.0),
        ("jitter", "sideways"),
    ],
)
def test_policy_validation_names_the_field(field_name: str, value: Any) -> None:
    """An invalid option raises ValueError naming the option."""
    with pytest.raises(ValueError, match=field_name):
        RetryOptions(**{field_name: value})


def test_jitter_may_be_given_as_text() -> None:
    """Options read from a config file may name the jitter mode as a plain string."""
    assert RetryOptions(jitter="equal").jitter is Jitter.EQUAL  # type: ignore[arg-type]


def test_no_jitter_doubles_up_to_the_cap() -> None:
    """Without jitter each retry waits the exponential ceiling, which stops at the cap."""
    policy = RetryOptions(jitter=Jitter.NONE)
    rng = random.Random(0)
    assert [policy.delay(n, rng) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_huge_retry_numbers_do_not_overflow() -> None:
    """A ceiling past the float range is simply the cap."""
    assert backoff_ceiling(100_000, base=0.5, factor=2.0, cap=8.0) == 8.0
    assert RetryOptions(jitter=Jitter.NONE).delay(100_000, random.Random(0)) == 8.0


def test_max_delay_and_worst_total_backoff() -> None:
    """The worst case of each retry is its ceiling; the total is their sum over the retries."""
    policy = RetryOptions(attempts=4)
    assert [policy.max_delay(n) for n in range(5)] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert policy.worst_total_backoff() == 3.5
    assert policy.worst_total_backoff(6) == 15.5
    assert policy.worst_total_backoff(1) == 0.0


def test_decorrelated_worst_case_triples_from_the_base() -> None:
    """Decorrelated waits can triple each time from the base, until the cap."""
    policy = RetryOptions(jitter=Jitter.DECORRELATED)
    assert [policy.max_delay(n) for n in range(4)] == [1.5, 4.5, 8.0, 8.0]


def test_provider_layer_adds_tries_and_worst_backoff() -> None:
    """A retrying provider call may last every try's timeout plus every worst-case wait."""
    layer = provider_layer("provider", 4, 10.0, RetryOptions())
    assert (layer.name, layer.timeout_s) == ("provider", 43.5)


policies = st.builds(
    RetryOptions,
    attempts=st.integers(1, 10),
    base=st.floats(0.0, 5.0),
    factor=st.floats(1.0, 4.0),
    cap=st.floats(5.0, 60.0),
    jitter=st.sampled_from(Jitter),
)


@settings(max_examples=300, deadline=None)
@given(
    policy=policies,
    retry_number=st.integers(0, 200),
    previous=st.none() | st.floats(0.0, 100.0),
    seed=st.integers(0, 2**32),
)
def test_jitter_stays_within_its_bounds(
    policy: RetryOptions, retry_number: int, previous: float | None, seed: int
) -> None:
    """Every jitter mode waits within its documented range, and never beyond the cap."""
    delay = policy.delay(retry_number, random.Random(seed), previous)
    ceiling = policy.ceiling(retry_number)
    assert 0.0 <= delay <= policy.cap
    if policy.jitter is Jitter.NONE:
        assert delay == ceiling
    elif policy.jitter is Jitter.FULL:
        assert 0.0 <= delay <= ceiling
    elif policy.jitter is Jitter.EQUAL:
        assert ceiling / 2.0 <= delay <= ceiling
    else:
        last = policy.base if previous is None else previous
        assert policy.base <= delay <= min(policy.cap, max(policy.base, 3.0 * last))
    if policy.jitter is not Jitter.DECORRELATED or previous is None:
        assert delay <= policy.max_delay(retry_number)


@settings(max_examples=200, deadline=None)
@given(policy=policies, seed=st.integers(0, 2**32))
def test_chained_delays_never_exceed_max_delay(policy: RetryOptions, seed: int) -> None:
    """Delays fed back as `previous`, as the call functions do, stay within max_delay."""
    rng = random.Random(seed)
    previous: float | None = None
    for n in range(12):
        delay = policy.delay(n, rng, previous)
        assert delay <= policy.max_delay(n)
        previous = delay


def test_budget_floor_alone_allows_floor_times_window() -> None:
    """With no first tries, the floor grants min_retries_per_second x window retries, no more."""
    budget = RetryBudget(ManualClock(0.0), ratio=0.1, min_retries_per_second=0.5, window=10.0)
    assert budget.available() == 5.0
    assert [budget.try_spend() for _ in range(6)] == [True] * 5 + [False]
    assert budget.available() == 0.0


def test_budget_grows_with_first_tries() -> None:
    """Each first try adds `ratio` retries to the allowance."""
    budget = RetryBudget(ManualClock(0.0), ratio=0.1, min_retries_per_second=0.0)
    assert not budget.try_spend()
    for _ in range(25):
        budget.record_first_try()
    assert budget.available() == 2.5
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]
    assert budget.available() == 0.5


def test_budget_first_tries_stop_counting_after_a_window() -> None:
    """A first try's credit lasts while its one-second slice is inside the window."""
    clock = ManualClock(0.5)
    budget = RetryBudget(clock, ratio=0.5, min_retries_per_second=0.0, window=10.0)
    budget.record_first_try()
    budget.record_first_try()
    clock.set(9.75)
    assert budget.available() == 1.0
    clock.set(10.0)
    assert budget.available() == 0.0


def test_budget_retries_count_for_a_whole_window_after_their_slice() -> None:
    """Granted retries keep counting until a full window has passed after their slice."""
    clock = ManualClock(0.0)
    budget = RetryBudget(clock, ratio=0.0, min_retries_per_second=0.2, window=10.0)
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]
    clock.set(10.5)
    assert not budget.try_spend()
    clock.set(11.0)
    assert budget.try_spend()


def test_budget_forgets_everything_after_a_long_pause() -> None:
    """After far more than a window of silence only the floor is left."""
    clock = ManualClock(0.0)
    budget = RetryBudget(clock, ratio=1.0, min_retries_per_second=0.1, window=10.0)
    for _ in range(50):
        budget.record_first_try()
    assert budget.try_spend()
    clock.advance(1_000.0)
    assert budget.available() == 1.0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"ratio": -0.1}, "ratio"),
        ({"min_retries_per_second": math.nan}, "min_retries_per_second"),
        ({"window": 0.0}, "window"),
        ({"window": math.inf}, "window"),
        ({"buckets": 0}, "buckets"),
    ],
)
def test_budget_validation_names_the_argument(kwargs: dict[str, Any], name: str) -> None:
    """An invalid budget setting raises ValueError naming the setting."""
    with pytest.raises(ValueError, match=name):
        RetryBudget(ManualClock(0.0), **kwargs)


# (window, buckets) pairs whose slice width is exact in binary, so the oracle below and the
# budget agree on every instant; times are multiples of 1/8 s for the same reason.
exact_windows = st.sampled_from([(10.0, 10), (5.0, 5), (6.0, 12), (3.0, 12), (2.0, 1)])
budget_ops = st.lists(
    st.one_of(
        st.tuples(st.just("first"), st.integers(1, 30)),
        st.tuples(st.just("retry"), st.integers(1, 6)),
        st.tuples(st.just("advance"), st.integers(0, 48)),
    ),
    max_size=80,
)


def budget_runs(*, starts: st.SearchStrategy[int]) -> Callable[[Callable[..., None]], Any]:
    """The retry-budget runs both model tests draw: a window, a ratio, a floor, a start (in
    eighths of a second, from ``starts``) and the operations."""
    return lambda test: settings(max_examples=300, deadline=None)(
        given(
            window_and_buckets=exact_windows,
            ratio=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),
            floor=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
            start=starts,
            ops=budget_ops,
        )(test)
    )


@budget_runs(starts=st.integers(0, 10_000))
def test_budget_never_grants_more_than_ratio_plus_floor_in_any_window(
    window_and_buckets: tuple[float, int],
    ratio: float,
    floor: float,
    start: int,
    ops: list[tuple[str, int]],
) -> None:
    """For every granted retry, the window ending then holds no more than the budget allows."""
    window, buckets = window_and_buckets
    clock = ManualClock(start / 8)
    budget = RetryBudget(
        clock, ratio=ratio, min_retries_per_second=floor, window=window, buckets=buckets
    )
    firsts: list[float] = []
    granted: list[float] = []
    for op, amount in ops:
        if op == "advance":
            clock.advance(amount / 8)
        elif op == "first":
            for _ in range(amount):
                budget.record_first_try()
                firsts.append(clock.now())
        else:
            for _ in range(amount):
                if budget.try_spend():
                    now = clock.now()
                    granted.append(now)
                    in_window = sum(1 for t in granted if now - window < t <= now)
                    credit = sum(1 for t in firsts if now - window < t <= now)
                    assert in_window <= ratio * credit + floor * window


@budget_runs(starts=st.integers(-10_000, 10_000))
def test_budget_counts_each_try_in_the_slice_it_was_made_in(
    window_and_buckets: tuple[float, int],
    ratio: float,
    floor: float,
    start: int,
    ops: list[tuple[str, int]],
) -> None:
    """The allowance is ``ratio`` times the first tries of the last ``buckets`` slices plus the
    floor, less the retries of one slice more, exactly, however the tries and slices interleave."""
    window, buckets = window_and_buckets
    width = window / buckets
    clock = ManualClock(start / 8)
    budget = RetryBudget(
        clock, ratio=ratio, min_retries_per_second=floor, window=window, buckets=buckets
    )
    firsts: list[int] = []  # the slice of each first try
    granted: list[int] = []  # the slice of each granted retry

    def allowance_and_spent() -> tuple[float, int]:
        current = math.floor(clock.now() / width)
        credit = sum(1 for s in firsts if current - buckets < s <= current)
        spent = sum(1 for s in granted if current - buckets <= s <= current)
        return ratio * credit + floor * window, spent

    for op, amount in ops:
        if op == "advance":
            clock.advance(amount / 8)
        for _ in range(amount if op != "advance" else 0):
            if op == "first":
                budget.record_first_try()
                firsts.append(math.floor(clock.now() / width))
            else:
                allowance, spent = allowance_and_spent()
                assert budget.try_spend() is (spent + 1 <= allowance)
                if spent + 1 <= allowance:
                    granted.append(math.floor(clock.now() / width))
        allowance, spent = allowance_and_spent()
        assert budget.available() == max(0.0, allowance - spent)


def planner(policy: RetryOptions | None = None, **kwargs: Any) -> RetryPlanner:
    return RetryPlanner(policy or RetryOptions(), rng=random.Random(3), **kwargs)


def test_start_caps_the_attempt_at_the_time_left() -> None:
    """An attempt gets the per-try timeout, or the time left when that is shorter."""
    clock = ManualClock(0.0)
    deadline = Deadline.after(clock, 7.0)
    assert planner().start(deadline, 5.0) == Attempt(5.0)
    clock.advance(4.0)
    assert planner().start(deadline, 5.0) == Attempt(3.0)


@pytest.mark.parametrize("elapsed", [7.0, 6.995, 8.0])
def test_start_refuses_at_after_or_just_before_the_deadline(elapsed: float) -> None:
    """No attempt starts at or after the deadline, nor with less than min_attempt left."""
    clock = ManualClock(0.0)
    deadline = Deadline.after(clock, 7.0)
    clock.advance(elapsed)
    assert planner().start(deadline, 5.0) == GiveUp(R.DEADLINE)


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequest("bad field"),
        ValueError("a bug"),
        failure(K.BAD_REQUEST),
        failure(K.CONTEXT_LENGTH),
        ProviderError(K.SERVER, "marked final", retryable=False),
    ],
)
def test_what_retrying_cannot_fix_is_not_retried(error: Exception) -> None:
    """Non-provider errors and provider errors marked not retryable end the call."""
    deadline = Deadline.after(ManualClock(0.0), 60.0)
    assert planner().after_failure(error, 1, deadline, 5.0) == GiveUp(R.NOT_RETRYABLE)


def test_retry_on_narrows_what_is_retried() -> None:
    """retry_on can refuse a retryable provider error, leaving it to another provider."""
    deadline = Deadline.after(ManualClock(0.0), 60.0)
    only_timeouts = planner(retry_on=lambda error: error.kind is K.TIMEOUT)
    assert only_timeouts.after_failure(failure(K.SERVER), 1, deadline, 5.0) == GiveUp(
        R.NOT_RETRYABLE
    )
    assert isinstance(only_timeouts.after_failure(timeout_error(), 1, deadline, 5.0), Retry)


def test_attempts_are_exhausted_after_the_last_try() -> None:
    """After attempt number `attempts` fails, there is no other."""
    deadline = Deadline.after(ManualClock(0.0), 60.0)
    plan = planner(RetryOptions(attempts=2))
    assert isinstance(plan.after_failure(timeout_error(), 1, deadline, 5.0), Retry)
    assert plan.after_failure(timeout_error(), 2, deadline, 5.0) == GiveUp(R.ATTEMPTS_EXHAUSTED)


def test_retry_waits_the_jittered_backoff() -> None:
    """Without retry_after the wait is the policy's jittered delay for that retry."""
    clock = ManualClock(0.0)
    deadline = Deadline.after(clock, 60.0)
    expected = RetryOptions().delay(1, random.Random(3))
    step = planner().after_failure(failure(K.OVERLOADED), 2, deadline, 5.0)
    assert step == Retry(
        delay=expected, next_timeout=5.0, attempt=3, kind=K.OVERLOADED, from_retry_after=False
    )


def test_retry_after_is_waited_exactly_and_uses_no_randomness() -> None:
    """A provider's retry_after replaces the backoff, and leaves the rng untouched."""
    rng = random.Random(5)
    before = rng.getstate()
    plan = RetryPlanner(RetryOptions(), rng=rng)
    deadline = Deadline.after(ManualClock(0.0), 10.0)
    step = plan.after_failure(failure(K.RATE_LIMITED, retry_after=6.0), 1, deadline, 5.0)
    assert step == Retry(
        delay=6.0, next_timeout=4.0, attempt=2, kind=K.RATE_LIMITED, from_retry_after=True
    )
    assert rng.getstate() == before


def test_retry_after_beyond_the_time_left_gives_up_at_once() -> None:
    """When the provider asks for a wait the deadline cannot afford, the call ends now."""
    deadline = Deadline.after(ManualClock(0.0), 3.0)
    step = planner().after_failure(failure(K.RATE_LIMITED, retry_after=4.0), 1, deadline, 5.0)
    assert step == GiveUp(R.RETRY_AFTER_EXCEEDS_DEADLINE)


def test_a_wait_that_would_reach_the_deadline_is_not_taken() -> None:
    """If the backoff plus the shortest useful attempt does not fit, the planner gives up."""
    clock = ManualClock(0.0)
    policy = RetryOptions(base=2.0, jitter=Jitter.NONE)
    fits = Deadline.after(clock, 2.02)
    too_tight = Deadline.after(clock, 2.005)
    assert isinstance(planner(policy).after_failure(timeout_error(), 1, fits, 5.0), Retry)
    assert planner(policy).after_failure(timeout_error(), 1, too_tight, 5.0) == GiveUp(R.DEADLINE)


def test_budget_refusal_gives_up_with_its_own_reason() -> None:
    """When the retry budget is spent, an otherwise allowed retry is refused."""
    clock = ManualClock(0.0)
    budget = RetryBudget(clock, ratio=0.0, min_retries_per_second=0.1, window=10.0)
    deadline = Deadline.after(clock, 60.0)
    plan = planner(budget=budget)
    assert isinstance(plan.after_failure(timeout_error(), 1, deadline, 5.0), Retry)
    assert plan.after_failure(timeout_error(), 1, deadline, 5.0) == GiveUp(R.RETRY_BUDGET)


def test_budget_is_not_spent_on_a_retry_that_is_not_made() -> None:
    """The budget is asked last, so refusals for other reasons leave it untouched."""
    clock = ManualClock(0.0)
    budget = RetryBudget(clock, ratio=0.0, min_retries_per_second=0.1, window=10.0)
    plan = planner(RetryOptions(attempts=2), budget=budget)
    deadline = Deadline.after(clock, 60.0)
    plan.after_failure(failure(K.BAD_REQUEST), 1, deadline, 5.0)
    plan.after_failure(timeout_error(), 2, deadline, 5.0)
    plan.after_failure(failure(K.RATE_LIMITED, retry_after=90.0), 1, deadline, 5.0)
    assert budget.available() == 1.0


@pytest.mark.parametrize("per_try", [0.0, -1.0, math.nan])
def test_per_try_must_be_positive(per_try: float) -> None:
    """A per-try timeout of zero or less is a configuration mistake and is refused."""
    with pytest.raises(ValueError, match="per_try"):
        planner().start(Deadline.after(ManualClock(0.0), 5.0), per_try)


@dataclass
class FakeModel:
    """Fails as its plan says, then answers; a timeout spends the whole timeout it was given."""

    clock: ManualClock
    plan: Sequence[Exception]
    fail_spends: float = 0.25
    timeouts: list[float] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)

    def __call__(self, timeout: float) -> str:
        self.starts.append(self.clock.now())
        self.timeouts.append(timeout)
        if len(self.timeouts) > len(self.plan):
            return "answer"
        error = self.plan[len(self.timeouts) - 1]
        is_timeout = isinstance(error, ProviderError) and error.kind is K.TIMEOUT
        self.clock.advance(timeout if is_timeout else min(timeout, self.fail_spends))
        raise error

    async def acall(self, limit: float) -> str:
        await self.clock.asleep(0.0)  # a real await point, as a network call has
        return self(limit)


@dataclass
class Outcome:
    timeouts: list[float]
    events: list[RetryEvent]
    result: str | None = None
    error: BaseException | None = None


def run_sync(
    plan: Sequence[Exception],
    seconds: float,
    *,
    seed: int = 1,
    policy: RetryOptions | None = None,
    **kwargs: Any,
) -> Outcome:
    clock = ManualClock(0.0)
    model = FakeModel(clock, plan)
    events: list[RetryEvent] = []
    outcome = Outcome(model.timeouts, events)
    try:
        outcome.result = call_with_deadline(
            model,
            Deadline.after(clock, seconds),
            RetryPlanner(policy or RetryOptions(), rng=random.Random(seed), **kwargs),
            per_try=5.0,
            sleep=clock.sleep,
            on_event=events.append,
        )
    except Exception as error:
        outcome.error = error
    return outcome


async def run_async(
    plan: Sequence[Exception],
    seconds: float,
    *,
    seed: int = 1,
    policy: RetryOptions | None = None,
    **kwargs: Any,
) -> Outcome:
    clock = ManualClock(0.0)
    model = FakeModel(clock, plan)
    events: list[RetryEvent] = []
    outcome = Outcome(model.timeouts, events)
    try:
        outcome.result = await acall_with_deadline(
            model.acall,
            Deadline.after(clock, seconds),
            RetryPlanner(policy or RetryOptions(), rng=random.Random(seed), **kwargs),
            per_try=5.0,
            sleep=clock.asleep,
            on_event=events.append,
        )
    except Exception as error:
        outcome.error = error
    return outcome


def test_429_with_retry_after_4_and_3s_left_gives_up_after_one_attempt() -> None:
    """A 429 asking for 4 s with 3 s left ends the call after its one, capped attempt."""
    limited = failure(K.RATE_LIMITED, retry_after=4.0)
    outcome = run_sync([limited], 3.0)
    assert outcome.timeouts == [3.0]
    assert outcome.error is limited
    assert outcome.events == [RetryGaveUp(R.RETRY_AFTER_EXCEEDS_DEADLINE, 1)]


@pytest.mark.parametrize(
    "error", [failure(K.BAD_REQUEST), InvalidRequest("temperature must be <= 2")]
)
def test_invalid_request_is_tried_once(error: Exception) -> None:
    """A request the provider or the gateway rejects as invalid is never retried."""
    outcome = run_sync([error], 12.0)
    assert outcome.timeouts == [5.0]
    assert outcome.error is error
    assert outcome.events == [RetryGaveUp(R.NOT_RETRYABLE, 1)]


def test_two_timeouts_then_success_gets_5_5_and_the_remainder() -> None:
    """With 12 s left and 5 s per try, the third try gets what the two tries and waits left."""
    policy = RetryOptions()
    rng = random.Random(1)
    first_wait = policy.delay(0, rng)
    second_wait = policy.delay(1, rng, first_wait)
    outcome = run_sync([timeout_error(), timeout_error()], 12.0, seed=1, policy=policy)
    # The clock reaches the third try through 5 s, the first wait, 5 s and the second wait.
    remainder = 12.0 - (((5.0 + first_wait) + 5.0) + second_wait)
    assert remainder == pytest.approx(12.0 - 10.0 - first_wait - second_wait)
    assert outcome.timeouts == [5.0, 5.0, remainder]
    assert outcome.result == "answer"
    assert outcome.events == [
        RetryScheduled(2, first_wait, K.TIMEOUT, False),
        RetryScheduled(3, second_wait, K.TIMEOUT, False),
    ]


def test_attempts_exhausted_reraises_the_last_error() -> None:
    """When every try fails, the last failure is raised as it was."""
    errors = [failure(K.SERVER), failure(K.OVERLOADED), failure(K.CONNECTION)]
    outcome = run_sync(errors, 60.0)
    assert len(outcome.timeouts) == 3
    assert outcome.error is errors[-1]
    assert outcome.events[-1] == RetryGaveUp(R.ATTEMPTS_EXHAUSTED, 3)


def test_a_passed_deadline_raises_deadline_exceeded_without_calling() -> None:
    """If no attempt can start, the call raises DeadlineExceeded from the retry policy."""
    outcome = run_sync([], 0.0)
    assert outcome.timeouts == []
    assert isinstance(outcome.error, DeadlineExceeded)
    assert outcome.error.policy == "retry"
    assert outcome.events == [RetryGaveUp(R.DEADLINE, 0)]


def test_budget_denial_is_reported_and_ends_the_call() -> None:
    """A retry the budget refuses emits RetryBudgetDenied, then gives up with the last error."""
    budget = RetryBudget(ManualClock(0.0), ratio=0.0, min_retries_per_second=0.0)
    error = timeout_error()
    outcome = run_sync([error], 60.0, budget=budget)
    assert outcome.error is error
    assert outcome.events == [RetryBudgetDenied(), RetryGaveUp(R.RETRY_BUDGET, 1)]


def test_the_first_attempt_is_recorded_in_the_budget() -> None:
    """The call counts its first try, so a ratio-only budget can pay for one retry of it."""
    budget = RetryBudget(ManualClock(0.0), ratio=1.0, min_retries_per_second=0.0)
    outcome = run_sync([failure(K.SERVER), failure(K.SERVER)], 60.0, budget=budget)
    assert len(outcome.timeouts) == 2
    assert outcome.events[-2:] == [RetryBudgetDenied(), RetryGaveUp(R.RETRY_BUDGET, 2)]


def test_an_overshooting_sleep_cannot_start_a_late_attempt() -> None:
    """If a wait overruns the deadline, the next attempt is not started and the error is raised."""
    clock = ManualClock(0.0)
    model = FakeModel(clock, [failure(K.SERVER)])
    events: list[RetryEvent] = []

    def slow_sleep(seconds: float) -> None:
        clock.advance(seconds + 10.0)

    with pytest.raises(ProviderError) as raised:
        call_with_deadline(
            model,
            Deadline.after(clock, 6.0),
            RetryPlanner(RetryOptions(), rng=random.Random(0)),
            per_try=5.0,
            sleep=slow_sleep,
            on_event=events.append,
        )
    assert raised.value is model.plan[0]
    assert model.timeouts == [5.0]
    assert isinstance(events[0], RetryScheduled)
    assert events[1:] == [RetryGaveUp(R.DEADLINE, 1)]


def test_seeded_runs_repeat_exactly() -> None:
    """Two runs with the same seed and failures give identical traces."""
    plan = [failure(K.SERVER), timeout_error(), failure(K.OVERLOADED)]
    policy = RetryOptions(attempts=5, jitter=Jitter.DECORRELATED)
    first = run_sync(plan, 40.0, seed=11, policy=policy)
    second = run_sync(plan, 40.0, seed=11, policy=policy)
    assert first.timeouts == second.timeouts
    assert first.events == second.events
    assert first.result == second.result == "answer"


scenarios: list[tuple[Callable[[], list[Exception]], float]] = [
    (lambda: [failure(K.RATE_LIMITED, retry_after=4.0)], 3.0),
    (lambda: [failure(K.BAD_REQUEST)], 12.0),
    (lambda: [timeout_error(), timeout_error()], 12.0),
    (lambda: [failure(K.SERVER)] * 3, 60.0),
    (lambda: [failure(K.RATE_LIMITED, retry_after=1.5), timeout_error()], 20.0),
    (list, 0.0),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("make_plan", "seconds"), scenarios)
async def test_async_variant_behaves_identically(
    make_plan: Callable[[], list[Exception]], seconds: float
) -> None:
    """acall_with_deadline gives the same timeouts, events and outcome as the sync call."""
    plan = make_plan()
    sync = run_sync(plan, seconds, seed=4)
    asynchronous = await run_async(plan, seconds, seed=4)
    assert asynchronous.timeouts == sync.timeouts
    assert asynchronous.events == sync.events
    assert asynchronous.result == sync.result
    assert type(asynchronous.error) is type(sync.error)
    if isinstance(sync.error, ProviderError):
        assert asynchronous.error is sync.error


@pytest.mark.asyncio
async def test_async_cancellation_is_not_retried() -> None:
    """A cancelled attempt propagates at once instead of being retried."""
    clock = ManualClock(0.0)
    calls: list[float] = []

    async def cancelled(limit: float) -> str:
        calls.append(limit)
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await acall_with_deadline(
            cancelled,
            Deadline.after(clock, 30.0),
            RetryPlanner(RetryOptions(), rng=random.Random(0)),
            per_try=5.0,
            sleep=clock.asleep,
        )
    assert calls == [5.0]


failures = st.one_of(
    st.builds(timeout_error),
    st.builds(
        failure,
        st.sampled_from([K.SERVER, K.OVERLOADED, K.CONNECTION, K.RATE_LIMITED]),
        st.none() | st.floats(0.0, 20.0),
    ),
    st.builds(failure, st.just(K.BAD_REQUEST)),
)


@settings(max_examples=300, deadline=None)
@given(
    plan=st.lists(failures, max_size=8),
    per_try=st.floats(0.05, 10.0),
    seconds=st.floats(0.0, 30.0),
    fail_spends=st.floats(0.0, 3.0),
    policy=policies,
    use_budget=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_no_attempt_starts_at_or_after_the_deadline(
    plan: list[ProviderError],
    per_try: float,
    seconds: float,
    fail_spends: float,
    policy: RetryOptions,
    use_budget: bool,
    seed: int,
) -> None:
    """Whatever fails and however long, every attempt starts before the deadline and fits in it."""
    clock = ManualClock(0.0)
    deadline = Deadline.after(clock, seconds)
    model = FakeModel(clock, plan, fail_spends=fail_spends)
    budget = RetryBudget(clock, ratio=0.1, min_retries_per_second=0.2) if use_budget else None
    raised: Exception | None = None
    try:
        call_with_deadline(
            model,
            deadline,
            RetryPlanner(policy, rng=random.Random(seed), budget=budget),
            per_try=per_try,
            sleep=clock.sleep,
        )
    except (DeadlineExceeded, ProviderError) as error:
        raised = error
    if isinstance(raised, DeadlineExceeded):
        assert model.starts == []
    elif raised is not None:
        assert raised is model.plan[len(model.timeouts) - 1]
    assert len(model.starts) <= policy.attempts
    for start, timeout in zip(model.starts, model.timeouts, strict=True):
        assert start < deadline.at
        assert deadline.at - start > policy.min_attempt
        assert 0.0 < timeout <= per_try
        assert timeout <= deadline.at - start
