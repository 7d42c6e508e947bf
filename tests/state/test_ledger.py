"""The spend ledger's contract, run against every durable backend."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.state.conftest import (
    postgres_database,
    postgres_schema,
    redis_database,
    redis_prefix,
)
from tidegate.clock import ManualClock, loop_round
from tidegate.state.ledger import (
    LedgerRow,
    LedgerStore,
    MemoryLedgerStore,
    SQLiteLedgerStore,
    row_of,
    settled_of,
    summarize,
)
from tidegate.state.ledger_remote import PostgresLedgerStore, RedisLedgerStore
from tidegate.state.sqlite import SQLiteDatabase
from tidegate.state.url import store_from_url

pytestmark = pytest.mark.asyncio

T0 = 1_000_000.0


def row(n: int, **changes: Any) -> LedgerRow:
    base = LedgerRow(
        request_id=f"req-{n}",
        at=T0 + n,
        key_id="key-a",
        tenant="shop",
        user="alice",
        route="chat",
        served_by="primary",
        model="gpt-x",
        prompt_tokens=10,
        completion_tokens=5,
        cost_usd=0.25,
        outcome="ok",
        status=200,
        billed=True,
        degraded=False,
        cached=False,
        replayed=False,
    )
    return base._replace(**changes)


@pytest_asyncio.fixture(params=["memory", "sqlite", "redis", "postgres"])
async def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LedgerStore]:
    async with AsyncExitStack() as stack:
        store: LedgerStore
        if request.param == "memory":
            store = MemoryLedgerStore()
        elif request.param == "sqlite":
            db = SQLiteDatabase(tmp_path / "state.db")
            stack.callback(db.close)
            store = SQLiteLedgerStore(db)
        elif request.param == "redis":
            url, prefix = await redis_prefix(stack)
            store = RedisLedgerStore(await redis_database(stack, url, prefix))
        else:
            url, schema = await postgres_schema(stack)
            pg = PostgresLedgerStore(await postgres_database(stack, url, schema))
            await pg.open()
            await pg.open()  # a second replica's start-up finds the table there
            store = pg
        yield store


async def test_rows_come_back_as_written_in_their_range(ledger: LedgerStore) -> None:
    rows = [row(1), row(2, served_by="primary,fallback", cached=True), row(3, billed=False)]
    await ledger.append([settled_of(r) for r in rows])
    assert await ledger.rows(T0, T0 + 10) == rows
    assert await ledger.rows(T0 + 2, T0 + 3) == [rows[1]]  # the end is left out
    assert await ledger.rows(T0, T0 + 10, limit=2) == rows[:2]


async def test_a_retried_batch_adds_nothing(ledger: LedgerStore) -> None:
    rows = [row(n) for n in range(5)]
    await ledger.append([settled_of(r) for r in rows])
    await ledger.append([settled_of(r) for r in rows])
    assert len(await ledger.rows(T0, T0 + 10)) == 5


async def test_two_requests_that_reuse_a_request_id_are_two_rows(ledger: LedgerStore) -> None:
    """A caller may send the same X-Request-ID twice: each request settled is spend."""
    first, second = row(1), row(2, request_id="req-1", cost_usd=1.0)
    await ledger.append([settled_of(first)])
    await ledger.append([settled_of(second)])
    assert await ledger.rows(T0, T0 + 10) == [first, second]
    (group,) = await ledger.summary("user", T0, T0 + 10)
    assert (group.requests, group.calls) == (2, 2)


async def test_summary_counts_only_billed_spend(ledger: LedgerStore) -> None:
    rows = [
        row(1),
        row(2, user="bob", cost_usd=1.0),
        row(3, billed=False, outcome="upstream_error", status=502),
        row(4, key_id="key-b", model="gpt-y", prompt_tokens=7, completion_tokens=0),
    ]
    await ledger.append([settled_of(r) for r in rows])
    by_user = await ledger.summary("user", T0, T0 + 10)
    assert [(g.key, g.requests, g.calls, g.tokens) for g in by_user] == [
        ("shop:bob", 1, 1, 15),
        ("shop:alice", 3, 2, 22),
    ]
    assert by_user[1].cost_usd == pytest.approx(0.5)
    assert await ledger.summary("user", T0, T0 + 10) == summarize(rows, "user")
    for group_by in ("key", "tenant", "model"):
        assert await ledger.summary(group_by, T0, T0 + 10) == summarize(rows, group_by)
    assert await ledger.summary("model", T0 + 5, T0 + 6) == []


async def test_purge_deletes_only_older_rows(ledger: LedgerStore) -> None:
    await ledger.append([settled_of(r) for r in [row(n) for n in range(6)]])
    assert await ledger.purge(T0 + 3) == 3
    assert [r.request_id for r in await ledger.rows(0, T0 + 10)] == ["req-3", "req-4", "req-5"]


async def test_an_empty_batch_and_a_backwards_range(ledger: LedgerStore) -> None:
    await ledger.append([])
    assert await ledger.rows(T0, T0) == []
    with pytest.raises(ValueError, match="must not end before"):
        await ledger.rows(T0 + 1, T0)
    with pytest.raises(ValueError, match="group_by"):
        await ledger.summary("colour", T0, T0 + 1)  # type: ignore[arg-type]


async def test_concurrent_batches_all_land(ledger: LedgerStore) -> None:
    batches = [[settled_of(row(b * 100 + i)) for i in range(20)] for b in range(5)]
    await asyncio.gather(*(ledger.append(batch) for batch in batches))
    assert len(await ledger.rows(0, T0 + 1000)) == 100


async def test_the_gateways_marks_become_the_rows_flags(ledger: LedgerStore) -> None:
    """What the request path records (token counts maybe unknown, the budget's and the cache's
    marks) is stored as the same row by every backend, as :func:`row_of` makes it."""
    base = ("r", T0, "k", "t", "u", "chat", "p", "m", None, 4, 0.1, "ok", 200, True, "", None)
    settled = [
        base,
        ("r2", *base[1:14], "degraded", "miss"),
        ("r3", *base[1:11], "degraded_corpus", 200, False, "", None),
        ("r4", *base[1:13], True, "", "stale"),
        ("r5", *base[1:13], False, "", "idempotent-replay"),
        ("r6", *base[1:13], True, "", "shared"),
    ]
    await ledger.append(settled)
    found = await ledger.rows(0, T0 + 1)
    assert sorted(found) == sorted(row_of(s) for s in settled)
    flags = {r.request_id: (r.billed, r.degraded, r.cached, r.replayed) for r in found}
    assert flags == {
        "r": (True, False, False, False),
        "r2": (True, True, False, False),
        "r3": (False, True, False, False),
        "r4": (True, False, True, False),
        "r5": (False, False, False, True),
        "r6": (True, False, True, False),
    }
    assert found[0].prompt_tokens == 0


async def test_every_url_has_a_ledger_in_its_durable_store(tmp_path: Path) -> None:
    clock = ManualClock(0.0, wall_start=T0)
    url = f"sqlite:///{tmp_path / 'state.db'}"
    async with await store_from_url(url, clock=clock) as stores:
        assert isinstance(stores.ledger, SQLiteLedgerStore)
        await stores.ledger.append([settled_of(r) for r in [row(1)]])
    async with await store_from_url(url, clock=clock) as stores:
        assert [r.request_id for r in await stores.ledger.rows(0, T0 + 10)] == ["req-1"]
    async with await store_from_url("memory://", clock=clock) as stores:
        assert isinstance(stores.ledger, MemoryLedgerStore)


async def test_sqlite_moves_the_rows_of_the_first_table_layout(tmp_path: Path) -> None:
    """A file written by the first layout (flags worked out on insert, keyed by request id)
    keeps its rows, flags included, when a store of the current layout opens it."""
    with contextlib.closing(sqlite3.connect(tmp_path / "state.db")) as conn:
        conn.executescript(
            "CREATE TABLE ledger (request_id TEXT NOT NULL, at REAL NOT NULL, key_id TEXT NOT"
            " NULL, tenant TEXT NOT NULL, user_name TEXT NOT NULL, route TEXT NOT NULL,"
            " served_by TEXT NOT NULL, model TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,"
            " completion_tokens INTEGER NOT NULL, cost_usd REAL NOT NULL, outcome TEXT NOT NULL,"
            " status INTEGER NOT NULL, billed INTEGER NOT NULL, degraded INTEGER NOT NULL,"
            " cached INTEGER NOT NULL, replayed INTEGER NOT NULL, PRIMARY KEY (request_id, at));"
            " CREATE INDEX ledger_at ON ledger (at);"
            " INSERT INTO ledger VALUES ('a', 1000001.0, 'k', 't', 'u', 'chat', 'p', 'm', 3, 4,"
            " 0.5, 'ok', 200, 1, 1, 0, 0), ('b', 1000002.0, 'k', 't', 'u', 'chat', 'p', 'm', 0,"
            " 0, 0.0, 'ok', 200, 0, 0, 0, 1), ('c', 1000003.0, 'k', 't', 'u', 'chat', 'p', 'm',"
            " 0, 0, 0.0, 'ok', 200, 1, 0, 1, 0);"
        )
    db = SQLiteDatabase(tmp_path / "state.db")
    store = SQLiteLedgerStore(db)
    try:
        found = await store.rows(0, T0 + 10)
        assert [(r.request_id, r.billed, r.degraded, r.cached, r.replayed) for r in found] == [
            ("a", True, True, False, False),
            ("b", False, False, False, True),
            ("c", True, False, True, False),
        ]
        assert (found[0].prompt_tokens, found[0].cost_usd) == (3, 0.5)
        await store.append([settled_of(row(9))])
        assert len(await store.rows(0, T0 + 10)) == 4
        tables = db.run(
            lambda conn: conn.execute("SELECT name FROM sqlite_master ORDER BY name").fetchall()
        )
        assert "ledger_first" not in {t[0] for t in tables}
    finally:
        db.close()


async def test_sqlite_writes_a_large_batch_in_chunks_with_the_loop_running(
    tmp_path: Path,
) -> None:
    """A batch of many chunks lands whole, and the event loop runs between its chunks."""
    from tidegate.state.ledger import SQLITE_CHUNK_ROWS

    db = SQLiteDatabase(tmp_path / "state.db")
    store = SQLiteLedgerStore(db)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await loop_round()

    beat = asyncio.ensure_future(ticker())
    try:
        count = SQLITE_CHUNK_ROWS * 5 + 7
        await store.append([settled_of(row(i)) for i in range(count)])
        assert len(await store.rows(0, T0 + count + 1, limit=count + 1)) == count
        assert ticks >= 5
    finally:
        beat.cancel()
        db.close()
