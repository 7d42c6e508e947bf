from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tidegate.clock import ManualClock
from tidegate.errors import StoreError
from tidegate.state.base import ClaimOutcome, StoredResponse
from tidegate.state.sqlite import MIGRATIONS, SQLiteDatabase, SQLiteIdempotencyStore


@pytest.mark.asyncio
async def test_state_survives_a_restart(tmp_path: Path) -> None:
    """A completed key written by one process is replayed by the next one on the same file."""
    clock = ManualClock()
    db = SQLiteDatabase(tmp_path / "s.db")
    store = SQLiteIdempotencyStore(db, clock)
    claim = await store.claim("k", "fp", lease_s=30)
    await store.complete("k", claim.token, StoredResponse(200, b"x"), ttl_s=60)
    db.close()
    reopened = SQLiteIdempotencyStore(SQLiteDatabase(tmp_path / "s.db"), clock)
    assert (await reopened.claim("k", "fp", lease_s=30)).outcome is ClaimOutcome.REPLAY


def test_migrations_apply_once(tmp_path: Path) -> None:
    """Opening an existing file applies no migration twice and records the schema version."""
    first = SQLiteDatabase(tmp_path / "s.db")
    assert first.schema_version == len(MIGRATIONS)
    first.close()
    second = SQLiteDatabase(tmp_path / "s.db")
    assert second.schema_version == len(MIGRATIONS)
    second.close()


def test_url_forms(tmp_path: Path) -> None:
    """sqlite:///relative and sqlite:////absolute name files; sqlite:// alone is in memory."""
    absolute = SQLiteDatabase.from_url(f"sqlite:///{tmp_path}/a.db")
    assert absolute.path == f"{tmp_path}/a.db"
    absolute.close()
    assert SQLiteDatabase.from_url("sqlite://").path == ":memory:"
    with pytest.raises(ValueError):
        SQLiteDatabase.from_url("redis://localhost")


def test_driver_errors_become_store_errors(tmp_path: Path) -> None:
    """A failing statement surfaces as StoreError with the driver's exception kept."""
    db = SQLiteDatabase(tmp_path / "s.db")

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("SELECT * FROM no_such_table")

    with pytest.raises(StoreError) as caught:
        db.run(broken)
    assert isinstance(caught.value.original, sqlite3.OperationalError)
    db.close()
    with pytest.raises(StoreError):
        db.ping()


def test_unopenable_file_is_a_store_error(tmp_path: Path) -> None:
    """A path that cannot be a database is reported as StoreError at start-up."""
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(StoreError):
        SQLiteDatabase(tmp_path / "dir.db")


@pytest.mark.asyncio
async def test_a_batch_is_one_transaction_that_keeps_refused_takes(tmp_path: Path) -> None:
    """Calls inside batch() commit together, also when a policy refusal leaves the block."""
    from tidegate.policy.ratelimit import BucketOptions
    from tidegate.state.sqlite import SQLiteBucketStore

    db = SQLiteDatabase(tmp_path / "s.db")
    buckets = SQLiteBucketStore(db, ManualClock())
    options = BucketOptions(rate=0.001, burst=1)
    seen: list[bool] = []

    async def refused_inside_a_batch() -> None:
        with db.batch():
            seen.append((await buckets.take("k", options)).allowed)
            seen.append((await buckets.take("k", options)).allowed)
            raise LookupError("a refusal leaving the batch")

    with pytest.raises(LookupError):
        await refused_inside_a_batch()
    assert seen == [True, False]
    assert not (await buckets.take("k", options)).allowed  # the first take was committed
    db.close()


