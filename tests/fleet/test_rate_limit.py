"""A per-user limit is one limit for the whole fleet only when its buckets are shared."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.fleet.conftest import PER_USER, shared_config
from tests.fleet.harness import Fleet, UpstreamServer, chat, running_fleet, served_by

pytestmark = pytest.mark.slow

REQUESTS = 40
CONCURRENCY = 8
BURST = int(PER_USER["burst"])


@pytest.fixture(scope="module")
def memory_fleet(
    nginx: str, upstream_server: UpstreamServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    """The same three replicas, but each keeps its state in its own memory."""
    config = shared_config("memory://", None, upstream_server.url)
    with running_fleet(tmp_path_factory.mktemp("memory-fleet"), config, nginx=nginx) as fleet:
        yield fleet


async def forty_calls(fleet: Fleet, tag: str) -> list[httpx.Response]:
    """One user's 40 calls, 8 at a time, round-robin through nginx; each asks something new."""
    key = fleet.new_user()
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        async with gate:
            return await client.post(
                "/v1/chat/completions",
                json=chat(f"{tag} question {i}"),
                headers={"Authorization": f"Bearer {key}"},
            )

    async with httpx.AsyncClient(base_url=fleet.url, timeout=30.0) as client:
        return await asyncio.gather(*(one(client, i) for i in range(REQUESTS)))


@pytest.mark.asyncio
async def test_a_shared_bucket_admits_exactly_the_limit(
    fleet: Fleet, upstream: UpstreamServer
) -> None:
    """With Redis buckets, 10 of one user's 40 calls pass across three replicas; 30 get 429."""
    tag = f"limit-{secrets.token_hex(4)}"
    responses = await forty_calls(fleet, tag)

    statuses = Counter(r.status_code for r in responses)
    assert statuses == {200: BURST, 429: REQUESTS - BURST}, statuses
    assert {served_by(r) for r in responses} == {r.port for r in fleet.replicas}
    refused = [r for r in responses if r.status_code == 429]
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert all(r.headers["ratelimit-policy"].startswith('"per-user"') for r in refused)
    assert len(upstream.attempts(tag)) == BURST


@pytest.mark.asyncio
async def test_memory_stores_multiply_the_limit_by_the_replicas(
    memory_fleet: Fleet, upstream: UpstreamServer
) -> None:
    """With per-process buckets each replica admits 10 of the calls it sees: up to 30 in all."""
    tag = f"memory-limit-{secrets.token_hex(4)}"
    responses = await forty_calls(memory_fleet, tag)

    per_replica = Counter(served_by(r) for r in responses)
    passed = Counter(served_by(r) for r in responses if r.status_code == 200)
    assert set(per_replica) == {r.port for r in memory_fleet.replicas}
    # Each replica's own bucket: the first ten calls it sees pass, whichever they are.
    assert passed == {port: min(BURST, seen) for port, seen in per_replica.items()}
    assert BURST < sum(passed.values()) <= len(memory_fleet.replicas) * BURST
    assert {r.status_code for r in responses} == {200, 429}
    assert len(upstream.attempts(tag)) == sum(passed.values())
