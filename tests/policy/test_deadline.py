import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tidegate.policy.deadline as deadline_module
from tidegate.clock import ManualClock
from tidegate.policy.deadline import Deadline, Layer, chain_problems
from tidegate.policy.retry import RetryOptions, provider_layer

seconds = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)


def test_all_is_sorted_and_complete() -> None:
    """The module exports exactly its public names, in sorted order."""
    assert deadline_module.__all__ == sorted(deadline_module.__all__)
    assert set(deadline_module.__all__) == {"Deadline", "Layer", "chain_problems"}


def test_after_sets_an_absolute_instant() -> None:
    """Deadline.after adds the budget to the clock's current time once, at creation."""
    clock = ManualClock(100.0)
    deadline = Deadline.after(clock, 12.0)
    clock.advance(5.0)
    assert deadline.at == 112.0
    assert deadline.remaining() == 7.0


def test_at_time_uses_the_instant_given() -> None:
    """Deadline.at_time keeps the absolute instant it was given."""
    clock = ManualClock(3.0)
    deadline = Deadline.at_time(clock, 10.5)
    assert deadline.at == 10.5
    assert deadline.remaining() == 7.5


def test_remaining_is_never_negative() -> None:
    """Once the deadline has passed, remaining() is zero, not a negative number."""
    clock = ManualClock(0.0)
    deadline = Deadline.after(clock, 2.0)
    clock.advance(5.0)
    assert deadline.remaining() == 0.0


def test_expired_from_the_instant_itself() -> None:
    """A deadline is expired at its own instant, not only after it."""
    clock = ManualClock(0.0)
    deadline = Deadline.after(clock, 2.0)
    clock.advance(1.5)
    assert not deadline.expired()
    clock.advance(0.5)
    assert deadline.expired()


def test_shorten_to_an_earlier_instant() -> None:
    """Shortening to fewer seconds than are left gives a new, earlier deadline."""
    clock = ManualClock(10.0)
    deadline = Deadline.after(clock, 30.0)
    shorter = deadline.shorten(5.0)
    assert shorter.at == 15.0
    assert deadline.at == 40.0


def test_shorten_never_lengthens() -> None:
    """Asking for more time than is left returns the very same deadline."""
    clock = ManualClock(10.0)
    deadline = Deadline.after(clock, 3.0)
    assert deadline.shorten(60.0) is deadline


@settings(max_examples=200, deadline=None)
@given(start=seconds, budget=seconds, elapsed=seconds, asked=seconds)
def test_shorten_is_the_earlier_of_the_two(
    start: float, budget: float, elapsed: float, asked: float
) -> None:
    """Whatever is asked, the shortened deadline is the earlier of the old one and now + asked."""
    clock = ManualClock(start)
    deadline = Deadline.after(clock, budget)
    clock.advance(elapsed)
    shorter = deadline.shorten(asked)
    assert shorter.at <= deadline.at
    assert shorter.at == min(deadline.at, clock.now() + asked)


def test_cap_cuts_to_the_time_left() -> None:
    """cap() gives the requested seconds while they fit, and the time left when they do not."""
    clock = ManualClock(0.0)
    deadline = Deadline.after(clock, 4.0)
    assert deadline.cap(1.5) == 1.5
    clock.advance(3.0)
    assert deadline.cap(1.5) == 1.0
    clock.advance(2.0)
    assert deadline.cap(1.5) == 0.0


def test_an_infinite_deadline_never_expires() -> None:
    """A deadline at infinity leaves every timeout as it is."""
    clock = ManualClock(0.0)
    deadline = Deadline.after(clock, math.inf)
    clock.advance(1e9)
    assert not deadline.expired()
    assert deadline.cap(5.0) == 5.0


@pytest.mark.parametrize("bad", [-0.5, math.nan])
def test_after_and_shorten_refuse_a_negative_or_nan_budget(bad: float) -> None:
    """A budget must be a number of seconds >= 0; the error names the argument."""
    clock = ManualClock(0.0)
    with pytest.raises(ValueError, match="seconds"):
        Deadline.after(clock, bad)
    with pytest.raises(ValueError, match="seconds"):
        Deadline.after(clock, 1.0).shorten(bad)


def test_a_deadline_at_nan_is_refused() -> None:
    """An instant of nan would compare false with everything, so it is refused."""
    with pytest.raises(ValueError, match="at"):
        Deadline.at_time(ManualClock(0.0), math.nan)


@pytest.mark.parametrize(("name", "timeout"), [("", 1.0), ("client", -1.0), ("client", math.nan)])
def test_layer_validates_its_fields(name: str, timeout: float) -> None:
    """A layer needs a name and a timeout of zero or more seconds."""
    with pytest.raises(ValueError, match="name" if not name else "timeout_s"):
        Layer(name, timeout)


def test_broken_chain_names_both_problems() -> None:
    """A stream limit and a retrying provider that outlive the gateway request are both listed."""
    provider = provider_layer("provider", 3, 8.0, RetryOptions(base=0.5, factor=2.0, cap=4.0))
    assert provider.timeout_s == 25.5  # 3 x 8 s plus the worst backoff, 0.5 s + 1 s
    chain = [
        Layer("client", 60.0),
        Layer("load balancer", 50.0),
        Layer("gateway request", 20.0),
        Layer("stream limit", 25.0),
        provider,
    ]
    assert chain_problems(chain) == [
        "stream limit (25s) outlives gateway request (20s): the gateway request gives up first "
        "and the stream limit is orphaned",
        "provider (25.5s) outlives gateway request (20s): the gateway request gives up first "
        "and the provider is orphaned",
    ]


def test_repaired_chain_has_no_problems() -> None:
    """When every layer gives up before the one above it, nothing is listed."""
    provider = provider_layer("provider", 2, 15.0, RetryOptions(attempts=2))
    assert provider.timeout_s == 30.5
    chain = [
        Layer("client", 60.0),
        Layer("load balancer", 50.0),
        Layer("gateway request", 40.0),
        Layer("stream limit", 35.0),
        provider,
    ]
    assert chain_problems(chain) == []


def test_a_layer_as_long_as_the_one_above_is_a_problem() -> None:
    """Equal timeouts race, so a layer that lasts exactly as long as its caller is listed."""
    assert chain_problems([Layer("client", 30.0), Layer("gateway request", 30.0)]) == [
        "gateway request (30s) lasts as long as client (30s): the client may give up first "
        "and the gateway request is orphaned"
    ]


def test_each_layer_is_compared_with_the_tightest_layer_above() -> None:
    """A layer inside a loose one is still checked against the tighter layer further out."""
    chain = [Layer("client", 10.0), Layer("load balancer", 60.0), Layer("gateway request", 30.0)]
    assert chain_problems(chain) == [
        "load balancer (60s) outlives client (10s): the client gives up first "
        "and the load balancer is orphaned",
        "gateway request (30s) outlives client (10s): the client gives up first "
        "and the gateway request is orphaned",
    ]


@pytest.mark.parametrize("chain", [[], [Layer("client", 30.0)]])
def test_a_chain_of_at_most_one_layer_has_no_problems(chain: list[Layer]) -> None:
    """With nothing above it, a layer cannot outlive anything."""
    assert chain_problems(chain) == []
