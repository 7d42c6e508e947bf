"""The embedded default (``sqlite:///path``): every store in one SQLite file in WAL mode.

SQLite calls are short and local, so they run inline on the event loop instead of hopping to a
thread (a hop costs more than the statement). Writers serialise on the database's write lock:
``BEGIN IMMEDIATE`` makes each deciding read-modify-write atomic across the processes that share the
file, and ``busy_timeout`` bounds how long one waits before the store reports a ``StoreError``.
"""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import orjson

from tidegate.clock import Clock
from tidegate.errors import StoreError
from tidegate.policy.budget import (
    BudgetDecision,
    BudgetOptions,
    Cost,
    Reservation,
    Usage,
    day_number,
    refund,
    reserve,
    rollover,
    settle,
)
from tidegate.policy.ratelimit import BucketOptions, BucketState, TakeResult, full_bucket, take
from tidegate.state.base import (
    AuditRecord,
    CacheEntry,
    Claim,
    ClaimOutcome,
    StoredResponse,
)

__all__ = [
    "SQLiteBucketStore",
    "SQLiteCacheStore",
    "SQLiteDatabase",
    "SQLiteFlagStore",
    "SQLiteIdempotencyStore",
    "SQLiteQuotaStore",
]

T = TypeVar("T")


def _current_task_id() -> int:
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop: a synchronous caller
        return 0
    return id(task) if task is not None else 0


