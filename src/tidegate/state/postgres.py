"""Postgres stores (``postgresql://``): the durable shared state of a fleet.

Every store of a process shares one :class:`PostgresDatabase`: one ``psycopg`` async connection
pool. What must survive a restart and be seen by every replica lives here: idempotency keys and
their answers, flags and their audit history, pending actions, rollout state; buckets, budgets and
the cache can live here too when no Redis is deployed.

Each deciding operation is one statement or one short transaction:

- an idempotency claim is one ``INSERT ... ON CONFLICT DO NOTHING`` (after deleting that key's row if
  it expired): of any number of concurrent claims exactly one inserts;
- a decision on a pending action is one conditional ``UPDATE ... WHERE status = 'pending' AND
  expires_at > now RETURNING``: of any number of concurrent approvals exactly one matches;
- a bucket take or a budget reservation locks its row (``SELECT ... FOR UPDATE``), reads the clock,
  and applies the pure functions of :mod:`tidegate.policy`, so the arithmetic is theirs exactly;
- a rollout write is an ``UPDATE ... WHERE version = expected`` (compare-and-set).

Time comes from the database (``now()`` for a statement, ``clock_timestamp()`` read after a row
lock is granted), so replicas with skewed clocks agree on leases, expiries and midnights. A store
built with ``clock=`` uses ``clock.wall()`` instead; that is for tests.

Schema changes are forward-only :data:`MIGRATIONS`, applied at start-up under a
``pg_advisory_lock`` and recorded in ``schema_migrations``: replicas starting together apply each
one once, and a restart applies nothing twice. Every call is bounded by ``timeout_s`` (a cancelled
statement is cancelled in the server too) and every failure surfaces as
:class:`~tidegate.errors.StoreError` with the driver's exception kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import secrets
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson
import psycopg
from psycopg import sql
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from tidegate.clock import Clock
from tidegate.errors import StoreError
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
from tidegate.state.actions import (
    ActionNotFound,
    ActionStatus,
    PendingAction,
    as_seen_at,
    check_ttl,
    new_action_id,
    refusal,
)
from tidegate.state.base import AuditRecord, CacheEntry, Claim, ClaimOutcome, StoredResponse
from tidegate.state.notify import FlagChangesIteration
from tidegate.state.rollout import RolloutRecord, VersionConflict, check_version

__all__ = [
    "MIGRATIONS",
    "PostgresBucketStore",
    "PostgresCacheStore",
    "PostgresDatabase",
    "PostgresFlagChanges",
    "PostgresFlagStore",
    "PostgresIdempotencyStore",
    "PostgresPendingActionStore",
    "PostgresQuotaStore",
    "PostgresRolloutStore",
]

T = TypeVar("T")
Connection = psycopg.AsyncConnection[TupleRow]

#: Forward-only migrations ``(name, statements)``; the index + 1 is the version each brings. Never
#: edit one that has shipped: add another. Each must work beside the previous release's code, so a
#: rollback is redeploying the previous image.
MIGRATIONS: tuple[tuple[str, str], ...] = (
    (
        "core stores",
        """
        CREATE TABLE idempotency (
            key text PRIMARY KEY, fingerprint text NOT NULL, token text NOT NULL,
            status integer, headers bytea, body bytea, expires_at double precision NOT NULL);
        CREATE TABLE cache (
            key text PRIMARY KEY, value bytea NOT NULL, stored double precision NOT NULL,
            fresh_until double precision NOT NULL, stale_until double precision NOT NULL);
        CREATE INDEX cache_stale_until ON cache (stale_until);
        CREATE TABLE flags (
            name text PRIMARY KEY, value jsonb NOT NULL, updated double precision NOT NULL);
        CREATE TABLE flag_audit (
            id bigserial PRIMARY KEY, flag text NOT NULL, old jsonb, new jsonb NOT NULL,
            who text NOT NULL, why text NOT NULL, at double precision NOT NULL);
        CREATE INDEX flag_audit_flag ON flag_audit (flag, id);
        CREATE TABLE buckets (
            key text PRIMARY KEY, tokens double precision NOT NULL,
            updated double precision NOT NULL);
        CREATE TABLE quotas (
            subject text PRIMARY KEY, day bigint NOT NULL,
            calls bigint NOT NULL DEFAULT 0, tokens bigint NOT NULL DEFAULT 0,
            cost double precision NOT NULL DEFAULT 0,
            reserved_calls bigint NOT NULL DEFAULT 0, reserved_tokens bigint NOT NULL DEFAULT 0,
            reserved_cost double precision NOT NULL DEFAULT 0);
        CREATE TABLE reservations (
            id text PRIMARY KEY, subject text NOT NULL, day bigint NOT NULL);
        CREATE INDEX reservations_subject_day ON reservations (subject, day);
        """,
    ),
    (
        "pending actions and rollout state",
        """
        CREATE TABLE pending_actions (
            id text PRIMARY KEY, kind text NOT NULL, payload jsonb NOT NULL,
            status text NOT NULL, proposed_by text NOT NULL,
            created_at double precision NOT NULL, expires_at double precision NOT NULL,
            decided_by text, decided_at double precision);
        CREATE TABLE rollout_state (
            key text PRIMARY KEY, value jsonb NOT NULL, version bigint NOT NULL,
            updated_at double precision NOT NULL);
        """,
    ),
    (
        "virtual api keys",
        """
        CREATE TABLE api_keys (
            id text PRIMARY KEY, revision bigint NOT NULL, data text NOT NULL);
        CREATE TABLE api_key_audit (
            seq bigserial PRIMARY KEY, key_id text NOT NULL, action text NOT NULL,
            who text NOT NULL, why text NOT NULL, at double precision NOT NULL,
            detail text NOT NULL);
        CREATE INDEX api_key_audit_key ON api_key_audit (key_id, seq);
        """,
    ),
)

_DRIVER_ERRORS = (psycopg.Error, OSError, TimeoutError)

# The database's clock for one statement (the transaction's start), unless a clock is injected.
SQL_NOW = "COALESCE(%(now)s::float8, extract(epoch FROM now())::float8)"

_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def _forget(task: asyncio.Task[Any]) -> None:
    """Retrieve an abandoned task's outcome so that it is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()


