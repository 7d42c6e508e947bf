"""The embedded default (``sqlite:///path``): every store in one SQLite file in WAL mode.

SQLite calls are short and local, so they run inline on the event loop instead of hopping to a
thread (a hop costs more than the statement). Writers serialise on the database's write lock:
``BEGIN IMMEDIATE`` makes each deciding read-modify-write atomic across the processes that share the
file, and ``busy_timeout`` bounds how long one waits before the store reports a ``StoreError``.

On an event loop the batches of one round of callbacks share a transaction and its commit (see
:class:`SQLiteDatabase`), and the bucket and quota stores keep a row cache that holds only while
no other connection has committed (see :class:`SQLiteBucketStore`); ``docs/state.md`` explains
both.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sqlite3
from asyncio import current_task
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from functools import partial
from pathlib import Path
from threading import get_ident
from types import TracebackType
from typing import Any, TypeVar

import orjson
import structlog

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
from tidegate.state.base import (
    DONE,
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

_log = structlog.get_logger("tidegate")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _CurrentTask:
    """The current task (None outside any task), for the batch owner checks.

    ``asyncio.current_task()`` first finds the running loop, which costs a ``getpid`` system call
    (the check that no fork happened); two batches a request made that show. The loop found last
    is remembered with its thread. On that thread, a task current in that loop is the task
    running now: a task runs on its loop's thread, and a thread runs one loop at a time. Any
    other case (no task current there: a callback, no loop, another loop) looks the loop up.
    """

    __slots__ = ("_loop", "_thread")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0  # no thread's id: the first call looks the loop up

    def __call__(self) -> asyncio.Task[Any] | None:
        if self._thread == get_ident():
            task = current_task(self._loop)
            if task is not None:
                return task
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no running loop: a synchronous caller
            return None
        self._loop, self._thread = loop, get_ident()
        return current_task(loop)


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
    # The tables every request writes, keyed by their text key alone (WITHOUT ROWID): one b-tree
    # each instead of a rowid table plus a key index, so a commit writes half the pages.
    """
    CREATE TABLE buckets_2 (
        key TEXT PRIMARY KEY, tokens REAL NOT NULL, updated REAL NOT NULL) WITHOUT ROWID;
    INSERT INTO buckets_2 (key, tokens, updated) SELECT key, tokens, updated FROM buckets;
    DROP TABLE buckets;
    ALTER TABLE buckets_2 RENAME TO buckets;
    CREATE TABLE quotas_2 (subject TEXT PRIMARY KEY, usage BLOB NOT NULL) WITHOUT ROWID;
    INSERT INTO quotas_2 (subject, usage) SELECT subject, usage FROM quotas;
    DROP TABLE quotas;
    ALTER TABLE quotas_2 RENAME TO quotas;
    CREATE TABLE reservations_2 (
        id TEXT PRIMARY KEY, subject TEXT NOT NULL, day INTEGER NOT NULL, amount BLOB NOT NULL)
        WITHOUT ROWID;
    INSERT INTO reservations_2 (id, subject, day, amount)
        SELECT id, subject, day, amount FROM reservations;
    DROP TABLE reservations;
    ALTER TABLE reservations_2 RENAME TO reservations;
    """,
)


class _Batch:
    """:attr:`SQLiteDatabase.batch`: a plain class, cheaper than a generator context manager.

    The transaction begins with the batch's first statement: a batch whose calls were all
    answered without the database (from a lease, say) costs no transaction at all. A batch
    started inside another one joins it: only the outer batch is the database's open batch, and
    only its way out ends the batch (a joined batch keeps no state of its own).
    """

    # No __slots__: ``_begun`` starts as the class's False, so a batch that runs no statement
    # never sets it.
    _begun = False
    #: The task of the batch's first statement; only it may run more statements in it. It is
    #: looked up then, not when the batch opens: a batch answered from leases runs none, and
    #: the lookup was a third of what such a batch cost (``benchmarks/opcodes.py``).
    owner: asyncio.Task[Any] | None

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    def __enter__(self) -> None:
        db = self._db
        if db._open_batch is not None:
            return  # already in a batch: join it
        db._open_batch = self

    def begin(self, owner: asyncio.Task[Any] | None) -> None:
        """Begin (or join) the transaction, before the batch's first statement (``owner``'s)."""
        self._joined = self._db._begin_batch()
        self.owner = owner
        self._begun = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        db = self._db
        if db._open_batch is not self:
            return  # a joined batch: the outer one ends it
        db._open_batch = None
        if not self._begun:
            return
        failed = exc_type is not None and issubclass(exc_type, (sqlite3.Error, StoreError))
        try:
            db._end_batch(joined=self._joined, failed=failed)
        except sqlite3.Error as error:
            raise StoreError(f"sqlite {db.path}: {error}", original=error) from error


class SQLiteDatabase:
    """One connection to one file, shared by every SQLite store of a process.

    Group commit: a batch run on an event loop does not commit on its way out. It leaves the
    write transaction open until the loop's next round of callbacks, so that the batches of every
    request handled in this round share one ``BEGIN IMMEDIATE`` ... ``COMMIT`` (and each page
    they change is written to the WAL once instead of once per request). A batch that starts
    while such a transaction is open joins it. Right after its batch (without yielding first) the
    caller awaits :meth:`committed`, and acts on what the batch decided only when that returns: a
    decision takes effect once it is durable. A failed commit, or a database error in any batch
    of the round (which rolls the whole transaction back), reaches every batch that was in it as
    a ``StoreError``. A call outside a batch first commits the open transaction, then runs in one
    of its own, as before; so does a batch with no running event loop.
    """

    def __init__(self, path: str | Path, *, timeout_s: float = 0.5) -> None:
        self.path = str(path)
        #: How long a statement waits for another connection's write lock.
        self.timeout_s = timeout_s
        #: ``with db.batch():`` runs the store calls made inside as one transaction: one lock
        #: and one commit. The pipeline decides a request's rate limits and budget reservation
        #: in one batch, and settles in another. Every call inside must complete without
        #: yielding to the event loop (SQLite calls never do); a call from another task
        #: meanwhile is a bug and raises. The batch's writes stand on the way out, also when a
        #: policy refused (its bucket take stands), and are undone only on a database error.
        #: On an event loop they are committed with the other batches of the same round (see
        #: the class docstring): await :meth:`committed`. (A bound factory rather than a
        #: method: every request opens two batches.)
        self.batch: Callable[[], AbstractContextManager[None]] = partial(_Batch, self)
        self._current_task = _CurrentTask()
        #: The batch open now, whose transaction begins with its first statement.
        self._open_batch: _Batch | None = None
        #: The thread whose event loop commits the open group transaction (None: none open).
        self._group_thread: int | None = None
        #: That thread's loop, whose next round commits it.
        self._group_loop: asyncio.AbstractEventLoop | None = None
        #: Resolved when the open group transaction commits (or fails).
        self._group_waiters: list[asyncio.Future[None]] = []
        #: The stores' row caches hold for this epoch only. It moves on when a write transaction
        #: finds that another connection committed since ours (``PRAGMA data_version``), and
        #: whenever this connection rolls back or a statement fails.
        self.rows_epoch = 0
        self._data_version: int | None = None
        self._group_batches = 0
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
        #: The file this connection opened, to tell at :meth:`ping` whether it is still the one
        #: at ``path`` (and not moved away, deleted or replaced).
        self._file = self._identity()

    def _identity(self) -> tuple[int, int] | None:
        if self.path == ":memory:":
            return None
        try:
            found = os.stat(self.path)
        except OSError:
            return None
        return found.st_dev, found.st_ino

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
        """``BEGIN IMMEDIATE`` ... ``COMMIT``: one atomic decision, rolled back on any error.

        An open group transaction is committed first.
        """
        conn = self._conn
        if self._group_thread is not None:
            self._commit_group()
        conn.execute("BEGIN IMMEDIATE")
        try:
            self._began()
            yield conn
        except BaseException:
            self.rows_epoch += 1
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _began(self) -> None:
        """Right after ``BEGIN IMMEDIATE`` (the write lock is ours): whether anyone else has
        committed since our last transaction decides whether the row caches still hold."""
        (version,) = self._conn.execute("PRAGMA data_version").fetchone()
        if version != self._data_version:
            self._data_version = version
            self.rows_epoch += 1

    def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work`` in one transaction (or in the open batch), wrapping driver errors."""
        try:
            batch = self._open_batch
            if batch is not None:
                task = self._current_task()
                if not batch._begun:
                    batch.begin(task)
                elif task is not batch.owner:
                    raise RuntimeError(
                        "a SQLite batch was joined from another task: a batch must not yield"
                    )
                return work(self._conn)
            with self.transaction() as conn:
                return work(conn)
        except sqlite3.Error as exc:
            self.rows_epoch += 1  # whatever the failed statement left, read the rows again
            raise StoreError(f"sqlite {self.path}: {exc}", original=exc) from exc

    def committed(self) -> Awaitable[None]:
        """Await it until the batches run so far are committed; ``StoreError`` if that failed."""
        thread = self._group_thread
        if thread is None or thread != get_ident():
            return DONE  # nothing open here: every batch so far committed on its way out
        loop = _running_loop()
        if loop is None or loop is not self._group_loop:
            self._commit_group()  # opened under a loop that is gone: commit it now
            return DONE
        # A future per waiter: a waiter cancelled while it waits cancels only its own.
        waiter: asyncio.Future[None] = loop.create_future()
        self._group_waiters.append(waiter)
        return waiter

    def _begin_batch(self) -> bool:
        """Open a batch; True when it joined the open group transaction."""
        if self._group_thread is not None:
            if self._group_loop is _running_loop():
                return True
            # Opened under a loop of this thread that is no longer running (its round never
            # came): nobody else will commit it.
            self._commit_group()
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            self._began()
        except sqlite3.Error:
            with suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            raise
        return False

    def _end_batch(self, *, joined: bool, failed: bool) -> None:
        if failed:
            # Undo the transaction: this batch, and any batch of this round that joined it
            # before (each of those is waiting in committed() and learns of it there).
            self.rows_epoch += 1
            with suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            self._fail_group(StoreError(f"sqlite {self.path}: a batch of this round failed"))
            return
        if joined:
            self._group_batches += 1
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a synchronous caller: commit now
            self._conn.execute("COMMIT")
            return
        self._group_thread = get_ident()
        self._group_loop = loop
        self._group_batches = 1
        loop.call_soon(self._commit_group)

    def _commit_group(self) -> None:
        """Commit the open group transaction and tell everyone waiting for it."""
        if self._group_thread is None:
            return
        try:
            self._conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self.rows_epoch += 1
            with suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            _log.warning(
                "sqlite_commit_failed", path=self.path, batches=self._group_batches, error=str(exc)
            )
            self._fail_group(StoreError(f"sqlite {self.path}: commit failed: {exc}", original=exc))
            return
        waiters, self._group_waiters = self._group_waiters, []
        self._group_thread = self._group_loop = None
        self._group_batches = 0
        # Every waiter was made on the group's loop (see committed): one check for all of them.
        if waiters and not waiters[0].get_loop().is_closed():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _fail_group(self, error: StoreError) -> None:
        waiters, self._group_waiters = self._group_waiters, []
        self._group_thread = self._group_loop = None
        self._group_batches = 0
        if waiters and not waiters[0].get_loop().is_closed():  # one loop, as in _commit_group
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(StoreError(error.message, original=error.original))

    def ping(self) -> None:
        """Raise ``StoreError`` unless a request could write now (readiness): the file at
        ``path`` is still the one open here, and the write lock is had within the timeout (an
        empty ``BEGIN IMMEDIATE`` ... ``COMMIT``). A read alone succeeds while another process
        holds the write lock, or after the file was moved away, when every request fails."""
        if self._file is not None and self._identity() != self._file:
            raise StoreError(
                f"sqlite {self.path}: the database file was moved, deleted or replaced"
                " since this process opened it"
            )
        try:
            with self.transaction():
                pass
        except sqlite3.Error as exc:
            self.rows_epoch += 1
            raise StoreError(f"sqlite {self.path}: {exc}", original=exc) from exc

    def close(self) -> None:
        if self._group_thread is not None:
            self._commit_group()
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


