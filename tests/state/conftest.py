"""Store backends for the contract tests, each isolated and cleaned up after its test.

Redis and Postgres run when ``TIDEGATE_TEST_REDIS_URL`` / ``TIDEGATE_TEST_POSTGRES_URL`` are set
(and then fail loudly if the service does not answer); otherwise their tests skip and say why.
Each Redis test gets a random key prefix, each Postgres test a fresh schema, dropped afterwards.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import pytest_asyncio
from psycopg import sql

from tidegate.clock import ManualClock
from tidegate.state.actions import (
    MemoryPendingActionStore,
    PendingActionStore,
    SQLitePendingActionStore,
)
from tidegate.state.base import BucketStore, CacheStore, FlagStore, IdempotencyStore, QuotaStore
from tidegate.state.memory import (
    MemoryBucketStore,
    MemoryCacheStore,
    MemoryFlagStore,
    MemoryIdempotencyStore,
    MemoryQuotaStore,
)
from tidegate.state.postgres import (
    PostgresBucketStore,
    PostgresCacheStore,
    PostgresDatabase,
    PostgresFlagStore,
    PostgresIdempotencyStore,
    PostgresPendingActionStore,
    PostgresQuotaStore,
    PostgresRolloutStore,
)
from tidegate.state.redis import (
    RedisBucketStore,
    RedisCacheStore,
    RedisDatabase,
    RedisFlagStore,
    RedisIdempotencyStore,
    RedisPendingActionStore,
    RedisQuotaStore,
    RedisRolloutStore,
)
from tidegate.state.rollout import MemoryRolloutStore, RolloutStore, SQLiteRolloutStore
from tidegate.state.sqlite import (
    SQLiteBucketStore,
    SQLiteCacheStore,
    SQLiteDatabase,
    SQLiteFlagStore,
    SQLiteIdempotencyStore,
    SQLiteQuotaStore,
)

REDIS_ENV = "TIDEGATE_TEST_REDIS_URL"
POSTGRES_ENV = "TIDEGATE_TEST_POSTGRES_URL"

#: Generous: the contract is about what stores decide, not how fast; timeouts have their own tests.
TIMEOUT_S = 5.0


def service_url(env: str) -> str:
    """The URL in ``env``, or skip the test (saying which variable would run it)."""
    url = os.environ.get(env, "")
    if not url:
        pytest.skip(f"set {env} to run the tests that need this service")
    return url


@dataclass
class Backend:
    name: str
    clock: ManualClock
    idempotency: IdempotencyStore
    cache: CacheStore
    flags: FlagStore
    buckets: BucketStore
    quotas: QuotaStore
    actions: PendingActionStore
    rollout: RolloutStore
    #: Another process's view of the same state, on connections of its own (memory: the same).
    replica: Callable[[], Awaitable[Backend]]


Factory = Callable[[], Awaitable[Backend]]


def _memory(clock: ManualClock) -> Factory:
    async def make() -> Backend:
        return shared

    shared = Backend(
        "memory",
        clock,
        MemoryIdempotencyStore(clock),
        MemoryCacheStore(clock),
        MemoryFlagStore(clock),
        MemoryBucketStore(clock),
        MemoryQuotaStore(clock),
        MemoryPendingActionStore(clock),
        MemoryRolloutStore(clock),
        make,
    )
    return make


def _sqlite(clock: ManualClock, path: Path, stack: AsyncExitStack) -> Factory:
    async def make() -> Backend:
        db = SQLiteDatabase(path)
        stack.callback(db.close)
        return Backend(
            "sqlite",
            clock,
            SQLiteIdempotencyStore(db, clock),
            SQLiteCacheStore(db, clock),
            SQLiteFlagStore(db, clock),
            SQLiteBucketStore(db, clock),
            SQLiteQuotaStore(db, clock),
            SQLitePendingActionStore(db, clock),
            SQLiteRolloutStore(db, clock),
            make,
        )

    return make


async def redis_prefix(stack: AsyncExitStack) -> tuple[str, str]:
    """The Redis URL and a fresh key prefix whose keys are deleted when ``stack`` closes."""
    url = service_url(REDIS_ENV)
    prefix = f"tidegate-test:{secrets.token_hex(6)}:"

    async def clean() -> None:
        db = RedisDatabase(url, prefix=prefix, timeout_s=TIMEOUT_S)
        keys = [key async for key in db.client.scan_iter(match=f"{prefix}*", count=500)]
        if keys:
            await db.client.delete(*keys)
        await db.aclose()

    stack.push_async_callback(clean)
    return url, prefix


async def redis_database(stack: AsyncExitStack, url: str, prefix: str) -> RedisDatabase:
    db = RedisDatabase(url, prefix=prefix, timeout_s=TIMEOUT_S)
    stack.push_async_callback(db.aclose)
    await db.ping()  # fail loudly, here, if the variable names a Redis that does not answer
    return db


async def _redis(clock: ManualClock, stack: AsyncExitStack) -> Factory:
    url, prefix = await redis_prefix(stack)

    async def make() -> Backend:
        db = await redis_database(stack, url, prefix)
        return Backend(
            "redis",
            clock,
            RedisIdempotencyStore(db, clock),
            RedisCacheStore(db, clock),
            RedisFlagStore(db, clock),
            RedisBucketStore(db, clock),
            RedisQuotaStore(db, clock),
            RedisPendingActionStore(db, clock),
            RedisRolloutStore(db, clock),
            make,
        )

    return make


async def postgres_schema(stack: AsyncExitStack) -> tuple[str, str]:
    """The Postgres URL and a fresh schema name, dropped (with its tables) when ``stack`` closes."""
    url = service_url(POSTGRES_ENV)
    schema = f"tidegate_test_{secrets.token_hex(6)}"

    async def drop() -> None:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )

    stack.push_async_callback(drop)
    return url, schema


async def postgres_database(stack: AsyncExitStack, url: str, schema: str) -> PostgresDatabase:
    db = await PostgresDatabase.connect(url, schema=schema, timeout_s=TIMEOUT_S)
    stack.push_async_callback(db.aclose)
    return db


async def _postgres(clock: ManualClock, stack: AsyncExitStack) -> Factory:
    url, schema = await postgres_schema(stack)

    async def make() -> Backend:
        db = await postgres_database(stack, url, schema)
        return Backend(
            "postgres",
            clock,
            PostgresIdempotencyStore(db, clock),
            PostgresCacheStore(db, clock),
            PostgresFlagStore(db, clock),
            PostgresBucketStore(db, clock),
            PostgresQuotaStore(db, clock),
            PostgresPendingActionStore(db, clock),
            PostgresRolloutStore(db, clock),
            make,
        )

    return make


@pytest_asyncio.fixture(params=["memory", "sqlite", "redis", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """Every store protocol, on every backend; Redis and Postgres only where configured."""
    clock = ManualClock(0.0, wall_start=1_000_000.0)
    async with AsyncExitStack() as stack:
        if request.param == "memory":
            make = _memory(clock)
        elif request.param == "sqlite":
            make = _sqlite(clock, tmp_path / "state.db", stack)
        elif request.param == "redis":
            make = await _redis(clock, stack)
        else:
            make = await _postgres(clock, stack)
        yield await make()
