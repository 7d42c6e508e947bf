"""Redis-only behaviour: the server's clock, expiry, timeouts, pub/sub, single-flight, retry budget."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.state.conftest import redis_database, redis_prefix
from tidegate.clock import ManualClock, SystemClock
from tidegate.errors import StoreError
from tidegate.policy.budget import day_number
from tidegate.policy.ratelimit import BucketOptions, BucketState, take
from tidegate.policy.retry import RetryBudget
from tidegate.state.base import ClaimOutcome
from tidegate.state.redis import (
    FlightFellBack,
    FlightJoined,
    FlightLed,
    RedisBucketStore,
    RedisCacheStore,
    RedisDatabase,
    RedisFlagStore,
    RedisIdempotencyStore,
    RedisQuotaStore,
    RedisRetryBudgetCounter,
    RedisSingleFlight,
    SingleFlightEvent,
)

pytestmark = pytest.mark.asyncio

REAL = SystemClock()


class Redis:
    """A Redis test area: a fresh key prefix, and databases ("replicas") that share it."""

    def __init__(self, stack: AsyncExitStack, url: str, prefix: str) -> None:
        self._stack = stack
        self.url = url
        self.prefix = prefix

    async def replica(self) -> RedisDatabase:
        return await redis_database(self._stack, self.url, self.prefix)


@pytest_asyncio.fixture
async def redis() -> AsyncIterator[Redis]:
    async with AsyncExitStack() as stack:
        url, prefix = await redis_prefix(stack)
        yield Redis(stack, url, prefix)


# --------------------------------------------------------------------------- the server's clock


async def test_buckets_refill_on_the_server_clock(redis: Redis) -> None:
    """Without an injected clock the script reads Redis TIME: real time refills the bucket."""
    buckets = RedisBucketStore(await redis.replica())
    options = BucketOptions(rate=20.0, burst=1.0)
    assert (await buckets.take("u", options)).allowed
    refused = await buckets.take("u", options)
    assert not refused.allowed
    assert 0 < refused.retry_after <= 0.05
    await REAL.asleep(refused.retry_after + 0.01)
    assert (await buckets.take("u", options)).allowed


async def test_leases_and_answers_lapse_on_the_server_clock(redis: Redis) -> None:
    """A lease of 0.15 s lapses in 0.15 s of the server's time, and Redis drops the key."""
    db = await redis.replica()
    keys = RedisIdempotencyStore(db)
    assert (await keys.claim("k", "fp", lease_s=0.15)).outcome is ClaimOutcome.CLAIMED
    assert (await keys.claim("k", "fp", lease_s=0.15)).outcome is ClaimOutcome.IN_PROGRESS
    assert 0 < await db.client.pttl(db.key("idempotency", "k")) <= 150
    await REAL.asleep(0.2)
    assert await db.client.exists(db.key("idempotency", "k")) == 0
    assert (await keys.claim("k", "fp", lease_s=0.15)).outcome is ClaimOutcome.CLAIMED


async def test_cache_entries_expire_at_their_stale_end(redis: Redis) -> None:
    """An entry is fresh, then stale, then gone from Redis itself."""
    db = await redis.replica()
    cache = RedisCacheStore(db)
    await cache.put("q", b"answer", ttl_s=0.1, stale_ttl_s=0.1)
    entry = await cache.get("q")
    assert entry is not None
    assert entry.fresh
    await REAL.asleep(0.12)
    assert await cache.get("q") is None
    stale = await cache.get("q", allow_stale=True)
    assert stale is not None
    assert not stale.fresh
    await REAL.asleep(0.1)
    assert await db.client.exists(db.key("cache", "q")) == 0
    assert await cache.get("q", allow_stale=True) is None


async def test_budget_days_follow_the_server_clock(redis: Redis) -> None:
    """The budget's day is the UTC day of the Redis server's clock."""
    db = await redis.replica()
    seconds, micros = await db.client.time()
    usage = await RedisQuotaStore(db).usage("u")
    assert usage.day == day_number(seconds + micros / 1e6)


async def test_retry_after_is_stepped_to_an_instant_that_really_refills(redis: Redis) -> None:
    """Where (n - tokens) / rate rounds down, the script steps up exactly as ratelimit.take does."""
    # A state whose naive wait is one unit in the last place too short (found by search).
    state = BucketState(tokens=0.2550690257394217, updated=1000004.9543508709)
    options = BucketOptions(rate=3.0, burst=10.0)
    naive = (1.0 - state.tokens) / options.rate
    db = await redis.replica()
    await db.client.hset(
        db.key("bucket", "u"),
        mapping={"tokens": repr(state.tokens), "updated": repr(state.updated)},
    )
    clock = ManualClock(0.0, wall_start=state.updated)
    buckets = RedisBucketStore(db, clock)
    refused = await buckets.take("u", options)
    assert refused == take(state, options, state.updated)[1]
    assert refused.retry_after > naive
    clock.advance(refused.retry_after)
    assert (await buckets.take("u", options)).allowed


