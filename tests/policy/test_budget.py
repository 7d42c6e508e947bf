import inspect
import math
import re
from dataclasses import FrozenInstanceError, fields, replace
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.clock import ManualClock
from tidegate.errors import BudgetExceeded, http_error
from tidegate.policy import budget
from tidegate.policy.budget import (
    DAY_SECONDS,
    BudgetBlocked,
    BudgetDecision,
    BudgetDegraded,
    BudgetDimension,
    BudgetEvent,
    BudgetOptions,
    BudgetRefunded,
    BudgetReserved,
    BudgetSettled,
    BudgetVerdict,
    Cost,
    DailyBudget,
    Quota,
    Reservation,
    Usage,
    day_number,
    refund,
    reserve,
    rollover,
    seconds_until_midnight,
    settle,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "policies" / "budget.md"
# ManualClock's default wall clock starts at 2026-01-01T00:00:00Z.
MIDNIGHT = 1_767_225_600.0
DAY = day_number(MIDNIGHT)


def keeper(
    quota: Quota, *, degrade_at: float = 0.8, start: float = 0.0
) -> tuple[DailyBudget, ManualClock]:
    clock = ManualClock(start)
    return DailyBudget(BudgetOptions(quota=quota, degrade_at=degrade_at), clock), clock


# --------------------------------------------------------------------------- decisions


def test_allows_then_degrades_then_blocks_until_midnight() -> None:
    """With 5 calls a day and degrade_at 0.8: four allowed, the fifth degraded, the sixth blocked."""
    daily, clock = keeper(Quota(calls=5))
    clock.advance(3_600.0)
    verdicts = [daily.reserve("omar")[1].verdict for _ in range(6)]
    assert verdicts == [BudgetVerdict.ALLOW] * 4 + [BudgetVerdict.DEGRADE, BudgetVerdict.BLOCK]
    reservation, decision = daily.reserve("omar")
    assert reservation is None
    assert decision == BudgetDecision(
        verdict=BudgetVerdict.BLOCK, reason=BudgetDimension.CALLS, retry_after=82_800.0
    )
    assert daily.reserve("nadia")[1].verdict is BudgetVerdict.ALLOW


def test_a_degrade_reserves_and_a_block_reserves_nothing() -> None:
    """The degraded request holds its estimate; the blocked one leaves usage as it was."""
    options = BudgetOptions(quota=Quota(tokens=1_000), degrade_at=0.5)
    usage = Usage(day=DAY, tokens=400)
    degraded_usage, reservation, decision = reserve(
        usage, options, MIDNIGHT, Cost(tokens=200), subject="u", reservation_id="r1"
    )
    assert decision == BudgetDecision(verdict=BudgetVerdict.DEGRADE, reason=BudgetDimension.TOKENS)
    assert reservation == Reservation(id="r1", subject="u", day=DAY, amount=Cost(tokens=200))
    assert degraded_usage == Usage(day=DAY, tokens=400, reserved_calls=1, reserved_tokens=200)
    blocked_usage, none, blocked = reserve(degraded_usage, options, MIDNIGHT, Cost(tokens=401))
    assert none is None
    assert blocked.verdict is BudgetVerdict.BLOCK
    assert blocked_usage == degraded_usage


def test_reserved_amounts_count_against_the_quota() -> None:
    """Open reservations count as if spent: the second of two 60% estimates is blocked."""
    options = BudgetOptions(quota=Quota(cost=10.0), degrade_at=1.0)
    usage, _, first = reserve(Usage(day=DAY), options, MIDNIGHT, Cost(cost=6.0))
    _, _, second = reserve(usage, options, MIDNIGHT, Cost(cost=6.0))
    assert first.verdict is BudgetVerdict.ALLOW
    assert second == BudgetDecision(
        verdict=BudgetVerdict.BLOCK, reason=BudgetDimension.COST, retry_after=86_400.0
    )


def test_exactly_at_the_quota_is_allowed_and_at_the_threshold_is_not_degraded() -> None:
    """Only passing a line counts: reaching the quota or the degrade threshold exactly does not."""
    options = BudgetOptions(quota=Quota(calls=10), degrade_at=0.5)
    at_threshold = reserve(Usage(day=DAY, calls=4), options, MIDNIGHT, Cost())[2]
    at_quota = reserve(Usage(day=DAY, calls=9), options, MIDNIGHT, Cost())[2]
    assert at_threshold.verdict is BudgetVerdict.ALLOW
    assert at_quota.verdict is BudgetVerdict.DEGRADE


def test_block_wins_over_degrade_and_names_the_first_dimension() -> None:
    """A block on any dimension beats a degrade on another; ties name calls, tokens, cost in order."""
    options = BudgetOptions(quota=Quota(calls=10, tokens=100, cost=1.0), degrade_at=0.5)
    usage = Usage(day=DAY, calls=8, tokens=90, cost=0.75)
    decision = reserve(usage, options, MIDNIGHT, Cost(tokens=20))[2]
    assert (decision.verdict, decision.reason) == (BudgetVerdict.BLOCK, BudgetDimension.TOKENS)
    decision = reserve(usage, options, MIDNIGHT, Cost(tokens=20, cost=0.5))[2]
    assert (decision.verdict, decision.reason) == (BudgetVerdict.BLOCK, BudgetDimension.TOKENS)
    decision = reserve(usage, options, MIDNIGHT, Cost(tokens=0, cost=0.125))[2]
    assert (decision.verdict, decision.reason) == (BudgetVerdict.DEGRADE, BudgetDimension.CALLS)


def test_an_estimate_over_the_whole_quota_can_never_pass() -> None:
    """An estimate larger than the quota blocks with an infinite wait, reported as no Retry-After."""
    daily, _ = keeper(Quota(calls=100, tokens=1_000))
    daily.reserve("u", Cost(tokens=900))
    reservation, decision = daily.reserve("u", Cost(calls=200, tokens=2_000))
    assert reservation is None
    assert decision.reason is BudgetDimension.CALLS
    assert decision.retry_after == math.inf
    error = daily.rejection(decision)
    assert error.retry_after is None
    assert "Retry-After" not in http_error(error)[2]


def test_unlimited_dimensions_are_counted_but_never_checked() -> None:
    """None in the quota means unlimited, yet the amounts are still recorded."""
    daily, _ = keeper(Quota(calls=None, tokens=None, cost=None))
    reservation, decision = daily.reserve("u", Cost(calls=10**9, tokens=10**12, cost=1e12))
    assert decision.verdict is BudgetVerdict.ALLOW
    assert reservation is not None
    daily.settle(reservation, Cost(calls=1, tokens=5, cost=0.5))
    assert daily.usage("u") == Usage(day=DAY, calls=1, tokens=5, cost=0.5)


def test_degrade_at_one_never_degrades() -> None:
    """degrade_at=1.0 goes straight from allow to block."""
    daily, _ = keeper(Quota(calls=2), degrade_at=1.0)
    verdicts = [daily.reserve("u")[1].verdict for _ in range(3)]
    assert verdicts == [BudgetVerdict.ALLOW, BudgetVerdict.ALLOW, BudgetVerdict.BLOCK]


# --------------------------------------------------------------------------- settle and refund


def test_settle_moves_the_reservation_into_use_at_the_actual_amounts() -> None:
    """Settling drops the reserved estimate and adds what was really spent, less or more."""
    usage = Usage(day=DAY, calls=1, tokens=10, cost=0.5, reserved_calls=2, reserved_tokens=300)
    reservation = Reservation(id="r", subject="u", day=DAY, amount=Cost(tokens=200, cost=0.25))
    assert settle(usage, reservation, Cost(tokens=120, cost=0.125)) == Usage(
        day=DAY, calls=2, tokens=130, cost=0.625, reserved_calls=1, reserved_tokens=100
    )
    assert settle(usage, reservation, Cost(tokens=500, cost=1.0)).tokens == 510


def test_refund_drops_the_reservation_entirely() -> None:
    """Refunding removes the reservation and records no use."""
    daily, _ = keeper(Quota(calls=5, tokens=1_000))
    reservation, _ = daily.reserve("u", Cost(tokens=300))
    assert reservation is not None
    assert daily.usage("u") == Usage(day=DAY, reserved_calls=1, reserved_tokens=300)
    assert daily.refund(reservation)
    assert daily.usage("u") == Usage(day=DAY)


def test_a_reservation_is_closed_once_and_only_once() -> None:
    """A second settle or refund, or one after the other, is a no-op returning False."""
    events: list[BudgetEvent] = []
    clock = ManualClock()
    daily = DailyBudget(BudgetOptions(quota=Quota(tokens=1_000)), clock, on_event=events.append)
    first, _ = daily.reserve("u", Cost(tokens=100))
    second, _ = daily.reserve("u", Cost(tokens=100))
    assert first is not None
    assert second is not None
    assert first.id != second.id
    assert daily.settle(first, Cost(tokens=80))
    assert not daily.settle(first, Cost(tokens=80))
    assert not daily.refund(first)
    assert daily.refund(second)
    assert not daily.refund(second)
    assert not daily.settle(second, Cost(tokens=100))
    assert daily.usage("u") == Usage(day=DAY, calls=1, tokens=80)
    assert daily.open_reservations() == 0
    assert len(events) == 4


def test_a_forged_reservation_with_an_open_id_is_refused() -> None:
    """Only the exact reservation that was handed out can close it."""
    daily, _ = keeper(Quota(tokens=1_000))
    reservation, _ = daily.reserve("u", Cost(tokens=100))
    assert reservation is not None
    forged = replace(reservation, amount=Cost(tokens=900))
    assert not daily.refund(forged)
    assert daily.usage("u").reserved_tokens == 100


# --------------------------------------------------------------------------- days


def test_usage_resets_at_utc_midnight() -> None:
    """A new UTC day starts empty, whatever the previous day used."""
    daily, clock = keeper(Quota(calls=2), degrade_at=1.0)
    daily.reserve("u")
    daily.reserve("u")
    assert daily.reserve("u")[1].retry_after == 86_400.0
    clock.advance(86_399.5)
    blocked = daily.reserve("u")[1]
    assert blocked.retry_after == 0.5
    clock.advance(blocked.retry_after)
    assert daily.usage("u") == Usage(day=DAY + 1)
    assert daily.reserve("u")[1].verdict is BudgetVerdict.ALLOW


def test_settling_yesterdays_reservation_changes_nothing_today() -> None:
    """A reservation from a past day is closed, but neither its estimate nor its actual touch today."""
    daily, clock = keeper(Quota(tokens=1_000))
    reservation, _ = daily.reserve("u", Cost(tokens=500))
    assert reservation is not None
    clock.advance(float(DAY_SECONDS))
    today, _ = daily.reserve("u", Cost(tokens=100))
    assert daily.settle(reservation, Cost(tokens=900))
    assert not daily.settle(reservation, Cost(tokens=900))
    assert daily.usage("u") == Usage(day=DAY + 1, reserved_calls=1, reserved_tokens=100)
    assert today is not None
    assert settle(Usage(day=DAY + 1), reservation, Cost(tokens=900)) == Usage(day=DAY + 1)
    assert refund(Usage(day=DAY + 1, reserved_tokens=7), reservation).reserved_tokens == 7


def test_a_wall_clock_stepping_back_does_not_move_the_day_back() -> None:
    """rollover() only ever moves to a later day."""
    usage = Usage(day=DAY, calls=3)
    assert rollover(usage, MIDNIGHT - 1.0) == usage
    assert rollover(usage, MIDNIGHT + 1.0) == usage
    assert rollover(usage, MIDNIGHT + DAY_SECONDS) == Usage(day=DAY + 1)


def test_day_arithmetic() -> None:
    """Day numbers floor Unix time by 86400; the wait to midnight is in (0, 86400]."""
    assert day_number(0.0) == 0
    assert day_number(86_399.75) == 0
    assert day_number(MIDNIGHT) == 20_454
    assert seconds_until_midnight(MIDNIGHT) == 86_400.0
    assert seconds_until_midnight(MIDNIGHT + 86_399.75) == 0.25


def test_prune_forgets_past_days_only() -> None:
    """prune() drops usage and open reservations of past days and keeps today's."""
    daily, clock = keeper(Quota(calls=10))
    old, _ = daily.reserve("yesterday")
    clock.advance(float(DAY_SECONDS))
    daily.reserve("today")
    assert daily.prune() == 2
    assert old is not None
    assert not daily.settle(old, Cost())
    assert daily.usage("today").reserved_calls == 1
    assert daily.open_reservations() == 1


# --------------------------------------------------------------------------- errors, events, options


def test_rejection_is_a_typed_budget_exceeded_error() -> None:
    """A block becomes BudgetExceeded(policy='budget') with the dimension and wait to midnight."""
    daily, clock = keeper(Quota(calls=1))
    clock.advance(86_000.0)
    daily.reserve("u")
    error = daily.rejection(daily.reserve("u")[1])
    assert isinstance(error, BudgetExceeded)
    assert (error.policy, error.reason, error.retry_after) == ("budget", "calls", 400.0)
    status, body, headers = http_error(error)
    assert (status, headers) == (429, {"Retry-After": "400"})
    assert body["error"]["code"] == "budget_exceeded"


def test_rejection_of_an_admitted_decision_is_a_programming_error() -> None:
    """Asking for the error of an allowed or degraded decision raises ValueError."""
    daily, _ = keeper(Quota(calls=1))
    for decision in (
        BudgetDecision(verdict=BudgetVerdict.ALLOW),
        BudgetDecision(verdict=BudgetVerdict.DEGRADE),
    ):
        assert decision.allowed
        with pytest.raises(ValueError):
            daily.rejection(decision)


def test_events_report_every_step() -> None:
    """Reserve, degrade, block, settle and refund each emit their past-tense event."""
    events: list[BudgetEvent] = []
    clock = ManualClock()
    daily = DailyBudget(BudgetOptions(quota=Quota(calls=2)), clock, on_event=events.append)
    first, _ = daily.reserve("u")
    second, _ = daily.reserve("u")
    daily.reserve("u")
    assert first is not None
    assert second is not None
    daily.settle(first, Cost())
    daily.refund(second)
    assert events == [
        BudgetReserved(subject="u", reservation=first),
        BudgetDegraded(subject="u", reservation=second, reason=BudgetDimension.CALLS),
        BudgetBlocked(subject="u", reason=BudgetDimension.CALLS, retry_after=86_400.0),
        BudgetSettled(subject="u", reservation=first, actual=Cost()),
        BudgetRefunded(subject="u", reservation=second),
    ]


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, math.nan, math.inf])
def test_degrade_at_must_be_a_fraction(value: float) -> None:
    """degrade_at outside (0, 1] is refused with a ValueError naming it."""
    with pytest.raises(ValueError, match="degrade_at"):
        BudgetOptions(quota=Quota(calls=1), degrade_at=value)


