"""The key store's contract, run against every backend: compare-and-set writes, an audit record
per write, a change counter that moves with every write, and a notice on the flags' channel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio

from tests.state.conftest import (
    postgres_database,
    postgres_schema,
    redis_database,
    redis_prefix,
)
from tidegate.clock import ManualClock
from tidegate.gateway.auth import hash_key
from tidegate.state.base import KeyAudit, KeyConflict, KeyRecord, KeyStore
from tidegate.state.keys import KEYS_NOTICE, MemoryKeyStore, SQLiteKeyStore
from tidegate.state.notify import WatchableFlagStore
from tidegate.state.postgres import PostgresFlagStore
from tidegate.state.postgres_keys import PostgresKeyStore
from tidegate.state.redis import RedisFlagStore
from tidegate.state.redis_keys import RedisKeyStore
from tidegate.state.sqlite import SQLiteDatabase

pytestmark = pytest.mark.asyncio

Factory = Callable[[], Awaitable[KeyStore]]


async def _factory(name: str, clock: ManualClock, tmp: Path, stack: AsyncExitStack) -> Factory:
    if name == "memory":
        shared = MemoryKeyStore(clock)

        async def memory() -> KeyStore:
            return shared

        return memory
    if name == "sqlite":

        async def sqlite() -> KeyStore:
            db = SQLiteDatabase(tmp / "state.db")
            stack.callback(db.close)
            return SQLiteKeyStore(db, clock)

        return sqlite
    if name == "redis":
        url, prefix = await redis_prefix(stack)

        async def redis() -> KeyStore:
            return RedisKeyStore(await redis_database(stack, url, prefix), clock)

        return redis
    pg_url, schema = await postgres_schema(stack)

    async def postgres() -> KeyStore:
        return PostgresKeyStore(await postgres_database(stack, pg_url, schema), clock)

    return postgres


@pytest_asyncio.fixture(params=["memory", "sqlite", "redis", "postgres"])
async def stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[KeyStore, KeyStore]]:
    """Two views of one key store (two connections: two replicas), on every backend."""
    clock = ManualClock(0.0, wall_start=1_000_000.0)
    async with AsyncExitStack() as stack:
        make = await _factory(request.param, clock, tmp_path, stack)
        yield await make(), await make()


def record(key_id: str = "svc", **fields: object) -> KeyRecord:
    base = KeyRecord(
        id=key_id,
        sha256=hash_key(f"secret-{key_id}"),
        tenant="shop",
        user="checkout",
        priority="critical",
        models=("chat", "embed"),
        rate_limit={"rate_per_s": 2.5, "burst": 10.0},
        budget={"calls": 100, "cost_usd": 0.1},
        expires_at=1_000_000.0 + 0.1,
        metadata={"team": "payments", "ticket": [1, 2]},
        created_at=1_000_000.0,
        created_by="oncall",
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def change(action: str, who: str = "oncall", why: str = "") -> KeyAudit:
    return KeyAudit("", action, who, why, 0.0, {"fields": ["tenant"]})


async def test_a_key_round_trips_exactly(stores: tuple[KeyStore, KeyStore]) -> None:
    """Every field reads back as written (floats to the bit), from another connection too."""
    store, other = stores
    written = await store.put(record(), expected_revision=0, audit=change("create"))
    assert written == record(revision=1)
    assert await other.get("svc") == written
    assert await other.all() == [written]
    assert await other.get("nobody") is None


async def test_writes_compare_and_set_the_revision(stores: tuple[KeyStore, KeyStore]) -> None:
    """A create of an existing id, or an update from a stale revision, is a conflict."""
    store, other = stores
    await store.put(record(), expected_revision=0, audit=change("create"))
    with pytest.raises(KeyConflict) as taken:
        await other.put(record(), expected_revision=0, audit=change("create"))
    assert (taken.value.expected, taken.value.current) == (0, 1)
    revoked = replace(record(), revoked_at=1_000_001.0, revoked_by="oncall")
    second = await other.put(revoked, expected_revision=1, audit=change("revoke"))
    assert second.revision == 2
    with pytest.raises(KeyConflict):
        await store.put(record(tenant="other"), expected_revision=1, audit=change("update"))
    with pytest.raises(KeyConflict) as missing:
        await store.put(record("ghost"), expected_revision=3, audit=change("update"))
    assert missing.value.current == 0
    assert (await store.get("svc")) == replace(revoked, revision=2)


async def test_every_write_is_audited_and_moves_the_counter(
    stores: tuple[KeyStore, KeyStore],
) -> None:
    """Who, why, what and when, newest first, per key and for all; a refused write leaves no
    record and does not move the counter."""
    store, other = stores
    assert await store.version() == 0
    await store.put(record("a"), expected_revision=0, audit=change("create", why="new service"))
    first = await other.version()
    await store.put(record("b"), expected_revision=0, audit=change("create"))
    await store.put(record("a", user="u2"), expected_revision=1, audit=change("update", "ops"))
    with pytest.raises(KeyConflict):
        await store.put(record("a"), expected_revision=1, audit=change("update"))
    third = await other.version()
    assert 0 < first < third
    history = await other.history("a")
    assert [(h.action, h.who) for h in history] == [("update", "ops"), ("create", "oncall")]
    assert history[1].why == "new service"
    assert history[0].detail == {"fields": ["tenant"]}
    assert history[0].at == pytest.approx(1_000_000.0)
    assert [h.key_id for h in await other.history()] == ["a", "b", "a"]
    assert len(await other.history(limit=2)) == 2
    assert await other.history(limit=0) == []


async def test_concurrent_revokes_of_one_key_write_once(
    stores: tuple[KeyStore, KeyStore],
) -> None:
    """Ten replicas change one key from the same revision at once: exactly one write lands."""
    store, other = stores
    await store.put(record(), expected_revision=0, audit=change("create"))
    results = await asyncio.gather(
        *(
            (store, other)[i % 2].put(
                record(metadata={"writer": i}), expected_revision=1, audit=change("update")
            )
            for i in range(10)
        ),
        return_exceptions=True,
    )
    landed = [r for r in results if isinstance(r, KeyRecord)]
    assert len(landed) == 1
    assert all(isinstance(r, KeyConflict) for r in results if r not in landed)
    assert len(await store.history("svc")) == 2


async def _watched(name: str, stack: AsyncExitStack) -> tuple[WatchableFlagStore, KeyStore]:
    """A flag store and a key store on one Redis or Postgres database."""
    if name == "redis":
        redis = await redis_database(stack, *await redis_prefix(stack))
        return RedisFlagStore(redis), RedisKeyStore(redis)
    postgres = await postgres_database(stack, *await postgres_schema(stack))
    return PostgresFlagStore(postgres), PostgresKeyStore(postgres)


@pytest.mark.parametrize("backend", ["redis", "postgres"])
async def test_write_sends_the_keys_notice(backend: str) -> None:
    """A key write is announced on the flags' channel, so the flags' subscription hears it."""
    async with AsyncExitStack() as stack:
        flags, keys = await _watched(backend, stack)
        async with flags.watch() as changes:
            await keys.put(record(), expected_revision=0, audit=change("create"))
            assert await changes.next(2.0) == KEYS_NOTICE
