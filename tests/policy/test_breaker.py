"""Tests for the circuit breaker: transitions, options, the probe lease and the permit protocol."""

from __future__ import annotations

import asyncio
import math
import random
import re
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tidegate.clock import ManualClock
from tidegate.errors import CircuitOpen, Rejected
from tidegate.policy import breaker as breaker_module
from tidegate.policy.breaker import (
    TRANSITIONS,
    BreakerEvent,
    BreakerOptions,
    BreakerState,
    CallRejected,
    CircuitBreaker,
    CircuitClosed,
    CircuitHalfOpened,
    CircuitOpened,
    FailureWindow,
    IllegalTransition,
    OpenReason,
    Permit,
    PermitAlreadyUsed,
    ProbeLeaseExpired,
    ProbeReleased,
    ProbeStarted,
    StaleVerdictIgnored,
    check_transition,
    open_duration,
    rate_tripped,
)

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN

#: No jitter, so open times are exact; the rate trip is out of the way unless a test sets it.
PLAIN = BreakerOptions(
    consecutive_failures=3, minimum_calls=1000, recovery=10.0, recovery_jitter=0.0
)


def make(
    options: BreakerOptions = PLAIN, *, seed: int = 7, start: float = 0.0
) -> tuple[CircuitBreaker, ManualClock, list[BreakerEvent]]:
    clock = ManualClock(start)
    events: list[BreakerEvent] = []
    breaker = CircuitBreaker(
        "primary", options, clock=clock, rng=random.Random(seed), on_event=events.append
    )
    return breaker, clock, events


def fail(breaker: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        breaker.acquire().failure()


def trip(breaker: CircuitBreaker) -> None:
    fail(breaker, breaker.options.consecutive_failures)
    assert breaker.state is OPEN


def half_open(breaker: CircuitBreaker, clock: ManualClock) -> None:
    trip(breaker)
    clock.advance(breaker.retry_after())
    assert breaker.state is HALF_OPEN


# -- the module


def test_all_is_sorted_and_complete() -> None:
    """The module exports a sorted __all__ whose every name exists."""
    names = breaker_module.__all__
    assert names == sorted(names, key=lambda n: (not n.isupper(), n))
    for name in names:
        assert hasattr(breaker_module, name)


# -- the transition table


@pytest.mark.parametrize("source", list(BreakerState))
@pytest.mark.parametrize("target", list(BreakerState))
def test_only_table_transitions_are_legal(source: BreakerState, target: BreakerState) -> None:
    """check_transition allows exactly the four table moves and raises on every other pair."""
    legal = {(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED), (HALF_OPEN, OPEN)}
    if (source, target) in legal:
        check_transition(source, target)
        assert target in TRANSITIONS[source]
    else:
        with pytest.raises(IllegalTransition) as caught:
            check_transition(source, target)
        assert (caught.value.source, caught.value.target) == (source, target)


def test_an_illegal_move_inside_the_breaker_raises() -> None:
    """The breaker's own state changes go through the table, so a bad move raises."""
    breaker, _, _ = make()
    with pytest.raises(IllegalTransition):
        breaker._close(0.0)
    assert breaker.state is CLOSED


def test_state_values_are_stable_strings() -> None:
    """The state names used in metrics and the admin API are the documented strings."""
    assert [s.value for s in BreakerState] == ["closed", "open", "half_open"]


# -- options


def test_option_defaults() -> None:
    """The documented defaults are the ones the dataclass uses."""
    options = BreakerOptions()
    assert options.consecutive_failures == 5
    assert options.failure_rate == 0.5
    assert options.window == 30.0
    assert options.window_buckets == 10
    assert options.minimum_calls == 10
    assert options.recovery == 30.0
    assert options.recovery_jitter == 0.2
    assert options.probe_timeout == 30.0


def test_options_are_frozen() -> None:
    """Options cannot be changed after they are made."""
    options = BreakerOptions()
    with pytest.raises(FrozenInstanceError):
        options.recovery = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("consecutive_failures", 0),
        ("consecutive_failures", 2.0),
        ("consecutive_failures", True),
        ("failure_rate", 0.0),
        ("failure_rate", 1.5),
        ("failure_rate", float("nan")),
        ("window", 0.0),
        ("window", float("inf")),
        ("window_buckets", 0),
        ("minimum_calls", 0),
        ("recovery", 0.0),
        ("recovery", -1.0),
        ("recovery_jitter", -0.1),
        ("recovery_jitter", float("inf")),
        ("probe_timeout", 0.0),
    ],
)
def test_invalid_options_name_the_field(field: str, value: object) -> None:
    """Each out-of-range option raises ValueError whose message starts with the field's name."""
    with pytest.raises(ValueError, match=f"^{field} "):
        BreakerOptions(**{field: value})  # type: ignore[arg-type]