@pytest.mark.parametrize("field", ["calls", "tokens", "cost"])
def test_quotas_and_costs_must_not_be_negative(field: str) -> None:
    """Quota and Cost refuse negative amounts, naming the field."""
    with pytest.raises(ValueError, match=field):
        Quota(**{field: -1})
    for bad in (-1, -0.5, math.nan, math.inf, -math.inf):
        amounts: dict[str, Any] = {field: bad}
        with pytest.raises(ValueError, match=field):
            Cost(**amounts)


def test_cost_is_the_frozen_keyword_only_dataclass_it_declares() -> None:
    """Cost's own __init__ gives what the generated one gives: the same signature, fields,
    equality, hashing, repr and refusals, through replace() too."""
    amount = Cost(calls=2, tokens=30, cost=0.5)
    assert repr(amount) == "Cost(calls=2, tokens=30, cost=0.5)"
    assert amount == Cost(calls=2, tokens=30, cost=0.5)
    assert hash(amount) == hash(Cost(calls=2, tokens=30, cost=0.5))
    assert amount != Cost(calls=2, tokens=30, cost=0.25)
    assert [(f.name, f.default, f.kw_only) for f in fields(Cost)] == [
        ("calls", 1, True),
        ("tokens", 0, True),
        ("cost", 0.0, True),
    ]
    parameters = inspect.signature(Cost).parameters.values()
    assert [(p.name, p.kind, p.default) for p in parameters] == [
        ("calls", inspect.Parameter.KEYWORD_ONLY, 1),
        ("tokens", inspect.Parameter.KEYWORD_ONLY, 0),
        ("cost", inspect.Parameter.KEYWORD_ONLY, 0.0),
    ]
    assert get_type_hints(Cost.__init__) == {
        "calls": int,
        "tokens": int,
        "cost": float,
        "return": type(None),
    }
    assert replace(amount, tokens=31) == Cost(calls=2, tokens=31, cost=0.5)
    with pytest.raises(ValueError, match="tokens"):
        replace(amount, tokens=-1)
    with pytest.raises(FrozenInstanceError):
        amount.calls = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        Cost(2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Cost(calls=None)  # type: ignore[arg-type]
    assert not hasattr(amount, "__dict__")
    assert Cost(calls=0, tokens=0, cost=0.0).calls == 0


def test_defaults() -> None:
    """A Cost defaults to one call; a Quota to unlimited; degrade_at to 0.8."""
    assert Cost() == Cost(calls=1, tokens=0, cost=0.0)
    assert Quota() == Quota(calls=None, tokens=None, cost=None)
    assert BudgetOptions(quota=Quota()).degrade_at == 0.8


# --------------------------------------------------------------------------- properties

# Costs are multiples of 1/8 so that every sum is exact and the checks need no tolerance.
eighths = st.integers(min_value=0, max_value=64).map(lambda k: k / 8)
quotas = st.builds(
    Quota,
    calls=st.none() | st.integers(min_value=0, max_value=12),
    tokens=st.none() | st.integers(min_value=0, max_value=2_000),
    cost=st.none() | eighths,
)
costs = st.builds(
    Cost,
    calls=st.integers(min_value=0, max_value=3),
    tokens=st.integers(min_value=0, max_value=600),
    cost=st.integers(min_value=0, max_value=24).map(lambda k: k / 8),
)
degrade_ats = st.sampled_from([0.25, 0.5, 0.8, 1.0])
fractions = st.sampled_from([0, 1, 2, 3, 4])  # quarters of the estimate actually spent
operations = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.sampled_from(["a", "b"]), costs),
        st.tuples(st.just("settle"), st.integers(min_value=0, max_value=99), fractions),
        st.tuples(st.just("refund"), st.integers(min_value=0, max_value=99)),
        st.tuples(st.just("advance"), st.sampled_from([1.0, 3_600.0, 43_200.0])),
    ),
    max_size=40,
)


