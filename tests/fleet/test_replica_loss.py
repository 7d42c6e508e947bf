"""SIGKILL of a replica in the middle of a load run loses and duplicates nothing that completed.

The run sends idempotent requests, each under a key of its own, from a few concurrent workers
through nginx; each worker retries its key until it gets a 200. A third of the way in, one
replica is killed with SIGKILL (no drain, no shutdown hook) and restarted a moment later.

A request in flight on the killed replica at that moment gets a 502 from nginx (it is never sent
to a second replica: nginx does not repeat a POST a replica already received). Its key stays
claimed by the dead replica until the claim's lease runs out, so its retries get 409 until then;
it was never completed, so its one extra upstream call (at most) is allowed. Every other key
costs exactly one upstream call, and every key's answer is then replayed, byte for byte, by
every replica.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.fleet.conftest import Services
from tests.fleet.harness import (
    CLOCK,
    Fleet,
    SharedState,
    UpstreamServer,
    base_config,
    chat,
    running_fleet,
    schema_migrations,
    served_by,
    shared_state,
)

pytestmark = pytest.mark.slow

KEYS = 45
WORKERS = 6
#: Upstream latency: long enough that each replica always has requests in flight.
LATENCY_S = 0.3
VICTIM = 1
#: How long the victim stays dead before it is started again.
DOWN_S = 1.5
#: Statuses a worker retries: nginx found no replica (502), the key is still claimed (409).
RETRY = {409, 502}
#: A bound on the whole run. An interrupted key waits out the dead replica's claim, a lease of
#: server.request_timeout_s plus a margin (about 35 s here), before a retry can succeed.
RUN_LIMIT_S = 90.0


@dataclass
class Call:
    key: str
    sent: float
    status: int  # 0: the connection itself failed
    replica: int | None
    replayed: bool


async def in_flight(client: httpx.AsyncClient, url: str) -> float:
    """The replica's model requests in progress, from its own /metrics."""
    response = await client.get(f"{url}/metrics")
    for line in response.text.splitlines():
        if line.startswith("tidegate_in_flight_requests "):
            return float(line.split()[1])
    return 0.0


@pytest.fixture(scope="module")
def state(services: Services) -> Iterator[SharedState]:
    with shared_state(services.redis_url, services.postgres_url) as fresh:
        yield fresh


@pytest.fixture(scope="module")
def kill_fleet(
    nginx: str,
    state: SharedState,
    upstream_server: UpstreamServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    config = base_config(
        durable=state.durable_url, fast=state.fast_url, upstream=upstream_server.url
    )
    with running_fleet(tmp_path_factory.mktemp("kill-fleet"), config, nginx=nginx) as fleet:
        yield fleet


@pytest.mark.asyncio
async def test_sigkill_mid_run_loses_and_duplicates_no_completed_request(
    kill_fleet: Fleet, state: SharedState, upstream: UpstreamServer
) -> None:
    """Every key completes once; the survivors keep serving; the restart migrates nothing."""
    fleet = kill_fleet
    upstream.reset(upstream.script(latency=LATENCY_S))
    migrations_before = schema_migrations(state.postgres_url, state.schema)
    run = f"kill-{secrets.token_hex(4)}"
    keys = [f"{run}-{i:02d}" for i in range(KEYS)]
    auth = {"Authorization": f"Bearer {fleet.new_user()}"}
    calls: list[Call] = []
    answers: dict[str, bytes] = {}
    queue: asyncio.Queue[str] = asyncio.Queue()
    for key in keys:
        queue.put_nowait(key)
    moments: dict[str, float] = {}

    async def complete(client: httpx.AsyncClient, key: str) -> None:
        while True:
            sent = CLOCK.now()
            try:
                response = await client.post(
                    "/v1/chat/completions",
                    json=chat(f"{key} file the claim"),
                    headers={**auth, "Idempotency-Key": key},
                )
            except httpx.TransportError:
                calls.append(Call(key, sent, 0, None, False))
            else:
                replica = fleet.replica_index(served_by(response))
                replayed = response.headers.get("idempotent-replayed") == "true"
                calls.append(Call(key, sent, response.status_code, replica, replayed))
                if response.status_code == 200:
                    answers[key] = response.content
                    return
                assert response.status_code in RETRY, (key, response.status_code, response.text)
            await CLOCK.asleep(0.2)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            await complete(client, queue.get_nowait())

    async def killer() -> None:
        while len(answers) < KEYS // 3:
            await CLOCK.asleep(0.01)
        # Kill while the victim is handling a request, so that the kill interrupts one (on a busy
        # machine the moment above can fall where it holds none); bounded, then kill anyway.
        async with httpx.AsyncClient(timeout=2.0) as probe:
            for _ in range(200):
                if await in_flight(probe, fleet.replicas[VICTIM].url) >= 1:
                    break
                await CLOCK.asleep(0.005)
        moments["killed"] = CLOCK.now()
        fleet.kill(VICTIM)
        await CLOCK.asleep(DOWN_S)
        moments["restarting"] = CLOCK.now()
        await asyncio.to_thread(fleet.restart, VICTIM)

    async with httpx.AsyncClient(base_url=fleet.url, timeout=30.0) as client:
        async with asyncio.timeout(RUN_LIMIT_S):
            await asyncio.gather(killer(), *(worker(client) for _ in range(WORKERS)))

    killed, restarting = moments["killed"], moments["restarting"]
    # Every key completed.
    assert sorted(answers) == keys
    # Only requests already in flight when the replica died failed; none was a 500.
    failed = [c for c in calls if c.status in (0, 502)]
    assert all(c.sent < killed for c in failed), [(c.key, c.sent - killed) for c in failed]
    interrupted = {c.key for c in failed}
    assert interrupted, "the kill interrupted no request: the run was not under load"
    # The survivors kept serving while the victim was down.
    during = [c for c in calls if killed < c.sent < restarting and c.status == 200]
    assert during, "nothing was served while the victim was down"
    assert {c.replica for c in during} <= {r.index for r in fleet.replicas} - {VICTIM}

    # Exactly one upstream call per key, answered. A key interrupted mid-call (never completed)
    # may have one more: the call the kill cut short, or, if the kill fell between the upstream's
    # answer and its storage, a second answer.
    upstream_calls = Counter[str]()
    answered = Counter[str]()
    for attempt in upstream.attempts(run):
        key = attempt["messages"][0]["content"].split()[0]
        upstream_calls[key] += 1
        answered[key] += attempt["outcome"] == "ok"
    for key in keys:
        if key in interrupted:
            assert 1 <= answered[key] <= upstream_calls[key] <= 2, (key, upstream_calls[key])
        else:
            assert answered[key] == upstream_calls[key] == 1, (key, upstream_calls[key])

    # Nothing completed was lost: each replica, the restarted one too, replays each answer.
    async with httpx.AsyncClient(timeout=30.0) as client:
        for replica in fleet.replicas:
            for key in keys:
                replay = await client.post(
                    f"{replica.url}/v1/chat/completions",
                    json=chat(f"{key} file the claim"),
                    headers={**auth, "Idempotency-Key": key},
                )
                assert replay.status_code == 200, (replica.index, key, replay.text)
                assert replay.headers["idempotent-replayed"] == "true"
                assert replay.content == answers[key]
    assert len(upstream.attempts(run)) == sum(upstream_calls.values())

    # The restarted replica found every migration applied and applied none again.
    assert schema_migrations(state.postgres_url, state.schema) == migrations_before
