"""Tests for the combination of retries, breakers, failover and the retry budget in one call."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.clock import ManualClock
from tidegate.errors import CircuitOpen, DeadlineExceeded, ProviderError, ProviderErrorKind
from tidegate.policy.attempts import (
    NOT_EVIDENCE,
    AttemptEvent,
    AttemptPolicy,
    Attempts,
    Call,
    RetryPlanned,
    RetryRefused,
    Step,
    Stop,
    Tried,
    Wait,
    is_evidence,
)
from tidegate.policy.breaker import BreakerOptions, BreakerState, CircuitBreaker, Permit
from tidegate.policy.deadline import Deadline
from tidegate.policy.retry import Jitter, RetryBudget, RetryOptions
from tidegate.policy.routing import (
    FailedOver,
    ProviderSpec,
    RoutePlan,
    SkipReason,
    plan_route,
    retry_same,
    rule_for,
)

K = ProviderErrorKind
PER_TRY = 1.0
NAMES = ("primary", "backup", "last")
RETRY = RetryOptions(attempts=3, base=0.1, cap=0.4, jitter=Jitter.FULL)


def spec(name: str) -> ProviderSpec:
    return ProviderSpec(name, frozenset({"internal"}))


def error(kind: ProviderErrorKind, **extra: object) -> ProviderError:
    return ProviderError(kind, f"{kind.value} for the test", provider="p", **extra)  # type: ignore[arg-type]


@dataclass
class Rig:
    """One gateway's worth of shared policy state on a manual clock."""

    clock: ManualClock = field(default_factory=ManualClock)
    breaker: BreakerOptions = field(
        default_factory=lambda: BreakerOptions(consecutive_failures=3, recovery_jitter=0.0)
    )
    budget: RetryBudget | None = None
    events: list[AttemptEvent] = field(default_factory=list)
    seed: int = 3

    def __post_init__(self) -> None:
        self.breakers = {
            name: CircuitBreaker(name, self.breaker, clock=self.clock, rng=random.Random(i))
            for i, name in enumerate(NAMES)
        }
        self.policy = AttemptPolicy(
            RETRY,
            breakers=self.breakers,
            rng=random.Random(self.seed),
            budget=self.budget,
            retry_on=retry_same,
            on_event=self.events.append,
        )

    def plan(self, names: Sequence[str] = NAMES) -> RoutePlan:
        return plan_route(
            [spec(n) for n in names],
            data_class="internal",
            approved=set(names),
            open_breakers={n for n in names if not self.breakers[n].would_admit()},
        )

    def start(self, seconds: float = 10.0, names: Sequence[str] = NAMES) -> tuple[Attempts, Tried]:
        tried: Tried = []
        deadline = Deadline.after(self.clock, seconds)
        return self.policy.start(self.plan(names), deadline, lambda _: PER_TRY, tried), tried


#: What a provider does with one attempt: how long it takes, and how it fails (None: answers).
Behaviour = Callable[[Call], tuple[float, ProviderError | None]]


def drive(rig: Rig, attempts: Attempts, behave: Behaviour) -> tuple[object, list[Call]]:
    """Run the steps to the end as a driver does, on the manual clock: ``("ok", provider)`` or
    the error the call stopped with, and every call made."""
    calls: list[Call] = []
    step: Step = attempts.begin()
    while True:
        if isinstance(step, Stop):
            return step.error, calls
        if isinstance(step, Wait):
            rig.clock.advance(step.delay)
            step = attempts.resume()
            continue
        calls.append(step)
        latency, failure = behave(step)
        if latency > step.timeout:
            latency, failure = step.timeout, error(K.TIMEOUT)
        rig.clock.advance(latency)
        if failure is None:
            attempts.succeeded()
            return ("ok", step.spec.name), calls
        step = attempts.failed(failure)


def healthy(latency: float = 0.05) -> Behaviour:
    return lambda _: (latency, None)


# --------------------------------------------------------------------------- the evidence rule


def test_errors_about_the_request_are_not_evidence() -> None:
    """A bad request, a prompt over the window, a content filter or a cancellation says nothing
    about the provider; a server error, an overload or a provider's own timeout does."""
    for kind in K:
        assert is_evidence(error(kind), cut_short=False) is (kind not in NOT_EVIDENCE)
    assert not is_evidence(error(K.TIMEOUT), cut_short=True)
    assert is_evidence(error(K.SERVER), cut_short=True)


def test_short_caller_deadlines_do_not_open_a_healthy_providers_breaker() -> None:
    """Five requests with 100 ms deadlines against a healthy provider that answers in 0.2 s all
    time out, but each attempt was cut short by its caller's deadline: the breaker stays closed
    and the next tenant, with the usual deadline, is served."""
    rig = Rig()
    slow = healthy(0.2)
    for _ in range(5):
        attempts, tried = rig.start(seconds=0.1, names=["primary"])
        outcome, _ = drive(rig, attempts, slow)
        assert isinstance(outcome, ProviderError)
        assert outcome.kind is K.TIMEOUT
        assert tried == [("primary", K.TIMEOUT)]
    assert rig.breakers["primary"].state is BreakerState.CLOSED
    attempts, _ = rig.start(seconds=10.0, names=["primary"])
    assert drive(rig, attempts, slow)[0] == ("ok", "primary")