async def test_a_bucket_that_refills_over_millennia_still_expires(redis: Redis) -> None:
    """An expiry too long for Redis is capped, not refused: the take still works."""
    db = await redis.replica()
    buckets = RedisBucketStore(db, ManualClock())
    result = await buckets.take("u", BucketOptions(rate=1e-12, burst=1e6))
    assert result.allowed
    # The cap, less the milliseconds that passed between the write and this read.
    assert 10**15 - 5_000 <= await db.client.pttl(db.key("bucket", "u")) <= 10**15


async def test_a_flushed_script_cache_is_reloaded(redis: Redis) -> None:
    """After SCRIPT FLUSH (a restarted or failed-over Redis) the next call loads the script again."""
    buckets = RedisBucketStore(await redis.replica(), ManualClock())
    options = BucketOptions(rate=1.0, burst=5.0)
    assert (await buckets.take("u", options)).remaining == 4.0
    admin = await redis.replica()
    await admin.client.script_flush()
    assert (await buckets.take("u", options)).remaining == 3.0


# --------------------------------------------------------------------------- failures


@pytest_asyncio.fixture
async def stalled_port() -> AsyncIterator[int]:
    """A local TCP server that accepts connections and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


async def test_a_stalled_redis_is_a_store_error_within_the_timeout(stalled_port: int) -> None:
    """A Redis that accepts and never answers costs one timeout, then a StoreError."""
    db = RedisDatabase(f"redis://127.0.0.1:{stalled_port}/0", timeout_s=0.2)
    started = REAL.now()
    with pytest.raises(StoreError) as caught:
        await RedisBucketStore(db).take("u", BucketOptions(rate=1.0, burst=1.0))
    assert REAL.now() - started < 0.5
    assert "no answer within 0.2 s" in caught.value.message
    assert caught.value.original is not None
    await db.aclose()


async def test_an_unreachable_redis_is_a_store_error() -> None:
    """A refused connection surfaces as StoreError with the driver's error kept."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    db = RedisDatabase(f"redis://:hunter2@127.0.0.1:{port}/0", timeout_s=0.5)
    with pytest.raises(StoreError) as caught:
        await db.ping()
    assert "hunter2" not in caught.value.message
    assert caught.value.original is not None
    await db.aclose()


async def test_the_url_sets_the_prefix_and_never_shows_the_password() -> None:
    """A prefix query parameter picks the key prefix; where names the server without secrets."""
    db = RedisDatabase("redis://:hunter2@cache.internal:6390/2?prefix=blue:")
    assert db.prefix == "blue:"
    assert db.key("bucket", "u") == "blue:bucket:u"
    assert db.where == "redis://cache.internal:6390/2"
    assert "hunter2" not in repr(db)
    await db.aclose()


# --------------------------------------------------------------------------- flag changes


async def test_a_flag_change_reaches_every_replica_within_a_second(redis: Redis) -> None:
    """Three subscribed replicas each hear of a kill switch set on a fourth."""
    replicas = [RedisFlagStore(await redis.replica()) for _ in range(3)]
    writer = RedisFlagStore(await redis.replica())
    async with AsyncExitStack() as subscriptions:
        watches = [await subscriptions.enter_async_context(r.watch()) for r in replicas]
        started = REAL.now()
        await writer.set("answer.enabled", False, who="oncall", why="provider outage")
        heard = await asyncio.gather(*(watch.next(1.0) for watch in watches))
        assert REAL.now() - started < 1.0
        assert heard == ["answer.enabled"] * 3
        assert [await r.values() for r in replicas] == [{"answer.enabled": False}] * 3
        assert await watches[0].next(0.05) is None


async def test_watching_iterates_changed_flag_names(redis: Redis) -> None:
    """The subscription is an async iterator of the names of changed flags, in order."""
    flags = RedisFlagStore(await redis.replica())
    async with flags.watch() as changes:
        await flags.set("a", 1, who="t", why="x")
        await flags.set("b", 2, who="t", why="x")
        names = [await anext(changes), await anext(changes)]
    assert names == ["a", "b"]


async def test_the_audit_log_is_capped(redis: Redis) -> None:
    """Only the newest audit_cap records are kept, per flag and overall."""
    flags = RedisFlagStore(await redis.replica(), audit_cap=3)
    for value in range(5):
        await flags.set("level", value, who="t", why="x")
    assert [r.new for r in await flags.history("level")] == [4, 3, 2]
    assert len(await flags.history()) == 3


