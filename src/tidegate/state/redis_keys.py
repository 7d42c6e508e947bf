"""Virtual API keys in Redis: records and revisions in two hashes, the audit log in capped lists,
a change counter, and a notice on the flags' pub/sub channel, all written by ``key_put.lua``."""

from __future__ import annotations

from typing import Any

import orjson

from tidegate.clock import Clock
from tidegate.state.base import KeyAudit, KeyConflict, KeyRecord
from tidegate.state.keys import KEYS_NOTICE, audit_from_json, check_revision, plain_record
from tidegate.state.redis import AuditedRedisStore, RedisDatabase, as_text, now_arg

__all__ = ["RedisKeyStore"]


def _audit_of(raw: bytes | str) -> KeyAudit:
    data = orjson.loads(raw)
    return audit_from_json({**data, "detail": orjson.loads(data["detail"])})


class RedisKeyStore(AuditedRedisStore):
    """Keys in Redis; ``clock`` replaces the server's clock for the audit times (tests)."""

    kind = "keys"

    def __init__(
        self, db: RedisDatabase, clock: Clock | None = None, *, audit_cap: int = 10_000
    ) -> None:
        super().__init__(db, clock, audit_cap=audit_cap)
        self._records = db.key("keys", "records")
        self._revisions = db.key("keys", "revisions")
        self._counter = db.key("keys", "version")

    async def put(self, record: KeyRecord, *, expected_revision: int, audit: KeyAudit) -> KeyRecord:
        check_revision(expected_revision)
        stored = plain_record(record, expected_revision + 1)
        outcome, value = await self._db.script(
            "key_put",
            [
                self._records,
                self._revisions,
                self._audit(None),
                self._audit(record.id),
                self._counter,
            ],
            [
                now_arg(self._clock),
                record.id,
                str(expected_revision),
                orjson.dumps(stored.to_json()),
                audit.action,
                audit.who,
                audit.why,
                orjson.dumps(audit.detail),
                str(self._cap),
                self.channel,
                KEYS_NOTICE,
            ],
        )
        if as_text(outcome) == "conflict":
            raise KeyConflict(record.id, expected=expected_revision, current=int(as_text(value)))
        return stored

    async def get(self, key_id: str) -> KeyRecord | None:
        raw = await self._db.run("key", lambda: self._db.client.hget(self._records, key_id))
        return None if raw is None else KeyRecord.from_json(orjson.loads(raw))

    async def all(self) -> list[KeyRecord]:
        raw: dict[Any, Any] = await self._db.run(
            "keys", lambda: self._db.client.hgetall(self._records)
        )
        records = [KeyRecord.from_json(orjson.loads(value)) for value in raw.values()]
        return sorted(records, key=lambda r: r.id)

    async def version(self) -> int:
        raw = await self._db.run("keys version", lambda: self._db.client.get(self._counter))
        return 0 if raw is None else int(raw)

    async def history(self, key_id: str | None = None, *, limit: int = 100) -> list[KeyAudit]:
        return [_audit_of(item) for item in await self._newest("key history", key_id, limit)]
