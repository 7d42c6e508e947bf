"""Slow start: a recovered provider's share of its traffic ramps back over a window."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.clock import ManualClock
from tidegate.policy.breaker import CircuitClosed, CircuitHalfOpened, CircuitOpened, OpenReason
from tidegate.policy.slowstart import SlowStart, SlowStartOptions, ramp_share


def test_the_share_ramps_from_its_floor_to_whole_over_the_window() -> None:
    options = SlowStartOptions(window_s=30.0, min_share=0.1)
    assert ramp_share(0.0, options) == 0.1
    assert ramp_share(1.5, options) == 0.1  # 5% of the window: still the floor
    assert ramp_share(15.0, options) == pytest.approx(0.5)
    assert ramp_share(29.9, options) == pytest.approx(29.9 / 30)
    assert ramp_share(30.0, options) == 1.0
    assert ramp_share(-5.0, options) == 0.1


def test_aggression_gives_the_share_back_faster_or_slower() -> None:
    fast = SlowStartOptions(window_s=10.0, min_share=0.01, aggression=2.0)
    slow = SlowStartOptions(window_s=10.0, min_share=0.01, aggression=0.5)
    assert ramp_share(2.5, fast) == pytest.approx(0.5)  # sqrt(0.25)
    assert ramp_share(5.0, slow) == pytest.approx(0.25)  # 0.5 ** 2


def test_a_zero_window_is_off() -> None:
    options = SlowStartOptions(window_s=0.0)
    assert ramp_share(0.0, options) == 1.0
    start = SlowStart(options, ManualClock(0.0), random.Random(1))
    assert not start.enabled
    start.recovered("p")
    assert start.share("p") == 1.0
    assert start.held_back(["p"] * 100) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("window_s", -1.0), ("window_s", float("inf")), ("min_share", 0.0), ("aggression", 0.0)],
)
def test_options_are_checked(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SlowStartOptions(**{field: value})


def test_breaker_events_start_and_end_a_ramp() -> None:
    clock = ManualClock(100.0)
    start = SlowStart(SlowStartOptions(window_s=10.0, min_share=0.2), clock, random.Random(1))
    start.on_event(CircuitHalfOpened(name="p", at=100.0))
    assert start.ramping() == {}
    start.on_event(CircuitClosed(name="p", at=99.0))
    clock.advance(4.0)
    assert start.ramping() == {"p": pytest.approx(0.5)}
    start.on_event(
        CircuitOpened(
            name="p", at=104.0, reason=OpenReason.CONSECUTIVE_FAILURES, half_open_at=134.0
        )
    )
    assert start.ramping() == {}
    assert start.share("p") == 1.0
    start.on_event(CircuitClosed(name="p", at=104.0))  # a new ramp from the new close
    assert start.share("p") == pytest.approx(0.2)
    clock.advance(10.0)
    assert start.share("p") == 1.0
    assert start.ramping() == {}  # done: forgotten


def test_requests_hold_a_ramping_provider_back_in_proportion() -> None:
    clock = ManualClock(0.0)
    start = SlowStart(SlowStartOptions(window_s=100.0, min_share=0.05), clock, random.Random(7))
    start.recovered("p")
    clock.advance(25.0)  # share 0.25
    kept = sum(not start.held_back(["p", "q"]) for _ in range(4000))
    # Binomial(4000, 0.25): sd ~27; 6 sd either side.
    assert 840 <= kept <= 1160
    assert all("q" not in start.held_back(["p", "q"]) for _ in range(200))


def test_the_same_seed_holds_back_the_same_requests() -> None:
    def run(seed: int) -> list[bool]:
        clock = ManualClock(0.0)
        start = SlowStart(SlowStartOptions(window_s=10.0), clock, random.Random(seed))
        start.recovered("p")
        found = []
        for _ in range(50):
            clock.advance(0.1)
            found.append(bool(start.held_back(["p"])))
        return found

    assert run(3) == run(3)
    assert run(3) != run(4)


@given(
    st.floats(min_value=0.001, max_value=1e4),
    st.floats(min_value=0.001, max_value=1.0),
    st.floats(min_value=0.1, max_value=10.0),
    st.floats(min_value=0.0, max_value=2e4),
    st.floats(min_value=0.0, max_value=2e4),
)
def test_the_share_never_falls_as_time_goes_on(
    window: float, floor: float, aggression: float, a: float, b: float
) -> None:
    options = SlowStartOptions(window_s=window, min_share=floor, aggression=aggression)
    early, late = sorted((a, b))
    assert floor <= ramp_share(early, options) <= ramp_share(late, options) <= 1.0
