from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tidegate.clock import ManualClock
from tidegate.state.base import BucketStore, CacheStore, FlagStore, IdempotencyStore, QuotaStore
from tidegate.state.memory import (
    MemoryBucketStore,
    MemoryCacheStore,
    MemoryFlagStore,
    MemoryIdempotencyStore,
    MemoryQuotaStore,
)
from tidegate.state.sqlite import (
    SQLiteBucketStore,
    SQLiteCacheStore,
    SQLiteDatabase,
    SQLiteFlagStore,
    SQLiteIdempotencyStore,
    SQLiteQuotaStore,
)


@dataclass
class Backend:
    name: str
    clock: ManualClock
    idempotency: IdempotencyStore
    cache: CacheStore
    flags: FlagStore
    buckets: BucketStore
    quotas: QuotaStore


@pytest.fixture(params=["memory", "sqlite"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Every store protocol, on every backend this machine can run without services."""
    clock = ManualClock(0.0, wall_start=1_000_000.0)
    if request.param == "memory":
        yield Backend(
            "memory",
            clock,
            MemoryIdempotencyStore(clock),
            MemoryCacheStore(clock),
            MemoryFlagStore(clock),
            MemoryBucketStore(clock),
            MemoryQuotaStore(clock),
        )
        return
    db = SQLiteDatabase(tmp_path / "state.db")
    yield Backend(
        "sqlite",
        clock,
        SQLiteIdempotencyStore(db, clock),
        SQLiteCacheStore(db, clock),
        SQLiteFlagStore(db, clock),
        SQLiteBucketStore(db, clock),
        SQLiteQuotaStore(db, clock),
    )
    db.close()