def _lock_key(schema: str) -> int:
    """The advisory-lock key that serialises migrations of one schema (a signed 64-bit int)."""
    digest = hashlib.blake2b(f"tidegate migrations {schema}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class PostgresDatabase:
    """One connection pool per process, shared by every Postgres store.

    ``url`` is a libpq URL (``postgresql://user:password@host:port/db``; ``postgres://`` too).
    ``schema`` (or a ``schema`` query parameter) puts every table in that schema, created if
    missing, instead of the connection's default search path. Call :meth:`open` (or use :meth:`connect`) before the first operation.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.5,
        schema: str | None = None,
        min_size: int = 1,
        max_size: int = 10,
        migrations: tuple[tuple[str, str], ...] = MIGRATIONS,
        migrate_timeout_s: float = 60.0,
    ) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        url_schema = query.pop("schema", None)
        schema = schema if schema is not None else url_schema
        if schema is not None and not _SCHEMA_NAME.fullmatch(schema):
            raise ValueError(f"schema must be a lower-case SQL identifier, got {schema!r}")
        #: Where the store is, for messages: never the password.
        self.where = f"postgresql://{parts.hostname}:{parts.port or 5432}{parts.path}"
        self.url = urlunsplit(parts._replace(query=urlencode(query)))
        self.timeout_s = timeout_s
        self.schema = schema
        self.migrations = migrations
        self._migrate_timeout_s = migrate_timeout_s
        # libpq counts connect_timeout in whole seconds, and at least 2.
        self._connect_kwargs: dict[str, Any] = {
            "autocommit": True,
            "connect_timeout": max(2, math.ceil(timeout_s)),
        }
        if schema is not None:
            self._connect_kwargs["options"] = f"-c search_path={schema}"
        self._pool: AsyncConnectionPool[Connection] = AsyncConnectionPool(
            self.url,
            min_size=min_size,
            max_size=max_size,
            kwargs=self._connect_kwargs,
            timeout=timeout_s,
            open=False,
        )

    @classmethod
    async def connect(cls, url: str, **options: Any) -> PostgresDatabase:
        """A database that is open and migrated: ``PostgresDatabase(url, **options)`` + ``open``."""
        db = cls(url, **options)
        try:
            await db.open()
        except BaseException:
            await db.aclose()
            raise
        return db

    def _error(self, what: str, exc: BaseException) -> StoreError:
        if isinstance(exc, TimeoutError):
            detail = f"no answer within {self.timeout_s:g} s"
        else:
            detail = f"{type(exc).__name__}: {exc}"
        return StoreError(f"postgres {self.where}: {what}: {detail}", original=exc)

    async def open(self, *, migrate: bool = True) -> None:
        """Open the pool (waiting for its first connection) and apply pending migrations."""
        try:
            # Reach the server on a connection of our own first: that attempt is cancelled at the
            # timeout, while a pool that cannot connect keeps its workers trying in the background.
            async with asyncio.timeout(self.timeout_s):
                probe = await self._connection()
            await probe.close()
            await self._pool.open(wait=True, timeout=self.timeout_s)
        except _DRIVER_ERRORS as exc:
            await self._pool.close(timeout=self.timeout_s)
            raise self._error("connect", exc) from exc
        if migrate:
            await self.migrate()

    async def _connection(self) -> Connection:
        return await psycopg.AsyncConnection.connect(self.url, **self._connect_kwargs)

    async def migrate(self) -> list[int]:
        """Apply the migrations this schema lacks, under an advisory lock; the versions applied.

        The lock is a session lock on a connection of its own, closed at the end: if this process
        dies half-way, the server drops the lock with the connection, and each applied migration
        was committed with its row in ``schema_migrations``.
        """
        applied: list[int] = []
        key = _lock_key(self.schema or "public")
        try:
            async with asyncio.timeout(self._migrate_timeout_s):
                async with await self._connection() as conn:
                    await conn.execute("SELECT pg_advisory_lock(%s)", (key,))
                    if self.schema is not None:
                        await conn.execute(
                            sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                                sql.Identifier(self.schema)
                            )
                        )
                    await conn.execute(
                        "CREATE TABLE IF NOT EXISTS schema_migrations (version integer PRIMARY KEY,"
                        " name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
                    )
                    cursor = await conn.execute("SELECT version FROM schema_migrations")
                    done = {row[0] for row in await cursor.fetchall()}
                    for version, (name, statements) in enumerate(self.migrations, start=1):
                        if version in done:
                            continue
                        async with conn.transaction():
                            await conn.execute(statements.encode())
                            await conn.execute(
                                "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                                (version, name),
                            )
                        applied.append(version)
        except _DRIVER_ERRORS as exc:
            raise self._error("migrate", exc) from exc
        return applied

    async def applied_migrations(self) -> list[int]:
        """The versions recorded in ``schema_migrations``, in order."""
        rows = await self.fetch("migrations", "SELECT version FROM schema_migrations ORDER BY 1")
        return [row[0] for row in rows]

    @asynccontextmanager
    async def transaction(self, what: str) -> AsyncIterator[Connection]:
        """A pooled connection inside one transaction (no time limit: see :meth:`run`)."""
        try:
            async with self._pool.connection() as conn, conn.transaction():
                yield conn
        except _DRIVER_ERRORS as exc:
            raise self._error(what, exc) from exc

    async def _bounded(self, what: str, work: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``work()`` within ``timeout_s``, returning at the limit even if Postgres never answers.

        Cancelling a query in flight makes psycopg ask the server to cancel it and wait for that
        (seconds, against a stalled server), so the work runs as a task that is cancelled and left
        to finish on its own: the caller gets its ``StoreError`` at the limit.
        """
        task: asyncio.Task[T] = asyncio.get_running_loop().create_task(work())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            task.add_done_callback(_forget)
            raise
        if not done:
            task.cancel()
            task.add_done_callback(_forget)
            raise self._error(what, TimeoutError())
        try:
            return task.result()
        except _DRIVER_ERRORS as exc:
            raise self._error(what, exc) from exc

    async def run(self, what: str, work: Callable[[Connection], Awaitable[T]]) -> T:
        """Run ``work`` in one transaction within the timeout; driver failures as ``StoreError``."""

        async def in_transaction() -> T:
            async with self._pool.connection() as conn, conn.transaction():
                return await work(conn)

        return await self._bounded(what, in_transaction)

    async def _statement(
        self, what: str, query: str, params: dict[str, Any] | tuple[Any, ...]
    ) -> tuple[list[tuple[Any, ...]], int]:
        async def one() -> tuple[list[tuple[Any, ...]], int]:
            async with self._pool.connection() as conn:
                cursor = await conn.execute(query.encode(), params)
                rows = await cursor.fetchall() if cursor.description is not None else []
                return rows, cursor.rowcount

        return await self._bounded(what, one)

    async def fetch(
        self, what: str, query: str, params: dict[str, Any] | tuple[Any, ...] = ()
    ) -> list[tuple[Any, ...]]:
        """The rows of one statement run on its own (autocommit), within the timeout."""
        rows, _ = await self._statement(what, query, params)
        return rows

    async def execute(
        self, what: str, query: str, params: dict[str, Any] | tuple[Any, ...] = ()
    ) -> int:
        """Run one statement on its own (autocommit) within the timeout; the rows it changed."""
        _, count = await self._statement(what, query, params)
        return count

    async def newest(
        self,
        what: str,
        query: str,
        *,
        order: str,
        limit: int,
        match: tuple[str, str] | None = None,
    ) -> list[tuple[Any, ...]]:
        """The first ``limit`` rows of ``query`` by ``order`` descending: of every row, or of
        those whose column ``match[0]`` holds ``match[1]``."""
        if limit <= 0:
            return []
        params: dict[str, Any] = {"limit": limit}
        if match is not None:
            query += f" WHERE {match[0]} = %(match)s"
            params["match"] = match[1]
        return await self.fetch(what, query + f" ORDER BY {order} DESC LIMIT %(limit)s", params)

    @property
    def flags_channel(self) -> str:
        """The ``LISTEN`` channel of flag changes (and key notices) in this schema."""
        return f"tidegate_flags_{self.schema or 'public'}"

    async def ping(self) -> None:
        """Raise ``StoreError`` unless Postgres answers within the timeout."""
        await self.execute("ping", "SELECT 1")

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self._pool.close()

    def __repr__(self) -> str:
        return f"PostgresDatabase({self.where!r}, schema={self.schema!r})"


async def _fetchone(conn: Connection, query: str, params: Any = ()) -> tuple[Any, ...] | None:
    cursor = await conn.execute(query.encode(), params)
    return await cursor.fetchone()


async def _locked_now(conn: Connection, clock: Clock | None) -> float:
    """The deciding instant, read after the row lock was granted (so never before the holder's)."""
    if clock is not None:
        return clock.wall()
    row = await _fetchone(conn, "SELECT extract(epoch FROM clock_timestamp())::float8")
    assert row is not None
    return float(row[0])


def now_param(clock: Clock | None) -> float | None:
    return None if clock is None else clock.wall()


class PostgresIdempotencyStore:
    """Idempotency keys in one table; a claim is one ``INSERT ... ON CONFLICT DO NOTHING``."""

    def __init__(self, db: PostgresDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock

    async def claim(self, key: str, fingerprint: str, *, lease_s: float) -> Claim:
        token = secrets.token_hex(8)
        params = {
            "key": key,
            "fp": fingerprint,
            "token": token,
            "lease": lease_s,
            "now": now_param(self._clock),
        }

        async def work(conn: Connection) -> Claim | None:
            await conn.execute(
                f"DELETE FROM idempotency WHERE key = %(key)s AND expires_at <= {SQL_NOW}".encode(),
                params,
            )
            inserted = await _fetchone(
                conn,
                "INSERT INTO idempotency (key, fingerprint, token, expires_at)"
                f" VALUES (%(key)s, %(fp)s, %(token)s, {SQL_NOW} + %(lease)s)"
                " ON CONFLICT (key) DO NOTHING RETURNING token",
                params,
            )
            if inserted is not None:
                return Claim(ClaimOutcome.CLAIMED, token=token)
            # A new statement sees the row the insert collided with, once its writer committed.
            row = await _fetchone(
                conn,
                "SELECT fingerprint, status, headers, body FROM idempotency WHERE key = %(key)s",
                params,
            )
            if row is None:
                return None  # its holder abandoned it in between: claim again
            held_fp, status, headers, body = row
            if held_fp != fingerprint:
                return Claim(ClaimOutcome.MISMATCH)
            if status is None:
                return Claim(ClaimOutcome.IN_PROGRESS)
            stored = StoredResponse(int(status), bytes(body), orjson.loads(bytes(headers)))
            return Claim(ClaimOutcome.REPLAY, response=stored)

        for _ in range(3):
            claim = await self._db.run("claim", work)
            if claim is not None:
                return claim
        return Claim(ClaimOutcome.IN_PROGRESS)

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, ttl_s: float
    ) -> bool:
        changed = await self._db.execute(
            "complete",
            "UPDATE idempotency SET status = %(status)s, headers = %(headers)s, body = %(body)s,"
            f" expires_at = {SQL_NOW} + %(ttl)s"
            " WHERE key = %(key)s AND token = %(token)s AND status IS NULL"
            f" AND expires_at > {SQL_NOW}",
            {
                "status": response.status,
                "headers": orjson.dumps(response.headers),
                "body": response.body,
                "ttl": ttl_s,
                "key": key,
                "token": token,
                "now": now_param(self._clock),
            },
        )
        return changed == 1

    async def abandon(self, key: str, token: str) -> bool:
        changed = await self._db.execute(
            "abandon",
            "DELETE FROM idempotency WHERE key = %s AND token = %s AND status IS NULL",
            (key, token),
        )
        return changed == 1


class PostgresCacheStore:
    """Cache entries in one table; stale rows are purged a few at a time by later puts.

    Postgres holds a cache only when no Redis is deployed: it works, but every hit is a query.
    """

    def __init__(self, db: PostgresDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock

    async def get(self, key: str, *, allow_stale: bool = False) -> CacheEntry | None:
        rows = await self._db.fetch(
            "cache get",
            f"SELECT value, stored, {SQL_NOW} < fresh_until FROM cache"
            f" WHERE key = %(key)s AND stale_until > {SQL_NOW}",
            {"key": key, "now": now_param(self._clock)},
        )
        row = rows[0] if rows else None
        if row is None or not (row[2] or allow_stale):
            return None
        return CacheEntry(bytes(row[0]), float(row[1]), bool(row[2]))

    async def put(self, key: str, value: bytes, *, ttl_s: float, stale_ttl_s: float = 0.0) -> None:
        params = {
            "key": key,
            "value": value,
            "ttl": ttl_s,
            "stale": stale_ttl_s,
            "now": now_param(self._clock),
        }
        # SKIP LOCKED: two puts never wait on (or deadlock over) each other's purge.
        await self._db.execute(
            "cache purge",
            "DELETE FROM cache WHERE key IN (SELECT key FROM cache"
            f" WHERE stale_until <= {SQL_NOW} LIMIT 100 FOR UPDATE SKIP LOCKED)",
            params,
        )
        await self._db.execute(
            "cache put",
            "INSERT INTO cache (key, value, stored, fresh_until, stale_until)"
            " SELECT %(key)s, %(value)s, n, n + %(ttl)s, n + %(ttl)s + %(stale)s"
            f" FROM (SELECT {SQL_NOW} AS n) AS clock"
            " ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, stored = EXCLUDED.stored,"
            " fresh_until = EXCLUDED.fresh_until, stale_until = EXCLUDED.stale_until",
            params,
        )


class PostgresFlagChanges(FlagChangesIteration):
    """A live subscription to flag changes: ``LISTEN`` on a connection of its own."""

    def __init__(self, db: PostgresDatabase, channel: str) -> None:
        self._db = db
        self._channel = channel
        self._conn: Connection | None = None
        self._pending: deque[str] = deque()

    async def __aenter__(self) -> PostgresFlagChanges:
        try:
            async with asyncio.timeout(self._db.timeout_s):
                conn = await self._db._connection()
                self._conn = conn
                await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        except _DRIVER_ERRORS as exc:
            await self._close()
            raise self._db._error("listen", exc) from exc
        return self

    async def _close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._close()

    async def next(self, timeout_s: float) -> str | None:
        """The next changed flag's name, or None if none changed within ``timeout_s``."""
        if self._conn is None:
            raise RuntimeError("use the subscription inside its 'async with' block")
        if not self._pending:
            try:
                # One packet may carry several notices: keep the ones after the first.
                notices = self._conn.notifies(timeout=timeout_s, stop_after=1)
                self._pending.extend([notice.payload async for notice in notices])
            except _DRIVER_ERRORS as exc:
                raise self._db._error("flag changes", exc) from exc
        return self._pending.popleft() if self._pending else None


class PostgresFlagStore:
    """Flags and their audit history in two tables; each change is one transaction that also
    announces it with ``pg_notify`` (delivered only if the change commits)."""

    def __init__(self, db: PostgresDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock
        #: The ``LISTEN`` channel that carries the name of every changed flag.
        self.channel = db.flags_channel

    async def values(self) -> dict[str, Any]:
        rows = await self._db.fetch("flags", "SELECT name, value FROM flags")
        return dict(rows)

    async def set(self, flag: str, value: Any, *, who: str, why: str) -> AuditRecord:
        params = {
            "flag": flag,
            "value": Jsonb(value),
            "who": who,
            "why": why,
            "channel": self.channel,
            "now": now_param(self._clock),
        }

        async def work(conn: Connection) -> AuditRecord:
            # Writers of flags queue here, so each audit record's old value is the one it replaced;
            # readers are not blocked.
            await conn.execute("LOCK TABLE flags IN SHARE ROW EXCLUSIVE MODE")
            held = await _fetchone(conn, "SELECT value FROM flags WHERE name = %(flag)s", params)
            old = None if held is None else held[0]
            row = await _fetchone(
                conn,
                "INSERT INTO flag_audit (flag, old, new, who, why, at)"
                f" VALUES (%(flag)s, %(old)s, %(value)s, %(who)s, %(why)s, {SQL_NOW}) RETURNING at",
                {**params, "old": None if held is None else Jsonb(old)},
            )
            assert row is not None
            await conn.execute(
                "INSERT INTO flags (name, value, updated) VALUES (%(flag)s, %(value)s, %(at)s)"
                " ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value,"
                " updated = EXCLUDED.updated",
                {**params, "at": row[0]},
            )
            await conn.execute("SELECT pg_notify(%(channel)s, %(flag)s)", params)
            return AuditRecord(flag, old, value, who, why, float(row[0]))

        return await self._db.run("set flag", work)

    async def history(self, flag: str | None = None, *, limit: int = 100) -> list[AuditRecord]:
        rows = await self._db.newest(
            "flag history",
            "SELECT flag, old, new, who, why, at FROM flag_audit",
            order="id",
            limit=limit,
            match=None if flag is None else ("flag", flag),
        )
        return [AuditRecord(*row) for row in rows]

    def watch(self) -> PostgresFlagChanges:
        """Subscribe to flag changes: ``async with store.watch() as changes: ...``."""
        return PostgresFlagChanges(self._db, self.channel)


class PostgresBucketStore:
    """Token buckets in one table; a take locks its row and applies :func:`ratelimit.take`."""

    def __init__(self, db: PostgresDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock

    async def _lock(
        self, conn: Connection, key: str, options: BucketOptions
    ) -> tuple[BucketState, float]:
        """The bucket's state, its row locked until commit, and the time read after the lock."""
        select = "SELECT tokens, updated FROM buckets WHERE key = %s FOR UPDATE"
        row = await _fetchone(conn, select, (key,))
        if row is None:
            # A new key: insert its row (locked by this transaction until commit); a concurrent
            # first take waits for it, then finds it with the select.
            created = await _fetchone(
                conn,
                "INSERT INTO buckets (key, tokens, updated) VALUES (%s, 0, 0)"
                " ON CONFLICT (key) DO NOTHING RETURNING key",
                (key,),
            )
            if created is None:
                row = await _fetchone(conn, select, (key,))
        now = await _locked_now(conn, self._clock)
        return (full_bucket(options, now) if row is None else BucketState(row[0], row[1])), now

    @staticmethod
    async def _store(conn: Connection, key: str, state: BucketState) -> None:
        await conn.execute(
            b"UPDATE buckets SET tokens = %s, updated = %s WHERE key = %s",
            (state.tokens, state.updated, key),
        )

    async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult:
        if not (math.isfinite(n) and n >= 0):
            raise ValueError(f"n must be a finite number >= 0, got {n!r}")

        async def work(conn: Connection) -> TakeResult:
            state, now = await self._lock(conn, key, options)
            new, result = take(state, options, now, n)
            await self._store(conn, key, new)
            return result

        return await self._db.run("take", work)

    async def give_back(self, key: str, options: BucketOptions, n: float) -> None:
        if not (math.isfinite(n) and n >= 0):
            raise ValueError(f"n must be a finite number >= 0, got {n!r}")

        async def work(conn: Connection) -> None:
            state, now = await self._lock(conn, key, options)
            await self._store(conn, key, give_back(state, options, now, n))

        await self._db.run("give back", work)


_USAGE_COLUMNS = "day, calls, tokens, cost, reserved_calls, reserved_tokens, reserved_cost"


def _usage(row: tuple[Any, ...] | None) -> Usage:
    if row is None:
        return Usage(day=0)
    day, calls, tokens, cost, rcalls, rtokens, rcost = row
    return Usage(
        day=day,
        calls=calls,
        tokens=tokens,
        cost=cost,
        reserved_calls=rcalls,
        reserved_tokens=rtokens,
        reserved_cost=rcost,
    )


class PostgresQuotaStore:
    """Daily usage per subject and its open reservations; every change locks the subject's row and
    applies the pure functions of :mod:`tidegate.policy.budget`."""

    def __init__(self, db: PostgresDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock

    @staticmethod
    async def _lock(conn: Connection, subject: str) -> Usage:
        select = f"SELECT {_USAGE_COLUMNS} FROM quotas WHERE subject = %s FOR UPDATE"
        row = await _fetchone(conn, select, (subject,))
        if row is None:
            # Day 0 rolls over to today at once: the same as a subject never seen.
            await conn.execute(
                b"INSERT INTO quotas (subject, day) VALUES (%s, 0) ON CONFLICT DO NOTHING",
                (subject,),
            )
            row = await _fetchone(conn, select, (subject,))
        return _usage(row)

    @staticmethod
    async def _store(conn: Connection, subject: str, usage: Usage) -> None:
        await conn.execute(
            b"UPDATE quotas SET day = %s, calls = %s, tokens = %s, cost = %s, reserved_calls = %s,"
            b" reserved_tokens = %s, reserved_cost = %s WHERE subject = %s",
            (
                usage.day,
                usage.calls,
                usage.tokens,
                usage.cost,
                usage.reserved_calls,
                usage.reserved_tokens,
                usage.reserved_cost,
                subject,
            ),
        )

    async def reserve(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> tuple[Reservation | None, BudgetDecision]:
        rid = new_id()

        async def work(conn: Connection) -> tuple[Reservation | None, BudgetDecision]:
            held = await self._lock(conn, subject)
            now = await _locked_now(conn, self._clock)
            # Reservations of past days can no longer change anything (settle() ignores them).
            await conn.execute(
                b"DELETE FROM reservations WHERE subject = %s AND day < %s",
                (subject, day_number(now)),
            )
            usage, reservation, decision = reserve(
                held, options, now, estimate, subject=subject, reservation_id=rid
            )
            await self._store(conn, subject, usage)
            if reservation is not None:
                await conn.execute(
                    b"INSERT INTO reservations (id, subject, day) VALUES (%s, %s, %s)",
                    (rid, subject, reservation.day),
                )
            return reservation, decision

        return await self._db.run("reserve", work)

    async def _close(
        self, reservation: Reservation, apply: Callable[[Usage], Usage], *, keep: bool = False
    ) -> bool:
        """Apply ``apply`` to the subject's usage if the reservation is open, deleting its row
        (with ``keep``, leaving it open)."""

        async def work(conn: Connection) -> bool:
            # The subject's row first, then the reservation: the order reserve() locks them in.
            held = await self._lock(conn, reservation.subject)
            statement = (
                b"SELECT id FROM reservations WHERE id = %s AND subject = %s FOR UPDATE"
                if keep
                else b"DELETE FROM reservations WHERE id = %s AND subject = %s"
            )
            cursor = await conn.execute(statement, (reservation.id, reservation.subject))
            if cursor.rowcount != 1:
                return False
            now = await _locked_now(conn, self._clock)
            await self._store(conn, reservation.subject, apply(rollover(held, now)))
            return True

        return await self._db.run("close reservation", work)

    async def settle(self, reservation: Reservation, actual: Cost) -> bool:
        return await self._close(reservation, lambda usage: settle(usage, reservation, actual))

    async def refund(self, reservation: Reservation) -> bool:
        return await self._close(reservation, lambda usage: refund(usage, reservation))

    async def rebase(
        self, reservation: Reservation, actual: Cost, keep: Cost
    ) -> Reservation | None:
        # The amount lives in the caller's reservation (the table keeps ids and days only).
        if not await self._close(
            reservation, lambda usage: rebase(usage, reservation, actual, keep), keep=True
        ):
            return None
        return Reservation(
            id=reservation.id, subject=reservation.subject, day=reservation.day, amount=keep
        )

    async def usage(self, subject: str) -> Usage:
        (row,) = await self._db.fetch(
            "usage",
            f"SELECT clock.n, {_USAGE_COLUMNS} FROM (SELECT {SQL_NOW} AS n) AS clock"
            " LEFT JOIN quotas ON subject = %(subject)s",
            {"subject": subject, "now": now_param(self._clock)},
        )
        held = _usage(None if row[1] is None else row[1:])
        return rollover(held, float(row[0]))


_ACTION_COLUMNS = (
    "id, kind, payload, status, proposed_by, created_at, expires_at, decided_by, decided_at"
)


def _action(row: tuple[Any, ...]) -> PendingAction:
    return PendingAction(
        id=row[0],
        kind=row[1],
        payload=row[2],
        status=ActionStatus(row[3]),
        proposed_by=row[4],
        created_at=row[5],
        expires_at=row[6],
        decided_by=row[7],
        decided_at=row[8],
    )


class PostgresPendingActionStore:
    """Pending actions in one table; a decision is one conditional ``UPDATE ... RETURNING``."""

    def __init__(self, db: PostgresDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock

    async def propose(
        self, kind: str, payload: dict[str, Any], *, ttl_s: float, proposed_by: str
    ) -> PendingAction:
        check_ttl(ttl_s)
        (row,) = await self._db.fetch(
            "propose",
            f"INSERT INTO pending_actions ({_ACTION_COLUMNS})"
            " SELECT %(id)s, %(kind)s, %(payload)s, 'pending', %(by)s, n, n + %(ttl)s, NULL, NULL"
            f" FROM (SELECT {SQL_NOW} AS n) AS clock RETURNING {_ACTION_COLUMNS}",
            {
                "id": new_action_id(),
                "kind": kind,
                "payload": Jsonb(payload),
                "by": proposed_by,
                "ttl": ttl_s,
                "now": now_param(self._clock),
            },
        )
        return _action(row)

    async def _decide(self, action_id: str, who: str, status: ActionStatus) -> PendingAction:
        params = {
            "id": action_id,
            "status": status.value,
            "who": who,
            "now": now_param(self._clock),
        }
        rows = await self._db.fetch(
            "decide",
            f"UPDATE pending_actions SET status = %(status)s, decided_by = %(who)s,"
            f" decided_at = {SQL_NOW}"
            f" WHERE id = %(id)s AND status = 'pending' AND expires_at > {SQL_NOW}"
            f" RETURNING {_ACTION_COLUMNS}",
            params,
        )
        if rows:
            return _action(rows[0])
        found, now = await self._read(action_id)
        if found is None:
            raise ActionNotFound(f"no action {action_id}", action_id=action_id)
        raise refusal(found, now)

    async def _read(self, action_id: str) -> tuple[PendingAction | None, float]:
        (row,) = await self._db.fetch(
            "get action",
            f"SELECT clock.n, {_ACTION_COLUMNS} FROM (SELECT {SQL_NOW} AS n) AS clock"
            " LEFT JOIN pending_actions ON id = %(id)s",
            {"id": action_id, "now": now_param(self._clock)},
        )
        now = float(row[0])
        return (None if row[1] is None else _action(row[1:])), now

    async def approve(self, action_id: str, who: str) -> PendingAction:
        return await self._decide(action_id, who, ActionStatus.APPROVED)

    async def reject(self, action_id: str, who: str) -> PendingAction:
        return await self._decide(action_id, who, ActionStatus.REJECTED)

    async def get(self, action_id: str) -> PendingAction | None:
        action, now = await self._read(action_id)
        return None if action is None else as_seen_at(action, now)


class PostgresRolloutStore:
    """Rollout state in one table; a write is one compare-and-set statement on the version."""

    def __init__(self, db: PostgresDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock

    async def get(self, key: str) -> RolloutRecord | None:
        rows = await self._db.fetch(
            "rollout get",
            "SELECT value, version, updated_at FROM rollout_state WHERE key = %s",
            (key,),
        )
        if not rows:
            return None
        value, version, updated_at = rows[0]
        return RolloutRecord(key=key, value=value, version=version, updated_at=updated_at)

    async def put(self, key: str, value: Any, *, expected_version: int) -> RolloutRecord:
        check_version(expected_version)
        params = {
            "key": key,
            "value": Jsonb(value),
            "expected": expected_version,
            "now": now_param(self._clock),
        }
        if expected_version == 0:
            query = (
                "INSERT INTO rollout_state (key, value, version, updated_at)"
                f" VALUES (%(key)s, %(value)s, 1, {SQL_NOW}) ON CONFLICT (key) DO NOTHING"
            )
        else:
            query = (
                "UPDATE rollout_state SET value = %(value)s, version = version + 1,"
                f" updated_at = {SQL_NOW} WHERE key = %(key)s AND version = %(expected)s"
            )
        rows = await self._db.fetch(
            "rollout put", query + " RETURNING value, version, updated_at", params
        )
        if not rows:
            current = await self.get(key)
            raise VersionConflict(
                key, expected=expected_version, current=0 if current is None else current.version
            )
        value, version, updated_at = rows[0]
        return RolloutRecord(key=key, value=value, version=version, updated_at=updated_at)