#: How many rows a store's row cache holds (then it starts over).
ROW_CACHE_MAX = 10_000


class SQLiteBucketStore:
    """Token buckets, one row each.

    Row cache: the store remembers each bucket state it read or wrote, with the database's
    ``rows_epoch``. A take inside a write transaction of the same epoch (no other connection has
    committed since, and nothing was rolled back) starts from the remembered state instead of
    reading the row: it is the row's value, so the decision is the same.
    """

    def __init__(self, db: SQLiteDatabase, clock: Clock) -> None:
        self._db = db
        self._clock = clock
        self._known: dict[str, tuple[int, float, float]] = {}

    def _load(
        self, conn: sqlite3.Connection, key: str, options: BucketOptions, now: float
    ) -> BucketState:
        known = self._known.get(key)
        if known is not None and known[0] == self._db.rows_epoch:
            return BucketState(known[1], known[2])
        row = conn.execute("SELECT tokens, updated FROM buckets WHERE key = ?", (key,)).fetchone()
        return full_bucket(options, now) if row is None else BucketState(row[0], row[1])

    def _store(self, conn: sqlite3.Connection, key: str, state: BucketState) -> None:
        conn.execute(
            "INSERT OR REPLACE INTO buckets (key, tokens, updated) VALUES (?, ?, ?)",
            (key, state.tokens, state.updated),
        )
        _remember(self._known, key, (self._db.rows_epoch, state.tokens, state.updated))

    async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult:
        now = self._clock.wall()

        def work(conn: sqlite3.Connection) -> TakeResult:
            new, result = take(self._load(conn, key, options, now), options, now, n)
            self._store(conn, key, new)
            return result

        return self._db.run(work)

    async def give_back(self, key: str, options: BucketOptions, n: float) -> None:
        now = self._clock.wall()

        def work(conn: sqlite3.Connection) -> None:
            self._store(conn, key, give_back(self._load(conn, key, options, now), options, now, n))

        self._db.run(work)