def _spent(estimate: Cost, quarters: int) -> Cost:
    return Cost(
        calls=estimate.calls * quarters // 4,
        tokens=estimate.tokens * quarters // 4,
        cost=estimate.cost * quarters / 4,
    )


def _within(usage: Usage, quota: Quota) -> bool:
    return (
        (quota.calls is None or usage.calls + usage.reserved_calls <= quota.calls)
        and (quota.tokens is None or usage.tokens + usage.reserved_tokens <= quota.tokens)
        and (quota.cost is None or usage.cost + usage.reserved_cost <= quota.cost)
    )


@settings(max_examples=200, deadline=None)
@given(quota=quotas, degrade_at=degrade_ats, ops=operations)
def test_used_plus_reserved_never_exceeds_the_quota(
    quota: Quota, degrade_at: float, ops: list[tuple[object, ...]]
) -> None:
    """When actuals never exceed estimates, used + reserved stays within the quota, and reserved
    always equals the sum of today's open reservations."""
    daily, clock = keeper(quota, degrade_at=degrade_at)
    open_: list[Reservation] = []
    for op in ops:
        match op:
            case ("reserve", str(subject), Cost() as estimate):
                reservation, decision = daily.reserve(subject, estimate)
                assert (reservation is None) == (decision.verdict is BudgetVerdict.BLOCK)
                if reservation is not None:
                    open_.append(reservation)
            case ("settle", int(index), int(quarters)) if open_:
                reservation = open_.pop(index % len(open_))
                assert daily.settle(reservation, _spent(reservation.amount, quarters))
            case ("refund", int(index)) if open_:
                assert daily.refund(open_.pop(index % len(open_)))
            case ("advance", float(seconds)):
                clock.advance(seconds)
        today = day_number(clock.wall())
        for subject in ("a", "b"):
            usage = daily.usage(subject)
            assert _within(usage, quota)
            mine = [r.amount for r in open_ if r.subject == subject and r.day == today]
            assert usage.reserved_calls == sum(c.calls for c in mine)
            assert usage.reserved_tokens == sum(c.tokens for c in mine)
            assert usage.reserved_cost == sum(c.cost for c in mine)


