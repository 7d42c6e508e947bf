"""The spend ledger: one row per settled request, kept in the durable store.

A row says who spent what on which request: the request id, when it settled (Unix seconds), the
key, tenant and user, the route, who served it (``a,b`` when a rescued stream had two parts), the
model, the tokens and the cost, the outcome and status, and whether the request was *billed*
(its budget reservation settled rather than refunded), degraded, answered from the cache or
replayed for its idempotency key. The gateway's writer (:mod:`tidegate.gateway.ledger`) appends
rows in batches, off the request path; operators read them back summed by key, user, tenant or
model (:meth:`LedgerStore.summary`) or row by row (:meth:`LedgerStore.rows`).

A row's numbers count towards the spend only when it is billed: that is exactly what the daily
budget records (one call, the answer's tokens and cost per billed request), so the two agree.

This module holds the protocol, the row, the summary and two implementations: in memory and in
the SQLite file of :class:`~tidegate.state.sqlite.SQLiteDatabase` (its table is added here with
``CREATE TABLE IF NOT EXISTS``, as the pending actions' is). Redis and Postgres implementations are
in :mod:`tidegate.state.ledger_remote`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, NamedTuple, Protocol, get_args

from tidegate.clock import loop_round
from tidegate.state.sqlite import SQLiteDatabase

__all__ = [
    "COLUMNS",
    "GROUPS",
    "SQLITE_CHUNK_ROWS",
    "SQL_COLUMNS",
    "GroupBy",
    "LedgerRow",
    "LedgerStore",
    "MemoryLedgerStore",
    "SQLiteLedgerStore",
    "Settled",
    "SpendGroup",
    "row_of",
    "settled_of",
    "summarize",
]


class LedgerRow(NamedTuple):
    """One settled request, as the ledger keeps it."""

    request_id: str
    at: float
    key_id: str
    tenant: str
    user: str
    route: str
    served_by: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    outcome: str
    status: int
    billed: bool
    degraded: bool
    cached: bool
    replayed: bool


#: The row's fields, in order: the columns of the CSV export.
COLUMNS: tuple[str, ...] = LedgerRow._fields
#: The same as SQL columns (``user`` is a reserved word in Postgres).
SQL_COLUMNS = ", ".join("user_name" if c == "user" else c for c in COLUMNS)

#: A settled request as the gateway records it, on its request path (one plain tuple, no
#: conversion there): ``(request_id, at, key_id, tenant, user, route, served_by, model,
#: prompt_tokens, completion_tokens, cost_usd, outcome, status, billed, budget, cache)``, where
#: the token counts may be None (unknown: 0), ``budget`` is the exchange's budget mark
#: (``"degraded"`` or empty) and ``cache`` its cache mark (``hit``, ``shared``, ``stale``,
#: ``idempotent-replay``, ``miss`` or None). A backend turns it into a :class:`LedgerRow`
#: (:func:`row_of`) as it writes the batch: SQLite in the ``INSERT`` itself.
Settled = tuple[Any, ...]
#: The cache marks of an answer that came from the cache (or a shared flight).
CACHED = frozenset({"hit", "shared", "stale"})


def row_of(settled: Settled) -> LedgerRow:
    """The row the ledger keeps of a settled request."""
    (rid, at, key, tenant, user, route, by, model, prompt, completion, cost, outcome, status) = (
        settled[:13]
    )
    billed, budget, cache = settled[13:]
    return LedgerRow(
        rid,
        at,
        key,
        tenant,
        user,
        route,
        by,
        model,
        prompt or 0,
        completion or 0,
        cost,
        outcome,
        status,
        bool(billed),
        budget == "degraded" or outcome.startswith("degraded"),
        cache in CACHED,
        cache == "idempotent-replay",
    )


def settled_of(row: LedgerRow) -> Settled:
    """What the gateway would have recorded for ``row`` (its inverse, for tests and imports)."""
    cache = "hit" if row.cached else "idempotent-replay" if row.replayed else None
    budget = "degraded" if row.degraded else ""
    return (*row[:13], row.billed, budget, cache)


#: What spend can be summed by; ``model`` is the model that served.
GroupBy = Literal["key", "user", "tenant", "model"]
GROUPS: tuple[str, ...] = get_args(GroupBy)
#: The column each grouping reads (a user is only unique within its tenant).
_GROUP_COLUMN = {"key": "key_id", "user": "user", "tenant": "tenant", "model": "model"}


@dataclass(frozen=True, slots=True)
class SpendGroup:
    """The spend of one group over a time range: ``calls`` are the billed requests, and the
    tokens and cost are theirs; ``requests`` counts every settled request."""

    key: str
    requests: int
    calls: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class LedgerStore(Protocol):
    async def append(self, settled: Sequence[Settled]) -> None:
        """Add the rows of ``settled`` requests (Postgres and Redis in one transaction, SQLite
        in transactions of :data:`SQLITE_CHUNK_ROWS`). On ``StoreError`` some of them may be
        kept: a row whose request id and settle time are already kept is left as it was, so
        appending the batch again adds each row once (as after a lost answer); two requests
        that carried the same caller-chosen request id settled at different times and are two
        rows."""
        ...

    async def purge(self, before: float) -> int:
        """Delete the rows settled before ``before``; how many went."""
        ...

    async def rows(self, start: float, end: float, *, limit: int = 10_000) -> list[LedgerRow]:
        """The rows settled in ``[start, end)``, oldest first, at most ``limit``."""
        ...

    async def summary(self, group_by: GroupBy, start: float, end: float) -> list[SpendGroup]:
        """The spend in ``[start, end)`` by ``group_by``, by cost (highest first), then key."""
        ...


def group_key(row: LedgerRow, group_by: GroupBy) -> str:
    """The group ``row`` belongs to."""
    if group_by == "user":
        return f"{row.tenant}:{row.user}"
    return str(getattr(row, _GROUP_COLUMN[group_by]))


def summarize(rows: Iterable[LedgerRow], group_by: GroupBy) -> list[SpendGroup]:
    """The rows' spend by ``group_by`` (what a backend without SQL sums with)."""
    if group_by not in GROUPS:
        raise ValueError(f"group_by must be one of {', '.join(GROUPS)}, got {group_by!r}")
    sums: dict[str, list[float]] = {}
    for row in rows:
        acc = sums.setdefault(group_key(row, group_by), [0, 0, 0, 0, 0.0])
        acc[0] += 1
        if row.billed:
            acc[1] += 1
            acc[2] += row.prompt_tokens
            acc[3] += row.completion_tokens
            acc[4] += row.cost_usd
    return _ordered(
        SpendGroup(key, int(a[0]), int(a[1]), int(a[2]), int(a[3]), a[4]) for key, a in sums.items()
    )


