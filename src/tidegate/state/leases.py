"""Leases: rate-limit tokens and budget taken from the shared store a few requests at a time.

Every request takes a token from its user's and its tenant's bucket and reserves its estimated
cost against a daily budget. Asking the shared store for each of these, for every request, was
the largest single cost of the request path (``benchmarks/instructions.py`` with
``state.leases.max_chunk: 1``: about 240,000 more instructions a request). A lease asks once for
several requests' worth, and keeps the store's decisions:

* **One store call of a key at a time.** In one process, at most one store call of a bucket key
  or budget subject is in flight; a request that needs the store while one is under way waits for
  it and then looks at the lease again (it usually draws from the lease that call made). So
  concurrent requests never lease side by side, and a request is refused (or degraded) only by a
  store that has been told everything this process holds. A wait is bounded by ``wait_s`` (the
  store's own timeout); if the call waited for fails, its :class:`~tidegate.errors.StoreError`
  reaches the waiters too.
* **Tokens.** :class:`LeasedBuckets` takes ``k`` tokens in one store call and hands them to the
  next requests of the key. ``k`` follows demand: half the requests the key had in the previous
  ``hold_s`` window, or in the current one so far if that is more, at most ``max_chunk`` and at
  most a twentieth of the burst (a burst under 40 never leases: every take goes to the store). A
  refused lease falls back to one token (and no lease is tried before the next window), so a
  refusal and its ``retry_after`` are always the store's own. Tokens left when the lease's
  ``hold_s`` is up go back to the bucket (:meth:`LeasedBuckets.expire`, run by the gateway's
  refresh round, or the key's next store call), never past the burst.
* **Budget.** :class:`LeasedQuotas` reserves ``k`` times the request's estimate as one store
  reservation and draws each request's reservation from it here; a lease holds at most a
  twentieth of each limited dimension's daily quota, and is used only when the store allowed all
  of it (``allow``: below the degrade threshold), so every request drawn from it is one the store
  would have allowed. A lease that would degrade or block is refunded at once and the request
  decided on its own, as is every request of the subject until the next window: degrades and
  blocks come from the store. A lease takes no more draws after ``hold_s``, on a new UTC day,
  when an estimate no longer fits, or when a request of the subject settles above its estimate.
  Retiring it is **one** store operation (:meth:`~tidegate.state.base.QuotaStore.rebase`, or a
  settle when nothing is open): what its requests used becomes use and the reservation shrinks
  to what its open requests still hold. No other replica can take the room in between, so the
  store always holds at least what the process has promised, and never less is recorded than
  was served.

What a lease changes, bounded and on purpose (docs/state.md states the same):

* **Another replica** sees a lease's unused part (its tokens, or its undrawn room) as taken until
  the lease retires, within ``hold_s``: it may refuse or degrade early by at most one lease per
  other replica (``min(max_chunk, burst / 20)`` tokens; a twentieth of a budget's quota). This
  process never does: it draws from its own lease before it asks the store.
* **Tokens out on a lease** are outside the bucket while it refills: a bucket that fills to its
  burst meanwhile can let through the lease's rest on top, at most ``min(k, rate * hold_s)``
  tokens per lease.
* **The store learns** of a budget lease's use when the lease retires, within ``hold_s``;
  :meth:`LeasedQuotas.usage` adds this process's open leases, so the process itself always reads
  its exact use.
* **A process that dies** holding a lease leaves its reservation (or its tokens) taken, as it
  leaves the reservations of its requests in flight: counted as reserved until the day ends. That
  errs toward refusing, never toward spending more than the budget.

With ``max_chunk = 1`` there are no leases: every call goes to the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

import structlog

from tidegate.clock import Clock
from tidegate.errors import StoreError
from tidegate.ids import new_id
from tidegate.policy.budget import (
    DAY_SECONDS,
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

__all__ = ["LEASE_HOLD_S", "LEASE_MAX_CHUNK", "LEASE_WAIT_S", "LeasedBuckets", "LeasedQuotas"]

_log = structlog.get_logger("tidegate")

#: How long a lease is drawn from, and the window demand is counted over.
LEASE_HOLD_S: Final = 0.25
#: The most requests one lease covers.
LEASE_MAX_CHUNK: Final = 128
#: How long a request waits for the store call of its key already in flight (the store's timeout).
LEASE_WAIT_S: Final = 0.5
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

    def holds_nothing(self) -> bool:
        """Whether forgetting this record loses nothing but its demand count."""
        return True


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

    def holds_nothing(self) -> bool:
        return self.tokens <= 0.0


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
T = TypeVar("T")
#: What a request waiting in a key's line asks for (a take, a reservation), and its answer.
Q = TypeVar("Q")
A = TypeVar("A")


class _Waiter(Generic[Q, A]):
    """A request waiting for the store call of its key under way in this process; ``asks`` is
    None for a lease round (it waits only for its turn)."""

    __slots__ = ("asks", "future")

    def __init__(self, asks: Q | None, future: asyncio.Future[A | None]) -> None:
        self.asks = asks
        #: Set by the request that made the call: an answer, or None for "your turn".
        self.future = future


def _no_refusal(_: object) -> None:
    return None


class _Leased(Generic[S, Q, A]):
    """What both kinds of lease keep: the store, the clock, the sizes, and for each key whose
    store call is under way in this process, the line of requests waiting for it.

    One store call of a key at a time: the request that makes it serves the line when it ends,
    first come first served. Each waiter gets an answer while one can be given without the store
    (a draw from the lease the call made, or the refusal it brought back for the very same
    request: the store's answer at that instant); the first that cannot be answered makes the
    next call. A surge of one key so costs one store call a lease, and one for all its
    refusals, instead of one a request.
    """

    def __init__(
        self,
        store: S,
        clock: Clock,
        *,
        max_chunk: int = LEASE_MAX_CHUNK,
        hold_s: float = LEASE_HOLD_S,
        wait_s: float = LEASE_WAIT_S,
    ) -> None:
        self.store: S = store
        #: The clock's readings, bound once (every request reads them).
        self._now = clock.now
        self._wall = clock.wall
        self._max_chunk = max_chunk
        self._hold_s = hold_s
        self._wait_s = wait_s
        #: The keys with a store call under way, and who waits for it.
        self._lines: dict[str, deque[_Waiter[Q, A]]] = {}
        self._start()

    def _start(self) -> None:
        """Set up the leases kept in this process (none yet)."""
        raise NotImplementedError

    def _answer(self, key: str, asks: Q, refusal: tuple[Q, A] | None) -> A | None:
        """A waiter's answer without the store (its lease has room, or ``refusal`` refused the
        same request a moment ago), or None: then it makes the next call."""
        raise NotImplementedError

    async def _undo(self, key: str, asks: Q, answer: A) -> None:
        """A waiter gave up (cancelled) just as it was answered: what it drew goes back."""
        raise NotImplementedError

    def _seen(self, table: dict[str, D], key: str, now: float, make: type[D]) -> D:
        """``key``'s demand record in ``table`` (made if new), with this request counted.

        Past :data:`MAX_KEYS` records, those whose window ended over ``hold_s`` ago and that hold
        nothing are forgotten (all of them if that is not enough): a key's next request starts it
        afresh. The reserve and take fast paths count a known key within its window themselves
        (the first branch here).
        """
        record = table.get(key)
        if record is not None and now < record.window_end:
            record.count += 1  # the usual case, as ``seen`` counts it within its window
            return record
        if record is None:
            if len(table) >= MAX_KEYS:
                for stale in [
                    k
                    for k, r in table.items()
                    if r.window_end + self._hold_s < now and r.holds_nothing()
                ]:
                    del table[stale]
                if len(table) >= MAX_KEYS:
                    table.clear()
            record = table[key] = make(now, self._hold_s)
        record.seen(now, self._hold_s)
        return record

    async def _turn(self, key: str, asks: Q | None) -> A | None:
        """This request's answer from the store call of ``key`` under way, or None once it is
        this request's turn to call the store (at once, when no call is under way): it must then
        end its turn with :meth:`_call` or :meth:`_serve`. Waiting is bounded by ``wait_s``; a
        call that fails fails its waiters with the same StoreError."""
        line = self._lines.get(key)
        if line is None:
            self._lines[key] = deque()
            return None
        waiter: _Waiter[Q, A] = _Waiter(asks, asyncio.get_running_loop().create_future())
        line.append(waiter)
        future = waiter.future
        try:
            async with asyncio.timeout(self._wait_s):
                return await future
        except BaseException as exc:
            if future.done() and not future.cancelled() and future.exception() is None:
                answer = future.result()  # given just as this request gave up waiting
                if answer is None:
                    self._serve(key, None)  # the turn passes on
                elif asks is not None:
                    await self._undo(key, asks, answer)
            if isinstance(exc, TimeoutError):
                raise StoreError(
                    f"the state store did not answer within {self._wait_s:g} s"
                    " (another request's call of the same key)"
                ) from None
            if isinstance(exc, StoreError):  # the call waited for failed: so does this request
                raise StoreError(exc.message, original=exc.original) from None
            raise

    async def _call(
        self, key: str, call: Awaitable[T], refusal: Callable[[T], tuple[Q, A] | None]
    ) -> T:
        """Await ``call`` (the store call of this request's turn), then serve the line: with
        what ``refusal`` makes of its result, or, should it fail, its StoreError."""
        try:
            result = await call
        except StoreError as exc:
            self._fail(key, exc)
            raise
        except BaseException:
            self._serve(key, None)
            raise
        self._serve(key, refusal(result))
        return result

    def _serve(self, key: str, refusal: tuple[Q, A] | None) -> None:
        """The store call of ``key`` has ended: answer the waiters in order while
        :meth:`_answer` can; the first it cannot makes the next call. With nobody left, ``key``
        has no call under way."""
        line = self._lines[key]
        while line:
            waiter = line.popleft()
            if waiter.future.done():
                continue  # it gave up waiting
            asks = waiter.asks
            answer = None if asks is None else self._answer(key, asks, refusal)
            waiter.future.set_result(answer)
            if answer is None:
                return  # its turn: it serves the rest when its own call ends
        del self._lines[key]

    def _fail(self, key: str, error: StoreError) -> None:
        """The store call of ``key`` failed: so does every request waiting for it."""
        for waiter in self._lines.pop(key):
            if not waiter.future.done():
                waiter.future.set_exception(StoreError(error.message, original=error.original))
                waiter.future.exception()  # retrieved: it may give up before it looks


_Take = tuple[float, BucketOptions]


class LeasedBuckets(_Leased[BucketStore, _Take, TakeResult]):
    """A :class:`~tidegate.state.base.BucketStore` that takes tokens from ``store`` in leases."""

    def _start(self) -> None:
        self._leases: dict[str, _TokenLease] = {}
        #: Leases that took tokens and may still hold some, for :meth:`expire`.
        self._holding: dict[str, _TokenLease] = {}
        self._answers = _Answers()

    def take_now(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult | None:
        """The take, if this process's live lease of ``key`` holds it now (the usual case: a
        known key within its demand window drawing from its lease), else None: then
        :meth:`take`, which may ask the store. Never refuses: a refusal is the store's."""
        lease = self._leases.get(key)
        if (
            lease is not None
            and self._now() < lease.until
            and lease.tokens >= n
            and lease.options is options
        ):
            lease.count += 1  # what ``_seen`` would count
            remaining = lease.tokens = lease.tokens - n
            return self._answers[remaining]
        return None

    async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult:
        drawn = self.take_now(key, options, n)
        if drawn is not None:
            return drawn
        now = self._now()
        if options.burst < 2 * BURST_SHARE or self._max_chunk < 2:
            return await self.store.take(key, options, n)  # this bucket never leases
        lease = self._seen(self._leases, key, now, _TokenLease)
        asks = (n, options)
        answer = self._draw(lease, asks) or await self._turn(key, asks)
        if answer is not None:
            return answer
        return await self._call(
            key,
            self._refill(key, lease, options, n),
            lambda result: None if result.allowed else (asks, result),
        )

    def _draw(self, lease: _TokenLease, asks: _Take) -> TakeResult | None:
        """A take drawn from ``lease`` if it holds enough for these options now, else None."""
        n, options = asks
        if (
            lease.tokens >= n
            and self._now() < lease.expires
            and (lease.options is options or lease.options == options)
        ):
            lease.tokens -= n
            return self._answers[lease.tokens]
        return None

    def _answer(
        self, key: str, asks: _Take, refusal: tuple[_Take, TakeResult] | None
    ) -> TakeResult | None:
        lease = self._leases.get(key)
        drawn = None if lease is None else self._draw(lease, asks)
        if drawn is None and refusal is not None and refusal[0] == asks:
            return refusal[1]
        return drawn

    async def _undo(self, key: str, asks: _Take, answer: TakeResult) -> None:
        lease = self._leases.get(key)
        if answer.allowed and lease is not None:  # drawn from the lease: back into it
            lease.tokens += asks[0]

    async def _refill(
        self, key: str, lease: _TokenLease, options: BucketOptions, n: float
    ) -> TakeResult:
        """Ask the store (this request's turn): a new lease when demand allows, else one take."""
        if lease.tokens > 0.0 and lease.options is not None:
            # Expired (or for other options): the rest goes back to the bucket first.
            tokens, lease.tokens = lease.tokens, 0.0
            await self.store.give_back(key, lease.options, tokens)
        now = self._now()
        cap = min(self._max_chunk, math.floor(options.burst / BURST_SHARE))
        chunk = float(min(lease.chunk(self._max_chunk), cap))
        if chunk >= 2 and chunk > n and now >= lease.try_after:
            result = await self.store.take(key, options, chunk)
            if result.allowed:
                lease.lease(chunk - n, self._now() + self._hold_s, options)
                self._holding[key] = lease
                return result
            # Too few tokens for a lease: single tokens until the next window.
            lease.try_after = now + self._hold_s
        return await self.store.take(key, options, n)

    async def give_back(self, key: str, options: BucketOptions, n: float) -> None:
        await self.store.give_back(key, options, n)

    async def expire(self) -> None:
        """Give back the tokens of leases whose time is up (run it every ``hold_s`` or so)."""
        await self._return_tokens(only_expired=True)

    async def flush(self) -> None:
        """Give back the tokens of every lease (at shutdown)."""
        await self._return_tokens(only_expired=False)

    async def _return_tokens(self, *, only_expired: bool) -> None:
        now = self._now()
        for key, lease in list(self._holding.items()):
            if only_expired and (now < lease.expires or key in self._lines):
                continue  # still drawn from, or a request of the key is asking the store
            await self._turn(key, None)
            del self._holding[key]
            if lease.tokens <= 0.0 or lease.options is None:
                self._serve(key, None)
                continue
            tokens, lease.tokens = lease.tokens, 0.0
            await self._call(key, self.store.give_back(key, lease.options, tokens), _no_refusal)