usages = st.builds(
    Usage,
    day=st.just(DAY),
    calls=st.integers(min_value=0, max_value=20),
    tokens=st.integers(min_value=0, max_value=5_000),
    cost=eighths,
    reserved_calls=st.integers(min_value=0, max_value=5),
    reserved_tokens=st.integers(min_value=0, max_value=1_000),
    reserved_cost=eighths,
)
walls = st.floats(min_value=0.0, max_value=3 * DAY_SECONDS - 1.0).map(lambda s: MIDNIGHT + s)


@settings(max_examples=200, deadline=None)
@given(usage=usages, quota=quotas, degrade_at=degrade_ats, wall=walls, estimate=costs)
def test_refund_restores_the_state_before_the_reservation(
    usage: Usage, quota: Quota, degrade_at: float, wall: float, estimate: Cost
) -> None:
    """reserve() then refund() leaves usage exactly as it was (rolled to the current day)."""
    options = BudgetOptions(quota=quota, degrade_at=degrade_at)
    after, reservation, decision = reserve(usage, options, wall, estimate)
    assert after.day == day_number(wall)
    if reservation is None:
        assert decision.verdict is BudgetVerdict.BLOCK
        assert after == rollover(usage, wall)
    else:
        assert refund(after, reservation) == rollover(usage, wall)


@settings(max_examples=200, deadline=None)
@given(usage=usages, quota=quotas, degrade_at=degrade_ats, days=st.integers(1, 400), estimate=costs)
def test_a_new_day_decides_as_if_nothing_had_been_used(
    usage: Usage, quota: Quota, degrade_at: float, days: int, estimate: Cost
) -> None:
    """After midnight, any usage is forgotten: the decision equals that on an empty day."""
    options = BudgetOptions(quota=quota, degrade_at=degrade_at)
    wall = MIDNIGHT + days * DAY_SECONDS + 1.0
    fresh = Usage(day=DAY + days)
    assert rollover(usage, wall) == fresh
    assert reserve(usage, options, wall, estimate) == reserve(fresh, options, wall, estimate)


# --------------------------------------------------------------------------- module surface


def _export_order(name: str) -> tuple[int, str]:
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_public_names_are_sorted_and_exist() -> None:
    """__all__ is sorted (constants, then classes, then functions) and every name is defined."""
    assert budget.__all__ == sorted(budget.__all__, key=_export_order)
    for name in budget.__all__:
        assert hasattr(budget, name)


def test_the_usage_example_in_the_docs_runs() -> None:
    """Every python block in docs/policies/budget.md executes without error."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    assert blocks
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})
