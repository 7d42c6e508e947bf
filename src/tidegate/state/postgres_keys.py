"""Virtual API keys in Postgres: ``api_keys`` and ``api_key_audit`` (migration 3). A write is one
transaction that also announces it with ``pg_notify`` on the flags' channel (delivered only if it
commits); writers queue on a table lock, so the audit's ``seq``, the change counter, moves in
commit order."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from tidegate.clock import Clock
from tidegate.state.base import KeyAudit, KeyConflict, KeyRecord
from tidegate.state.keys import KEYS_NOTICE, check_revision
from tidegate.state.postgres import SQL_NOW, Connection, PostgresDatabase, now_param

__all__ = ["PostgresKeyStore"]


def _record(text: str) -> KeyRecord:
    return KeyRecord.from_json(orjson.loads(text))


class PostgresKeyStore:
    def __init__(self, db: PostgresDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock
        #: The flags' ``LISTEN`` channel (see :data:`~tidegate.state.keys.KEYS_NOTICE`).
        self.channel = db.flags_channel

    async def put(self, record: KeyRecord, *, expected_revision: int, audit: KeyAudit) -> KeyRecord:
        check_revision(expected_revision)
        stored = replace(record, revision=expected_revision + 1)
        data = orjson.dumps(stored.to_json()).decode()
        params: dict[str, Any] = {
            "id": record.id,
            "expected": expected_revision,
            "data": data,
            "action": audit.action,
            "who": audit.who,
            "why": audit.why,
            "detail": orjson.dumps(audit.detail).decode(),
            "now": now_param(self._clock),
            "channel": self.channel,
            "notice": KEYS_NOTICE,
        }

        async def work(conn: Connection) -> None:
            await conn.execute("LOCK TABLE api_keys IN SHARE ROW EXCLUSIVE MODE")
            if expected_revision == 0:
                cursor = await conn.execute(
                    "INSERT INTO api_keys (id, revision, data) VALUES (%(id)s, 1, %(data)s)"
                    " ON CONFLICT (id) DO NOTHING",
                    params,
                )
            else:
                cursor = await conn.execute(
                    "UPDATE api_keys SET revision = revision + 1, data = %(data)s"
                    " WHERE id = %(id)s AND revision = %(expected)s",
                    params,
                )
            if cursor.rowcount != 1:
                found = await conn.execute(
                    "SELECT revision FROM api_keys WHERE id = %(id)s", params
                )
                row = await found.fetchone()
                current = 0 if row is None else int(row[0])
                raise KeyConflict(record.id, expected=expected_revision, current=current)
            await conn.execute(
                "INSERT INTO api_key_audit (key_id, action, who, why, at, detail) VALUES"
                f" (%(id)s, %(action)s, %(who)s, %(why)s, {SQL_NOW}, %(detail)s)".encode(),
                params,
            )
            await conn.execute("SELECT pg_notify(%(channel)s, %(notice)s)", params)

        await self._db.run("put key", work)
        return _record(data)

    async def get(self, key_id: str) -> KeyRecord | None:
        rows = await self._db.fetch(
            "key", "SELECT data FROM api_keys WHERE id = %(id)s", {"id": key_id}
        )
        return _record(rows[0][0]) if rows else None

    async def all(self) -> list[KeyRecord]:
        rows = await self._db.fetch("keys", "SELECT data FROM api_keys ORDER BY id")
        return [_record(row[0]) for row in rows]

    async def version(self) -> int:
        rows = await self._db.fetch(
            "keys version", "SELECT coalesce(max(seq), 0) FROM api_key_audit"
        )
        return int(rows[0][0])

    async def history(self, key_id: str | None = None, *, limit: int = 100) -> list[KeyAudit]:
        rows = await self._db.newest(
            "key history",
            "SELECT key_id, action, who, why, at, detail FROM api_key_audit",
            order="seq",
            limit=limit,
            match=None if key_id is None else ("key_id", key_id),
        )
        return [KeyAudit(k, a, w, y, float(t), orjson.loads(d)) for k, a, w, y, t, d in rows]
