"""Leases: rate-limit tokens and budget taken from the shared store a few requests at a time.

Every request takes a token from its user's and its tenant's bucket and reserves its estimated
cost against a daily budget. Asking the shared store for each of these, for every request, was
the largest single cost of the request path. A lease asks once for several requests' worth:

* **Tokens.** :class:`LeasedBuckets` takes ``k`` tokens from the store's bucket in one call and
  hands them out to the next requests of the same key in this process. A lease is good for
  ``hold_s`` seconds; whatever is left then is dropped (never given back). ``k`` follows the
  key's demand: half the requests it had in the previous ``hold_s`` window, or in the current
  one so far if that is more (so a burst after a pause leases after a few requests, and each
  lease is about half as large again as the one before), at most ``max_chunk``, and never more
  than a twentieth of the bucket's burst. A key with little
  traffic (or a small burst) has ``k = 1``: every take goes to the store, exactly as without
  leases. A refused lease falls back to taking one token (and no lease is tried again before the
  next window), so a refusal and its ``retry_after`` always come from the store itself.
* **Budget.** :class:`LeasedQuotas` reserves ``k`` times the request's estimate as one store
  reservation and draws each request's own reservation from it locally; ``k`` follows demand as
  for tokens, and a lease never holds more than a twentieth of any limited dimension's quota.
  The store decides the lease as it would any reservation; a lease is only used when that
  decision is ``allow``, so every request drawn from it is one the store would have allowed
  (the lease never crosses the degrade threshold or the limit). A lease that is refused, or would degrade, is refunded at
  once and the request is reserved on its own, as is every request of that subject until the
  next window: blocks and degrades are decided by the store. A lease stops taking draws after
  ``hold_s`` seconds, on a new UTC day, when a request's estimate no longer fits, or when a
  request of the subject settles above its estimate. Retiring it tells the store at once: it is
  settled with what its requests used, and if some are still open, reserved again for exactly
  what they hold (a *rebase*), so the store then holds what it would without leases.

What this changes, on purpose and bounded:

* The store learns of a lease's use when the lease retires, within ``hold_s`` (the gateway's
  refresh round calls :meth:`LeasedQuotas.expire`). :meth:`LeasedQuotas.usage` adds this
  process's open leases, so the process itself always reads its exact use. Other replicas see a
  lease's whole amount as reserved meanwhile, which can make them refuse early near a limit,
  by at most that amount (a twentieth of the quota).
* A process that dies holding a lease leaves its reservation open, as it would leave the
  reservations of its requests in flight: it counts as reserved until the day ends. That errs
  toward refusing, never toward spending more than the budget.
* Tokens sit in a bucket lease outside the bucket, which refills meanwhile: right after a pause
  a key can get ``k - 1`` (less than a twentieth of the burst) more requests through at once
  than its burst; and tokens left in a lease when demand stops are lost to that key.

With ``max_chunk = 1`` there are no leases: every call goes to the store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

import structlog

from tidegate.clock import Clock
from tidegate.ids import new_id
from tidegate.policy.budget import (
    BudgetDecision,
    BudgetOptions,
    BudgetVerdict,
    Cost,
    Reservation,
    Usage,
    day_number,
)
from tidegate.policy.ratelimit import BucketOptions, TakeResult
from tidegate.state.base import BucketStore, QuotaStore

__all__ = ["LEASE_HOLD_S", "LEASE_MAX_CHUNK", "LeasedBuckets", "LeasedQuotas"]

_log = structlog.get_logger("tidegate")

#: How long a lease is drawn from, and the window demand is counted over.
LEASE_HOLD_S: Final = 0.25
#: The most requests one lease covers.
LEASE_MAX_CHUNK: Final = 128
#: A bucket lease takes at most this share of the bucket's burst (1/20).
BURST_SHARE: Final = 20
#: A budget lease holds at most this share of each limited dimension's daily quota (1/20).
QUOTA_SHARE: Final = 20
#: Keys remembered before the expired ones are forgotten.
MAX_KEYS: Final = 10_000

_ALLOWED: Final = BudgetDecision(verdict=BudgetVerdict.ALLOW)


class _Demand:
    """Requests per key in the current window, and in the window before."""

    __slots__ = ("count", "previous", "try_after", "window_end")

    def __init__(self, now: float, hold_s: float) -> None:
        self.window_end = now + hold_s
        self.count = 0
        self.previous = 0
        #: No new lease is tried before this (the last try was refused).
        self.try_after = now

    def seen(self, now: float, hold_s: float) -> None:
        if now >= self.window_end:
            # The window just ended counts; an older one (an idle gap) does not.
            self.previous = self.count if now < self.window_end + hold_s else 0
            self.count = 0
            self.window_end = now + hold_s
        self.count += 1

    def chunk(self, max_chunk: int) -> int:
        """Requests a new lease should cover: half the last window's, or half the current
        window's so far when that is more (a burst after a pause leases within a few requests,
        not a window later), within ``[1, max_chunk]``."""
        return max(1, min(max_chunk, max(self.previous, self.count) // 2))


class _TokenLease(_Demand):
    __slots__ = ("expires", "options", "tokens", "until")

    def __init__(self, now: float, hold_s: float) -> None:
        super().__init__(now, hold_s)
        self.tokens = 0.0
        self.expires = now
        self.options: BucketOptions | None = None
        #: ``min(window_end, expires)``: before it, the demand window and the lease both hold.
        self.until = min(self.window_end, now)

    def seen(self, now: float, hold_s: float) -> None:
        super().seen(now, hold_s)
        self.until = min(self.window_end, self.expires)

    def lease(self, tokens: float, expires: float, options: BucketOptions) -> None:
        """Hold ``tokens`` until ``expires``, for takes with ``options``."""
        self.tokens = tokens
        self.expires = expires
        self.options = options
        self.until = min(self.window_end, expires)


class _Answers(dict[float, TakeResult]):
    """The answers of takes drawn from a lease, by the tokens left in it (all they differ in):
    one frozen result shared by every take that leaves the same amount."""

    __slots__ = ()

    def __missing__(self, remaining: float) -> TakeResult:
        if len(self) >= MAX_KEYS:
            self.clear()
        answer = self[remaining] = TakeResult(
            allowed=True, remaining=remaining, retry_after=0.0, reset_after=0.0
        )
        return answer


S = TypeVar("S")
D = TypeVar("D", bound="_Demand")


class _Leased(Generic[S]):
    """What both kinds of lease keep: the store they lease from, the clock and the sizes."""

    def __init__(
        self,
        store: S,
        clock: Clock,
        *,
        max_chunk: int = LEASE_MAX_CHUNK,
        hold_s: float = LEASE_HOLD_S,
    ) -> None:
        self.store: S = store
        #: The clock's readings, bound once (every request reads them).
        self._now = clock.now
        self._wall = clock.wall
        self._max_chunk = max_chunk
        self._hold_s = hold_s
        self._start()

    def _start(self) -> None:
        """Set up the leases kept in this process (none yet)."""
        raise NotImplementedError

    def _seen(self, table: dict[str, D], key: str, now: float, make: type[D]) -> D:
        """``key``'s demand record in ``table`` (made if new), with this request counted.

        Past :data:`MAX_KEYS` records, those whose window ended over ``hold_s`` ago are
        forgotten (all of them if that is not enough): a key's next request starts it afresh.
        :meth:`LeasedQuotas.reserve` counts a known key within its window itself (the usual
        case, the first branch here), as :meth:`LeasedBuckets.take` does on its fast path.
        """
        record = table.get(key)
        if record is not None and now < record.window_end:
            record.count += 1  # the usual case, as ``seen`` counts it within its window
            return record
        if record is None:
            if len(table) >= MAX_KEYS:
                for stale in [k for k, r in table.items() if r.window_end + self._hold_s < now]:
                    del table[stale]
                if len(table) >= MAX_KEYS:
                    table.clear()
            record = table[key] = make(now, self._hold_s)
        record.seen(now, self._hold_s)
        return record


class LeasedBuckets(_Leased[BucketStore]):
    """A :class:`~tidegate.state.base.BucketStore` that takes tokens from ``store`` in leases."""

    def _start(self) -> None:
        self._leases: dict[str, _TokenLease] = {}
        self._answers = _Answers()

    async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult:
        now = self._now()
        lease = self._leases.get(key)
        if (
            lease is not None
            and now < lease.until
            and lease.tokens >= n
            and lease.options is options
        ):
            # The usual case, as the general path below decides it: a known key within its
            # demand window (``_seen`` counts the take) drawing from a live lease.
            lease.count += 1
            remaining = lease.tokens = lease.tokens - n
            return self._answers[remaining]
        lease = self._seen(self._leases, key, now, _TokenLease)
        if (
            lease.tokens >= n
            and now < lease.expires
            and (lease.options is options or lease.options == options)
        ):
            lease.tokens -= n
            return self._answers[lease.tokens]
        lease.tokens = 0.0
        chunk = float(min(lease.chunk(self._max_chunk), math.floor(options.burst / BURST_SHARE)))
        if chunk >= 2 and chunk > n and now >= lease.try_after:
            result = await self.store.take(key, options, chunk)
            if result.allowed:
                lease.lease(chunk - n, now + self._hold_s, options)
                return result
            # Too few tokens for a lease: single tokens until the next window.
            lease.try_after = now + self._hold_s
        return await self.store.take(key, options, n)


@dataclass(slots=True, eq=False)
class _BudgetLease:
    """One store reservation that this process's requests draw their own reservations from."""

    #: What the store holds for the lease; None once a rebase found no room (see ``_retire``).
    reservation: Reservation | None
    options: BudgetOptions
    day: int
    expires: float
    #: Held by requests drawn from the lease and not yet settled.
    held_calls: int = 0
    held_tokens: int = 0
    held_cost: float = 0.0
    #: Used by the settled requests since the store last heard: told when the lease closes.
    used_calls: int = 0
    used_tokens: int = 0
    used_cost: float = 0.0
    #: Requests drawn and not yet settled.
    open: int = 0
    #: No new draws; closes once ``open`` is 0.
    retired: bool = False

    def draw(self, subject: str, estimate: Cost) -> Reservation:
        """A reservation of ``estimate`` for one request, held by the lease."""
        self.held_calls += estimate.calls
        self.held_tokens += estimate.tokens
        self.held_cost += estimate.cost
        self.open += 1
        return Reservation(id=new_id(), subject=subject, day=self.day, amount=estimate)

    def give_back(self, estimate: Cost, used: Cost | None) -> None:
        """A drawn request ended: its estimate is released, ``used`` (if served) is spent."""
        self.open -= 1
        self.held_calls -= estimate.calls
        self.held_tokens -= estimate.tokens
        self.held_cost -= estimate.cost
        if used is not None:
            self.used_calls += used.calls
            self.used_tokens += used.tokens
            self.used_cost += used.cost

    def used(self) -> Cost:
        return Cost(calls=self.used_calls, tokens=self.used_tokens, cost=max(0.0, self.used_cost))

    def held(self) -> Cost:
        return Cost(calls=self.held_calls, tokens=self.held_tokens, cost=max(0.0, self.held_cost))

    def amount(self) -> Cost:
        """What the store holds reserved for the lease."""
        return self.reservation.amount if self.reservation is not None else _NOTHING


