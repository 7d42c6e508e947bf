"""Choose the stores by URL: ``store_from_url("redis://...")`` gives every store on one backend.

========================  ===================================================================
``memory://``             in this process only: tests, and one process that needs no durability
``sqlite:///path``        one file (``sqlite:////abs/path``; ``sqlite://`` alone is in memory):
                          the embedded default, shared by the processes of one machine
``redis://...``           a Redis server (``rediss://`` for TLS; ``?prefix=`` sets the key prefix)
``postgresql://...``      a Postgres database (``postgres://`` too; ``?schema=`` picks the schema)
========================  ===================================================================

A fleet splits its state by what each piece needs (see ``docs/state.md``):
``store_from_urls(durable="postgresql://...", fast="redis://...")`` keeps idempotency keys, flags,
pending actions and rollout state in the durable store, and buckets, budgets and the cache in the
fast one.

Redis and Postgres decide time on their own server clock; ``store_clock=False`` makes them use
``clock.wall()`` instead, which only tests should want.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from tidegate.clock import Clock
from tidegate.errors import ConfigError
from tidegate.policy.budget import BudgetOptions, Cost, Reservation
from tidegate.policy.ratelimit import BucketOptions, TakeResult
from tidegate.state.actions import (
    MemoryPendingActionStore,
    PendingActionStore,
    SQLitePendingActionStore,
)
from tidegate.state.base import (
    DONE,
    BucketStore,
    CacheStore,
    FlagStore,
    IdempotencyStore,
    KeyStore,
    QuotaStore,
)
from tidegate.state.keys import MemoryKeyStore, SQLiteKeyStore
from tidegate.state.ledger import LedgerStore, MemoryLedgerStore, SQLiteLedgerStore
from tidegate.state.memory import (
    MemoryBucketStore,
    MemoryCacheStore,
    MemoryFlagStore,
    MemoryIdempotencyStore,
    MemoryQuotaStore,
)
from tidegate.state.rollout import MemoryRolloutStore, RolloutStore, SQLiteRolloutStore
from tidegate.state.sqlite import (
    SQLiteBucketStore,
    SQLiteCacheStore,
    SQLiteDatabase,
    SQLiteFlagStore,
    SQLiteIdempotencyStore,
    SQLiteQuotaStore,
)

if TYPE_CHECKING:
    from tidegate.state.postgres import PostgresDatabase
    from tidegate.state.redis import RedisDatabase

__all__ = ["SCHEMES", "Stores", "redact", "store_from_url", "store_from_urls"]

#: The URL schemes :func:`store_from_url` knows.
SCHEMES = ("memory", "sqlite", "redis", "rediss", "postgresql", "postgres")


def redact(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``: safe for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _nothing() -> Awaitable[None]:
    return DONE


def _no_take(key: str, options: BucketOptions) -> TakeResult | None:
    return None


def _no_reservation(subject: str, options: BudgetOptions, estimate: Cost) -> Reservation | None:
    return None


def _not_settled(reservation: Reservation, actual: Cost) -> bool:
    return False


@dataclass(slots=True, kw_only=True)
class _Backend:
    """Every store on one backend, and how to check and close that backend."""

    url: str
    buckets: BucketStore
    quotas: QuotaStore
    idempotency: IdempotencyStore
    cache: CacheStore
    flags: FlagStore
    actions: PendingActionStore
    rollout: RolloutStore
    ledger: LedgerStore = field(default_factory=MemoryLedgerStore)
    keys: KeyStore = field(default_factory=MemoryKeyStore)
    ping: Callable[[], Awaitable[None]] = _nothing
    close: Callable[[], Awaitable[None]] = _nothing
    batch: Callable[[], AbstractContextManager[None]] = nullcontext
    committed: Callable[[], Awaitable[None]] = _nothing
    redis: RedisDatabase | None = None
    postgres: PostgresDatabase | None = None


def _memory(url: str, clock: Clock) -> _Backend:
    return _Backend(
        url=url,
        buckets=MemoryBucketStore(clock),
        quotas=MemoryQuotaStore(clock),
        idempotency=MemoryIdempotencyStore(clock),
        cache=MemoryCacheStore(clock),
        flags=MemoryFlagStore(clock),
        actions=MemoryPendingActionStore(clock),
        rollout=MemoryRolloutStore(clock),
        keys=MemoryKeyStore(clock),
    )


def _sqlite(url: str, clock: Clock, timeout_s: float) -> _Backend:
    db = SQLiteDatabase.from_url(url, timeout_s=timeout_s)

    async def ping() -> None:
        db.ping()

    async def close() -> None:
        db.close()

    return _Backend(
        url=url,
        buckets=SQLiteBucketStore(db, clock),
        quotas=SQLiteQuotaStore(db, clock),
        idempotency=SQLiteIdempotencyStore(db, clock),
        cache=SQLiteCacheStore(db, clock),
        flags=SQLiteFlagStore(db, clock),
        actions=SQLitePendingActionStore(db, clock),
        rollout=SQLiteRolloutStore(db, clock),
        keys=SQLiteKeyStore(db, clock),
        ledger=SQLiteLedgerStore(db),
        ping=ping,
        close=close,
        batch=db.batch,
        committed=db.committed,
    )


def _redis(url: str, clock: Clock | None, timeout_s: float) -> _Backend:
    # Imported here so that a process without the redis extra can still use the other backends.
    from tidegate.state import redis as r
    from tidegate.state.ledger_remote import RedisLedgerStore
    from tidegate.state.redis_keys import RedisKeyStore

    db = r.RedisDatabase(url, timeout_s=timeout_s)
    return _Backend(
        url=url,
        buckets=r.RedisBucketStore(db, clock),
        quotas=r.RedisQuotaStore(db, clock),
        idempotency=r.RedisIdempotencyStore(db, clock),
        cache=r.RedisCacheStore(db, clock),
        flags=r.RedisFlagStore(db, clock),
        actions=r.RedisPendingActionStore(db, clock),
        rollout=r.RedisRolloutStore(db, clock),
        keys=RedisKeyStore(db, clock),
        ledger=RedisLedgerStore(db),
        ping=db.ping,
        close=db.aclose,
        redis=db,
    )


async def _postgres(url: str, clock: Clock | None, timeout_s: float) -> _Backend:
    from tidegate.state import postgres as p
    from tidegate.state.ledger_remote import PostgresLedgerStore
    from tidegate.state.postgres_keys import PostgresKeyStore

    db = await p.PostgresDatabase.connect(url, timeout_s=timeout_s)
    ledger = PostgresLedgerStore(db)
    try:
        await ledger.open()
    except BaseException:
        await db.aclose()
        raise
    return _Backend(
        url=url,
        buckets=p.PostgresBucketStore(db, clock),
        quotas=p.PostgresQuotaStore(db, clock),
        idempotency=p.PostgresIdempotencyStore(db, clock),
        cache=p.PostgresCacheStore(db, clock),
        flags=p.PostgresFlagStore(db, clock),
        actions=p.PostgresPendingActionStore(db, clock),
        rollout=p.PostgresRolloutStore(db, clock),
        keys=PostgresKeyStore(db, clock),
        ledger=ledger,
        ping=db.ping,
        close=db.aclose,
        postgres=db,
    )


def _scheme(url: str) -> str:
    scheme = urlsplit(url).scheme.lower()
    if scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise ConfigError(f"unknown state store URL {redact(url)!r}: use one of {known}")
    return scheme


async def _open(url: str, *, clock: Clock, timeout_s: float, store_clock: bool) -> _Backend:
    scheme = _scheme(url)
    server_clock = None if store_clock else clock
    try:
        if scheme == "memory":
            return _memory(url, clock)
        if scheme == "sqlite":
            return _sqlite(url, clock, timeout_s)
        if scheme in ("redis", "rediss"):
            return _redis(url, server_clock, timeout_s)
        return await _postgres(url, server_clock, timeout_s)
    except ValueError as exc:  # a malformed URL or option: the drivers say ValueError
        raise ConfigError(f"state store URL {redact(url)!r}: {exc}") from exc


@dataclass(slots=True, kw_only=True, eq=False)
class Stores:
    """Every store the gateway uses, and the backends behind them.

    ``durable`` holds idempotency keys, flags, pending actions and rollout state (what must
    survive a restart); ``fast`` holds buckets, budgets and the cache. Often they are one backend.
    """

    buckets: BucketStore
    quotas: QuotaStore
    idempotency: IdempotencyStore
    cache: CacheStore
    flags: FlagStore
    actions: PendingActionStore
    rollout: RolloutStore
    #: The spend ledger, in the durable backend (:mod:`tidegate.state.ledger`).
    ledger: LedgerStore = field(default_factory=MemoryLedgerStore)
    #: Virtual API keys, in the durable backend (:class:`~tidegate.state.base.KeyStore`).
    keys: KeyStore = field(default_factory=MemoryKeyStore)
    #: The durable backend's URL, with any password redacted.
    durable_url: str
    #: The fast backend's URL, with any password redacted.
    fast_url: str
    #: The shared Redis database, if a backend is Redis: for ``RedisSingleFlight`` and
    #: ``RedisRetryBudgetCounter``.
    redis: RedisDatabase | None = None
    #: The shared Postgres database, if a backend is Postgres.
    postgres: PostgresDatabase | None = None
    _backends: tuple[_Backend, ...] = field(default=(), repr=False)
    #: ``with stores.batch():`` groups the fast store's next calls into one transaction where
    #: the backend can (SQLite). Elsewhere it changes nothing: each call stays atomic on its own.
    batch: Callable[[], AbstractContextManager[None]] = field(
        init=False, repr=False, default=nullcontext
    )
    #: ``await stores.committed()`` waits until the fast store's batches so far are durable
    #: (SQLite commits the batches of one event-loop round together); ``StoreError`` if their
    #: commit failed.
    committed: Callable[[], Awaitable[None]] = field(init=False, repr=False, default=_nothing)
    #: ``stores.take_now(key, options)`` is the take when this process can answer it at once
    #: (from a lease: :meth:`~tidegate.state.leases.LeasedBuckets.take_now`), else None and
    #: only ``await stores.buckets.take(...)`` answers. Without leases it is always None.
    take_now: Callable[[str, BucketOptions], TakeResult | None] = field(
        init=False, repr=False, default=_no_take
    )
    #: ``stores.reserve_now(subject, options, estimate)`` and ``stores.settle_now(reservation,
    #: actual)`` are the same for budgets (:meth:`~tidegate.state.leases.LeasedQuotas.reserve_now`,
    #: ``settle_now``): the reservation or True when a lease answers at once, else None or False
    #: and only ``await stores.quotas...`` answers.
    reserve_now: Callable[[str, BudgetOptions, Cost], Reservation | None] = field(
        init=False, repr=False, default=_no_reservation
    )
    settle_now: Callable[[Reservation, Cost], bool] = field(
        init=False, repr=False, default=_not_settled
    )

    def __post_init__(self) -> None:
        # The fast backend's own functions, bound once: every request calls each twice.
        if self._backends:
            self.batch = self._backends[-1].batch
            self.committed = self._backends[-1].committed

    async def ping_durable(self) -> None:
        """Raise ``StoreError`` unless the durable backend answers: what readiness should reflect.

        The fast backend is left out on purpose: a cache blip must not unready every replica.
        """
        await self._backends[0].ping()

    @property
    def one_backend(self) -> bool:
        """Whether the durable and the fast stores are one backend (so share its batches)."""
        return self._backends[0] is self._backends[-1]

    async def ping(self) -> None:
        """Raise ``StoreError`` unless every backend answers."""
        for backend in self._backends:
            await backend.ping()

    async def aclose(self) -> None:
        """Close every backend (each once), even if closing one of them fails."""
        errors: list[BaseException] = []
        for backend in self._backends:
            try:
                await backend.close()
            except Exception as exc:  # close the others anyway, then report the first
                errors.append(exc)
        if errors:
            raise errors[0]

    async def __aenter__(self) -> Stores:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


async def store_from_urls(
    *,
    durable: str,
    fast: str | None = None,
    clock: Clock,
    timeout_s: float = 0.5,
    store_clock: bool = True,
) -> Stores:
    """Open the stores: idempotency, flags, actions and rollout state in ``durable``; buckets,
    budgets and the cache in ``fast`` (the same backend when ``fast`` is None or equal).

    Raises ``ConfigError`` for a URL no backend knows, ``StoreError`` when a backend cannot be
    reached within ``timeout_s``.
    """
    _scheme(durable)
    if fast is not None:
        _scheme(fast)
    first = await _open(durable, clock=clock, timeout_s=timeout_s, store_clock=store_clock)
    second = first
    if fast is not None and fast != durable:
        try:
            second = await _open(fast, clock=clock, timeout_s=timeout_s, store_clock=store_clock)
        except BaseException:
            await first.close()
            raise
    backends = (first,) if second is first else (first, second)
    return Stores(
        buckets=second.buckets,
        quotas=second.quotas,
        cache=second.cache,
        idempotency=first.idempotency,
        flags=first.flags,
        actions=first.actions,
        rollout=first.rollout,
        ledger=first.ledger,
        keys=first.keys,
        durable_url=redact(first.url),
        fast_url=redact(second.url),
        redis=second.redis or first.redis,
        postgres=first.postgres or second.postgres,
        _backends=backends,
    )


async def store_from_url(
    url: str, *, clock: Clock, timeout_s: float = 0.5, store_clock: bool = True
) -> Stores:
    """Open every store on the backend ``url`` names; see the module docstring for the forms."""
    return await store_from_urls(
        durable=url, clock=clock, timeout_s=timeout_s, store_clock=store_clock
    )