def _ordered(groups: Iterable[SpendGroup]) -> list[SpendGroup]:
    return sorted(groups, key=lambda g: (-g.cost_usd, -g.calls, g.key))


def check_range(start: float, end: float) -> None:
    if not start <= end:
        raise ValueError(f"the range must not end before it starts: {start!r} .. {end!r}")


class MemoryLedgerStore:
    """The ledger in a list: for tests and a single process."""

    def __init__(self) -> None:
        #: By request id and settle time (see :meth:`LedgerStore.append`).
        self._rows: dict[tuple[str, float], LedgerRow] = {}

    async def append(self, settled: Sequence[Settled]) -> None:
        for raw in settled:
            self._rows.setdefault((raw[0], raw[1]), row_of(raw))

    async def purge(self, before: float) -> int:
        old = [key for key, row in self._rows.items() if row.at < before]
        for key in old:
            del self._rows[key]
        return len(old)

    async def rows(self, start: float, end: float, *, limit: int = 10_000) -> list[LedgerRow]:
        check_range(start, end)
        found = sorted((r for r in self._rows.values() if start <= r.at < end), key=lambda r: r.at)
        return found[:limit]

    async def summary(self, group_by: GroupBy, start: float, end: float) -> list[SpendGroup]:
        check_range(start, end)
        return summarize((r for r in self._rows.values() if start <= r.at < end), group_by)


