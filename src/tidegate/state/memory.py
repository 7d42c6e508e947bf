"""In-process stores (``memory://``): for tests and a single process that needs no durability.

Each replica gets its own copy, which is exactly why a fleet needs a shared store: per-process
counters multiply every limit by the replica count.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from tidegate.clock import Clock
from tidegate.ids import new_id
from tidegate.policy.budget import (
    BudgetDecision,
    BudgetOptions,
    Cost,
    Reservation,
    Usage,
    day_number,
    rebase,
    refund,
    reserve,
    rollover,
    settle,
)
from tidegate.policy.ratelimit import (
    BucketOptions,
    BucketState,
    TakeResult,
    full_bucket,
    give_back,
    take,
)
from tidegate.state.base import (
    AuditRecord,
    CacheEntry,
    Claim,
    ClaimOutcome,
    StoredResponse,
)

__all__ = [
    "MemoryBucketStore",
    "MemoryCacheStore",
    "MemoryFlagStore",
    "MemoryIdempotencyStore",
    "MemoryQuotaStore",
]


@dataclass(slots=True)
class _Key:
    fingerprint: str
    token: str
    expires: float
    response: StoredResponse | None = None


class MemoryIdempotencyStore:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._keys: dict[str, _Key] = {}

    async def claim(self, key: str, fingerprint: str, *, lease_s: float) -> Claim:
        now = self._clock.wall()
        held = self._keys.get(key)
        if held is not None and held.expires <= now:
            del self._keys[key]
            held = None
        if held is None:
            token = secrets.token_hex(8)
            self._keys[key] = _Key(fingerprint, token, now + lease_s)
            return Claim(ClaimOutcome.CLAIMED, token=token)
        if held.fingerprint != fingerprint:
            return Claim(ClaimOutcome.MISMATCH)
        if held.response is not None:
            return Claim(ClaimOutcome.REPLAY, response=held.response)
        return Claim(ClaimOutcome.IN_PROGRESS)

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, ttl_s: float
    ) -> bool:
        held = self._keys.get(key)
        if held is None or held.token != token or held.response is not None:
            return False
        held.response = response
        held.expires = self._clock.wall() + ttl_s
        return True

    async def abandon(self, key: str, token: str) -> bool:
        held = self._keys.get(key)
        if held is None or held.token != token or held.response is not None:
            return False
        del self._keys[key]
        return True


class MemoryCacheStore:
    def __init__(self, clock: Clock, *, max_entries: int = 10_000) -> None:
        self._clock = clock
        self._max = max_entries
        self._entries: dict[str, tuple[bytes, float, float, float]] = {}

    async def get(self, key: str, *, allow_stale: bool = False) -> CacheEntry | None:
        found = self._entries.get(key)
        if found is None:
            return None
        value, stored, fresh_until, stale_until = found
        now = self._clock.wall()
        if now >= stale_until:
            del self._entries[key]
            return None
        fresh = now < fresh_until
        if not fresh and not allow_stale:
            return None
        return CacheEntry(value, stored, fresh)

    async def put(self, key: str, value: bytes, *, ttl_s: float, stale_ttl_s: float = 0.0) -> None:
        now = self._clock.wall()
        if len(self._entries) >= self._max and key not in self._entries:
            # Drop the oldest insertion: dicts keep insertion order.
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (value, now, now + ttl_s, now + ttl_s + stale_ttl_s)


class MemoryFlagStore:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._values: dict[str, Any] = {}
        self._audit: list[AuditRecord] = []

    async def values(self) -> dict[str, Any]:
        return dict(self._values)

    async def set(self, flag: str, value: Any, *, who: str, why: str) -> AuditRecord:
        record = AuditRecord(flag, self._values.get(flag), value, who, why, self._clock.wall())
        self._values[flag] = value
        self._audit.append(record)
        return record

    async def history(self, flag: str | None = None, *, limit: int = 100) -> list[AuditRecord]:
        rows = [r for r in reversed(self._audit) if flag is None or r.flag == flag]
        return rows[:limit]


class MemoryBucketStore:
    """Buckets in a dict; the options travel with each call, so one store serves every limit."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._states: dict[str, BucketState] = {}

    async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult:
        now = self._clock.wall()
        state = self._states.get(key) or full_bucket(options, now)
        self._states[key], result = take(state, options, now, n)
        return result

    async def give_back(self, key: str, options: BucketOptions, n: float) -> None:
        now = self._clock.wall()
        state = self._states.get(key) or full_bucket(options, now)
        self._states[key] = give_back(state, options, now, n)


class MemoryQuotaStore:
    """Usage by subject and the open reservations, kept with the pure budget functions."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._usage: dict[str, Usage] = {}
        self._open: dict[str, Reservation] = {}

    async def reserve(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> tuple[Reservation | None, BudgetDecision]:
        now = self._clock.wall()
        current = self._usage.get(subject) or Usage(day=day_number(now))
        usage, reservation, decision = reserve(
            current, options, now, estimate, subject=subject, reservation_id=new_id()
        )
        self._usage[subject] = usage
        if reservation is not None:
            self._open[reservation.id] = reservation
        return reservation, decision

    async def settle(self, reservation: Reservation, actual: Cost) -> bool:
        if self._open.pop(reservation.id, None) is None:
            return False
        self._usage[reservation.subject] = settle(
            self._today(reservation.subject), reservation, actual
        )
        return True

    async def refund(self, reservation: Reservation) -> bool:
        if self._open.pop(reservation.id, None) is None:
            return False
        self._usage[reservation.subject] = refund(self._today(reservation.subject), reservation)
        return True

    async def rebase(
        self, reservation: Reservation, actual: Cost, keep: Cost
    ) -> Reservation | None:
        if reservation.id not in self._open:
            return None
        kept = Reservation(
            id=reservation.id, subject=reservation.subject, day=reservation.day, amount=keep
        )
        self._open[reservation.id] = kept
        subject = reservation.subject
        self._usage[subject] = rebase(self._today(subject), reservation, actual, keep)
        return kept

    def _today(self, subject: str) -> Usage:
        now = self._clock.wall()
        return rollover(self._usage.get(subject) or Usage(day=day_number(now)), now)

    async def usage(self, subject: str) -> Usage:
        return self._today(subject)