_Reserve = tuple[Cost, BudgetOptions]
_Decided = tuple[Reservation | None, BudgetDecision]


@dataclass(slots=True, eq=False)
class _BudgetLease:
    """One store reservation that this process's requests draw their own reservations from."""

    #: What the store holds for the lease (after a rebase, what its open requests hold).
    reservation: Reservation
    options: BudgetOptions
    day: int
    #: No draws from this instant on (``-inf`` once stopped).
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
    #: The wall-clock instant the lease's day ends: no draws from then on.
    day_ends: float = 0.0
    #: No new draws; closes once ``open`` is 0.
    retired: bool = False
    #: The store is being told (a rebase is under way): closing waits for it.
    rebasing: bool = False

    def __post_init__(self) -> None:
        self.day_ends = float((self.day + 1) * DAY_SECONDS)

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

    def told(self, used: Cost) -> None:
        """The store has recorded ``used``: it is no longer owed."""
        self.used_calls -= used.calls
        self.used_tokens -= used.tokens
        self.used_cost -= used.cost


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


class LeasedQuotas(_Leased[QuotaStore, _Reserve, _Decided]):
    """A :class:`~tidegate.state.base.QuotaStore` that reserves budget from ``store`` in leases."""

    def _start(self) -> None:
        self._demand: dict[str, _Demand] = {}
        #: The lease each subject draws from now.
        self._current: dict[str, _BudgetLease] = {}
        #: The open reservations drawn from leases, by id: their lease and their own amount.
        self._drawn: dict[str, tuple[_BudgetLease, Cost]] = {}
        #: Retired leases with requests still open (or a close the store did not take), by
        #: subject.
        self._retired: dict[str, list[_BudgetLease]] = {}

    def reserve_now(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> Reservation | None:
        """The reservation (allowed), if the subject's lease holds the estimate now and the
        subject is known within its demand window (the usual case), else None: then
        :meth:`reserve`, which may ask the store. Never refuses or degrades: those are the
        store's."""
        now = self._now()
        demand = self._demand.get(subject)
        if demand is None or now >= demand.window_end:
            return None
        drawn = self._draw(subject, (estimate, options), now)
        if drawn is None:
            return None
        demand.count += 1  # what _seen would count
        return drawn[0]

    async def reserve(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> tuple[Reservation | None, BudgetDecision]:
        now = self._now()
        demand = self._demand.get(subject)
        if demand is not None and now < demand.window_end:
            demand.count += 1  # a known subject within its window: what _seen would do
        else:
            demand = self._seen(self._demand, subject, now, _Demand)
        asks = (estimate, options)
        answer = self._draw(subject, asks, now) or await self._turn(subject, asks)
        if answer is not None:
            return answer
        return await self._call(
            subject,
            self._decide(subject, options, estimate, demand),
            lambda decided: (asks, decided) if decided[0] is None else None,
        )

    def _draw(self, subject: str, asks: _Reserve, now: float) -> _Decided | None:
        """A reservation drawn from the subject's lease if the estimate fits there now (the lease
        takes draws for these options, and the part not yet handed out holds it), else None."""
        lease = self._current.get(subject)
        if lease is None:
            return None
        estimate, options = asks
        amount = lease.reservation.amount
        if not (
            lease.options is options
            and now < lease.expires
            and self._wall() < lease.day_ends
            and estimate.calls <= amount.calls - lease.held_calls - lease.used_calls
            and estimate.tokens <= amount.tokens - lease.held_tokens - lease.used_tokens
            and estimate.cost <= amount.cost - lease.held_cost - lease.used_cost
        ):
            return None
        own = lease.draw(subject, estimate)
        self._drawn[own.id] = (lease, estimate)
        return own, _ALLOWED

    def _answer(
        self, key: str, asks: _Reserve, refusal: tuple[_Reserve, _Decided] | None
    ) -> _Decided | None:
        drawn = self._draw(key, asks, self._now())
        if drawn is None and refusal is not None:
            (estimate, options), blocked = refusal
            if asks[0] == estimate and asks[1] is options:
                return blocked
        return drawn

    async def _undo(self, key: str, asks: _Reserve, answer: _Decided) -> None:
        reservation, _ = answer
        if reservation is not None:  # drawn from the lease: back into it
            with contextlib.suppress(StoreError):
                await self.refund(reservation)

    async def _decide(
        self, subject: str, options: BudgetOptions, estimate: Cost, demand: _Demand
    ) -> tuple[Reservation | None, BudgetDecision]:
        """Ask the store (this request's turn): the current lease retires, then a new lease when
        demand allows and the store allows all of it, else this request on its own."""
        lease = self._current.get(subject)
        if lease is not None:
            await self._retire(subject, lease)
        now = self._now()
        chunk = _quota_share(options, estimate, demand.chunk(self._max_chunk))
        if chunk >= 2 and now >= demand.try_after:
            amount = Cost(
                calls=estimate.calls * chunk,
                tokens=estimate.tokens * chunk,
                cost=estimate.cost * chunk,
            )
            reservation, decision = await self.store.reserve(subject, options, amount)
            if reservation is not None and decision.verdict is BudgetVerdict.ALLOW:
                lease = _BudgetLease(
                    reservation, options, reservation.day, self._now() + self._hold_s
                )
                self._current[subject] = lease
                own = lease.draw(subject, estimate)
                self._drawn[own.id] = (lease, estimate)
                return own, _ALLOWED
            if reservation is not None:  # it would degrade: decide this request on its own
                await self.store.refund(reservation)
            # Near a limit: every request asks the store until the next window.
            demand.try_after = now + self._hold_s
        return await self.store.reserve(subject, options, estimate)

    def settle_now(self, reservation: Reservation, actual: Cost) -> bool:
        """Settle a reservation drawn from the subject's current lease, here (the usual case:
        no store call), and say so; False, with nothing done, when only :meth:`settle` can."""
        drawn = self._drawn.get(reservation.id)
        if drawn is None or drawn[0].retired:
            return False
        # Not retired, so the current lease: a use above the estimate is counted in the very
        # lease that decides the next draws (settle's rule for other leases does not apply).
        del self._drawn[reservation.id]
        drawn[0].give_back(drawn[1], actual)
        return True

    async def settle(self, reservation: Reservation, actual: Cost) -> bool:
        estimate = reservation.amount
        drawn = self._drawn.pop(reservation.id, None)
        if (  # more was used than estimated, on some dimension
            actual.calls > estimate.calls
            or actual.tokens > estimate.tokens
            or actual.cost > estimate.cost
        ):
            # The current lease's room was decided without this use (unless the request was
            # drawn from it, which counts its use): it takes no more draws, so the next request
            # asks the store, which by then knows.
            current = self._current.get(reservation.subject)
            if current is not None and (drawn is None or drawn[0] is not current):
                current.expires = -math.inf
        if drawn is None:
            return await self.store.settle(reservation, actual)
        lease, amount = drawn
        lease.give_back(amount, actual)
        if lease.retired:  # a lease still drawn from stays open
            await self._close_if_done(reservation.subject, lease)
        return True

    async def refund(self, reservation: Reservation) -> bool:
        drawn = self._drawn.pop(reservation.id, None)
        if drawn is None:
            return await self.store.refund(reservation)
        lease, amount = drawn
        lease.give_back(amount, None)
        if lease.retired:
            await self._close_if_done(reservation.subject, lease)
        return True

    async def rebase(
        self, reservation: Reservation, actual: Cost, keep: Cost
    ) -> Reservation | None:
        """As the store's: a reservation drawn from a lease is settled there and ``keep`` drawn
        from the same lease in its place."""
        drawn = self._drawn.pop(reservation.id, None)
        if drawn is None:
            return await self.store.rebase(reservation, actual, keep)
        lease, amount = drawn
        lease.give_back(amount, actual)
        kept = lease.draw(reservation.subject, keep)
        kept = Reservation(id=reservation.id, subject=kept.subject, day=kept.day, amount=keep)
        self._drawn[kept.id] = (lease, keep)
        return kept

    async def usage(self, subject: str) -> Usage:
        """The store's use, with this process's open leases replaced by what they hold and used."""
        usage = await self.store.usage(subject)
        leases = [*self._retired.get(subject, ())]
        if subject in self._current:
            leases.append(self._current[subject])
        for lease in leases:
            if lease.day != usage.day:
                continue
            amount = lease.reservation.amount
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
        await self._retire_all(only_expired=True)

    async def flush(self) -> None:
        """Retire every lease now (at shutdown): each settles once its last request has."""
        await self._retire_all(only_expired=False)

    async def _retire_all(self, *, only_expired: bool) -> None:
        now = self._now()
        for subject, waiting in list(self._retired.items()):
            for lease in list(waiting):  # closes the store could not take before
                await self._close_if_done(subject, lease)
        for subject, lease in list(self._current.items()):
            if only_expired and (now < lease.expires or subject in self._lines):
                continue  # still drawn from, or a request of the subject is asking the store
            await self._turn(subject, None)
            if self._current.get(subject) is not lease:  # retired while this waited
                self._serve(subject, None)
                continue
            await self._call(subject, self._retire(subject, lease), _no_refusal)

    async def _retire(self, subject: str, lease: _BudgetLease) -> None:
        """No more draws from ``lease`` (in the subject's turn); the store is told its use, and
        gets back the room it does not need, in one operation.

        With requests still open, the lease is *rebased*: settled at what was used so far and
        left reserving exactly what its open requests hold, so that the store holds what it
        would without leases. Should the store fail, the lease keeps its whole reservation and
        all its use, and tells the store when its last request ends (it errs toward refusing).
        """
        lease.retired = True
        if self._current.get(subject) is lease:
            del self._current[subject]
        if lease.open == 0:
            await self._close(lease)
            return
        self._retired.setdefault(subject, []).append(lease)
        if lease.day != day_number(self._wall()):
            return  # a past day's reservation no longer counts against anything
        used = lease.used()
        lease.rebasing = True
        try:
            rebased = await self.store.rebase(lease.reservation, used, lease.held())
        except StoreError as exc:
            _log.warning("lease_rebase_failed", subject=subject, error=exc.message)
            rebased = None
        else:
            if rebased is None:  # not open in the store: nothing but a lost row does this
                _log.warning("lease_reservation_lost", subject=subject)
        finally:
            lease.rebasing = False
        if rebased is not None:
            lease.reservation = rebased
            lease.told(used)
        await self._close_if_done(subject, lease)

    async def _close_if_done(self, subject: str, lease: _BudgetLease) -> None:
        if lease.open > 0 or lease.rebasing:
            return
        waiting = self._retired.get(subject)
        if waiting is None or lease not in waiting:
            return  # closed already
        waiting.remove(lease)
        if not waiting:
            del self._retired[subject]
        await self._close(lease)

    async def _close(self, lease: _BudgetLease) -> None:
        """The lease's last request has ended: the store settles it at what is still owed.

        Should the store fail, the lease waits among the retired ones (still counted by
        :meth:`usage`) and the next :meth:`expire` tries again: its use is never dropped.
        """
        try:
            await self.store.settle(lease.reservation, lease.used())
        except StoreError as exc:
            _log.warning(
                "lease_settle_failed", subject=lease.reservation.subject, error=exc.message
            )
            self._retired.setdefault(lease.reservation.subject, []).append(lease)
