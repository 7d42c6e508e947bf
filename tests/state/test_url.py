"""Choosing stores by URL, splitting them between a durable and a fast backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import pytest_asyncio

from tests.state.conftest import postgres_schema, redis_prefix
from tidegate.clock import ManualClock
from tidegate.errors import ConfigError, StoreError
from tidegate.policy.ratelimit import BucketOptions
from tidegate.state.actions import MemoryPendingActionStore, SQLitePendingActionStore
from tidegate.state.base import ClaimOutcome
from tidegate.state.memory import MemoryBucketStore, MemoryIdempotencyStore
from tidegate.state.postgres import PostgresBucketStore, PostgresIdempotencyStore
from tidegate.state.redis import RedisBucketStore, RedisIdempotencyStore
from tidegate.state.sqlite import SQLiteBucketStore
from tidegate.state.url import SCHEMES, redact, store_from_url, store_from_urls

BUCKET = BucketOptions(rate=1.0, burst=2.0)


@pytest_asyncio.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as stack:
        yield stack


@pytest.mark.asyncio
async def test_memory_url_keeps_everything_in_the_process() -> None:
    """memory:// gives in-process stores; ping always succeeds."""
    stores = await store_from_url("memory://", clock=ManualClock())
    assert isinstance(stores.buckets, MemoryBucketStore)
    assert isinstance(stores.actions, MemoryPendingActionStore)
    await stores.ping()
    await stores.aclose()


@pytest.mark.asyncio
async def test_sqlite_url_puts_every_store_in_one_file(tmp_path: Path) -> None:
    """sqlite:///path opens one file for every store, actions and rollout state included."""
    async with await store_from_url(f"sqlite:///{tmp_path}/s.db", clock=ManualClock()) as stores:
        assert isinstance(stores.buckets, SQLiteBucketStore)
        assert isinstance(stores.actions, SQLitePendingActionStore)
        await stores.ping_durable()
        await stores.rollout.put("canary", {"share": 0.1}, expected_version=0)
    async with await store_from_url(f"sqlite:///{tmp_path}/s.db", clock=ManualClock()) as again:
        record = await again.rollout.get("canary")
        assert record is not None
        assert record.value == {"share": 0.1}


@pytest.mark.asyncio
async def test_an_unknown_scheme_is_a_config_error_naming_the_url() -> None:
    """A URL no backend knows stops start-up with the URL in the message, password hidden."""
    with pytest.raises(ConfigError) as caught:
        await store_from_url("mongodb://admin:hunter2@db/state", clock=ManualClock())
    assert "mongodb://admin:***@db/state" in caught.value.message
    assert "hunter2" not in caught.value.message
    with pytest.raises(ConfigError):
        await store_from_urls(durable="memory://", fast="etcd://x", clock=ManualClock())


@pytest.mark.asyncio
async def test_a_malformed_url_is_a_config_error() -> None:
    """A URL with a known scheme but unusable parts stops start-up too."""
    with pytest.raises(ConfigError, match="schema"):
        await store_from_url("postgresql://db/x?schema=Not-An-Identifier", clock=ManualClock())
    with pytest.raises(ConfigError, match="redis://cache:port"):
        await store_from_url("redis://cache:port/0", clock=ManualClock())


def test_redact_hides_only_the_password() -> None:
    """Passwords are masked; URLs without one are unchanged."""
    assert redact("redis://:s3cret@cache:6379/0") == "redis://:***@cache:6379/0"
    assert redact("postgresql://app:s3cret@db/x?schema=y") == "postgresql://app:***@db/x?schema=y"
    assert redact("sqlite:///state.db") == "sqlite:///state.db"
    assert "postgresql" in SCHEMES


@pytest.mark.asyncio
async def test_a_split_keeps_durable_state_apart_from_fast_state(tmp_path: Path) -> None:
    """durable holds idempotency, flags, actions and rollout; fast holds buckets, budgets, cache."""
    stores = await store_from_urls(
        durable=f"sqlite:///{tmp_path}/s.db", fast="memory://", clock=ManualClock()
    )
    assert isinstance(stores.buckets, MemoryBucketStore)
    assert isinstance(stores.actions, SQLitePendingActionStore)
    assert not isinstance(stores.idempotency, MemoryIdempotencyStore)
    assert (stores.durable_url, stores.fast_url) == (f"sqlite:///{tmp_path}/s.db", "memory://")
    await stores.aclose()