# --------------------------------------------------------------------------- single-flight


async def test_identical_calls_across_replicas_share_one_upstream_call(redis: Redis) -> None:
    """Ten identical calls spread over three replicas make one upstream call and share its result."""
    calls = 0
    events: list[SingleFlightEvent] = []

    async def upstream() -> bytes:
        nonlocal calls
        calls += 1
        await REAL.asleep(0.1)
        return b"the answer"

    flights = [
        RedisSingleFlight(await redis.replica(), poll_s=0.005, on_event=events.append)
        for _ in range(3)
    ]
    results = await asyncio.gather(*(flights[i % 3].run("q", upstream) for i in range(10)))
    assert results == [b"the answer"] * 10
    assert calls == 1
    assert sum(isinstance(e, FlightLed) for e in events) == 1
    assert sum(isinstance(e, FlightJoined) for e in events) == 9


async def test_a_failed_leader_hands_the_lead_to_a_waiter(redis: Redis) -> None:
    """The leader's error is its own; a waiting caller then leads and makes the call itself."""
    attempts = 0

    async def flaky() -> bytes:
        nonlocal attempts
        attempts += 1
        await REAL.asleep(0.05)
        if attempts == 1:
            raise ConnectionError("upstream reset")
        return b"second try"

    first = RedisSingleFlight(await redis.replica(), poll_s=0.005)
    second = RedisSingleFlight(await redis.replica(), poll_s=0.005)
    leader = asyncio.create_task(first.run("q", flaky))
    await REAL.asleep(0.01)
    follower = await second.run("q", flaky)
    with pytest.raises(ConnectionError):
        await leader
    assert (follower, attempts) == (b"second try", 2)


async def test_waiters_fall_back_to_their_own_call_after_the_bound(redis: Redis) -> None:
    """A leader that takes too long does not hold the others past wait_s: they call themselves."""
    events: list[SingleFlightEvent] = []

    async def slow() -> bytes:
        await REAL.asleep(0.3)
        return b"slow"

    async def quick() -> bytes:
        return b"quick"

    leader = RedisSingleFlight(await redis.replica(), poll_s=0.005)
    waiter = RedisSingleFlight(
        await redis.replica(), wait_s=0.05, poll_s=0.005, on_event=events.append
    )
    task = asyncio.create_task(leader.run("q", slow))
    await REAL.asleep(0.01)
    assert await waiter.run("q", quick) == b"quick"
    assert events == [FlightFellBack("q")]
    assert await task == b"slow"


# --------------------------------------------------------------------------- retry budget

_ops = st.lists(
    st.tuples(
        st.sampled_from(["first", "spend", "peek"]),
        st.floats(min_value=0.0, max_value=4.0, allow_nan=False),
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=_ops,
    ratio=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    floor=st.sampled_from([0.0, 0.25, 1.0]),
    window=st.integers(min_value=1, max_value=5),
)
async def test_the_shared_retry_budget_decides_as_the_local_one(
    redis: Redis, ops: list[tuple[str, float]], ratio: float, floor: float, window: int
) -> None:
    """With one slice per second, the Redis counter grants exactly the retries RetryBudget does."""
    clock = ManualClock(0.0, wall_start=0.0)  # wall == now, so both count the same seconds
    local = RetryBudget(
        clock, ratio=ratio, min_retries_per_second=floor, window=float(window), buckets=window
    )
    shared = RedisRetryBudgetCounter(
        await redis.replica(),
        f"prop-{REAL.now()}",
        ratio=ratio,
        min_retries_per_second=floor,
        window=window,
        clock=clock,
    )
    for op, advance in ops:
        clock.advance(advance)
        if op == "first":
            local.record_first_try()
            await shared.record_first_try()
        elif op == "spend":
            assert await shared.try_spend() == local.try_spend()
        else:
            assert await shared.available() == local.available()


async def test_replicas_share_one_retry_budget(redis: Redis) -> None:
    """Retries granted on one replica count against the others."""
    clock = ManualClock(0.0, wall_start=1_000_000.0)
    budgets = [
        RedisRetryBudgetCounter(
            await redis.replica(),
            "provider-a",
            ratio=0.0,
            min_retries_per_second=0.5,
            window=4,
            clock=clock,
        )
        for _ in range(2)
    ]
    granted = [await budgets[i % 2].try_spend() for i in range(6)]
    assert granted == [True, True, False, False, False, False]
    assert await budgets[1].available() == 0.0
    clock.advance(5)
    assert await budgets[0].available() == 2.0
