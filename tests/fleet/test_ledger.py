"""The spend ledger across three replicas: per user, the ledger's rows, the budget store's
recorded use and the upstream's count of answers are the same numbers."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.fleet.conftest import Services
from tests.fleet.harness import (
    ADMIN_KEY,
    CLOCK,
    TENANT,
    Fleet,
    SharedState,
    UpstreamServer,
    base_config,
    chat,
    running_fleet,
    served_by,
    shared_state,
)
from tidegate.clock import SystemClock
from tidegate.state.url import Stores, store_from_urls

pytestmark = pytest.mark.slow

USERS = 4
PER_USER = (5, 9, 13, 2)
#: How long the ledger and the budget leases may take to reach the stores.
SETTLE_S = 10.0


@pytest.fixture(scope="module")
def ledger_fleet(
    nginx: str,
    services: Services,
    upstream_server: UpstreamServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Fleet, SharedState]]:
    """Three replicas with a daily budget (Redis) and the ledger (Postgres), no cache."""
    with shared_state(services.redis_url, services.postgres_url) as state:
        config = base_config(
            durable=state.durable_url, fast=state.fast_url, upstream=upstream_server.url
        )
        config["budgets"] = {"calls": 1_000, "tokens": 10_000_000}
        config["cache"] = {"enabled": False}
        config["ledger"] = {"flush_s": 0.2, "batch_rows": 8}
        workdir = tmp_path_factory.mktemp("ledger-fleet")
        with running_fleet(workdir, config, nginx=nginx) as fleet:
            yield fleet, state


async def _settled(stores: Stores, users: list[str], expected: dict[str, int]) -> None:
    """Wait until every user's rows and budget use are in the stores (batches and leases are
    written off the request path)."""
    deadline = CLOCK.now() + SETTLE_S
    while True:
        groups = {g.key: g for g in await stores.ledger.summary("user", 0, 1e12)}
        usage = [await stores.quotas.usage(f"{TENANT}:{u}") for u in users]
        done = all(
            groups.get(f"{TENANT}:{u}") is not None
            and groups[f"{TENANT}:{u}"].calls == expected[u]
            and use.calls == expected[u]
            and use.reserved_calls == 0
            for u, use in zip(users, usage, strict=True)
        )
        if done or CLOCK.now() > deadline:
            return
        await CLOCK.asleep(0.1)


@pytest.mark.asyncio
async def test_ledger_rows_equal_budget_use_and_upstream_answers(
    ledger_fleet: tuple[Fleet, SharedState], upstream: UpstreamServer
) -> None:
    fleet, state = ledger_fleet
    tag = f"ledger-{secrets.token_hex(4)}"
    keys = [fleet.new_user() for _ in range(USERS)]
    users = [f"user-{fleet.user_index(k):03d}" for k in keys]

    async def one(client: httpx.AsyncClient, key: str, i: int) -> httpx.Response:
        return await client.post(
            "/v1/chat/completions",
            json=chat(f"{tag} {key[-3:]} question {i}"),
            headers={"Authorization": f"Bearer {key}"},
        )

    async with httpx.AsyncClient(base_url=fleet.url, timeout=30.0) as client:
        responses = await asyncio.gather(
            *(one(client, key, i) for key, n in zip(keys, PER_USER, strict=True) for i in range(n))
        )
    assert all(r.status_code == 200 for r in responses), Counter(r.status_code for r in responses)
    assert {served_by(r) for r in responses} == {r.port for r in fleet.replicas}

    answers = Counter(
        next(key for key in keys if f"{tag} {key[-3:]} " in str(a["messages"]))
        for a in upstream.attempts(tag)
    )
    expected = dict(zip(users, PER_USER, strict=True))
    stores = await store_from_urls(
        durable=state.durable_url, fast=state.fast_url, clock=SystemClock(), timeout_s=5.0
    )
    async with stores:
        await _settled(stores, users, expected)
        groups = {g.key: g for g in await stores.ledger.summary("user", 0, 1e12)}
        rows = await stores.ledger.rows(0, 1e12)
        for key, user in zip(keys, users, strict=True):
            use = await stores.quotas.usage(f"{TENANT}:{user}")
            group = groups[f"{TENANT}:{user}"]
            assert group.calls == use.calls == answers[key] == expected[user], user
            assert group.requests == expected[user]
            assert group.tokens == use.tokens, user
            assert use.reserved_calls == 0
    mine = [r for r in rows if r.user in users]
    assert len({r.request_id for r in mine}) == sum(PER_USER)  # one row per request, no twin
    assert {r.served_by for r in mine} == {"upstream"}

    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(base_url=fleet.url, timeout=10.0) as client:
        spend = await client.get(
            "/admin/spend", params={"group_by": "user", "from": "0"}, headers=admin
        )
    assert spend.status_code == 200, spend.text
    shown = {g["key"]: g["calls"] for g in spend.json()["groups"]}
    assert all(shown[f"{TENANT}:{u}"] == expected[u] for u in users)
