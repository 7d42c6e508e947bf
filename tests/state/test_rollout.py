"""Rollout state beyond the shared contract: validation, copies, the SQLite table."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidegate.clock import ManualClock
from tidegate.state.rollout import (
    MemoryRolloutStore,
    SQLiteRolloutStore,
    VersionConflict,
    check_version,
)
from tidegate.state.sqlite import SQLiteDatabase


@pytest.mark.parametrize("version", [-1, True])
def test_a_version_must_be_a_count(version: int) -> None:
    """Negative versions and booleans are refused before reaching a store."""
    with pytest.raises(ValueError, match="expected_version"):
        check_version(version)


def test_a_conflict_names_both_versions() -> None:
    """The error says which version the writer expected and which one it found."""
    conflict = VersionConflict("canary", expected=3, current=4)
    assert (conflict.key, conflict.expected, conflict.current) == ("canary", 3, 4)
    assert "version 4, not 3" in str(conflict)


@pytest.mark.asyncio
async def test_the_memory_store_keeps_its_own_copy() -> None:
    """Changing the written value afterwards does not change the stored state."""
    store = MemoryRolloutStore(ManualClock())
    value = {"share": 0.1}
    await store.put("canary", value, expected_version=0)
    value["share"] = 1.0
    record = await store.get("canary")
    assert record is not None
    assert record.value == {"share": 0.1}


@pytest.mark.asyncio
async def test_sqlite_rollout_state_survives_a_restart(tmp_path: Path) -> None:
    """A version written before a restart is the one a writer must name after it."""
    clock = ManualClock()
    db = SQLiteDatabase(tmp_path / "s.db")
    await SQLiteRolloutStore(db, clock).put("canary", {"share": 0.1}, expected_version=0)
    db.close()
    reopened = SQLiteDatabase(tmp_path / "s.db")
    store = SQLiteRolloutStore(reopened, clock)
    with pytest.raises(VersionConflict):
        await store.put("canary", {"share": 0.5}, expected_version=0)
    assert (await store.put("canary", {"share": 0.5}, expected_version=1)).version == 2
    reopened.close()