def test_a_database_error_rolls_the_whole_batch_back(tmp_path: Path) -> None:
    """A failing statement inside a batch undoes every write made in it."""
    db = SQLiteDatabase(tmp_path / "s.db")

    def write(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO buckets (key, tokens, updated) VALUES ('x', 1, 0)")

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("SELECT * FROM no_such_table")

    def both() -> None:
        with db.batch():
            db.run(write)
            db.run(broken)

    with pytest.raises(StoreError):
        both()
    assert db.run(lambda conn: conn.execute("SELECT count(*) FROM buckets").fetchone()[0]) == 0
    db.close()


@pytest.mark.asyncio
async def test_joining_a_batch_from_another_task_is_refused(tmp_path: Path) -> None:
    """A batch must not yield: another task running a statement in a batch that has run one
    is a bug, reported loudly."""
    import asyncio

    db = SQLiteDatabase(tmp_path / "s.db")

    def select_one() -> None:
        db.run(lambda conn: conn.execute("SELECT 1").fetchone())

    async def intruder() -> None:
        select_one()

    with db.batch():
        select_one()
        with pytest.raises(RuntimeError, match="another task"):
            await asyncio.get_running_loop().create_task(intruder())
    db.close()


# --------------------------------------------------------------------------- group commit


def _open(db: SQLiteDatabase) -> bool:
    """Whether the database has a transaction open (a round not committed yet)."""
    return db._conn.in_transaction


def _bucket_rows(path: Path) -> int:
    """How many bucket rows another connection (another process, say) sees committed."""
    other = sqlite3.connect(path)
    try:
        return int(other.execute("SELECT count(*) FROM buckets").fetchone()[0])
    finally:
        other.close()


@pytest.mark.asyncio
async def test_the_batches_of_one_round_share_one_commit(tmp_path: Path) -> None:
    """Batches run in one event-loop round commit together at its end; committed() waits."""
    from tidegate.policy.ratelimit import BucketOptions
    from tidegate.state.sqlite import SQLiteBucketStore

    db = SQLiteDatabase(tmp_path / "s.db")
    buckets = SQLiteBucketStore(db, ManualClock())
    options = BucketOptions(rate=1.0, burst=5)
    for key in ("a", "b", "c"):
        with db.batch():
            assert (await buckets.take(key, options)).allowed
    assert _open(db)  # one transaction holds the three batches
    assert _bucket_rows(tmp_path / "s.db") == 0  # nothing is visible before the commit
    await db.committed()
    assert not _open(db)
    assert _bucket_rows(tmp_path / "s.db") == 3
    await db.committed()  # nothing open: returns at once
    db.close()


@pytest.mark.asyncio
async def test_a_batch_without_statements_opens_no_transaction(tmp_path: Path) -> None:
    """A batch begins its transaction at its first statement: one whose calls were all answered
    without the database (from a lease) costs nothing; the next one that writes begins it."""
    from tidegate.policy.ratelimit import BucketOptions
    from tidegate.state.sqlite import SQLiteBucketStore

    db = SQLiteDatabase(tmp_path / "s.db")
    buckets = SQLiteBucketStore(db, ManualClock())
    with db.batch():
        pass
    assert not _open(db)
    await db.committed()  # nothing to wait for
    with db.batch():
        assert (await buckets.take("a", BucketOptions(rate=1.0, burst=5))).allowed
    assert _open(db)
    await db.committed()
    assert not _open(db)
    assert _bucket_rows(tmp_path / "s.db") == 1
    db.close()


@pytest.mark.asyncio
async def test_a_call_outside_a_batch_commits_the_round_first(tmp_path: Path) -> None:
    """A plain store call (an idempotency claim, say) never joins the round's open transaction."""
    from tidegate.policy.ratelimit import BucketOptions
    from tidegate.state.sqlite import SQLiteBucketStore

    db = SQLiteDatabase(tmp_path / "s.db")
    buckets = SQLiteBucketStore(db, ManualClock())
    store = SQLiteIdempotencyStore(db, ManualClock())
    with db.batch():
        await buckets.take("a", BucketOptions(rate=1.0, burst=5))
    waiting = db.committed()
    claim = await store.claim("k", "fp", lease_s=30)  # commits the round, then its own
    assert claim.outcome is ClaimOutcome.CLAIMED
    assert _bucket_rows(tmp_path / "s.db") == 1
    assert not _open(db)
    await waiting  # the earlier batch's wait ends with that commit
    db.close()


@pytest.mark.asyncio
async def test_a_database_error_in_a_round_fails_every_batch_in_it(tmp_path: Path) -> None:
    """A failing batch rolls the round back: the batches before it learn so, none is half-kept."""
    db = SQLiteDatabase(tmp_path / "s.db")

    def write(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO buckets (key, tokens, updated) VALUES ('x', 1, 0)")

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("SELECT * FROM no_such_table")

    with db.batch():
        db.run(write)
    earlier = db.committed()
    with pytest.raises(StoreError), db.batch():
        db.run(broken)
    with pytest.raises(StoreError):
        await earlier
    assert not _open(db)
    assert _bucket_rows(tmp_path / "s.db") == 0
    db.close()


class _FailingCommit:
    """A connection whose COMMIT fails, as on a full disk."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, parameters: Any = ()) -> sqlite3.Cursor:
        if sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self._conn.execute(sql, parameters)

    def __getattr__(self, name: str) -> object:
        return getattr(self._conn, name)


@pytest.mark.asyncio
async def test_a_failed_commit_reaches_every_batch_of_the_round(tmp_path: Path) -> None:
    """Every waiter gets a StoreError of its own, and the writes are rolled back."""
    from tidegate.policy.ratelimit import BucketOptions
    from tidegate.state.sqlite import SQLiteBucketStore

    db = SQLiteDatabase(tmp_path / "s.db")
    real = db._conn
    db._conn = _FailingCommit(real)  # type: ignore[assignment]
    buckets = SQLiteBucketStore(db, ManualClock())
    with db.batch():
        await buckets.take("a", BucketOptions(rate=1.0, burst=5))
    first = db.committed()
    with db.batch():
        await buckets.take("b", BucketOptions(rate=1.0, burst=5))
    second = db.committed()
    errors = []
    for waiting in (first, second):
        with pytest.raises(StoreError, match="commit failed") as caught:
            await waiting
        errors.append(caught.value)
    assert errors[0] is not errors[1]
    assert not real.in_transaction
    db._conn = real
    assert _bucket_rows(tmp_path / "s.db") == 0
    db.close()


@pytest.mark.asyncio
async def test_closing_commits_the_open_round(tmp_path: Path) -> None:
    """Shutting down never drops the writes of the last round."""
    from tidegate.policy.ratelimit import BucketOptions
    from tidegate.state.sqlite import SQLiteBucketStore

    db = SQLiteDatabase(tmp_path / "s.db")
    with db.batch():
        await SQLiteBucketStore(db, ManualClock()).take("a", BucketOptions(rate=1.0, burst=5))
    db.close()
    assert _bucket_rows(tmp_path / "s.db") == 1


def test_version_1_files_keep_their_rows(tmp_path: Path) -> None:
    """Migration 2 rebuilds the hot tables WITHOUT ROWID and keeps every row."""
    path = tmp_path / "s.db"
    old = sqlite3.connect(path, isolation_level=None)
    for statement in filter(str.strip, MIGRATIONS[0].split(";")):
        old.execute(statement)
    old.execute("PRAGMA user_version=1")
    old.execute("INSERT INTO buckets VALUES ('user:t:u', 3.5, 100.0)")
    old.execute("INSERT INTO quotas VALUES ('t:u', X'7B7D')")
    old.execute("INSERT INTO reservations VALUES ('r1', 't:u', 20000, X'7B7D')")
    old.close()
    db = SQLiteDatabase(path)
    assert db.schema_version == len(MIGRATIONS)
    conn = db._conn
    assert conn.execute("SELECT * FROM buckets").fetchall() == [("user:t:u", 3.5, 100.0)]
    assert conn.execute("SELECT * FROM quotas").fetchall() == [("t:u", b"{}")]
    assert conn.execute("SELECT * FROM reservations").fetchall() == [("r1", "t:u", 20000, b"{}")]
    for table in ("buckets", "quotas", "reservations"):
        (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (table,)).fetchone()
        assert "WITHOUT ROWID" in sql
    db.close()


@pytest.mark.asyncio
async def test_a_usage_written_by_another_process_is_read_again(tmp_path: Path) -> None:
    """The quota store reuses a parsed usage only while the row still holds the very same blob."""
    from tidegate.policy.budget import BudgetOptions, Cost, Quota
    from tidegate.state.sqlite import SQLiteQuotaStore

    clock = ManualClock()
    options = BudgetOptions(quota=Quota(calls=10))
    one, two = SQLiteDatabase(tmp_path / "s.db"), SQLiteDatabase(tmp_path / "s.db")
    mine, theirs = SQLiteQuotaStore(one, clock), SQLiteQuotaStore(two, clock)
    await mine.reserve("t:u", options, Cost(calls=1))
    assert (await mine.usage("t:u")).reserved_calls == 1
    await theirs.reserve("t:u", options, Cost(calls=1))
    assert (await mine.usage("t:u")).reserved_calls == 2
    one.close()
    two.close()


# --------------------------------------------------------------------------- row caches


@pytest.mark.asyncio
async def test_bucket_takes_from_two_processes_see_each_other(tmp_path: Path) -> None:
    """A remembered bucket state is used only while no other connection has committed."""
    from tidegate.policy.ratelimit import BucketOptions
    from tidegate.state.sqlite import SQLiteBucketStore

    clock = ManualClock()
    options = BucketOptions(rate=0.001, burst=3)
    one, two = SQLiteDatabase(tmp_path / "s.db"), SQLiteDatabase(tmp_path / "s.db")
    mine, theirs = SQLiteBucketStore(one, clock), SQLiteBucketStore(two, clock)
    seen = []
    for store in (mine, theirs, mine, theirs, mine):
        with store._db.batch():
            seen.append((await store.take("k", options)).allowed)
        await store._db.committed()
    assert seen == [True, True, True, False, False]
    one.close()
    two.close()


@pytest.mark.asyncio
async def test_a_rolled_back_take_is_not_remembered(tmp_path: Path) -> None:
    """After a rollback the store reads the row again instead of trusting what it wrote."""
    from tidegate.policy.ratelimit import BucketOptions
    from tidegate.state.sqlite import SQLiteBucketStore

    db = SQLiteDatabase(tmp_path / "s.db")
    buckets = SQLiteBucketStore(db, ManualClock())
    options = BucketOptions(rate=0.001, burst=1)

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("SELECT * FROM no_such_table")

    async def take_then_fail() -> None:
        with db.batch():
            assert (await buckets.take("k", options)).allowed
            db.run(broken)

    with pytest.raises(StoreError):
        await take_then_fail()
    assert (await buckets.take("k", options)).allowed  # the first take was undone
    assert not (await buckets.take("k", options)).allowed
    db.close()


@pytest.mark.asyncio
async def test_budget_decisions_match_with_and_without_the_row_cache(tmp_path: Path) -> None:
    """The same reservations and settlements decide the same, cache or no cache."""
    from tidegate.policy.budget import BudgetOptions, Cost, Quota
    from tidegate.state.sqlite import SQLiteQuotaStore

    clock = ManualClock()
    options = BudgetOptions(quota=Quota(calls=5, tokens=100), degrade_at=0.5)

    async def run(path: Path, *, cached: bool) -> list[object]:
        db = SQLiteDatabase(path)
        store = SQLiteQuotaStore(db, clock)
        decisions: list[object] = []
        for i in range(8):
            if not cached:
                db.rows_epoch += 1  # forget every remembered row: read each one
            with db.batch():
                reservation, decision = await store.reserve("t:u", options, Cost(tokens=15))
            await db.committed()
            decisions.append(decision)
            if reservation is not None and i % 3 != 2:
                if not cached:
                    db.rows_epoch += 1
                with db.batch():
                    await store.settle(reservation, Cost(tokens=10 + i))
                await db.committed()
        decisions.append(await store.usage("t:u"))
        db.close()
        return decisions

    assert await run(tmp_path / "a.db", cached=True) == await run(tmp_path / "b.db", cached=False)


def test_a_round_left_open_by_a_loop_that_ended_is_committed_by_the_next(tmp_path: Path) -> None:
    """A loop that stops before its next round never commits: the next batch does, first."""
    import asyncio

    from tidegate.policy.ratelimit import BucketOptions
    from tidegate.state.sqlite import SQLiteBucketStore

    db = SQLiteDatabase(tmp_path / "s.db")
    buckets = SQLiteBucketStore(db, ManualClock())
    options = BucketOptions(rate=0.001, burst=1)

    seen: list[bool] = []

    async def take() -> None:
        with db.batch():
            seen.append((await buckets.take("k", options)).allowed)

    async def take_then_stop() -> None:
        asyncio.get_running_loop().stop()  # this round is the loop's last
        await take()

    ended = asyncio.new_event_loop()
    task = ended.create_task(take_then_stop())
    ended.run_forever()
    assert task.done()
    ended.close()
    assert _open(db)  # the round that would have committed never came

    async def take_and_wait() -> None:
        await take()
        await db.committed()

    asyncio.run(take_and_wait())
    assert seen == [True, False]  # the first take was committed first, then counted
    assert not _open(db)
    assert _bucket_rows(tmp_path / "s.db") == 1
    db.close()


def test_batches_find_their_task_under_each_loop_and_without_one(tmp_path: Path) -> None:
    """The batch owner check follows the running loop: a batch run under a second loop (the
    first one gone) and a batch with no loop at all run their statements; a task that is not
    the batch's own is still refused under the second loop."""
    import asyncio

    db = SQLiteDatabase(tmp_path / "s.db")

    def select_one() -> int:
        return int(db.run(lambda conn: conn.execute("SELECT 1").fetchone()[0]))

    async def inside_a_batch() -> int:
        with db.batch():
            return select_one()

    async def intruded() -> None:
        async def intruder() -> None:
            select_one()

        with db.batch():
            select_one()
            with pytest.raises(RuntimeError, match="another task"):
                await asyncio.get_running_loop().create_task(intruder())

    assert asyncio.run(inside_a_batch()) == 1
    assert asyncio.run(inside_a_batch()) == 1  # another loop on this thread
    asyncio.run(intruded())
    with db.batch():  # no loop: a synchronous caller
        assert select_one() == 1
    assert not _open(db)
    db.close()


@pytest.mark.asyncio
async def test_a_joined_batch_leaves_the_outer_one_open(tmp_path: Path) -> None:
    """A batch inside a batch joins it: leaving the inner one neither ends nor commits the outer
    one, whose statements still run in it."""
    from tidegate.policy.ratelimit import BucketOptions
    from tidegate.state.sqlite import SQLiteBucketStore

    db = SQLiteDatabase(tmp_path / "s.db")
    buckets = SQLiteBucketStore(db, ManualClock())
    options = BucketOptions(rate=1.0, burst=5)

    def in_a_batch() -> bool:
        return db._open_batch is not None

    with db.batch():
        with db.batch():
            assert (await buckets.take("a", options)).allowed
        assert in_a_batch()
        assert (await buckets.take("b", options)).allowed
    assert not in_a_batch()
    assert _open(db)
    await db.committed()
    assert _bucket_rows(tmp_path / "s.db") == 2
    db.close()


def test_ping_fails_while_another_connection_holds_the_write_lock(tmp_path: Path) -> None:
    """Readiness asks for the write lock, as every request does: while another process holds it
    past the timeout the ping fails, and it succeeds again once the lock is released."""
    db = SQLiteDatabase(tmp_path / "s.db", timeout_s=0.05)
    db.ping()
    other = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(StoreError, match="locked"):
        db.ping()
    other.execute("ROLLBACK")
    other.close()
    db.ping()
    db.close()


@pytest.mark.parametrize("change", ["moved", "replaced", "deleted"])
def test_ping_fails_once_the_file_is_no_longer_at_its_path(tmp_path: Path, change: str) -> None:
    """A database file moved away, replaced or deleted under a running process is not ready:
    what it writes no longer reaches the file the next process (or a restart) opens."""
    path = tmp_path / "s.db"
    db = SQLiteDatabase(path)
    db.ping()
    path.rename(tmp_path / "moved.db")
    if change == "replaced":
        SQLiteDatabase(path).close()
    elif change == "deleted":
        (tmp_path / "moved.db").unlink()
    with pytest.raises(StoreError, match="moved, deleted or replaced"):
        db.ping()
    db.close()