_NOTHING: Final = Cost(calls=0, tokens=0, cost=0.0)


def _quota_share(options: BudgetOptions, estimate: Cost, most: int) -> int:
    """The most estimates a lease may hold (at most ``most``): a twentieth of each limited
    dimension's quota."""
    quota = options.quota
    share = most
    for limit, amount in (
        (quota.calls, estimate.calls),
        (quota.tokens, estimate.tokens),
        (quota.cost, estimate.cost),
    ):
        if limit is not None and amount > 0:
            share = min(share, int(limit / (QUOTA_SHARE * amount)))
    return share


class LeasedQuotas(_Leased[QuotaStore]):
    """A :class:`~tidegate.state.base.QuotaStore` that reserves budget from ``store`` in leases."""

    def _start(self) -> None:
        self._demand: dict[str, _Demand] = {}
        #: The lease each subject draws from now.
        self._current: dict[str, _BudgetLease] = {}
        #: The open reservations drawn from leases, by id: their lease and their own amount.
        self._drawn: dict[str, tuple[_BudgetLease, Cost]] = {}
        #: Retired leases with requests still open, by subject.
        self._retired: dict[str, list[_BudgetLease]] = {}

    async def reserve(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> tuple[Reservation | None, BudgetDecision]:
        now = self._now()
        demand = self._demand.get(subject)
        if demand is not None and now < demand.window_end:
            demand.count += 1  # a known subject within its window: what _seen would do
        else:
            demand = self._seen(self._demand, subject, now, _Demand)
        lease = self._current.get(subject)
        if lease is not None:
            amount = lease.reservation.amount if lease.reservation is not None else _NOTHING
            if (
                now < lease.expires
                and lease.options is options
                and lease.day == day_number(self._wall())
                # The part not yet handed out (the amount less what is held and used) fits.
                and estimate.calls <= amount.calls - lease.held_calls - lease.used_calls
                and estimate.tokens <= amount.tokens - lease.held_tokens - lease.used_tokens
                and estimate.cost <= amount.cost - lease.held_cost - lease.used_cost
            ):
                # lease.draw(subject, estimate), inline: most requests are drawn here.
                lease.held_calls += estimate.calls
                lease.held_tokens += estimate.tokens
                lease.held_cost += estimate.cost
                lease.open += 1
                own = Reservation(id=new_id(), subject=subject, day=lease.day, amount=estimate)
                self._drawn[own.id] = (lease, estimate)
                return own, _ALLOWED
            await self._retire(subject, lease)
        chunk = _quota_share(options, estimate, demand.chunk(self._max_chunk))
        if chunk >= 2 and now >= demand.try_after:
            amount = Cost(
                calls=estimate.calls * chunk,
                tokens=estimate.tokens * chunk,
                cost=estimate.cost * chunk,
            )
            reservation, decision = await self.store.reserve(subject, options, amount)
            if reservation is not None and decision.verdict is BudgetVerdict.ALLOW:
                lease = _BudgetLease(reservation, options, reservation.day, now + self._hold_s)
                # Another request of this subject may have opened a lease meanwhile (the store
                # call yields on a networked store): that one takes no more draws.
                previous = self._current.get(subject)
                self._current[subject] = lease
                own = lease.draw(subject, estimate)
                self._drawn[own.id] = (lease, estimate)
                if previous is not None:
                    await self._retire(subject, previous)
                return own, _ALLOWED
            if reservation is not None:  # it would degrade: decide this request on its own
                await self.store.refund(reservation)
            # Near a limit: every request asks the store until the next window.
            demand.try_after = now + self._hold_s
        return await self.store.reserve(subject, options, estimate)

    async def settle(self, reservation: Reservation, actual: Cost) -> bool:
        estimate = reservation.amount
        if (  # more was used than estimated, on some dimension
            actual.calls > estimate.calls
            or actual.tokens > estimate.tokens
            or actual.cost > estimate.cost
        ):
            # More was used than estimated: the current lease's room was decided without it.
            current = self._current.get(reservation.subject)
            if current is not None and (
                reservation.id not in self._drawn or self._drawn[reservation.id][0] is not current
            ):
                await self._retire(reservation.subject, current)
        drawn = self._drawn.pop(reservation.id, None)
        if drawn is None:
            return await self.store.settle(reservation, actual)
        lease, amount = drawn
        # lease.give_back(amount, actual), inline: every request drawn from a lease settles here.
        lease.open -= 1
        lease.held_calls -= amount.calls
        lease.held_tokens -= amount.tokens
        lease.held_cost -= amount.cost
        lease.used_calls += actual.calls
        lease.used_tokens += actual.tokens
        lease.used_cost += actual.cost
        if lease.retired:  # a lease still drawn from stays open
            await self._close_if_done(reservation.subject, lease)
        return True

    async def refund(self, reservation: Reservation) -> bool:
        drawn = self._drawn.pop(reservation.id, None)
        if drawn is None:
            return await self.store.refund(reservation)
        lease, amount = drawn
        lease.give_back(amount, None)
        await self._close_if_done(reservation.subject, lease)
        return True

    async def usage(self, subject: str) -> Usage:
        """The store's use, with this process's open leases replaced by what they hold and used."""
        usage = await self.store.usage(subject)
        leases = [*self._retired.get(subject, ())]
        if subject in self._current:
            leases.append(self._current[subject])
        for lease in leases:
            if lease.day != usage.day:
                continue
            amount = lease.amount()
            usage = Usage(
                day=usage.day,
                calls=usage.calls + lease.used_calls,
                tokens=usage.tokens + lease.used_tokens,
                cost=usage.cost + lease.used_cost,
                reserved_calls=usage.reserved_calls - amount.calls + lease.held_calls,
                reserved_tokens=usage.reserved_tokens - amount.tokens + lease.held_tokens,
                reserved_cost=usage.reserved_cost - amount.cost + lease.held_cost,
            )
        return usage

    async def expire(self) -> None:
        """Retire the leases whose time is up (settling those with no request open): run it
        every ``hold_s`` or so, so that the store learns of the use of a subject gone quiet."""
        now = self._now()
        for subject, lease in list(self._current.items()):
            if now >= lease.expires and self._current.get(subject) is lease:
                await self._retire(subject, lease)

    async def flush(self) -> None:
        """Retire every lease now (at shutdown): each settles once its last request has."""
        for subject, lease in list(self._current.items()):
            if self._current.get(subject) is lease:
                await self._retire(subject, lease)

    async def _retire(self, subject: str, lease: _BudgetLease) -> None:
        """No more draws from ``lease``; the store is told its use, and gets its room back.

        With requests still open, the lease is *rebased*: settled with what was used so far, then
        reserved again for exactly what its open requests hold, so that the store sees what it
        would without leases. Should the store find no room for that (only when the subject's use
        already passed a limit, through answers longer than estimated, or another replica took
        the room in between), the open requests' use is reserved and settled when they end.
        """
        if lease.retired:
            return
        lease.retired = True
        if self._current.get(subject) is lease:
            del self._current[subject]
        if lease.open == 0:
            await self._settle_lease(subject, lease)
            return
        self._retired.setdefault(subject, []).append(lease)
        if lease.day != day_number(self._wall()) or lease.reservation is None:
            return  # a past day's reservation no longer counts against anything
        reservation, used = lease.reservation, lease.used()
        await self.store.settle(reservation, used)
        # From here the store holds nothing for the lease, and knows its use so far.
        lease.reservation = None
        lease.used_calls = lease.used_tokens = 0
        lease.used_cost = 0.0
        carrier, _ = await self.store.reserve(subject, lease.options, lease.held())
        if carrier is None:
            return
        if lease.open == 0 and lease not in self._retired.get(subject, ()):
            # Its last request ended while the store was asked (a networked store yields) and
            # recorded its use on its own: the carrier is not needed.
            await self.store.refund(carrier)
            return
        lease.reservation = carrier

    async def _close_if_done(self, subject: str, lease: _BudgetLease) -> None:
        if not lease.retired or lease.open > 0:
            return
        waiting = self._retired.get(subject)
        if waiting is not None and lease in waiting:
            waiting.remove(lease)
            if not waiting:
                del self._retired[subject]
        await self._settle_lease(subject, lease)

    async def _settle_lease(self, subject: str, lease: _BudgetLease) -> None:
        used = lease.used()
        if lease.reservation is not None:
            await self.store.settle(lease.reservation, used)
            return
        if used.calls == 0 and used.tokens == 0 and used.cost == 0.0:
            return
        # No reservation carries it (see _retire): record the use through one of its own.
        reservation, _ = await self.store.reserve(subject, lease.options, used)
        if reservation is None:
            _log.warning(
                "lease_use_unrecorded",
                subject=subject,
                calls=used.calls,
                tokens=used.tokens,
                cost=used.cost,
            )
            return
        await self.store.settle(reservation, used)
