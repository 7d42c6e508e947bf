"""With a Redis store the retry budget is the fleet's: retries other replicas spent count here."""

from __future__ import annotations

import os
import secrets

import pytest

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake

pytestmark = pytest.mark.asyncio

REDIS = os.environ.get("TIDEGATE_TEST_REDIS_URL")
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.skipif(
    REDIS is None, reason="set TIDEGATE_TEST_REDIS_URL to run the tests that need Redis"
)
async def test_a_spent_fleet_budget_stops_retries_on_this_replica(
    gateway_client: AppFactory,
) -> None:
    """Other replicas spent the shared budget: this one tries once and reports the denial."""
    assert REDIS is not None
    fast = f"{REDIS}?prefix=budget-{secrets.token_hex(4)}:"
    config = {
        "state": {"url": "memory://", "fast_url": fast},
        "providers": {"p": fake(model="m-1", faults=[{"kind": "http", "status": 500}])},
        "models": {"chat": {"providers": ["p"]}},
        "retry": {
            "attempts": 3,
            "base_s": 0.01,
            "cap_s": 0.01,
            "budget_ratio": 0.1,
            "budget_floor_per_s": 0.5,
        },
        "cache": {"enabled": False},
    }
    async with gateway_client(config) as (client, app):
        fleet = app.runtime.fleet_retry_budget
        assert fleet is not None
        while await fleet.try_spend():  # what the other replicas did
            pass
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "provider_server"
        assert response.json()["error"]["retryable"] is True  # the caller may still retry later
        assert len(app.runtime.providers["p"].attempts) == 1
        metrics = (await client.get("/metrics")).text
        assert "tidegate_retry_budget_denials_total 1.0" in metrics