def test_a_provider_that_outlasts_its_own_limit_is_evidence() -> None:
    """An attempt given the provider's whole per-try limit that times out is a failure: three
    such requests open the breaker."""
    rig = Rig()
    for _ in range(3):
        attempts, _ = rig.start(seconds=10.0, names=["primary"])
        drive(rig, attempts, healthy(5.0))
    assert rig.breakers["primary"].state is BreakerState.OPEN


# --------------------------------------------------------------------------- the steps


def test_a_failure_is_retried_then_answered() -> None:
    """A 503 then an answer: one wait (the jittered backoff), two calls on the primary."""
    rig = Rig()
    attempts, tried = rig.start()
    script = iter([error(K.OVERLOADED), None])
    outcome, calls = drive(rig, attempts, lambda _: (0.01, next(script)))
    assert outcome == ("ok", "primary")
    assert [(c.spec.name, c.attempt) for c in calls] == [("primary", 1), ("primary", 2)]
    assert tried == [("primary", K.OVERLOADED), ("primary", None)]
    (planned,) = rig.events
    assert isinstance(planned, RetryPlanned)
    assert (planned.provider, planned.attempt, planned.kind) == ("primary", 2, K.OVERLOADED)


def test_retries_exhausted_fail_over_to_the_next_candidate() -> None:
    """Three 500s on the primary, then the backup answers; a failover event says so."""
    rig = Rig()
    attempts, tried = rig.start()
    outcome, calls = drive(
        rig, attempts, lambda c: (0.01, error(K.SERVER) if c.spec.name == "primary" else None)
    )
    assert outcome == ("ok", "backup")
    assert [c.spec.name for c in calls] == ["primary"] * 3 + ["backup"]
    assert tried[-1] == ("backup", None)
    assert FailedOver("primary", "backup", K.SERVER) in rig.events


def test_a_timeout_fails_over_at_once() -> None:
    """A provider that says nothing for its whole limit is not retried: the backup is called."""
    rig = Rig()
    attempts, tried = rig.start()
    outcome, _ = drive(rig, attempts, lambda c: (5.0 if c.spec.name == "primary" else 0.01, None))
    assert outcome == ("ok", "backup")
    assert tried == [("primary", K.TIMEOUT), ("backup", None)]


@pytest.mark.parametrize("kind", [K.BAD_REQUEST, K.AUTH, K.CONTENT_FILTER, K.CANCELLED])
def test_an_error_whose_rule_stops_is_neither_retried_nor_failed_over(kind: K) -> None:
    """The request itself is wrong (or nobody waits for it): one call, then the call stops."""
    rig = Rig()
    attempts, _ = rig.start()
    outcome, calls = drive(rig, attempts, lambda _: (0.01, error(kind)))
    assert isinstance(outcome, ProviderError)
    assert outcome.kind is kind
    assert len(calls) == 1
    assert rig.events == []


def test_an_error_marked_not_retryable_still_fails_over() -> None:
    """A spent quota (429, not retryable) is not retried on the same provider, but another
    provider has its own quota: the backup is called."""
    rig = Rig()
    attempts, _ = rig.start()
    spent = error(K.RATE_LIMITED, retryable=False)
    outcome, calls = drive(
        rig, attempts, lambda c: (0.01, spent if c.spec.name == "primary" else None)
    )
    assert outcome == ("ok", "backup")
    assert [c.spec.name for c in calls] == ["primary", "backup"]


def test_a_breaker_that_opened_is_skipped_and_recorded() -> None:
    """The primary's breaker is open: the backup is called and the record says why."""
    rig = Rig()
    for _ in range(3):
        rig.breakers["primary"].acquire().failure()
    attempts, tried = rig.start()
    assert drive(rig, attempts, healthy())[0] == ("ok", "backup")
    assert tried[:1] == [("backup", None)]  # the plan already skipped the primary
    # Opened between the plan and the attempt: skipped at acquire, and recorded.
    rig2 = Rig()
    plan = rig2.plan()
    for _ in range(3):
        rig2.breakers["primary"].acquire().failure()
    tried2: Tried = []
    attempts2 = rig2.policy.start(plan, Deadline.after(rig2.clock, 10.0), lambda _: 1.0, tried2)
    assert drive(rig2, attempts2, healthy())[0] == ("ok", "backup")
    assert tried2 == [("primary", SkipReason.BREAKER_OPEN), ("backup", None)]


