"""A kill switch set on one replica reaches every replica, and its audit entry is everywhere."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from typing import Any

import httpx
import pytest

from tests.fleet.harness import ADMIN_KEY, CLOCK, Fleet, Replica, UpstreamServer, chat

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
#: How soon every replica must refuse once the switch is set.
WITHIN_S = 1.0
POLL_S = 0.05


async def ask(client: httpx.AsyncClient, replica: Replica, key: str, tag: str) -> httpx.Response:
    return await client.post(
        f"{replica.url}/v1/chat/completions",
        json=chat(f"{tag} {secrets.token_hex(3)}"),
        headers={"Authorization": f"Bearer {key}"},
    )


async def first_refusal(
    client: httpx.AsyncClient, replica: Replica, keys: list[str], tag: str, since: float
) -> tuple[float, httpx.Response]:
    """Seconds from ``since`` until ``replica`` stops answering, and the answer it gives then.

    Calls that still pass spend the caller's tokens, so they rotate over several callers.
    """
    callers = itertools.cycle(keys)
    while True:
        response = await ask(client, replica, next(callers), tag)
        elapsed = CLOCK.now() - since
        if response.status_code != 200 or elapsed > 2 * WITHIN_S:
            return elapsed, response
        await CLOCK.asleep(POLL_S)


async def set_mode(client: httpx.AsyncClient, replica: Replica, **body: Any) -> httpx.Response:
    return await client.post(f"{replica.url}/admin/kill-switch", json=body, headers=ADMIN)


@pytest.mark.asyncio
async def test_a_kill_switch_set_on_one_replica_is_honoured_by_all_within_a_second(
    fleet: Fleet, upstream: UpstreamServer
) -> None:
    """Set through replica 0's admin API, every replica refuses 503 within 1 s; the audit entry
    (who, why, when) reads the same from every replica."""
    tag = f"kill-{secrets.token_hex(4)}"
    who, why = "oncall@fleet-test", f"provider incident {tag}"
    async with httpx.AsyncClient(timeout=10.0) as client:
        for replica in fleet.replicas:
            answered = await ask(client, replica, fleet.new_user(), tag)
            assert answered.status_code == 200, answered.text
        pollers = [[fleet.new_user() for _ in range(3)] for _ in fleet.replicas]
        wall_before, sent = CLOCK.wall(), CLOCK.now()
        try:
            switched = await set_mode(
                client, fleet.replicas[0], mode="unavailable", who=who, why=why
            )
            assert switched.status_code == 200, switched.text
            honoured = await asyncio.gather(
                *(
                    first_refusal(client, replica, keys, tag, sent)
                    for replica, keys in zip(fleet.replicas, pollers, strict=True)
                )
            )
            wall_after = CLOCK.wall()
            for replica, (elapsed, refusal) in zip(fleet.replicas, honoured, strict=True):
                assert refusal.status_code == 503, (replica.index, refusal.text)
                assert refusal.json()["error"]["code"] == "unavailable"
                assert int(refusal.headers["retry-after"]) >= 1
                assert elapsed <= WITHIN_S, (replica.index, elapsed)

            entries = []
            for replica in fleet.replicas:
                audit = await client.get(
                    f"{replica.url}/admin/audit", params={"flag": "answer.mode"}, headers=ADMIN
                )
                assert audit.status_code == 200, audit.text
                entries.append(audit.json()[0])  # newest first
            assert entries[0] == entries[1] == entries[2]
            entry = entries[0]
            assert (entry["flag"], entry["new"], entry["who"], entry["why"]) == (
                "answer.mode",
                "unavailable",
                who,
                why,
            )
            # When: the store's clock, which runs on this machine too.
            assert wall_before - 1.0 <= entry["at"] <= wall_after + 1.0
        finally:
            await set_mode(client, fleet.replicas[0], mode="full", who=who, why=f"{tag} over")
            await every_replica_answers(client, fleet, tag)


async def every_replica_answers(client: httpx.AsyncClient, fleet: Fleet, tag: str) -> None:
    """Wait (up to 5 s) until every replica answers again, so later tests start from normal."""
    deadline = CLOCK.now() + 5.0
    for replica in fleet.replicas:
        key = fleet.new_user()
        while (await ask(client, replica, key, tag)).status_code != 200:
            assert CLOCK.now() < deadline, f"replica {replica.index} still refuses"
            await CLOCK.asleep(0.1)
