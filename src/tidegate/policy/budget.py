"""Daily budgets: a per-subject quota on calls, tokens and cost that degrades before it blocks.

A request *reserves* its estimated cost on entry, then either *settles* (the reservation becomes
use, at the amounts actually spent) or is *refunded* (nothing was spent: a failed call, a degraded
answer). Near the quota the budget says *degrade* (the gateway answers with a cheaper model or a
lower ``max_tokens``); past it, *block* until the next UTC midnight.

The state of one subject is the small immutable :class:`Usage`, and every step is a pure function,
so a shared store can hold the state and repeat the same arithmetic atomically (a Lua script, one
SQL statement). For a dimension ``d`` in (calls, tokens, cost) with quota ``L_d`` (``None`` is
unlimited: never checked, still counted)::

    today      = floor(now_wall / 86400)                    the UTC day number
    rollover:    if today > usage.day: usage = Usage(day=today)       (every amount zero)
                 a wall clock that steps back never moves the day back

    reserve(estimate):
                 total_d = used_d + (reserved_d + estimate_d)
                 block    if total_d > L_d                      for some limited d
                 degrade  if total_d > degrade_at * L_d         for some limited d, and no block
                 allow    otherwise
                 block   -> usage unchanged, no reservation,
                            retry_after = 86400 * (today + 1) - now_wall     (to the next midnight)
                                        = inf if estimate_d > L_d            (no day can admit it)
                 allow, degrade -> reserved_d += estimate_d for every d; a Reservation for usage.day
                 reason = the first blocking (else degrading) dimension, in the order calls,
                          tokens, cost; a dimension no day can admit comes first

    settle(reservation, actual):       only if reservation.day == usage.day, else no change
                 reserved_d = max(0, reserved_d - reservation_d)
                 used_d     = used_d + actual_d                  actual may be more or less
    refund(reservation):               only if reservation.day == usage.day, else no change
                 reserved_d = max(0, reserved_d - reservation_d)
    rebase(reservation, actual, keep): only if reservation.day == usage.day, else no change
                 reserved_d = max(0, reserved_d - reservation_d) + keep_d
                 used_d     = used_d + actual_d                  a settle and a hold, at once

A rebase is how a lease (:mod:`tidegate.state.leases`) tells the store what its settled requests
used while some are still open: the reservation then holds exactly what those hold. It decides
nothing (``keep`` was part of what the reservation held), so it needs no room and cannot fail for
want of it: done as one step, no other request can take the room in between.

A reservation from a past day is settled or refunded against that day only, and that day is over:
so it changes nothing. Cost is a float: its sums are exact when every amount is a whole number (so
price in a small unit, such as micro-dollars) and otherwise carry ordinary floating-point rounding.

The pure functions cannot tell a second settle of the same reservation from a first: whoever keeps
the state must track which reservations are open. :class:`DailyBudget` does so in memory; a store
keeps a table of open reservation ids and settles by deleting the row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from tidegate.clock import Clock
from tidegate.errors import BudgetExceeded

__all__ = [
    "DAY_SECONDS",
    "BudgetBlocked",
    "BudgetDecision",
    "BudgetDegraded",
    "BudgetDimension",
    "BudgetEvent",
    "BudgetOptions",
    "BudgetRefunded",
    "BudgetReserved",
    "BudgetSettled",
    "BudgetVerdict",
    "Cost",
    "DailyBudget",
    "Quota",
    "Reservation",
    "Usage",
    "day_number",
    "rebase",
    "refund",
    "reserve",
    "rollover",
    "seconds_until_midnight",
    "settle",
]

#: Length of a budget day; days start at midnight UTC.
DAY_SECONDS = 86_400


_INF = math.inf
#: How a frozen dataclass sets its own fields (its __setattr__ refuses).
_set_field: Final = object.__setattr__


def _non_negative(value: float | None, name: str) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class BudgetVerdict(StrEnum):
    """What a reservation decided."""

    ALLOW = "allow"
    DEGRADE = "degrade"
    BLOCK = "block"


class BudgetDimension(StrEnum):
    """What a budget counts."""

    CALLS = "calls"
    TOKENS = "tokens"
    COST = "cost"


@dataclass(frozen=True, slots=True, kw_only=True)
class Quota:
    """The most one subject may use in one UTC day; ``None`` means unlimited."""

    #: Calls per day.
    calls: int | None = None
    #: Model tokens (prompt and completion) per day.
    tokens: int | None = None
    #: Money per day, in whatever unit the gateway prices calls in.
    cost: float | None = None

    def __post_init__(self) -> None:
        _non_negative(self.calls, "calls")
        _non_negative(self.tokens, "tokens")
        _non_negative(self.cost, "cost")


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class Cost:
    """An amount on every dimension: an estimate to reserve, or what a call actually spent."""

    calls: int = 1
    tokens: int = 0
    cost: float = 0.0

    # Written out instead of generated: a Cost is built several times for every request, and
    # this is the generated __init__ with its __post_init__ inlined (same signature, checks and
    # fields), setting each field through a module constant for object.__setattr__.
    def __init__(self, *, calls: int = 1, tokens: int = 0, cost: float = 0.0) -> None:
        # One chained comparison decides the usual case (NaN and infinity fail it too), and the
        # checks naming the bad field run only then.
        if not (0 <= calls < _INF and 0 <= tokens < _INF and 0 <= cost < _INF):
            _non_negative(calls, "calls")
            _non_negative(tokens, "tokens")
            _non_negative(cost, "cost")
        _set_field(self, "calls", calls)
        _set_field(self, "tokens", tokens)
        _set_field(self, "cost", cost)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetOptions:
    """A daily budget."""

    #: The daily quota (required: there is no sensible default amount of money).
    quota: Quota
    #: Fraction of the quota past which reservations are answered ``degrade``. In (0, 1];
    #: 1.0 never degrades.
    degrade_at: float = 0.8

    def __post_init__(self) -> None:
        if not (math.isfinite(self.degrade_at) and 0 < self.degrade_at <= 1):
            raise ValueError(f"degrade_at must be in (0, 1], got {self.degrade_at!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """One subject's use of one UTC day: settled amounts and open reservations."""

    #: UTC day number, ``floor(wall / 86400)``.
    day: int
    calls: int = 0
    tokens: int = 0
    cost: float = 0.0
    reserved_calls: int = 0
    reserved_tokens: int = 0
    reserved_cost: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """An amount held for one request until it is settled or refunded."""

    #: Unique among the open reservations of whoever keeps the state.
    id: str
    subject: str
    #: The UTC day the amount was reserved on; it counts against that day only.
    day: int
    amount: Cost


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetDecision:
    """The answer to a reservation."""

    verdict: BudgetVerdict
    #: The dimension that caused a degrade or block; None when allowed.
    reason: BudgetDimension | None = None
    #: 0.0 unless blocked; then seconds until the next UTC midnight, or ``math.inf`` when the
    #: estimate alone is over the quota and no day can admit it.
    retry_after: float = 0.0

    @property
    def allowed(self) -> bool:
        """Whether the request may go on (allowed or degraded)."""
        return self.verdict is not BudgetVerdict.BLOCK


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetReserved:
    """A reservation was allowed in full."""

    subject: str
    reservation: Reservation


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetDegraded:
    """A reservation was allowed, but the request should be served more cheaply."""

    subject: str
    reservation: Reservation
    reason: BudgetDimension


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetBlocked:
    """A reservation was refused: the quota would be passed."""

    subject: str
    reason: BudgetDimension
    retry_after: float


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetSettled:
    """An open reservation became use, at the actual amounts."""

    subject: str
    reservation: Reservation
    actual: Cost


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetRefunded:
    """An open reservation was dropped without use."""

    subject: str
    reservation: Reservation