#: SQLite keeps what the request path recorded as it is (token counts may be NULL, the budget's
#: and the cache's marks as text) and works the row's flags out when it is read
#: (:data:`_SQLITE_ROW`): an insert that only binds values costs about half of one that works
#: them out, and a batch is written far more often than it is read. Keyed by settle time first,
#: without a rowid, the table is one B-tree that rows are appended to: an insert touches the
#: same few pages however large the table grows (keyed by request id, each insert landed on a
#: random page, which stopped fitting the page cache after a few hundred thousand rows).
_SQLITE_TABLE = """
CREATE TABLE IF NOT EXISTS ledger (
    at REAL NOT NULL, request_id TEXT NOT NULL, key_id TEXT NOT NULL, tenant TEXT NOT NULL,
    user_name TEXT NOT NULL, route TEXT NOT NULL, served_by TEXT NOT NULL, model TEXT NOT NULL,
    prompt_tokens INTEGER, completion_tokens INTEGER, cost_usd REAL NOT NULL,
    outcome TEXT NOT NULL, status INTEGER NOT NULL, billed INTEGER NOT NULL,
    budget_mark TEXT, cache_mark TEXT,
    PRIMARY KEY (at, request_id)) WITHOUT ROWID
"""
#: The columns of a :data:`Settled` tuple, in its order.
_SQLITE_SETTLED = (
    "request_id, at, key_id, tenant, user_name, route, served_by, model, prompt_tokens,"
    " completion_tokens, cost_usd, outcome, status, billed, budget_mark, cache_mark"
)
_SQLITE_INSERT = f"INSERT OR IGNORE INTO ledger ({_SQLITE_SETTLED}) VALUES ({', '.join('?' * 16)})"
#: :func:`row_of` in SQL: a stored settled request read back as a :class:`LedgerRow`.
_SQLITE_ROW = (
    "request_id, at, key_id, tenant, user_name, route, served_by, model,"
    " coalesce(prompt_tokens, 0), coalesce(completion_tokens, 0), cost_usd, outcome, status,"
    " billed, coalesce(budget_mark = 'degraded', 0) OR substr(outcome, 1, 8) = 'degraded',"
    f" coalesce(cache_mark IN ({', '.join(repr(m) for m in sorted(CACHED))}), 0),"
    " coalesce(cache_mark = 'idempotent-replay', 0)"
)
#: The first layout of the table (flags worked out on insert, keyed by request id), whose rows
#: the store moves into the current one when it finds them.
_SQLITE_FIRST_LAYOUT = (
    f"INSERT OR IGNORE INTO ledger ({_SQLITE_SETTLED})"
    " SELECT request_id, at, key_id, tenant, user_name, route, served_by, model, prompt_tokens,"
    " completion_tokens, cost_usd, outcome, status, billed,"
    " CASE WHEN degraded THEN 'degraded' ELSE '' END,"
    " CASE WHEN cached THEN 'hit' WHEN replayed THEN 'idempotent-replay' END"
    " FROM ledger_first"
)
#: Rows written per transaction, one transaction per round of the event loop: about a third of
#: a millisecond each, so a batch of thousands never holds the loop for long.
SQLITE_CHUNK_ROWS = 100

#: The SQL of one group's key, by grouping (``||`` joins text in SQLite and Postgres alike).
GROUP_SQL = {
    "key": "key_id",
    "user": "tenant || ':' || user_name",
    "tenant": "tenant",
    "model": "model",
}
#: The sums of a summary, in :class:`SpendGroup`'s order after the key.
SUMS_SQL = (
    "COUNT(*), SUM(CASE WHEN billed THEN 1 ELSE 0 END),"
    " SUM(CASE WHEN billed THEN prompt_tokens ELSE 0 END),"
    " SUM(CASE WHEN billed THEN completion_tokens ELSE 0 END),"
    " SUM(CASE WHEN billed THEN cost_usd ELSE 0 END)"
)


