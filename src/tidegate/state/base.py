"""Small store protocols for the state the gateway shares, and the values they hold.

One protocol per kind of state, each with the few operations the pipeline needs; every operation
that decides something (claim a key, take a token) is atomic in the store. Stores read time from
an injected :class:`~tidegate.clock.Clock` via ``clock.wall()``: wall time, because the values
outlive the process and may be shared between processes.

Every backend wraps its driver's exceptions into :class:`~tidegate.errors.StoreError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Protocol

from tidegate.policy.budget import BudgetDecision, BudgetOptions, Cost, Reservation, Usage
from tidegate.policy.ratelimit import BucketOptions, TakeResult

# DONE, re-exported: what ``committed()`` answers when nothing is left to wait for.
from tidegate.timers import DONE

__all__ = [
    "DONE",
    "AuditRecord",
    "BucketStore",
    "CacheEntry",
    "CacheStore",
    "Claim",
    "ClaimOutcome",
    "FlagStore",
    "IdempotencyStore",
    "KeyAudit",
    "KeyConflict",
    "KeyRecord",
    "KeyStore",
    "QuotaStore",
    "StoredResponse",
]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished HTTP answer kept for replay: status, the headers worth replaying, the body."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


class ClaimOutcome(StrEnum):
    CLAIMED = "claimed"  # this caller runs the request and must complete() or abandon()
    REPLAY = "replay"  # a finished answer is stored: send it again
    IN_PROGRESS = "in_progress"  # another caller holds the key right now
    MISMATCH = "mismatch"  # the key was used with another request body


@dataclass(frozen=True, slots=True)
class Claim:
    outcome: ClaimOutcome
    token: str = ""
    response: StoredResponse | None = None


class IdempotencyStore(Protocol):
    async def claim(self, key: str, fingerprint: str, *, lease_s: float) -> Claim:
        """Atomically take ``key`` for ``lease_s`` seconds, or say why not."""
        ...

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, ttl_s: float
    ) -> bool:
        """Store the answer under a claim this caller holds; False if the claim was lost."""
        ...

    async def abandon(self, key: str, token: str) -> bool:
        """Give the key up so a retry may run; False if the claim was already gone."""
        ...


@dataclass(frozen=True, slots=True)
class CacheEntry:
    value: bytes
    stored_at: float
    fresh: bool


class CacheStore(Protocol):
    async def get(self, key: str, *, allow_stale: bool = False) -> CacheEntry | None:
        """The entry under ``key``: fresh ones always, stale ones only when asked."""
        ...

    async def put(self, key: str, value: bytes, *, ttl_s: float, stale_ttl_s: float = 0.0) -> None:
        """Keep ``value`` fresh for ``ttl_s`` and, after that, stale for ``stale_ttl_s`` more."""
        ...


@dataclass(frozen=True, slots=True)
class AuditRecord:
    flag: str
    old: Any
    new: Any
    who: str
    why: str
    at: float


class FlagStore(Protocol):
    async def values(self) -> dict[str, Any]:
        """Every flag that was ever set, by name (JSON values)."""
        ...

    async def set(self, flag: str, value: Any, *, who: str, why: str) -> AuditRecord:
        """Change one flag and append its audit record, in one atomic step."""
        ...

    async def history(self, flag: str | None = None, *, limit: int = 100) -> list[AuditRecord]:
        """Audit records, newest first."""
        ...


class BucketStore(Protocol):
    """Token buckets by key; ``take`` is one atomic read-refill-take-write."""

    async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult: ...

    async def give_back(self, key: str, options: BucketOptions, n: float) -> None:
        """Return ``n`` tokens taken but not used, never past the burst (one atomic step)."""
        ...


class QuotaStore(Protocol):
    """Daily budgets by subject, with the open reservations that make settle-once possible."""

    async def reserve(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> tuple[Reservation | None, BudgetDecision]:
        """Decide and hold ``estimate`` atomically; a block holds nothing."""
        ...

    async def settle(self, reservation: Reservation, actual: Cost) -> bool:
        """Turn an open reservation into use; False if it was already settled or refunded."""
        ...

    async def refund(self, reservation: Reservation) -> bool:
        """Drop an open reservation; False if it was already settled or refunded."""
        ...

    async def rebase(
        self, reservation: Reservation, actual: Cost, keep: Cost
    ) -> Reservation | None:
        """Settle an open reservation at ``actual`` and hold ``keep`` under its id instead, in
        one atomic step; None if it was not open. The result is the reservation to close later."""
        ...

    async def usage(self, subject: str) -> Usage:
        """Today's use for ``subject``."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyRecord:
    """One virtual API key as the durable store keeps it: the SHA-256 digest, never the key.

    ``rate_limit`` is ``{"rate_per_s", "burst"}`` and ``budget`` ``{"calls", "tokens",
    "cost_usd"}`` (each optional), both the key's own, on top of (rate limit) or instead of
    (budget) the deployment's per-user ones. Times are Unix seconds. ``previous_sha256`` is the
    digest a rotation replaced, accepted until ``previous_until``. ``revision`` counts the writes:
    :meth:`KeyStore.put` compares and sets it.
    """

    id: str
    sha256: str
    tenant: str
    user: str
    priority: str = "standard"
    data_class: str = "internal"
    models: tuple[str, ...] = ("*",)
    rate_limit: dict[str, float] | None = None
    budget: dict[str, float] | None = None
    expires_at: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    created_by: str = ""
    revoked_at: float | None = None
    revoked_by: str | None = None
    previous_sha256: str | None = None
    previous_until: float | None = None
    revision: int = 0

    def to_json(self) -> dict[str, Any]:
        """The record as plain JSON values."""
        return {name: getattr(self, name) for name in _KEY_FIELDS} | {"models": list(self.models)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KeyRecord:
        """The record :meth:`to_json` wrote (fields a later release added are left out)."""
        known = {name: data[name] for name in _KEY_FIELDS if name in data}
        known["models"] = tuple(known.get("models", ("*",)))
        return cls(**known)


_KEY_FIELDS: Final = tuple(KeyRecord.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class KeyAudit:
    """One change of one key: ``action`` (create, update, rotate, revoke), by whom, why, when,
    and ``detail``: the fields it set (never a key or a digest)."""

    key_id: str
    action: str
    who: str
    why: str
    at: float
    detail: dict[str, Any]


class KeyConflict(Exception):
    """:meth:`KeyStore.put` found another revision than the one expected (0: no such key)."""

    def __init__(self, key_id: str, *, expected: int, current: int) -> None:
        super().__init__(f"key {key_id!r} is at revision {current}, not {expected}")
        self.key_id = key_id
        self.expected = expected
        self.current = current


class KeyStore(Protocol):
    """Virtual API keys and their audit history, in the durable store.

    Every write is one atomic step: the record (compare-and-set on its revision), its audit
    record, the store's change counter and, where the backend has them, a change notice
    (:data:`tidegate.state.keys.KEYS_NOTICE` on the flags' channel).
    """

    async def put(self, record: KeyRecord, *, expected_revision: int, audit: KeyAudit) -> KeyRecord:
        """Write ``record`` if the key is at ``expected_revision`` (0: create a new key), else
        ``KeyConflict``; append ``audit`` (its ``at`` is the store's time). The stored record,
        its ``revision`` moved on by one."""
        ...

    async def get(self, key_id: str) -> KeyRecord | None: ...

    async def all(self) -> list[KeyRecord]:
        """Every key, revoked and expired ones included, by id."""
        ...

    async def version(self) -> int:
        """How many writes the store has seen: a cheap test of whether anything changed."""
        ...

    async def history(self, key_id: str | None = None, *, limit: int = 100) -> list[KeyAudit]:
        """Audit records, newest first."""
        ...