BudgetEvent = BudgetReserved | BudgetDegraded | BudgetBlocked | BudgetSettled | BudgetRefunded


def day_number(wall: float) -> int:
    """The UTC day number of Unix time ``wall``: ``floor(wall / 86400)``."""
    return int(wall // DAY_SECONDS)


def seconds_until_midnight(wall: float) -> float:
    """Seconds from Unix time ``wall`` to the next UTC midnight (in (0, 86400])."""
    return (day_number(wall) + 1) * DAY_SECONDS - wall


def rollover(usage: Usage, now_wall: float) -> Usage:
    """``usage`` as of ``now_wall``: a fresh, empty day if a new UTC day has begun."""
    today = day_number(now_wall)
    return Usage(day=today) if today > usage.day else usage


def reserve(
    usage: Usage,
    options: BudgetOptions,
    now_wall: float,
    estimate: Cost,
    *,
    subject: str = "",
    reservation_id: str = "",
) -> tuple[Usage, Reservation | None, BudgetDecision]:
    """Decide ``estimate`` against the quota and hold it unless blocked; see the module docstring.

    ``subject`` and ``reservation_id`` only label the returned reservation; the keeper of the
    state supplies an id unique among its open reservations.
    """
    usage = rollover(usage, now_wall)
    quota = options.quota
    reserved_calls = usage.reserved_calls + estimate.calls
    reserved_tokens = usage.reserved_tokens + estimate.tokens
    reserved_cost = usage.reserved_cost + estimate.cost
    rows: tuple[tuple[BudgetDimension, float | None, float, float], ...] = (
        (BudgetDimension.CALLS, quota.calls, usage.calls + reserved_calls, estimate.calls),
        (BudgetDimension.TOKENS, quota.tokens, usage.tokens + reserved_tokens, estimate.tokens),
        (BudgetDimension.COST, quota.cost, usage.cost + reserved_cost, estimate.cost),
    )
    blocking: list[BudgetDimension] = []
    hopeless: list[BudgetDimension] = []
    degrading: list[BudgetDimension] = []
    for dimension, limit, total, amount in rows:
        if limit is None:
            continue
        if total > limit:
            blocking.append(dimension)
            if amount > limit:
                hopeless.append(dimension)
        elif total > options.degrade_at * limit:
            degrading.append(dimension)
    if blocking:
        retry_after = math.inf if hopeless else seconds_until_midnight(now_wall)
        decision = BudgetDecision(
            verdict=BudgetVerdict.BLOCK, reason=(hopeless or blocking)[0], retry_after=retry_after
        )
        return usage, None, decision
    # Built field by field: dataclasses.replace() costs several times more, on every request.
    new_usage = Usage(
        day=usage.day,
        calls=usage.calls,
        tokens=usage.tokens,
        cost=usage.cost,
        reserved_calls=reserved_calls,
        reserved_tokens=reserved_tokens,
        reserved_cost=reserved_cost,
    )
    reservation = Reservation(id=reservation_id, subject=subject, day=usage.day, amount=estimate)
    if degrading:
        decision = BudgetDecision(verdict=BudgetVerdict.DEGRADE, reason=degrading[0])
    else:
        decision = BudgetDecision(verdict=BudgetVerdict.ALLOW)
    return new_usage, reservation, decision


def _release(usage: Usage, amount: Cost, used: Cost | None = None) -> Usage:
    """``usage`` without the reservation of ``amount``, plus ``used`` when it was used."""
    return Usage(
        day=usage.day,
        calls=usage.calls if used is None else usage.calls + used.calls,
        tokens=usage.tokens if used is None else usage.tokens + used.tokens,
        cost=usage.cost if used is None else usage.cost + used.cost,
        reserved_calls=max(0, usage.reserved_calls - amount.calls),
        reserved_tokens=max(0, usage.reserved_tokens - amount.tokens),
        reserved_cost=max(0.0, usage.reserved_cost - amount.cost),
    )


def settle(usage: Usage, reservation: Reservation, actual: Cost) -> Usage:
    """Turn ``reservation`` into use at the ``actual`` amounts (a past day's: no change)."""
    if reservation.day != usage.day:
        return usage
    return _release(usage, reservation.amount, actual)


def refund(usage: Usage, reservation: Reservation) -> Usage:
    """Drop ``reservation`` without use (a past day's: no change)."""
    if reservation.day != usage.day:
        return usage
    return _release(usage, reservation.amount)


def rebase(usage: Usage, reservation: Reservation, actual: Cost, keep: Cost) -> Usage:
    """Settle ``reservation`` at ``actual`` and reserve ``keep`` in its place, as one step (a
    past day's: no change); see the module docstring."""
    if reservation.day != usage.day:
        return usage
    released = _release(usage, reservation.amount, actual)
    return Usage(
        day=released.day,
        calls=released.calls,
        tokens=released.tokens,
        cost=released.cost,
        reserved_calls=released.reserved_calls + keep.calls,
        reserved_tokens=released.reserved_tokens + keep.tokens,
        reserved_cost=released.reserved_cost + keep.cost,
    )


class DailyBudget:
    """Daily budgets kept in this process, one per subject; for tests and single-process use.

    A gateway with more than one replica must keep budgets in a shared store instead: a budget per
    process multiplies the quota by the number of processes.
    """

    __slots__ = ("_clock", "_ids", "_on_event", "_open", "_usage", "options")

    def __init__(
        self,
        options: BudgetOptions,
        clock: Clock,
        *,
        on_event: Callable[[BudgetEvent], None] | None = None,
    ) -> None:
        self.options = options
        self._clock = clock
        self._on_event = on_event
        self._usage: dict[str, Usage] = {}
        self._open: dict[str, Reservation] = {}
        self._ids = itertools.count(1)

    def _current(self, subject: str, now_wall: float) -> Usage:
        usage = self._usage.get(subject)
        if usage is None:
            return Usage(day=day_number(now_wall))
        return rollover(usage, now_wall)

    def _emit(self, event: BudgetEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)

    def reserve(
        self, subject: str, estimate: Cost | None = None
    ) -> tuple[Reservation | None, BudgetDecision]:
        """Reserve ``estimate`` (default: one call) for ``subject``; no reservation when blocked."""
        estimate = Cost() if estimate is None else estimate
        now_wall = self._clock.wall()
        usage, reservation, decision = reserve(
            self._current(subject, now_wall),
            self.options,
            now_wall,
            estimate,
            subject=subject,
            reservation_id=str(next(self._ids)),
        )
        self._usage[subject] = usage
        if reservation is None:
            assert decision.reason is not None
            self._emit(
                BudgetBlocked(
                    subject=subject, reason=decision.reason, retry_after=decision.retry_after
                )
            )
            return None, decision
        self._open[reservation.id] = reservation
        if decision.reason is None:
            self._emit(BudgetReserved(subject=subject, reservation=reservation))
        else:
            self._emit(
                BudgetDegraded(subject=subject, reservation=reservation, reason=decision.reason)
            )
        return reservation, decision

    def _close(self, reservation: Reservation) -> bool:
        if self._open.get(reservation.id) != reservation:
            return False
        del self._open[reservation.id]
        return True

    def settle(self, reservation: Reservation, actual: Cost) -> bool:
        """Settle an open reservation at ``actual``; False (and no change) if it is not open."""
        if not self._close(reservation):
            return False
        subject = reservation.subject
        self._usage[subject] = settle(
            self._current(subject, self._clock.wall()), reservation, actual
        )
        self._emit(BudgetSettled(subject=subject, reservation=reservation, actual=actual))
        return True

    def refund(self, reservation: Reservation) -> bool:
        """Refund an open reservation; False (and no change) if it is not open."""
        if not self._close(reservation):
            return False
        subject = reservation.subject
        self._usage[subject] = refund(self._current(subject, self._clock.wall()), reservation)
        self._emit(BudgetRefunded(subject=subject, reservation=reservation))
        return True

    def usage(self, subject: str) -> Usage:
        """``subject``'s usage of the current UTC day."""
        return self._current(subject, self._clock.wall())

    def open_reservations(self) -> int:
        """How many reservations are neither settled nor refunded."""
        return len(self._open)

    def prune(self) -> int:
        """Forget past days: usage and open reservations older than today, which can no longer
        change anything; return how many entries were forgotten. Settling a forgotten
        reservation returns False."""
        today = day_number(self._clock.wall())
        stale_usage = [subject for subject, usage in self._usage.items() if usage.day < today]
        stale_open = [rid for rid, reservation in self._open.items() if reservation.day < today]
        for subject in stale_usage:
            del self._usage[subject]
        for rid in stale_open:
            del self._open[rid]
        return len(stale_usage) + len(stale_open)

    def rejection(self, decision: BudgetDecision) -> BudgetExceeded:
        """The error to raise for a blocked reservation (``retry_after`` None when no day helps)."""
        if decision.verdict is not BudgetVerdict.BLOCK or decision.reason is None:
            raise ValueError(f"cannot build a rejection for a {decision.verdict} decision")
        dimension = decision.reason.value
        if math.isinf(decision.retry_after):
            return BudgetExceeded(
                f"the request's estimated {dimension} exceed the whole daily quota",
                policy="budget",
                retry_after=None,
                reason=dimension,
            )
        return BudgetExceeded(
            f"the daily {dimension} budget is spent; it resets at midnight UTC",
            policy="budget",
            retry_after=decision.retry_after,
            reason=dimension,
        )

    def __repr__(self) -> str:
        return f"DailyBudget({self.options!r}, subjects={len(self._usage)}, open={len(self._open)})"