def test_edge_options_are_accepted() -> None:
    """A failure rate of 1, no jitter and a single bucket are valid settings."""
    options = BreakerOptions(failure_rate=1.0, recovery_jitter=0.0, window_buckets=1)
    assert (options.failure_rate, options.recovery_jitter, options.window_buckets) == (1.0, 0.0, 1)


# -- closed: consecutive failures


def test_closed_admits_ordinary_calls() -> None:
    """A closed breaker grants permits that are not probes, as many as are asked for."""
    breaker, _, events = make()
    permits = [breaker.acquire() for _ in range(50)]
    assert not any(p.is_probe for p in permits)
    assert breaker.would_admit()
    assert breaker.retry_after() == 0.0
    assert events == []


def test_trips_on_exactly_consecutive_failures() -> None:
    """The breaker opens on the Nth failure in a row and not before."""
    breaker, clock, events = make()
    fail(breaker, 2)
    assert breaker.state is CLOSED
    clock.advance(1.0)
    fail(breaker, 1)
    assert breaker.state is OPEN
    assert events == [
        CircuitOpened(
            name="primary", at=1.0, reason=OpenReason.CONSECUTIVE_FAILURES, half_open_at=11.0
        )
    ]


def test_a_success_resets_the_consecutive_count() -> None:
    """A success between failures means they are no longer in a row."""
    breaker, _, _ = make()
    fail(breaker, 2)
    breaker.acquire().success()
    fail(breaker, 2)
    assert breaker.state is CLOSED
    assert breaker.snapshot().consecutive_failures == 2


def test_released_calls_do_not_count() -> None:
    """A release in the closed state is neither a success nor a failure."""
    breaker, _, _ = make()
    fail(breaker, 2)
    for _ in range(5):
        breaker.acquire().release()
    snap = breaker.snapshot()
    assert (snap.consecutive_failures, snap.window_calls, snap.window_failures) == (2, 2, 2)
    fail(breaker, 1)
    assert breaker.state is OPEN


# -- closed: failure rate over the window

RATE = BreakerOptions(
    consecutive_failures=100,
    failure_rate=0.5,
    window=10.0,
    window_buckets=10,
    minimum_calls=10,
    recovery=10.0,
    recovery_jitter=0.0,
)


def alternate(breaker: CircuitBreaker, calls: int) -> None:
    for i in range(calls):
        permit = breaker.acquire()
        if i % 2 == 0:
            permit.success()
        else:
            permit.failure()


def test_rate_trip_needs_minimum_calls() -> None:
    """Half the calls failing trips only once the window holds minimum_calls calls."""
    breaker, _, events = make(RATE)
    alternate(breaker, 9)
    assert breaker.state is CLOSED
    assert (breaker.snapshot().window_calls, breaker.snapshot().window_failures) == (9, 4)
    breaker.acquire().failure()
    assert breaker.state is OPEN
    assert events == [
        CircuitOpened(name="primary", at=0.0, reason=OpenReason.FAILURE_RATE, half_open_at=10.0)
    ]


