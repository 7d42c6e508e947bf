"""Rate limits and daily budgets stay exact in a fleet at the load where leases engage.

Three replicas share Redis (buckets and budgets) and Postgres, behind nginx. One user fires
hundreds of distinct requests at once, round-robin: a burst of 200 leases ten tokens at a time,
a budget of 200 calls ten calls at a time (docs/state.md, "Leases").
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import aiohttp
import orjson
import pytest

from tests.fleet.conftest import Services, shared_config
from tests.fleet.harness import (
    CLOCK,
    Fleet,
    SharedState,
    UpstreamServer,
    chat,
    running_fleet,
    shared_state,
)
from tidegate.clock import SystemClock
from tidegate.state.redis import RedisDatabase, RedisQuotaStore

pytestmark = pytest.mark.slow

BURST = 200
CALLS = 200
DEGRADE_AT = 0.8
REPLICAS = 3
#: Another replica's lease can hold at most a twentieth of the burst or quota unused.
SLACK = (REPLICAS - 1) * BURST // 20
#: Enough room that no request is shed by admission: what is refused here is the limit's doing.
ROOMY = {"slots": 1024, "queue_cap": 1024}


@pytest.fixture(scope="module")
def state(services: Services) -> Iterator[SharedState]:
    with shared_state(services.redis_url, services.postgres_url) as shared:
        yield shared


@pytest.fixture(scope="module")
def limit_fleet(
    nginx: str,
    state: SharedState,
    upstream_server: UpstreamServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    """Three replicas with a per-user bucket of 200 that (practically) never refills."""
    config = shared_config(
        state.durable_url,
        state.fast_url,
        upstream_server.url,
        admission=ROOMY,
        cache={"enabled": False},
    )
    config["rate_limits"] = {"per_user": {"rate_per_s": 0.001, "burst": BURST}}
    with running_fleet(tmp_path_factory.mktemp("limit-fleet"), config, nginx=nginx) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def budget_fleet(
    nginx: str,
    state: SharedState,
    upstream_server: UpstreamServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    """Three replicas with a daily budget of 200 calls per user, degrading past 160."""
    config = shared_config(
        state.durable_url,
        state.fast_url,
        upstream_server.url,
        admission=ROOMY,
        cache={"enabled": False},
        budgets={"calls": CALLS, "degrade_at": DEGRADE_AT, "degrade": {"max_tokens": 8}},
    )
    del config["rate_limits"]
    with running_fleet(tmp_path_factory.mktemp("budget-fleet"), config, nginx=nginx) as fleet:
        yield fleet


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Mapping[str, str]
    body: bytes


async def _at_once(fleet: Fleet, key: str, tag: str, offered: int) -> list[Answer]:
    """``offered`` distinct requests of one user, all sent at once through nginx (aiohttp: the
    httpx pool slows down with the square of its connections at this count)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(fleet.url, connector=connector) as session:

        async def one(i: int) -> Answer:
            async with session.post(
                "/v1/chat/completions",
                json=chat(f"{tag} question {i}"),
                headers={"Authorization": f"Bearer {key}"},
            ) as response:
                return Answer(response.status, response.headers, await response.read())

        return await asyncio.gather(*(one(i) for i in range(offered)))


@pytest.mark.asyncio
@pytest.mark.parametrize("offered", [100, 300, 1_000])
async def test_a_leased_bucket_passes_what_the_shared_bucket_holds(
    limit_fleet: Fleet, upstream: UpstreamServer, offered: int
) -> None:
    """All of 100 requests pass a bucket of 200 (none is refused while the bucket has tokens);
    of 300 or 1,000, at most 200 pass and at least 200 less what two other replicas' leases can
    hold."""
    tag = f"leased-limit-{secrets.token_hex(4)}"
    responses = await _at_once(limit_fleet, limit_fleet.new_user(), tag, offered)
    statuses = Counter(r.status for r in responses)
    assert set(statuses) <= {200, 429}, (statuses, limit_fleet.logs())
    expected = min(BURST, offered)
    if offered <= BURST - REPLICAS * BURST // 20:
        assert statuses[200] == offered
    else:
        assert expected - SLACK <= statuses[200] <= expected, statuses
    assert len(upstream.attempts(tag)) == statuses[200]


async def _recorded_calls(state: SharedState, subject: str) -> tuple[int, int]:
    """The calls the shared store counts for ``subject`` today, and those still reserved."""
    db = RedisDatabase(state.fast_url, prefix=state.prefix, timeout_s=5.0)
    try:
        usage = await RedisQuotaStore(db, SystemClock()).usage(subject)
    finally:
        await db.aclose()
    return usage.calls, usage.reserved_calls


@pytest.mark.asyncio
@pytest.mark.parametrize("offered", [300, 1_000])
async def test_a_leased_budget_is_never_overspent_and_every_call_is_recorded(
    budget_fleet: Fleet, state: SharedState, upstream: UpstreamServer, offered: int
) -> None:
    """Hundreds of one user's requests at once over three replicas: at most 200 are served and
    answered upstream, none in full past the degrade threshold (160), and once the leases have
    retired the shared store counts exactly the calls served, with nothing left reserved."""
    tag = f"leased-budget-{secrets.token_hex(4)}"
    key = budget_fleet.new_user()
    responses = await _at_once(budget_fleet, key, tag, offered)
    statuses = Counter(r.status for r in responses)
    assert set(statuses) <= {200, 429}, (statuses, budget_fleet.logs())
    served = [r for r in responses if r.status == 200]
    degraded = [r for r in served if r.headers.get("x-tidegate-budget") == "degraded"]
    assert len(served) <= CALLS
    assert len(served) - len(degraded) <= int(CALLS * DEGRADE_AT)
    assert len(served) >= CALLS - SLACK
    assert len(upstream.attempts(tag)) == len(served)
    refused = [r for r in responses if r.status == 429]
    assert all(orjson.loads(r.body)["error"]["code"] == "budget_exceeded" for r in refused)

    user = f"user-{budget_fleet.user_index(key):03d}"
    deadline = CLOCK.now() + 5.0
    recorded = await _recorded_calls(state, f"fleet:{user}")
    while recorded != (len(served), 0) and CLOCK.now() < deadline:
        await CLOCK.asleep(0.1)  # leases retire within the replicas' refresh rounds
        recorded = await _recorded_calls(state, f"fleet:{user}")
    assert recorded == (len(served), 0), budget_fleet.logs()