#: Forward-only migrations; the index + 1 is the schema version it brings.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE idempotency (
        key TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, token TEXT NOT NULL,
        status INTEGER, headers BLOB, body BLOB, expires REAL NOT NULL);
    CREATE TABLE cache (
        key TEXT PRIMARY KEY, value BLOB NOT NULL, stored REAL NOT NULL,
        fresh_until REAL NOT NULL, stale_until REAL NOT NULL);
    CREATE INDEX cache_stale_until ON cache (stale_until);
    CREATE TABLE flags (name TEXT PRIMARY KEY, value BLOB NOT NULL, updated REAL NOT NULL);
    CREATE TABLE flag_audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT, flag TEXT NOT NULL, old BLOB, new BLOB,
        who TEXT NOT NULL, why TEXT NOT NULL, at REAL NOT NULL);
    CREATE TABLE buckets (key TEXT PRIMARY KEY, tokens REAL NOT NULL, updated REAL NOT NULL);
    CREATE TABLE quotas (subject TEXT PRIMARY KEY, usage BLOB NOT NULL);
    CREATE TABLE reservations (
        id TEXT PRIMARY KEY, subject TEXT NOT NULL, day INTEGER NOT NULL, amount BLOB NOT NULL);
    """,
)


class SQLiteDatabase:
    """One connection to one file, shared by every SQLite store of a process."""

    def __init__(self, path: str | Path, *, timeout_s: float = 0.5) -> None:
        self.path = str(path)
        self._batch_owner: int | None = None
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(
                self.path, timeout=timeout_s, isolation_level=None, check_same_thread=False
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
            self._migrate()
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite {self.path}: {exc}", original=exc) from exc

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.5) -> SQLiteDatabase:
        if not url.startswith("sqlite://"):
            raise ValueError(f"not a sqlite URL: {url!r}")
        rest = url[len("sqlite://") :]
        path = rest[1:] if rest.startswith("/") else rest
        return cls(path or ":memory:", timeout_s=timeout_s)

    def _migrate(self) -> None:
        with self.transaction() as conn:
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in filter(str.strip, script.split(";")):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version={number}")

    @property
    def schema_version(self) -> int:
        return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT``: one atomic decision, rolled back on any error."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work`` in one transaction (or in the open batch), wrapping driver errors."""
        try:
            if self._batch_owner is not None:
                self._check_batch_owner()
                return work(self._conn)
            with self.transaction() as conn:
                return work(conn)
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite {self.path}: {exc}", original=exc) from exc

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Run the store calls made inside as one transaction: one lock and one commit.

        The pipeline decides a request's rate limits and budget reservation in one batch, and
        settles in another. Every call inside must complete without yielding to the event loop
        (SQLite calls never do); a call from another task meanwhile is a bug and raises. The
        batch commits on the way out, also when a policy refused (its bucket take stands), and
        rolls back only on a database error.
        """
        if self._batch_owner is not None:
            yield  # already in a batch: join it
            return
        self._batch_owner = _current_task_id()
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self._batch_owner = None
            raise StoreError(f"sqlite {self.path}: {exc}", original=exc) from exc
        try:
            yield
        except (sqlite3.Error, StoreError):
            self._batch_owner = None
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        except BaseException:
            self._batch_owner = None
            conn.execute("COMMIT")
            raise
        self._batch_owner = None
        conn.execute("COMMIT")

    def _check_batch_owner(self) -> None:
        if _current_task_id() != self._batch_owner:
            raise RuntimeError(
                "a SQLite batch was joined from another task: a batch must not yield"
            )

    def ping(self) -> None:
        try:
            self._conn.execute("SELECT 1").fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite {self.path}: {exc}", original=exc) from exc

    def close(self) -> None:
        self._conn.close()


class SQLiteIdempotencyStore:
    def __init__(self, db: SQLiteDatabase, clock: Clock) -> None:
        self._db = db
        self._clock = clock

    async def claim(self, key: str, fingerprint: str, *, lease_s: float) -> Claim:
        now = self._clock.wall()
        token = secrets.token_hex(8)

        def work(conn: sqlite3.Connection) -> Claim:
            conn.execute("DELETE FROM idempotency WHERE key = ? AND expires <= ?", (key, now))
            inserted = conn.execute(
                "INSERT OR IGNORE INTO idempotency (key, fingerprint, token, expires)"
                " VALUES (?, ?, ?, ?)",
                (key, fingerprint, token, now + lease_s),
            ).rowcount
            if inserted == 1:
                return Claim(ClaimOutcome.CLAIMED, token=token)
            held_fp, status, headers, body = conn.execute(
                "SELECT fingerprint, status, headers, body FROM idempotency WHERE key = ?", (key,)
            ).fetchone()
            if held_fp != fingerprint:
                return Claim(ClaimOutcome.MISMATCH)
            if status is None:
                return Claim(ClaimOutcome.IN_PROGRESS)
            stored = StoredResponse(int(status), bytes(body), orjson.loads(headers))
            return Claim(ClaimOutcome.REPLAY, response=stored)

        return self._db.run(work)

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, ttl_s: float
    ) -> bool:
        expires = self._clock.wall() + ttl_s
        headers = orjson.dumps(response.headers)
        return self._db.run(
            lambda conn: (
                conn.execute(
                    "UPDATE idempotency SET status = ?, headers = ?, body = ?, expires = ?"
                    " WHERE key = ? AND token = ? AND status IS NULL",
                    (response.status, headers, response.body, expires, key, token),
                ).rowcount
                == 1
            )
        )

    async def abandon(self, key: str, token: str) -> bool:
        return self._db.run(
            lambda conn: (
                conn.execute(
                    "DELETE FROM idempotency WHERE key = ? AND token = ? AND status IS NULL",
                    (key, token),
                ).rowcount
                == 1
            )
        )


class SQLiteCacheStore:
    def __init__(self, db: SQLiteDatabase, clock: Clock) -> None:
        self._db = db
        self._clock = clock

    async def get(self, key: str, *, allow_stale: bool = False) -> CacheEntry | None:
        now = self._clock.wall()

        def work(conn: sqlite3.Connection) -> CacheEntry | None:
            row = conn.execute(
                "SELECT value, stored, fresh_until FROM cache WHERE key = ? AND stale_until > ?",
                (key, now),
            ).fetchone()
            if row is None:
                return None
            fresh = now < row[2]
            if not fresh and not allow_stale:
                return None
            return CacheEntry(bytes(row[0]), float(row[1]), fresh)

        return self._db.run(work)

    async def put(self, key: str, value: bytes, *, ttl_s: float, stale_ttl_s: float = 0.0) -> None:
        now = self._clock.wall()

        def work(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM cache WHERE stale_until <= ?", (now,))
            conn.execute(
                "INSERT OR REPLACE INTO cache (key, value, stored, fresh_until, stale_until)"
                " VALUES (?, ?, ?, ?, ?)",
                (key, value, now, now + ttl_s, now + ttl_s + stale_ttl_s),
            )

        self._db.run(work)


def _load(blob: bytes | None) -> Any:
    return None if blob is None else orjson.loads(blob)


class SQLiteFlagStore:
    def __init__(self, db: SQLiteDatabase, clock: Clock) -> None:
        self._db = db
        self._clock = clock

    async def values(self) -> dict[str, Any]:
        rows = self._db.run(lambda conn: conn.execute("SELECT name, value FROM flags").fetchall())
        return {name: orjson.loads(value) for name, value in rows}

    async def set(self, flag: str, value: Any, *, who: str, why: str) -> AuditRecord:
        now = self._clock.wall()
        new = orjson.dumps(value)

        def work(conn: sqlite3.Connection) -> AuditRecord:
            row = conn.execute("SELECT value FROM flags WHERE name = ?", (flag,)).fetchone()
            old = None if row is None else row[0]
            conn.execute(
                "INSERT OR REPLACE INTO flags (name, value, updated) VALUES (?, ?, ?)",
                (flag, new, now),
            )
            conn.execute(
                "INSERT INTO flag_audit (flag, old, new, who, why, at) VALUES (?, ?, ?, ?, ?, ?)",
                (flag, old, new, who, why, now),
            )
            return AuditRecord(flag, _load(old), value, who, why, now)

        return self._db.run(work)

    async def history(self, flag: str | None = None, *, limit: int = 100) -> list[AuditRecord]:
        query = "SELECT flag, old, new, who, why, at FROM flag_audit"
        params: tuple[Any, ...] = ()
        if flag is not None:
            query += " WHERE flag = ?"
            params = (flag,)
        query += " ORDER BY id DESC LIMIT ?"
        rows = self._db.run(lambda conn: conn.execute(query, (*params, limit)).fetchall())
        return [AuditRecord(f, _load(o), _load(n), w, y, a) for f, o, n, w, y, a in rows]


class SQLiteBucketStore:
    def __init__(self, db: SQLiteDatabase, clock: Clock) -> None:
        self._db = db
        self._clock = clock

    async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult:
        now = self._clock.wall()

        def work(conn: sqlite3.Connection) -> TakeResult:
            row = conn.execute(
                "SELECT tokens, updated FROM buckets WHERE key = ?", (key,)
            ).fetchone()
            state = full_bucket(options, now) if row is None else BucketState(row[0], row[1])
            new, result = take(state, options, now, n)
            conn.execute(
                "INSERT OR REPLACE INTO buckets (key, tokens, updated) VALUES (?, ?, ?)",
                (key, new.tokens, new.updated),
            )
            return result

        return self._db.run(work)


def _usage_from(blob: bytes) -> Usage:
    return Usage(**orjson.loads(blob))


def _usage_blob(usage: Usage) -> bytes:
    return orjson.dumps(usage)  # orjson writes dataclasses natively (and ~8x faster than asdict)


def _cost_blob(cost: Cost) -> bytes:
    return orjson.dumps(cost)


class SQLiteQuotaStore:
    def __init__(self, db: SQLiteDatabase, clock: Clock) -> None:
        self._db = db
        self._clock = clock
        self._swept_day = -1

    @staticmethod
    def _load(conn: sqlite3.Connection, subject: str, now: float) -> Usage:
        row = conn.execute("SELECT usage FROM quotas WHERE subject = ?", (subject,)).fetchone()
        usage = Usage(day=day_number(now)) if row is None else _usage_from(row[0])
        return rollover(usage, now)

    @staticmethod
    def _store(conn: sqlite3.Connection, subject: str, usage: Usage) -> None:
        conn.execute(
            "INSERT OR REPLACE INTO quotas (subject, usage) VALUES (?, ?)",
            (subject, _usage_blob(usage)),
        )

    async def reserve(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> tuple[Reservation | None, BudgetDecision]:
        now = self._clock.wall()
        rid = secrets.token_hex(8)

        def work(conn: sqlite3.Connection) -> tuple[Reservation | None, BudgetDecision]:
            today = day_number(now)
            if today != self._swept_day:
                # Reservations of past days can no longer change anything (settle() ignores
                # them); sweeping them once a day per process keeps the table small.
                conn.execute("DELETE FROM reservations WHERE day < ?", (today,))
                self._swept_day = today
            usage, reservation, decision = reserve(
                self._load(conn, subject, now),
                options,
                now,
                estimate,
                subject=subject,
                reservation_id=rid,
            )
            self._store(conn, subject, usage)
            if reservation is not None:
                conn.execute(
                    "INSERT INTO reservations (id, subject, day, amount) VALUES (?, ?, ?, ?)",
                    (rid, subject, reservation.day, _cost_blob(estimate)),
                )
            return reservation, decision

        return self._db.run(work)

    def _close(self, reservation: Reservation, apply: Callable[[Usage], Usage]) -> bool:
        now = self._clock.wall()

        def work(conn: sqlite3.Connection) -> bool:
            gone = conn.execute("DELETE FROM reservations WHERE id = ?", (reservation.id,)).rowcount
            if gone != 1:
                return False
            usage = self._load(conn, reservation.subject, now)
            self._store(conn, reservation.subject, apply(usage))
            return True

        return self._db.run(work)

    async def settle(self, reservation: Reservation, actual: Cost) -> bool:
        return self._close(reservation, lambda usage: settle(usage, reservation, actual))

    async def refund(self, reservation: Reservation) -> bool:
        return self._close(reservation, lambda usage: refund(usage, reservation))

    async def usage(self, subject: str) -> Usage:
        now = self._clock.wall()
        return self._db.run(lambda conn: self._load(conn, subject, now))
