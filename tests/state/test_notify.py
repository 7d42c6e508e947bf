"""Which flag stores can announce changes (the others are polled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidegate.clock import ManualClock
from tidegate.state.memory import MemoryFlagStore
from tidegate.state.notify import FlagChanges, WatchableFlagStore
from tidegate.state.postgres import PostgresDatabase, PostgresFlagChanges, PostgresFlagStore
from tidegate.state.redis import RedisDatabase, RedisFlagChanges, RedisFlagStore
from tidegate.state.sqlite import SQLiteDatabase, SQLiteFlagStore


@pytest.mark.asyncio
async def test_redis_and_postgres_flag_stores_can_be_watched(tmp_path: Path) -> None:
    """The shared backends announce changes; the in-process and file backends do not."""
    redis = RedisDatabase("redis://127.0.0.1:1/0")
    postgres = PostgresDatabase("postgresql://127.0.0.1:1/none")
    sqlite = SQLiteDatabase(tmp_path / "s.db")
    assert isinstance(RedisFlagStore(redis), WatchableFlagStore)
    assert isinstance(PostgresFlagStore(postgres), WatchableFlagStore)
    assert not isinstance(MemoryFlagStore(ManualClock()), WatchableFlagStore)
    assert not isinstance(SQLiteFlagStore(sqlite, ManualClock()), WatchableFlagStore)
    assert isinstance(RedisFlagChanges(redis, "c"), FlagChanges)
    assert isinstance(PostgresFlagChanges(postgres, "c"), FlagChanges)
    sqlite.close()
    await redis.aclose()
    await postgres.aclose()


@pytest.mark.asyncio
async def test_a_subscription_is_used_inside_its_block() -> None:
    """Waiting on a subscription that was never entered is a programming error, said plainly."""
    redis = RedisDatabase("redis://127.0.0.1:1/0")
    with pytest.raises(RuntimeError, match="async with"):
        await RedisFlagStore(redis).watch().next(0.01)
    await redis.aclose()
