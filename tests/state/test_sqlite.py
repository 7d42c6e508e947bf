from __future__ import annotations

import sqlite3
from pathlib import Path

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
    """A batch must not yield: another task calling into it is a bug, reported loudly."""
    import asyncio

    db = SQLiteDatabase(tmp_path / "s.db")

    async def intruder() -> None:
        db.run(lambda conn: conn.execute("SELECT 1").fetchone())

    with db.batch(), pytest.raises(RuntimeError, match="another task"):
        await asyncio.get_running_loop().create_task(intruder())
    db.close()
