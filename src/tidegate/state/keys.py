"""Virtual API keys in the durable store: in memory and in the SQLite file.

The protocol and its values are :class:`~tidegate.state.base.KeyStore`,
:class:`~tidegate.state.base.KeyRecord` and :class:`~tidegate.state.base.KeyAudit`; the Redis and
Postgres stores are in :mod:`tidegate.state.redis_keys` and :mod:`tidegate.state.postgres_keys`.
A store keeps digests only, never a key. Each write is one atomic step (record, audit record,
change counter); the gateway re-reads every key when the counter moves (``version()``), on a
change notice or on its periodic check.

Notices travel on the flags' channel (Redis pub/sub, Postgres ``LISTEN``), so a replica's one
subscription hears both: a flag's notice carries its name, a key's carries :data:`KEYS_NOTICE`,
which no flag name can be.

The SQLite tables are added on first use (``CREATE TABLE IF NOT EXISTS``, run inside the file's
write lock), so the shared file gains them without a change to the core schema.
"""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from typing import Any, Final

import orjson

from tidegate.clock import Clock, SystemClock
from tidegate.state.base import KeyAudit, KeyConflict, KeyRecord
from tidegate.state.sqlite import SQLiteDatabase

__all__ = [
    "KEYS_NOTICE",
    "MemoryKeyStore",
    "SQLiteKeyStore",
    "audit_from_json",
    "audit_to_json",
    "check_revision",
    "plain_record",
]

#: The change notice a key's write sends on the flags' channel (flag names start with a letter
#: or a digit, so no flag is called this).
KEYS_NOTICE: Final = "@keys"


def check_revision(expected_revision: int) -> None:
    """Refuse a revision no record can have."""
    if isinstance(expected_revision, bool) or expected_revision < 0:
        raise ValueError(f"expected_revision must be an int >= 0, got {expected_revision!r}")


def audit_to_json(audit: KeyAudit) -> dict[str, Any]:
    return {
        "key_id": audit.key_id,
        "action": audit.action,
        "who": audit.who,
        "why": audit.why,
        "at": audit.at,
        "detail": audit.detail,
    }


def audit_from_json(data: dict[str, Any]) -> KeyAudit:
    return KeyAudit(
        data["key_id"], data["action"], data["who"], data["why"], float(data["at"]), data["detail"]
    )


def plain_record(record: KeyRecord, revision: int) -> KeyRecord:
    """``record`` at ``revision``, as it reads back from JSON (no shared mutable parts)."""
    return KeyRecord.from_json(
        orjson.loads(orjson.dumps(replace(record, revision=revision).to_json()))
    )


class MemoryKeyStore:
    """Keys in a dict: for tests and a single process."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or SystemClock()
        self._records: dict[str, KeyRecord] = {}
        self._audit: list[KeyAudit] = []

    async def put(self, record: KeyRecord, *, expected_revision: int, audit: KeyAudit) -> KeyRecord:
        check_revision(expected_revision)
        held = self._records.get(record.id)
        current = 0 if held is None else held.revision
        if current != expected_revision:
            raise KeyConflict(record.id, expected=expected_revision, current=current)
        stored = self._records[record.id] = plain_record(record, current + 1)
        self._audit.append(replace(audit, key_id=record.id, at=self._clock.wall()))
        return stored

    async def get(self, key_id: str) -> KeyRecord | None:
        return self._records.get(key_id)

    async def all(self) -> list[KeyRecord]:
        return [self._records[k] for k in sorted(self._records)]

    async def version(self) -> int:
        return len(self._audit)

    async def history(self, key_id: str | None = None, *, limit: int = 100) -> list[KeyAudit]:
        rows = [a for a in reversed(self._audit) if key_id is None or a.key_id == key_id]
        return rows[: max(limit, 0)]


_SQLITE_TABLES = (
    "CREATE TABLE IF NOT EXISTS api_keys ("
    " id TEXT PRIMARY KEY, revision INTEGER NOT NULL, data BLOB NOT NULL)",
    "CREATE TABLE IF NOT EXISTS api_key_audit ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT, key_id TEXT NOT NULL, action TEXT NOT NULL,"
    " who TEXT NOT NULL, why TEXT NOT NULL, at REAL NOT NULL, detail BLOB NOT NULL)",
    "CREATE INDEX IF NOT EXISTS api_key_audit_key ON api_key_audit (key_id, seq)",
)


def _create_tables(conn: sqlite3.Connection) -> None:
    for statement in _SQLITE_TABLES:
        conn.execute(statement)


class SQLiteKeyStore:
    """Keys and their audit history in the shared SQLite file; the tables are added on first use.

    The change counter is the audit table's last ``seq``: writers take the file's write lock, so
    the counter moves in commit order.
    """

    def __init__(self, db: SQLiteDatabase, clock: Clock) -> None:
        self._db = db
        self._clock = clock
        db.run(_create_tables)

    async def put(self, record: KeyRecord, *, expected_revision: int, audit: KeyAudit) -> KeyRecord:
        check_revision(expected_revision)
        now = self._clock.wall()
        stored = plain_record(record, expected_revision + 1)
        blob = orjson.dumps(stored.to_json())

        def work(conn: sqlite3.Connection) -> KeyRecord:
            if expected_revision == 0:
                written = conn.execute(
                    "INSERT OR IGNORE INTO api_keys (id, revision, data) VALUES (?, 1, ?)",
                    (record.id, blob),
                ).rowcount
            else:
                written = conn.execute(
                    "UPDATE api_keys SET revision = revision + 1, data = ?"
                    " WHERE id = ? AND revision = ?",
                    (blob, record.id, expected_revision),
                ).rowcount
            if written != 1:
                row = conn.execute(
                    "SELECT revision FROM api_keys WHERE id = ?", (record.id,)
                ).fetchone()
                current = 0 if row is None else int(row[0])
                raise KeyConflict(record.id, expected=expected_revision, current=current)
            conn.execute(
                "INSERT INTO api_key_audit (key_id, action, who, why, at, detail)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (record.id, audit.action, audit.who, audit.why, now, orjson.dumps(audit.detail)),
            )
            return stored

        return self._db.run(work)

    async def get(self, key_id: str) -> KeyRecord | None:
        row = self._db.run(
            lambda conn: conn.execute(
                "SELECT data FROM api_keys WHERE id = ?", (key_id,)
            ).fetchone()
        )
        return None if row is None else KeyRecord.from_json(orjson.loads(row[0]))

    async def all(self) -> list[KeyRecord]:
        rows = self._db.run(
            lambda conn: conn.execute("SELECT data FROM api_keys ORDER BY id").fetchall()
        )
        return [KeyRecord.from_json(orjson.loads(row[0])) for row in rows]

    async def version(self) -> int:
        row = self._db.run(
            lambda conn: conn.execute("SELECT coalesce(max(seq), 0) FROM api_key_audit").fetchone()
        )
        return int(row[0])

    async def history(self, key_id: str | None = None, *, limit: int = 100) -> list[KeyAudit]:
        query = "SELECT key_id, action, who, why, at, detail FROM api_key_audit"
        params: tuple[Any, ...] = ()
        if key_id is not None:
            query += " WHERE key_id = ?"
            params = (key_id,)
        query += " ORDER BY seq DESC LIMIT ?"
        rows = self._db.run(lambda conn: conn.execute(query, (*params, max(limit, 0))).fetchall())
        return [KeyAudit(k, a, w, y, float(t), orjson.loads(d)) for k, a, w, y, t, d in rows]