def _remember(cache: dict[str, Any], key: str, value: Any) -> None:
    if len(cache) >= ROW_CACHE_MAX and key not in cache:
        cache.clear()
    cache[key] = value


def _usage_from(blob: bytes) -> Usage:
    return Usage(**orjson.loads(blob))


def _usage_blob(usage: Usage) -> bytes:
    return orjson.dumps(usage)  # orjson writes dataclasses natively (and ~8x faster than asdict)


def _cost_blob(cost: Cost) -> bytes:
    return orjson.dumps(cost)


class SQLiteQuotaStore:
    """Daily usage per subject (a JSON blob) and the open reservations.

    Row cache: as :class:`SQLiteBucketStore` does with bucket states, the store remembers each
    subject's usage it read or wrote, with the database's ``rows_epoch``, and within the same
    epoch uses it instead of reading and decoding the row again.
    """

    def __init__(self, db: SQLiteDatabase, clock: Clock) -> None:
        self._db = db
        self._clock = clock
        self._swept_day = -1
        self._known: dict[str, tuple[int, Usage]] = {}

    def _load(self, conn: sqlite3.Connection, subject: str, now: float) -> Usage:
        epoch = self._db.rows_epoch
        known = self._known.get(subject)
        if known is not None and known[0] == epoch:
            usage = known[1]
        else:
            row = conn.execute("SELECT usage FROM quotas WHERE subject = ?", (subject,)).fetchone()
            if row is None:
                usage = Usage(day=day_number(now))
            else:
                usage = _usage_from(row[0])
                _remember(self._known, subject, (epoch, usage))
        return rollover(usage, now)

    def _store(self, conn: sqlite3.Connection, subject: str, usage: Usage) -> None:
        conn.execute(
            "INSERT OR REPLACE INTO quotas (subject, usage) VALUES (?, ?)",
            (subject, _usage_blob(usage)),
        )
        _remember(self._known, subject, (self._db.rows_epoch, usage))

    async def reserve(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> tuple[Reservation | None, BudgetDecision]:
        now = self._clock.wall()
        rid = new_id()

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

    def _close(
        self, reservation: Reservation, apply: Callable[[Usage], Usage], keep: Cost | None = None
    ) -> bool:
        """Apply ``apply`` to the subject's usage if the reservation is open, deleting its row
        (or, with ``keep``, leaving it open for that amount)."""
        now = self._clock.wall()

        def work(conn: sqlite3.Connection) -> bool:
            if keep is None:
                changed = conn.execute("DELETE FROM reservations WHERE id = ?", (reservation.id,))
            else:
                changed = conn.execute(
                    "UPDATE reservations SET amount = ? WHERE id = ?",
                    (_cost_blob(keep), reservation.id),
                )
            if changed.rowcount != 1:
                return False
            usage = self._load(conn, reservation.subject, now)
            self._store(conn, reservation.subject, apply(usage))
            return True

        return self._db.run(work)

    async def settle(self, reservation: Reservation, actual: Cost) -> bool:
        return self._close(reservation, lambda usage: settle(usage, reservation, actual))

    async def refund(self, reservation: Reservation) -> bool:
        return self._close(reservation, lambda usage: refund(usage, reservation))

    async def rebase(
        self, reservation: Reservation, actual: Cost, keep: Cost
    ) -> Reservation | None:
        if not self._close(reservation, lambda u: rebase(u, reservation, actual, keep), keep):
            return None
        return Reservation(
            id=reservation.id, subject=reservation.subject, day=reservation.day, amount=keep
        )

    async def usage(self, subject: str) -> Usage:
        now = self._clock.wall()
        return self._db.run(lambda conn: self._load(conn, subject, now))