def test_rate_below_threshold_does_not_trip() -> None:
    """Forty per cent failures never trip a fifty per cent threshold."""
    breaker, _, _ = make(RATE)
    for i in range(100):
        permit = breaker.acquire()
        if i % 5 >= 3:
            permit.failure()
        else:
            permit.success()
    assert breaker.state is CLOSED


def test_rate_is_checked_on_failures() -> None:
    """A success that leaves the rate at the threshold does not open the circuit."""
    breaker, _, _ = make(RATE)
    fail(breaker, 5)
    for _ in range(5):
        breaker.acquire().success()
    assert breaker.snapshot().window_failures == 5
    assert breaker.state is CLOSED
    breaker.acquire().failure()
    assert breaker.state is OPEN


def test_old_failures_slide_out_of_the_window() -> None:
    """Failures older than the window no longer count towards the rate."""
    breaker, clock, _ = make(RATE)
    fail(breaker, 9)
    clock.advance(10.0)
    assert breaker.snapshot().window_calls == 0
    breaker.acquire().failure()
    assert breaker.state is CLOSED
    assert breaker.snapshot().window_calls == 1


def test_the_oldest_bucket_drops_out_whole() -> None:
    """A bucket leaves the window once its start is a full window in the past."""
    breaker, clock, _ = make(RATE)
    clock.set(0.5)
    fail(breaker, 4)
    clock.set(9.5)
    assert breaker.snapshot().window_calls == 4
    clock.set(10.0)
    assert breaker.snapshot().window_calls == 0


def test_window_memory_is_bounded() -> None:
    """However many calls arrive over however long, the window keeps at most window_buckets."""
    window = FailureWindow(window=30.0, buckets=10)
    for step in range(10_000):
        window.record(step * 0.37, failed=step % 3 == 0)
        assert len(window) <= 10
    calls, failures = window.totals(9_999 * 0.37)
    assert 0 < failures < calls <= 30 / 0.37 + 1


def test_window_clear_forgets_everything() -> None:
    """Clearing a window leaves no calls and no buckets."""
    window = FailureWindow(window=1.0, buckets=4)
    window.record(0.1, failed=True)
    window.clear()
    assert (window.totals(0.1), len(window)) == ((0, 0), 0)


def _window_as_counted(
    steps: list[tuple[str, float, bool]], *, window: float, buckets: int
) -> list[tuple[int, int, int]]:
    """``(calls, failures, entries)`` of a window after each step, by the plain rule.

    A step at ``t`` is in bucket ``floor(t / width)``. ``totals``, and a ``record`` whose oldest
    entry is stale, drop the stale entries (``bucket <= index - buckets``) from the front; a
    ``record`` then counts into the last entry, started at the end unless it is its bucket's.
    """
    width = window / buckets
    entries: list[list[int]] = []  # [bucket, calls, failures], in the order they were started
    seen: list[tuple[int, int, int]] = []
    for op, t, failed in steps:
        index = math.floor(t / width)
        if op == "clear":
            entries.clear()
        elif op == "totals" or (entries and entries[0][0] <= index - buckets):
            while entries and entries[0][0] <= index - buckets:
                entries.pop(0)
        if op == "record":
            if not entries or entries[-1][0] != index:
                entries.append([index, 0, 0])
            entries[-1][1] += 1
            entries[-1][2] += failed
        seen.append((sum(e[1] for e in entries), sum(e[2] for e in entries), len(entries)))
    return seen


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["record", "record", "record", "totals", "clear"]),
            st.floats(min_value=-50.0, max_value=50.0),
            st.booleans(),
        ),
        max_size=60,
    ),
    st.integers(min_value=1, max_value=5),
)
def test_window_counts_every_call_still_inside_it(
    steps: list[tuple[str, float, bool]], buckets: int
) -> None:
    """Records in any order of time (backwards too), with totals and clears between them, leave
    the counts of the calls still in their buckets: the same call lands in the same bucket
    whether it is the first of its bucket or not."""
    window = FailureWindow(window=10.0, buckets=buckets)
    expected = _window_as_counted(steps, window=10.0, buckets=buckets)
    for (op, t, failed), (calls, failures, entries) in zip(steps, expected, strict=True):
        if op == "record":
            window.record(t, failed=failed)
        elif op == "totals":
            window.totals(t)
        else:
            window.clear()
        # Totals long before every step drop nothing: they show what the window holds.
        assert (*window.totals(-1e9), len(window)) == (calls, failures, entries)


