"""Postgres-only behaviour: migrations, the database clock, locks and timeouts, LISTEN/NOTIFY."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import psycopg
import pytest
import pytest_asyncio

from tests.state.conftest import postgres_database, postgres_schema
from tidegate.clock import ManualClock, SystemClock
from tidegate.errors import StoreError
from tidegate.policy.budget import day_number
from tidegate.policy.ratelimit import BucketOptions
from tidegate.state.actions import ActionExpired, ActionStatus
from tidegate.state.base import ClaimOutcome, StoredResponse
from tidegate.state.postgres import (
    MIGRATIONS,
    PostgresBucketStore,
    PostgresCacheStore,
    PostgresDatabase,
    PostgresFlagStore,
    PostgresIdempotencyStore,
    PostgresPendingActionStore,
    PostgresQuotaStore,
)

pytestmark = pytest.mark.asyncio

REAL = SystemClock()


class Postgres:
    """A Postgres test area: a fresh schema, and databases ("replicas") that share it."""

    def __init__(self, stack: AsyncExitStack, url: str, schema: str) -> None:
        self.stack = stack
        self.url = url
        self.schema = schema

    async def replica(self) -> PostgresDatabase:
        return await postgres_database(self.stack, self.url, self.schema)

    def unopened(self, *, timeout_s: float = 5.0) -> PostgresDatabase:
        db = PostgresDatabase(self.url, schema=self.schema, timeout_s=timeout_s)
        self.stack.push_async_callback(db.aclose)
        return db


@pytest_asyncio.fixture
async def postgres() -> AsyncIterator[Postgres]:
    async with AsyncExitStack() as stack:
        url, schema = await postgres_schema(stack)
        yield Postgres(stack, url, schema)


# --------------------------------------------------------------------------- migrations


async def test_replicas_starting_together_apply_each_migration_once(postgres: Postgres) -> None:
    """Two concurrent migrate() calls: one applies everything, the other waits and applies none."""
    first, second = postgres.unopened(), postgres.unopened()
    await first.open(migrate=False)
    await second.open(migrate=False)
    applied = await asyncio.gather(first.migrate(), second.migrate())
    everything = list(range(1, len(MIGRATIONS) + 1))
    assert sorted(applied) == [[], everything]
    assert await first.applied_migrations() == everything


async def test_a_restart_applies_nothing_twice(postgres: Postgres) -> None:
    """Opening an already migrated schema again applies no migration."""
    db = await postgres.replica()
    assert await db.migrate() == []
    restarted = postgres.unopened()
    await restarted.open()
    assert await restarted.migrate() == []
    assert await restarted.applied_migrations() == list(range(1, len(MIGRATIONS) + 1))


async def test_a_new_migration_is_applied_on_the_next_start(postgres: Postgres) -> None:
    """Adding a migration to the list applies just that one at the next start."""
    await postgres.replica()
    extra = (*MIGRATIONS, ("notes", "CREATE TABLE notes (id bigserial PRIMARY KEY, body text)"))
    upgraded = PostgresDatabase(postgres.url, schema=postgres.schema, migrations=extra)
    postgres.stack.push_async_callback(upgraded.aclose)
    await upgraded.open(migrate=False)
    assert await upgraded.migrate() == [len(extra)]
    assert await upgraded.execute("insert", "INSERT INTO notes (body) VALUES ('x')") == 1


async def test_the_schema_can_come_from_the_url(postgres: Postgres) -> None:
    """A schema query parameter is the schema; it is not passed on to the driver."""
    db = await PostgresDatabase.connect(f"{postgres.url}?schema={postgres.schema}")
    postgres.stack.push_async_callback(db.aclose)
    assert db.schema == postgres.schema
    assert await db.fetch("schema", "SELECT current_schema()") == [(postgres.schema,)]


async def test_a_schema_name_must_be_a_plain_identifier() -> None:
    """A schema that would need quoting (or could inject SQL) is refused at construction."""
    with pytest.raises(ValueError):
        PostgresDatabase("postgresql://localhost/db", schema='x"; DROP TABLE flags; --')


# --------------------------------------------------------------------------- the database clock


async def test_leases_lapse_on_the_database_clock(postgres: Postgres) -> None:
    """Without an injected clock, a lease of 0.15 s lapses after 0.15 s of the database's time."""
    keys = PostgresIdempotencyStore(await postgres.replica())
    claim = await keys.claim("k", "fp", lease_s=0.15)
    assert claim.outcome is ClaimOutcome.CLAIMED
    assert (await keys.claim("k", "fp", lease_s=0.15)).outcome is ClaimOutcome.IN_PROGRESS
    await REAL.asleep(0.2)
    assert (await keys.claim("k", "fp", lease_s=0.15)).outcome is ClaimOutcome.CLAIMED
    assert not await keys.complete("k", claim.token, StoredResponse(200, b"late"), ttl_s=60)


