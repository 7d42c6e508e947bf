"""Virtual API keys in Redis: records and revisions in two hashes, the audit log in capped lists,
a change counter, and a notice on the flags' pub/sub channel, all written by ``key_put.lua``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from tidegate.clock import Clock
from tidegate.state.base import KeyAudit, KeyConflict, KeyRecord
from tidegate.state.keys import KEYS_NOTICE, check_revision
from tidegate.state.redis import RedisDatabase

__all__ = ["RedisKeyStore"]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _audit(raw: bytes | str) -> KeyAudit:
    data = orjson.loads(raw)
    return KeyAudit(
        data["key_id"],
        data["action"],
        data["who"],
        data["why"],
        float(data["at"]),
        orjson.loads(data["detail"]),
    )


class RedisKeyStore:
    """Keys in Redis; ``clock`` replaces the server's clock for the audit times (tests)."""

    def __init__(
        self, db: RedisDatabase, clock: Clock | None = None, *, audit_cap: int = 10_000
    ) -> None:
        if audit_cap < 1:
            raise ValueError(f"audit_cap must be >= 1, got {audit_cap!r}")
        self._db = db
        self._clock = clock
        self._cap = audit_cap
        self._records = db.key("keys", "records")
        self._revisions = db.key("keys", "revisions")
        self._counter = db.key("keys", "version")
        #: The flags' channel (see :data:`~tidegate.state.keys.KEYS_NOTICE`).
        self.channel = db.key("flags", "changed")

    def _log(self, key_id: str | None) -> str:
        return self._db.key("keys", "audit" if key_id is None else f"audit:{key_id}")

    async def put(self, record: KeyRecord, *, expected_revision: int, audit: KeyAudit) -> KeyRecord:
        check_revision(expected_revision)
        stored = replace(record, revision=expected_revision + 1)
        now = "" if self._clock is None else repr(float(self._clock.wall()))
        outcome, value = await self._db.script(
            "key_put",
            [self._records, self._revisions, self._log(None), self._log(record.id), self._counter],
            [
                now,
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
        if _text(outcome) == "conflict":
            raise KeyConflict(record.id, expected=expected_revision, current=int(_text(value)))
        return KeyRecord.from_json(orjson.loads(orjson.dumps(stored.to_json())))

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
        if limit <= 0:
            return []
        log = self._log(key_id)
        raw = await self._db.run("key history", lambda: self._db.client.lrange(log, 0, limit - 1))
        return [_audit(item) for item in raw]
