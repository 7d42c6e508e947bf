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