async def test_actions_expire_on_the_database_clock(postgres: Postgres) -> None:
    """An action proposed with a 0.1 s time to live is refused after it, on the database clock."""
    actions = PostgresPendingActionStore(await postgres.replica())
    action = await actions.propose("refund", {"order": 1}, ttl_s=0.1, proposed_by="agent")
    assert action.expires_at - action.created_at == pytest.approx(0.1)
    await REAL.asleep(0.15)
    with pytest.raises(ActionExpired):
        await actions.approve(action.id, "ana")
    seen = await actions.get(action.id)
    assert seen is not None
    assert seen.status is ActionStatus.EXPIRED


async def test_cache_and_buckets_use_the_database_clock(postgres: Postgres) -> None:
    """Freshness and refill follow the database's time when no clock is injected."""
    db = await postgres.replica()
    cache, buckets = PostgresCacheStore(db), PostgresBucketStore(db)
    await cache.put("q", b"answer", ttl_s=0.1, stale_ttl_s=10)
    options = BucketOptions(rate=20.0, burst=1.0)
    assert (await buckets.take("u", options)).allowed
    assert not (await buckets.take("u", options)).allowed
    await REAL.asleep(0.12)
    assert await cache.get("q") is None
    stale = await cache.get("q", allow_stale=True)
    assert stale is not None
    assert not stale.fresh
    assert (await buckets.take("u", options)).allowed


async def test_budget_days_follow_the_database_clock(postgres: Postgres) -> None:
    """The budget's day is the UTC day of the database's clock."""
    db = await postgres.replica()
    ((now,),) = await db.fetch("now", "SELECT extract(epoch FROM now())::float8")
    assert (await PostgresQuotaStore(db).usage("u")).day == day_number(now)


# --------------------------------------------------------------------------- failures


async def test_a_held_row_lock_costs_one_timeout_then_a_store_error(postgres: Postgres) -> None:
    """A take behind a stuck transaction gives up after timeout_s instead of hanging."""
    options = BucketOptions(rate=1.0, burst=5.0)
    await PostgresBucketStore(await postgres.replica(), ManualClock()).take("u", options)
    impatient = postgres.unopened(timeout_s=0.2)
    await impatient.open()
    async with await psycopg.AsyncConnection.connect(
        postgres.url, options=f"-c search_path={postgres.schema}"
    ) as holder:
        await holder.execute("SELECT * FROM buckets WHERE key = 'u' FOR UPDATE")
        started = REAL.now()
        with pytest.raises(StoreError) as caught:
            await PostgresBucketStore(impatient, ManualClock()).take("u", options)
        assert REAL.now() - started < 0.5
        assert isinstance(caught.value.original, TimeoutError)
        await holder.rollback()
    assert (await PostgresBucketStore(impatient, ManualClock()).take("u", options)).allowed


async def test_driver_errors_become_store_errors(postgres: Postgres) -> None:
    """A failing statement surfaces as StoreError with the driver's exception kept."""
    db = await postgres.replica()
    with pytest.raises(StoreError) as caught:
        await db.fetch("broken", "SELECT * FROM no_such_table")
    assert isinstance(caught.value.original, psycopg.errors.UndefinedTable)


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


async def test_a_stalled_postgres_is_a_store_error_at_start_up(stalled_port: int) -> None:
    """A server that accepts and never answers fails the start within the timeout."""
    started = REAL.now()
    with pytest.raises(StoreError) as caught:
        await PostgresDatabase.connect(
            f"postgresql://tidegate:hunter2@127.0.0.1:{stalled_port}/db", timeout_s=0.2
        )
    assert REAL.now() - started < 1.0
    assert "hunter2" not in caught.value.message


# --------------------------------------------------------------------------- flag changes


async def test_a_flag_change_reaches_every_replica_within_a_second(postgres: Postgres) -> None:
    """Replicas listening on their own connections each hear of a change made on another."""
    replicas = [PostgresFlagStore(await postgres.replica()) for _ in range(3)]
    writer = PostgresFlagStore(await postgres.replica())
    async with AsyncExitStack() as subscriptions:
        watches = [await subscriptions.enter_async_context(r.watch()) for r in replicas]
        started = REAL.now()
        await writer.set("answer.enabled", False, who="oncall", why="provider outage")
        heard = await asyncio.gather(*(watch.next(1.0) for watch in watches))
        assert REAL.now() - started < 1.0
        assert heard == ["answer.enabled"] * 3
        assert await watches[0].next(0.05) is None


async def test_watching_iterates_changed_flag_names(postgres: Postgres) -> None:
    """The subscription is an async iterator of changed flag names, none lost when they bunch up."""
    flags = PostgresFlagStore(await postgres.replica())
    async with flags.watch() as changes:
        for name in ("a", "b", "c"):
            await flags.set(name, 1, who="t", why="x")
        names = [await anext(changes) for _ in range(3)]
    assert names == ["a", "b", "c"]
