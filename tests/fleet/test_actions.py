"""A pending action is decided once, however many replicas are asked to decide it at once."""

from __future__ import annotations

import asyncio
import secrets

import httpx
import pytest

from tests.fleet.harness import ADMIN_KEY, Fleet

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ROUNDS = 5


@pytest.mark.asyncio
async def test_an_action_approved_on_two_replicas_at_once_is_approved_once(fleet: Fleet) -> None:
    """Proposed on replica 0, approved concurrently on replicas 1 and 2: one 200, one 409."""
    first, second, third = fleet.replicas
    async with httpx.AsyncClient(timeout=10.0, headers=ADMIN) as client:
        for round_ in range(ROUNDS):
            tag = f"refund-{secrets.token_hex(4)}"
            proposed = await client.post(
                f"{first.url}/v1/actions",
                json={
                    "kind": "refund",
                    "payload": {"order": tag, "round": round_},
                    "ttl_s": 60,
                    "who": "agent@fleet-test",
                },
            )
            assert proposed.status_code == 201, proposed.text
            action = proposed.json()
            assert action["status"] == "pending"

            deciders = {second.url: "alice@fleet-test", third.url: "bob@fleet-test"}
            decisions = await asyncio.gather(
                *(
                    client.post(f"{url}/v1/actions/{action['id']}/approve", json={"who": who})
                    for url, who in deciders.items()
                )
            )

            assert sorted(d.status_code for d in decisions) == [200, 409], [
                d.text for d in decisions
            ]
            won = next(d for d in decisions if d.status_code == 200).json()
            lost = next(d for d in decisions if d.status_code == 409).json()
            assert lost["error"]["code"] == "already_decided"
            assert won["status"] == "approved"
            assert won["decided_by"] in deciders.values()
            for replica in fleet.replicas:
                seen = await client.get(f"{replica.url}/v1/actions/{action['id']}")
                assert seen.status_code == 200, seen.text
                assert seen.json() == won