def test_no_candidate_left_stops_with_circuit_open() -> None:
    rig = Rig()
    plan = rig.plan(["primary"])
    for _ in range(3):
        rig.breakers["primary"].acquire().failure()
    attempts = rig.policy.start(plan, Deadline.after(rig.clock, 10.0), lambda _: 1.0, [])
    step = attempts.begin()
    assert isinstance(step, Stop)
    assert isinstance(step.error, CircuitOpen)


def test_no_time_for_a_first_attempt_stops_with_deadline_exceeded() -> None:
    rig = Rig()
    attempts, tried = rig.start(seconds=0.0)
    step = attempts.begin()
    assert isinstance(step, Stop)
    assert isinstance(step.error, DeadlineExceeded)
    assert tried == []


def test_a_retry_refused_by_another_budget_fails_over() -> None:
    """The fleet's retry budget refuses the retry after the wait: the backup is called at once,
    and the refusal is an event."""
    rig = Rig()
    attempts, _ = rig.start()
    step: Step = attempts.begin()
    assert isinstance(step, Call)
    step = attempts.failed(error(K.SERVER))
    assert isinstance(step, Wait)
    step = attempts.retry_refused()
    assert isinstance(step, Call)
    assert step.spec.name == "backup"
    assert RetryRefused("primary") in rig.events


def test_retry_after_is_waited_exactly() -> None:
    rig = Rig()
    attempts, _ = rig.start()
    attempts.begin()
    step = attempts.failed(error(K.RATE_LIMITED, retry_after=0.25))
    assert step == Wait(0.25, "primary")


def test_an_abandoned_call_releases_its_permit() -> None:
    """A caller that goes away frees the probe slot of a half-open breaker."""
    rig = Rig(breaker=BreakerOptions(consecutive_failures=1, recovery=1.0, recovery_jitter=0.0))
    rig.breakers["primary"].acquire().failure()
    rig.clock.advance(1.0)
    attempts, _ = rig.start(names=["primary"])
    step = attempts.begin()
    assert isinstance(step, Call)
    assert step.permit.is_probe
    attempts.abandoned()
    assert step.permit.settled
    assert rig.breakers["primary"].would_admit()


# --------------------------------------------------------------------------- properties

_kinds = st.sampled_from(list(K))
_outcomes = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=2.5),
        st.none() | _kinds,
        st.booleans(),
        st.none() | st.floats(min_value=0.0, max_value=1.0),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(
    outcomes=_outcomes,
    seconds=st.floats(min_value=0.0, max_value=6.0),
    names=st.permutations(NAMES).flatmap(lambda p: st.integers(1, 3).map(lambda n: p[:n])),
    ratio=st.sampled_from([0.0, 0.1, 1.0]),
    seed=st.integers(0, 1_000),
)
def test_properties_of_every_call(
    outcomes: list[tuple[float, K | None, bool, float | None]],
    seconds: float,
    names: Sequence[str],
    ratio: float,
    seed: int,
) -> None:
    """Whatever the providers do: no attempt starts at or after the deadline, nor runs past it;
    every permit ends exactly once; retries stay within the retry budget; an error whose rule
    stops is never followed by another attempt; one marked not retryable is never retried on
    the same provider."""
    clock = ManualClock()
    budget = RetryBudget(clock, ratio=ratio, min_retries_per_second=0.0, window=10.0)
    rig = Rig(clock=clock, budget=budget, seed=seed)
    attempts, _ = rig.start(seconds=seconds, names=names)
    deadline_at = clock.now() + seconds
    script = iter(outcomes)
    permits: list[Permit] = []
    previous: tuple[Call, ProviderError | None] | None = None

    def behave(call: Call) -> tuple[float, ProviderError | None]:
        nonlocal previous
        assert clock.now() < deadline_at
        assert clock.now() + call.timeout <= deadline_at
        if previous is not None:
            before, failure = previous
            assert failure is not None
            assert rule_for(failure.kind).fails_over
            if not failure.retryable:
                assert call.spec.name != before.spec.name
        permits.append(call.permit)
        latency, kind, retryable, retry_after = next(script, (0.0, None, True, None))
        failure = (
            None if kind is None else error(kind, retryable=retryable, retry_after=retry_after)
        )
        if latency > call.timeout:  # as drive() sees it
            latency, failure = call.timeout, error(K.TIMEOUT)
        previous = (call, failure)
        return latency, failure

    drive(rig, attempts, behave)
    assert all(permit.settled for permit in permits)
    retries = sum(isinstance(e, RetryPlanned) for e in rig.events)
    first_tries = len(permits) - retries
    assert retries <= ratio * first_tries


def test_the_docs_example_runs() -> None:
    """The python block of docs/policies/attempts.md executes and its assertions hold."""
    page = Path(__file__).resolve().parents[2] / "docs" / "policies" / "attempts.md"
    (block,) = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
    exec(compile(block, str(page), "exec"), {})