@pytest.mark.parametrize(
    ("calls", "failures", "tripped"),
    [(9, 9, False), (10, 4, False), (10, 5, True), (10, 10, True), (0, 0, False)],
)
def test_rate_tripped_math(calls: int, failures: int, tripped: bool) -> None:
    """rate_tripped needs minimum_calls and a failure share at or above the rate."""
    assert rate_tripped(calls, failures, minimum_calls=10, failure_rate=0.5) is tripped


def test_rate_tripped_uses_the_exact_share() -> None:
    """Three failures in ten calls meet a rate of 0.3 exactly, with no rounding surprise."""
    assert rate_tripped(10, 3, minimum_calls=1, failure_rate=0.3)


# -- open


def test_open_rejects_with_circuit_open_and_the_time_left() -> None:
    """An open breaker raises the breaker policy's CircuitOpen with the seconds until half-open."""
    breaker, clock, events = make()
    trip(breaker)
    clock.advance(4.0)
    with pytest.raises(CircuitOpen) as caught:
        breaker.acquire()
    assert isinstance(caught.value, Rejected)
    assert caught.value.policy == "breaker"
    assert caught.value.retry_after == 6.0
    assert events[-1] == CallRejected(name="primary", at=4.0, state=OPEN, retry_after=6.0)
    assert not breaker.would_admit()
    assert breaker.retry_after() == 6.0


def test_open_half_opens_lazily_after_recovery() -> None:
    """The state reads open until the recovery time, then half-open, with one event."""
    breaker, clock, events = make()
    trip(breaker)
    clock.advance(9.5)
    assert breaker.state is OPEN
    clock.advance(0.5)
    assert breaker.state is HALF_OPEN
    assert breaker.state is HALF_OPEN
    assert events[1:] == [CircuitHalfOpened(name="primary", at=10.0)]


def test_recovery_without_jitter_is_exact() -> None:
    """With no jitter the circuit half-opens exactly recovery seconds after opening."""
    breaker, _, _ = make(start=100.0)
    trip(breaker)
    assert breaker.snapshot().half_open_at == 110.0


def test_recovery_jitter_draws_from_the_injected_rng() -> None:
    """The open time is recovery plus recovery*jitter times the rng's next draw."""
    options = BreakerOptions(consecutive_failures=1, recovery=20.0, recovery_jitter=0.5)
    breaker, _, events = make(options, seed=42)
    trip(breaker)
    draw = random.Random(42).random()
    assert events[0] == CircuitOpened(
        name="primary",
        at=0.0,
        reason=OpenReason.CONSECUTIVE_FAILURES,
        half_open_at=20.0 + 20.0 * 0.5 * draw,
    )


def test_recovery_jitter_spreads_replicas() -> None:
    """Breakers with different seeds that open together half-open at different times."""
    options = BreakerOptions(consecutive_failures=1, recovery=20.0, recovery_jitter=0.5)
    times = set()
    for seed in range(20):
        breaker, _, _ = make(options, seed=seed)
        trip(breaker)
        half_open_at = breaker.snapshot().half_open_at
        assert half_open_at is not None
        assert 20.0 <= half_open_at <= 30.0
        times.add(half_open_at)
    assert len(times) == 20