@pytest.mark.asyncio
async def test_batches_group_the_fast_backends_calls(tmp_path: Path) -> None:
    """batch() and committed() are the fast backend's: on SQLite a batch's writes wait for the
    round's commit; with a memory fast store they change nothing, also when the durable store is
    SQLite."""
    stores = await store_from_url(f"sqlite:///{tmp_path}/s.db", clock=ManualClock())
    buckets = stores.buckets
    assert isinstance(buckets, SQLiteBucketStore)

    def open_round() -> bool:
        return buckets._db._conn.in_transaction

    with stores.batch():
        assert (await buckets.take("k", BUCKET)).allowed
    assert open_round()  # committed with the round, not yet
    await stores.committed()
    assert not open_round()
    await stores.aclose()

    split = await store_from_urls(
        durable=f"sqlite:///{tmp_path}/t.db", fast="memory://", clock=ManualClock()
    )
    with split.batch():
        assert (await split.buckets.take("k", BUCKET)).allowed
    await split.committed()  # nothing to wait for
    await split.aclose()


@pytest.mark.asyncio
async def test_redis_url_uses_redis_for_everything(stack: AsyncExitStack) -> None:
    """redis:// puts every store in Redis, deciding time on the server's clock by default."""
    url, prefix = await redis_prefix(stack)
    stores = await store_from_url(f"{url}?prefix={prefix}", clock=ManualClock())
    stack.push_async_callback(stores.aclose)
    assert isinstance(stores.buckets, RedisBucketStore)
    assert isinstance(stores.idempotency, RedisIdempotencyStore)
    assert stores.redis is not None
    assert stores.redis.prefix == prefix
    await stores.ping()
    assert (await stores.buckets.take("u", BUCKET)).allowed


@pytest.mark.asyncio
async def test_postgres_url_uses_postgres_for_everything(stack: AsyncExitStack) -> None:
    """postgresql:// opens the pool and migrates at start-up; every store is in Postgres."""
    url, schema = await postgres_schema(stack)
    stores = await store_from_url(f"{url}?schema={schema}", clock=ManualClock())
    stack.push_async_callback(stores.aclose)
    assert isinstance(stores.buckets, PostgresBucketStore)
    assert stores.postgres is not None
    assert stores.postgres.schema == schema
    claim = await stores.idempotency.claim("k", "fp", lease_s=30)
    assert claim.outcome is ClaimOutcome.CLAIMED


@pytest.mark.asyncio
async def test_a_fleet_split_uses_postgres_and_redis(stack: AsyncExitStack) -> None:
    """The fleet layout: Postgres for what must last, Redis for what must be fast."""
    pg, schema = await postgres_schema(stack)
    redis, prefix = await redis_prefix(stack)
    stores = await store_from_urls(
        durable=f"{pg}?schema={schema}", fast=f"{redis}?prefix={prefix}", clock=ManualClock()
    )
    stack.push_async_callback(stores.aclose)
    assert isinstance(stores.idempotency, PostgresIdempotencyStore)
    assert isinstance(stores.buckets, RedisBucketStore)
    assert stores.redis is not None
    assert stores.postgres is not None
    await stores.ping()


@pytest.mark.asyncio
async def test_readiness_ignores_a_fast_store_outage(tmp_path: Path) -> None:
    """ping_durable() passes while the cache backend is down; ping() reports it."""
    stores = await store_from_urls(
        durable=f"sqlite:///{tmp_path}/s.db",
        fast="redis://127.0.0.1:1/0",
        clock=ManualClock(),
        timeout_s=0.2,
    )
    await stores.ping_durable()
    with pytest.raises(StoreError):
        await stores.ping()
    await stores.aclose()


@pytest.mark.asyncio
async def test_an_unreachable_postgres_fails_start_up_with_a_store_error() -> None:
    """A durable store that cannot be reached stops start-up with StoreError, not a hang."""
    with pytest.raises(StoreError):
        await store_from_url("postgresql://nobody@127.0.0.1:1/none", clock=ManualClock())
