"""Rollout state: a small JSON document per key, written only by whoever read its latest version.

A canary's progress (its current share, when it last stepped, why it held) must be the same on
every replica and survive a restart; two replicas evaluating the gate at the same moment must not
both step it. Each write names the version it read, and the store applies it only if that is still
the current version (compare-and-set): the loser gets :class:`VersionConflict`, re-reads and decides
again.

This module holds the protocol, the value, the error and two implementations: in memory and in the
SQLite file of :class:`~tidegate.state.sqlite.SQLiteDatabase` (its table is added here by its own
forward-only migration). Redis and Postgres implementations live beside their other stores.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from tidegate.clock import Clock
from tidegate.state.sqlite import SQLiteDatabase

__all__ = [
    "MemoryRolloutStore",
    "RolloutRecord",
    "RolloutStore",
    "SQLiteRolloutStore",
    "VersionConflict",
    "check_version",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutRecord:
    """One key's state: a JSON value, its version (1 for the first write), when it was written."""

    key: str
    value: Any
    version: int
    updated_at: float


class VersionConflict(Exception):
    """The state changed since it was read: ``expected`` was not the current version."""

    def __init__(self, key: str, *, expected: int, current: int) -> None:
        super().__init__(f"rollout state {key!r} is at version {current}, not {expected}")
        self.key = key
        self.expected = expected
        self.current = current


class RolloutStore(Protocol):
    async def get(self, key: str) -> RolloutRecord | None:
        """The current state under ``key``, or None if it was never written."""
        ...

    async def put(self, key: str, value: Any, *, expected_version: int) -> RolloutRecord:
        """Write ``value`` if the current version is ``expected_version`` (0: no state yet)."""
        ...


def check_version(expected_version: int) -> None:
    """Refuse a version no record can have."""
    if isinstance(expected_version, bool) or expected_version < 0:
        raise ValueError(f"expected_version must be an int >= 0, got {expected_version!r}")


class MemoryRolloutStore:
    """Rollout state in a dict: for tests and a single process."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._records: dict[str, RolloutRecord] = {}

    async def get(self, key: str) -> RolloutRecord | None:
        return self._records.get(key)

    async def put(self, key: str, value: Any, *, expected_version: int) -> RolloutRecord:
        check_version(expected_version)
        held = self._records.get(key)
        current = 0 if held is None else held.version
        if current != expected_version:
            raise VersionConflict(key, expected=expected_version, current=current)
        record = RolloutRecord(
            key=key,
            value=orjson.loads(orjson.dumps(value)),
            version=current + 1,
            updated_at=self._clock.wall(),
        )
        self._records[key] = record
        return record


_SQLITE_TABLE = """
CREATE TABLE IF NOT EXISTS rollout_state (
    key TEXT PRIMARY KEY, value BLOB NOT NULL, version INTEGER NOT NULL, updated_at REAL NOT NULL)
"""


class SQLiteRolloutStore:
    """Rollout state in the shared SQLite file; the table is added on first use."""

    def __init__(self, db: SQLiteDatabase, clock: Clock) -> None:
        self._db = db
        self._clock = clock
        db.run(lambda conn: conn.execute(_SQLITE_TABLE))

    async def get(self, key: str) -> RolloutRecord | None:
        row = self._db.run(
            lambda conn: conn.execute(
                "SELECT value, version, updated_at FROM rollout_state WHERE key = ?", (key,)
            ).fetchone()
        )
        if row is None:
            return None
        return RolloutRecord(key=key, value=orjson.loads(row[0]), version=row[1], updated_at=row[2])

    async def put(self, key: str, value: Any, *, expected_version: int) -> RolloutRecord:
        check_version(expected_version)
        now = self._clock.wall()
        blob = orjson.dumps(value)

        def work(conn: sqlite3.Connection) -> RolloutRecord:
            if expected_version == 0:
                written = conn.execute(
                    "INSERT OR IGNORE INTO rollout_state (key, value, version, updated_at)"
                    " VALUES (?, ?, 1, ?)",
                    (key, blob, now),
                ).rowcount
            else:
                written = conn.execute(
                    "UPDATE rollout_state SET value = ?, version = version + 1, updated_at = ?"
                    " WHERE key = ? AND version = ?",
                    (blob, now, key, expected_version),
                ).rowcount
            if written != 1:
                row = conn.execute(
                    "SELECT version FROM rollout_state WHERE key = ?", (key,)
                ).fetchone()
                current = 0 if row is None else int(row[0])
                raise VersionConflict(key, expected=expected_version, current=current)
            return RolloutRecord(
                key=key, value=orjson.loads(blob), version=expected_version + 1, updated_at=now
            )

        return self._db.run(work)