@settings(max_examples=200, deadline=None)
@given(
    recovery=st.floats(min_value=1e-3, max_value=1e6),
    jitter=st.floats(min_value=0.0, max_value=10.0),
    draw=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_open_duration_stays_in_its_range(recovery: float, jitter: float, draw: float) -> None:
    """The open time never falls below recovery nor above recovery*(1+jitter)."""
    duration = open_duration(recovery, jitter, draw)
    assert recovery <= duration <= recovery + recovery * jitter


# -- half-open: the one probe


def test_half_open_admits_exactly_one_probe() -> None:
    """The first call after recovery is the probe; the next is refused until its lease ends."""
    breaker, clock, events = make(replace(PLAIN, probe_timeout=5.0))
    half_open(breaker, clock)
    probe = breaker.acquire()
    assert probe.is_probe
    assert probe.lease_ends_at == 15.0
    assert events[-1:] == [ProbeStarted(name="primary", at=10.0, lease_ends_at=15.0)]
    clock.advance(2.0)
    assert not breaker.would_admit()
    with pytest.raises(CircuitOpen) as caught:
        breaker.acquire()
    assert caught.value.retry_after == 3.0
    assert caught.value.reason == "probe_in_flight"
    assert events[-1] == CallRejected(name="primary", at=12.0, state=HALF_OPEN, retry_after=3.0)


def test_probe_lease_ends_at_the_permit_deadline() -> None:
    """A probe with a deadline holds the slot until that deadline, not for probe_timeout."""
    breaker, clock, _ = make()
    half_open(breaker, clock)
    probe = breaker.acquire(deadline_at=12.5)
    assert probe.lease_ends_at == 12.5
    assert breaker.retry_after() == 2.5


def test_deadline_does_not_matter_when_closed() -> None:
    """A closed-state permit is an ordinary call whatever its deadline."""
    breaker, _, _ = make()
    permit = breaker.acquire(deadline_at=1.0)
    assert (permit.is_probe, permit.lease_ends_at) == (False, None)


def test_probe_success_closes_the_circuit() -> None:
    """A successful probe closes the circuit and the counts start from zero."""
    breaker, clock, events = make()
    half_open(breaker, clock)
    clock.advance(1.0)
    assert breaker.acquire().success() is True
    assert breaker.state is CLOSED
    assert events[-1] == CircuitClosed(name="primary", at=11.0)
    snap = breaker.snapshot()
    assert (snap.consecutive_failures, snap.window_calls, snap.half_open_at) == (0, 0, None)
    fail(breaker, 2)
    assert breaker.state is CLOSED


def test_probe_failure_opens_the_circuit_again() -> None:
    """A failed probe reopens the circuit for another recovery period."""
    breaker, clock, events = make()
    half_open(breaker, clock)
    clock.advance(1.0)
    assert breaker.acquire().failure() is True
    assert breaker.state is OPEN
    assert events[-1] == CircuitOpened(
        name="primary", at=11.0, reason=OpenReason.PROBE_FAILED, half_open_at=21.0
    )
    assert breaker.retry_after() == 10.0


def test_a_cancelled_half_open_probe_does_not_disable_the_breaker() -> None:
    """A released probe frees the slot: another probe is admitted and its success closes it."""
    breaker, clock, events = make()
    half_open(breaker, clock)
    breaker.acquire().release()
    assert events[-1] == ProbeReleased(name="primary", at=10.0)
    assert breaker.state is HALF_OPEN
    assert breaker.would_admit()
    second = breaker.acquire()
    assert second.is_probe
    assert second.success() is True
    assert breaker.state is CLOSED


@pytest.mark.asyncio
async def test_a_cancelled_probe_task_releases_its_slot() -> None:
    """Cancelling the task that holds a probe inside `with` releases the slot during the unwind."""
    breaker, clock, _ = make()
    half_open(breaker, clock)
    started, never = asyncio.Event(), asyncio.Event()

    async def call() -> None:
        with breaker.acquire() as permit:
            started.set()
            await never.wait()
            permit.success()

    task = asyncio.create_task(call())
    await started.wait()
    assert not breaker.would_admit()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert breaker.state is HALF_OPEN
    assert breaker.acquire().success() is True
    assert breaker.state is CLOSED


def test_a_verdict_from_before_the_last_state_change_is_ignored() -> None:
    """A permit granted in an earlier state cannot move the breaker, and is reported as stale."""
    breaker, clock, events = make()
    slow = breaker.acquire()
    generation = slow.generation
    trip(breaker)
    clock.advance(10.0)
    probe = breaker.acquire()
    assert slow.success() is False
    assert events[-1] == StaleVerdictIgnored(
        name="primary",
        at=10.0,
        verdict="success",
        permit_generation=generation,
        generation=generation + 2,
    )
    assert breaker.state is HALF_OPEN
    assert not breaker.would_admit()
    probe.failure()
    assert breaker.state is OPEN


def test_a_stale_failure_after_closing_is_ignored() -> None:
    """Failures from calls granted before the circuit last closed do not count in the new state."""
    breaker, clock, _ = make()
    old = [breaker.acquire() for _ in range(5)]
    half_open(breaker, clock)
    breaker.acquire().success()
    assert [p.failure() for p in old] == [False] * 5
    snap = breaker.snapshot()
    assert (snap.state, snap.consecutive_failures, snap.window_calls) == (CLOSED, 0, 0)


def test_a_stale_release_changes_nothing() -> None:
    """Releasing a permit from an earlier state neither frees the probe slot nor emits."""
    breaker, clock, events = make()
    old = breaker.acquire()
    half_open(breaker, clock)
    breaker.acquire()
    count = len(events)
    old.release()
    assert len(events) == count
    assert not breaker.would_admit()


# -- half-open: the lease


def test_an_expired_lease_admits_a_new_probe_and_voids_the_old_verdict() -> None:
    """After the probe's lease ends a new probe is admitted, and only its verdict counts."""
    breaker, clock, events = make(replace(PLAIN, probe_timeout=5.0))
    half_open(breaker, clock)
    first = breaker.acquire()
    clock.advance(5.0)
    assert breaker.would_admit()
    second = breaker.acquire()
    assert events[-2:] == [
        ProbeLeaseExpired(name="primary", at=15.0, lease_ended_at=15.0),
        ProbeStarted(name="primary", at=15.0, lease_ends_at=20.0),
    ]
    assert first.failure() is False
    assert isinstance(events[-1], StaleVerdictIgnored)
    assert breaker.state is HALF_OPEN
    assert second.success() is True
    assert breaker.state is CLOSED


def test_a_verdict_after_the_lease_is_ignored_even_with_no_new_probe() -> None:
    """A probe that reports after its lease ended does not close the circuit."""
    breaker, clock, events = make()
    half_open(breaker, clock)
    probe = breaker.acquire(deadline_at=12.0)
    clock.advance(3.0)
    assert probe.success() is False
    assert events[-2] == ProbeLeaseExpired(name="primary", at=13.0, lease_ended_at=12.0)
    assert breaker.state is HALF_OPEN
    assert breaker.would_admit()


def test_the_lease_is_held_until_just_before_it_ends() -> None:
    """A probe verdict just before the lease ends still counts."""
    breaker, clock, _ = make()
    half_open(breaker, clock)
    probe = breaker.acquire(deadline_at=12.0)
    clock.set(11.999)
    assert probe.success() is True
    assert breaker.state is CLOSED


def test_an_expired_probe_release_does_not_free_the_new_probes_slot() -> None:
    """Releasing a lapsed probe leaves the slot with the probe that replaced it."""
    breaker, clock, events = make()
    half_open(breaker, clock)
    first = breaker.acquire(deadline_at=11.0)
    clock.advance(1.0)
    breaker.acquire(deadline_at=20.0)
    first.release()
    assert not any(isinstance(e, ProbeReleased) for e in events)
    assert not breaker.would_admit()
    assert breaker.retry_after() == 9.0


# -- the permit protocol


@pytest.mark.parametrize("first", ["success", "failure", "release"])
@pytest.mark.parametrize("second", ["success", "failure", "release"])
def test_a_permit_takes_exactly_one_settlement(first: str, second: str) -> None:
    """Any second success, failure or release on a permit raises PermitAlreadyUsed."""
    breaker, _, _ = make()
    permit = breaker.acquire()
    getattr(permit, first)()
    assert permit.settled
    with pytest.raises(PermitAlreadyUsed):
        getattr(permit, second)()


def test_a_second_probe_verdict_raises_and_changes_nothing() -> None:
    """A probe that already closed the circuit cannot then fail it."""
    breaker, clock, _ = make()
    half_open(breaker, clock)
    probe = breaker.acquire()
    probe.success()
    with pytest.raises(PermitAlreadyUsed):
        probe.failure()
    assert breaker.state is CLOSED


def test_context_manager_releases_without_a_verdict() -> None:
    """A probe that leaves its `with` block without a verdict gives the slot back."""
    breaker, clock, events = make()
    half_open(breaker, clock)
    with breaker.acquire() as permit:
        assert not breaker.would_admit()
    assert permit.settled
    assert events[-1] == ProbeReleased(name="primary", at=10.0)
    assert breaker.would_admit()


def test_context_manager_releases_on_an_exception_and_lets_it_through() -> None:
    """An exception in the block releases the permit and is not swallowed or counted."""
    breaker, clock, _ = make()
    half_open(breaker, clock)
    with pytest.raises(KeyError), breaker.acquire():
        raise KeyError("bad request")
    assert breaker.state is HALF_OPEN
    assert breaker.would_admit()


def test_context_manager_keeps_a_verdict_given_inside() -> None:
    """A verdict inside the block stands; leaving the block does not settle again."""
    breaker, clock, _ = make()
    half_open(breaker, clock)
    with breaker.acquire() as permit:
        permit.failure()
    assert breaker.state is OPEN


def test_permit_repr_says_what_it_is() -> None:
    """A permit's repr names its kind, serial and generation."""
    breaker, clock, _ = make()
    assert repr(breaker.acquire()) == "Permit(call, serial=1, generation=0)"
    half_open(breaker, clock)
    assert repr(breaker.acquire()) == "Permit(probe, serial=5, generation=2)"


# -- reading without side effects


def test_would_admit_and_retry_after_change_nothing() -> None:
    """would_admit and retry_after neither half-open, nor expire a lease, nor emit events."""
    breaker, clock, events = make()
    trip(breaker)
    clock.advance(10.0)
    count = len(events)
    assert breaker.would_admit()
    assert breaker.retry_after() == 0.0
    assert len(events) == count
    assert breaker._state is OPEN
    assert breaker.state is HALF_OPEN
    breaker.acquire(deadline_at=11.0)
    clock.advance(2.0)
    count = len(events)
    assert breaker.would_admit()
    assert len(events) == count
    assert breaker._probe_serial is not None


def test_snapshot_reports_the_state_and_counters() -> None:
    """The snapshot carries state, generation, counts, open time, lease and retry hint."""
    breaker, clock, _ = make()
    fail(breaker, 1)
    breaker.acquire().success()
    fail(breaker, 1)
    snap = breaker.snapshot()
    assert snap.name == "primary"
    assert (snap.state, snap.generation, snap.consecutive_failures) == (CLOSED, 0, 1)
    assert (snap.window_calls, snap.window_failures, snap.retry_after) == (3, 2, 0.0)
    assert (snap.half_open_at, snap.probe_lease_ends_at) == (None, None)
    fail(breaker, 2)
    clock.advance(3.0)
    snap = breaker.snapshot()
    assert (snap.state, snap.generation, snap.half_open_at, snap.retry_after) == (
        OPEN,
        1,
        10.0,
        7.0,
    )
    clock.advance(7.0)
    breaker.acquire(deadline_at=20.0)
    snap = breaker.snapshot()
    assert (snap.state, snap.generation, snap.probe_lease_ends_at, snap.retry_after) == (
        HALF_OPEN,
        2,
        20.0,
        10.0,
    )


def test_breaker_repr_and_default_options() -> None:
    """A breaker made without options uses the defaults and shows its name and state."""
    breaker = CircuitBreaker("backup", clock=ManualClock(), rng=random.Random(0))
    assert breaker.options == BreakerOptions()
    assert repr(breaker) == "CircuitBreaker('backup', state=closed)"


def _trace(seed: int) -> list[BreakerEvent]:
    options = BreakerOptions(
        consecutive_failures=2, minimum_calls=4, window=5.0, recovery=3.0, probe_timeout=2.0
    )
    breaker, clock, events = make(options, seed=seed)
    rng = random.Random(seed + 1)
    for _ in range(500):
        clock.advance(rng.choice([0.0, 0.25, 1.0, 2.5]))
        try:
            permit = breaker.acquire()
        except CircuitOpen:
            continue
        rng.choice([permit.success, permit.failure, permit.failure, permit.release])()
    return events


def test_a_seeded_run_repeats_exactly() -> None:
    """Two runs with the same seed produce identical event traces."""
    first = _trace(3)
    assert any(isinstance(e, CircuitOpened) for e in first)
    assert first == _trace(3)
    assert first != _trace(4)


# -- property: at most one probe


class ProbeMachine(RuleBasedStateMachine):
    """Random acquire / verdict / release / clock steps against one breaker."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.breaker = CircuitBreaker(
            "primary",
            BreakerOptions(
                consecutive_failures=2,
                failure_rate=0.5,
                window=6.0,
                window_buckets=3,
                minimum_calls=3,
                recovery=2.0,
                recovery_jitter=0.5,
                probe_timeout=3.0,
            ),
            clock=self.clock,
            rng=random.Random(0),
        )
        self.permits: list[Permit] = []

    def open_probes(self) -> list[Permit]:
        now = self.clock.now()
        return [
            p
            for p in self.permits
            if p.lease_ends_at is not None and not p.settled and now < p.lease_ends_at
        ]

    @rule(deadline=st.none() | st.sampled_from([0.0, 0.5, 1.0, 4.0]))
    def acquire(self, deadline: float | None) -> None:
        expected = self.breaker.would_admit()
        hint = self.breaker.retry_after()
        deadline_at = None if deadline is None else self.clock.now() + deadline
        try:
            permit = self.breaker.acquire(deadline_at)
        except CircuitOpen as error:
            refused: CircuitOpen | None = error
        else:
            refused = None
            self.permits.append(permit)
        assert expected is (refused is None)
        if refused is not None:
            assert refused.retry_after == hint > 0.0

    @precondition(lambda self: any(not p.settled for p in self.permits))
    @rule(data=st.data(), verdict=st.sampled_from(["success", "failure", "release"]))
    def settle(self, data: st.DataObject, verdict: str) -> None:
        pending = [p for p in self.permits if not p.settled]
        permit = data.draw(st.sampled_from(pending))
        was_open_probe = permit in self.open_probes()
        getattr(permit, verdict)()
        if verdict == "release" and was_open_probe:
            assert self.breaker.state is HALF_OPEN
            assert self.breaker.would_admit()
            replacement = self.breaker.acquire()
            assert replacement.is_probe
            self.permits.append(replacement)

    @rule(seconds=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 5.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def at_most_one_probe(self) -> None:
        assert len(self.open_probes()) <= 1

    @invariant()
    def an_open_probe_blocks_admission(self) -> None:
        if self.open_probes():
            assert not self.breaker.would_admit()

    @invariant()
    def only_half_open_has_probes(self) -> None:
        if self.open_probes():
            assert self.breaker.state is HALF_OPEN


ProbeMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_probe_machine = ProbeMachine.TestCase


# -- the docs page


def test_docs_usage_example_runs() -> None:
    """The usage example on the breaker's docs page runs as written."""
    page = Path(__file__).resolve().parents[2] / "docs" / "policies" / "breaker.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
    assert blocks
    for block in blocks:
        exec(compile(block, str(page), "exec"), {"__name__": "breaker_docs"})