def group_sql(group_by: GroupBy) -> str:
    if group_by not in GROUPS:
        raise ValueError(f"group_by must be one of {', '.join(GROUPS)}, got {group_by!r}")
    return GROUP_SQL[group_by]


def groups_from(found: Iterable[Sequence[Any]]) -> list[SpendGroup]:
    """Summary rows ``(key, requests, calls, prompt, completion, cost)`` as groups, ordered."""
    return _ordered(
        SpendGroup(
            str(r[0]), int(r[1]), int(r[2] or 0), int(r[3] or 0), int(r[4] or 0), float(r[5] or 0)
        )
        for r in found
    )


def row_from(values: Sequence[Any]) -> LedgerRow:
    """A row as a driver returns it (flags as integers or booleans)."""
    row = LedgerRow._make(values)
    return row._replace(
        billed=bool(row.billed),
        degraded=bool(row.degraded),
        cached=bool(row.cached),
        replayed=bool(row.replayed),
        cost_usd=float(row.cost_usd),
    )


class SQLiteLedgerStore:
    """The ledger in the shared SQLite file; the table is added on first use.

    A batch is written on the event loop through the database's one connection, in
    transactions of :data:`SQLITE_CHUNK_ROWS` rows with a round of the loop between them. An
    insert that only binds values costs about 3 µs a row. (Written on a worker thread through a
    connection of its own, the same batch cost the process ten times as much: the thread took
    the GIL back for every row, and the event loop's own statements waited for the thread's
    write lock; ``benchmarks/gateway.py`` measured about 45 µs of CPU a request for it.)
    """

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

        def create(conn: sqlite3.Connection) -> None:
            columns = {r[1] for r in conn.execute("PRAGMA table_info(ledger)")}
            first_layout = "degraded" in columns
            if first_layout:
                conn.execute("ALTER TABLE ledger RENAME TO ledger_first")
            conn.execute(_SQLITE_TABLE)
            if first_layout:
                conn.execute(_SQLITE_FIRST_LAYOUT)
                conn.execute("DROP TABLE ledger_first")

        db.run(create)

    async def append(self, settled: Sequence[Settled]) -> None:
        for start in range(0, len(settled), SQLITE_CHUNK_ROWS):
            if start:
                await loop_round()
            chunk = settled[start : start + SQLITE_CHUNK_ROWS]
            self._db.run(partial(_insert, chunk))

    async def purge(self, before: float) -> int:
        return self._db.run(
            lambda conn: conn.execute("DELETE FROM ledger WHERE at < ?", (before,)).rowcount
        )

    async def rows(self, start: float, end: float, *, limit: int = 10_000) -> list[LedgerRow]:
        check_range(start, end)
        found = self._db.run(
            lambda conn: conn.execute(
                f"SELECT {_SQLITE_ROW} FROM ledger WHERE at >= ? AND at < ?"
                " ORDER BY at, request_id LIMIT ?",
                (start, end, limit),
            ).fetchall()
        )
        return [row_from(r) for r in found]

    async def summary(self, group_by: GroupBy, start: float, end: float) -> list[SpendGroup]:
        check_range(start, end)
        key = group_sql(group_by)
        found = self._db.run(
            lambda conn: conn.execute(
                f"SELECT {key}, {SUMS_SQL} FROM ledger WHERE at >= ? AND at < ? GROUP BY 1",
                (start, end),
            ).fetchall()
        )
        return groups_from(found)


def _insert(settled: Sequence[Settled], conn: sqlite3.Connection) -> None:
    conn.executemany(_SQLITE_INSERT, settled)
