"""The spend ledger (:mod:`tidegate.state.ledger`) in Postgres and in Redis.

Postgres keeps it in a table of its own, created at start-up with ``CREATE TABLE IF NOT EXISTS``
under a transaction-scoped advisory lock (replicas starting together do not race, and the core
migrations stay as they are); a batch is one ``INSERT ... ON CONFLICT DO NOTHING`` of many rows
in one transaction, and a summary is one ``GROUP BY``. Redis keeps the rows in one sorted set,
scored by when each request settled: a batch is one ``ZADD`` (a retried batch adds the same
members again, which changes nothing), retention is ``ZREMRANGEBYSCORE``, and a summary reads
the range and sums it here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, cast

import orjson

from tidegate.state.ledger import (
    COLUMNS,
    SQL_COLUMNS,
    SUMS_SQL,
    GroupBy,
    LedgerRow,
    Settled,
    SpendGroup,
    check_range,
    group_sql,
    groups_from,
    row_from,
    row_of,
    summarize,
)

if TYPE_CHECKING:
    from tidegate.state.postgres import Connection, PostgresDatabase
    from tidegate.state.redis import RedisDatabase

__all__ = ["PostgresLedgerStore", "RedisLedgerStore"]

_PG_TABLE = """
CREATE TABLE IF NOT EXISTS ledger (
    request_id text NOT NULL, at double precision NOT NULL, key_id text NOT NULL,
    tenant text NOT NULL, user_name text NOT NULL, route text NOT NULL,
    served_by text NOT NULL, model text NOT NULL, prompt_tokens bigint NOT NULL,
    completion_tokens bigint NOT NULL, cost_usd double precision NOT NULL,
    outcome text NOT NULL, status integer NOT NULL, billed boolean NOT NULL,
    degraded boolean NOT NULL, cached boolean NOT NULL, replayed boolean NOT NULL,
    PRIMARY KEY (request_id, at));
CREATE INDEX IF NOT EXISTS ledger_at ON ledger (at);
"""

#: The advisory lock that serialises creating the table (a signed 64-bit int).
_LOCK = int.from_bytes(
    hashlib.blake2b(b"tidegate ledger", digest_size=8).digest(), "big", signed=True
)
#: Rows read from Redis per request when summing a range.
_PAGE = 5_000


class PostgresLedgerStore:
    """The ledger in one Postgres table; call :meth:`open` once before the first operation."""

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def open(self) -> None:
        """Create the table and its index unless they exist (under the advisory lock)."""
        async with self._db.transaction("ledger table") as conn:
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK,))
            await conn.execute(_PG_TABLE.encode())

    async def append(self, settled: Sequence[Settled]) -> None:
        if not settled:
            return
        rows = [row_of(raw) for raw in settled]
        marks = ", ".join(["%s"] * len(COLUMNS))
        query = (
            f"INSERT INTO ledger ({SQL_COLUMNS}) VALUES ({marks})"
            " ON CONFLICT (request_id, at) DO NOTHING"
        ).encode()

        async def work(conn: Connection) -> None:
            async with conn.cursor() as cursor:
                await cursor.executemany(query, rows)

        await self._db.run("ledger append", work)

    async def purge(self, before: float) -> int:
        return await self._db.execute("ledger purge", "DELETE FROM ledger WHERE at < %s", (before,))

    async def rows(self, start: float, end: float, *, limit: int = 10_000) -> list[LedgerRow]:
        check_range(start, end)
        found = await self._db.fetch(
            "ledger rows",
            f"SELECT {SQL_COLUMNS} FROM ledger WHERE at >= %s AND at < %s"
            " ORDER BY at, request_id LIMIT %s",
            (start, end, limit),
        )
        return [row_from(r) for r in found]

    async def summary(self, group_by: GroupBy, start: float, end: float) -> list[SpendGroup]:
        check_range(start, end)
        key = group_sql(group_by)
        found = await self._db.fetch(
            "ledger summary",
            f"SELECT {key}, {SUMS_SQL} FROM ledger WHERE at >= %s AND at < %s GROUP BY 1",
            (start, end),
        )
        return groups_from(found)


class RedisLedgerStore:
    """The ledger as one sorted set of JSON rows, scored by when each request settled."""

    def __init__(self, db: RedisDatabase) -> None:
        self._db = db
        self._key = db.key("ledger", "rows")

    async def append(self, settled: Sequence[Settled]) -> None:
        if not settled:
            return
        members = {orjson.dumps(list(row_of(raw))): raw[1] for raw in settled}
        await self._db.run("ledger append", lambda: self._db.client.zadd(self._key, members))

    async def purge(self, before: float) -> int:
        key = self._key
        removed = await self._db.run(
            "ledger purge", lambda: self._db.client.zremrangebyscore(key, "-inf", f"({before!r}")
        )
        return int(removed)

    async def _range(self, start: float, end: float, limit: int) -> list[LedgerRow]:
        found: list[LedgerRow] = []
        client, key = self._db.client, self._key
        while len(found) < limit:
            count = min(_PAGE, limit - len(found))
            page = await self._db.run(
                "ledger rows",
                partial(client.zrangebyscore, key, start, f"({end!r}", len(found), count),
            )
            found.extend(row_from(orjson.loads(cast("bytes", member))) for member in page)
            if len(page) < count:
                break
        return found

    async def rows(self, start: float, end: float, *, limit: int = 10_000) -> list[LedgerRow]:
        check_range(start, end)
        found = await self._range(start, end, limit)
        return sorted(found, key=lambda r: (r.at, r.request_id))

    async def summary(self, group_by: GroupBy, start: float, end: float) -> list[SpendGroup]:
        check_range(start, end)
        return summarize(await self._range(start, end, 2**62), group_by)
