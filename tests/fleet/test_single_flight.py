"""Identical requests in flight at once share one upstream call, across replicas (through Redis)."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter

import httpx
import pytest

from tests.fleet.harness import Fleet, UpstreamServer, chat, served_by

pytestmark = pytest.mark.slow

REQUESTS = 10


@pytest.mark.asyncio
async def test_ten_identical_requests_over_three_replicas_make_one_upstream_call(
    fleet: Fleet, upstream: UpstreamServer
) -> None:
    """Ten identical concurrent requests (a slow upstream, so they overlap) cause one call."""
    upstream.reset(upstream.script(latency=0.5))
    tag = f"flight-{secrets.token_hex(4)}"
    body = chat(f"{tag} what is the refund policy?")
    # Ten users of one tenant: the same question, so one cache key, but ten separate limits.
    keys = [fleet.new_user() for _ in range(REQUESTS)]

    async with httpx.AsyncClient(base_url=fleet.url, timeout=30.0) as client:
        responses = await asyncio.gather(
            *(
                client.post(
                    "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
                for key in keys
            )
        )

    assert [r.status_code for r in responses] == [200] * REQUESTS, [r.text for r in responses]
    assert len(upstream.attempts(tag)) == 1
    assert len({r.json()["choices"][0]["message"]["content"] for r in responses}) == 1
    outcomes = Counter(r.headers["x-tidegate-cache"] for r in responses)
    assert outcomes["miss"] == 1, outcomes  # the leader
    assert set(outcomes) <= {"miss", "shared", "hit"}, outcomes
    leader = next(served_by(r) for r in responses if r.headers["x-tidegate-cache"] == "miss")
    shared_elsewhere = {
        served_by(r) for r in responses if r.headers["x-tidegate-cache"] == "shared"
    } - {leader}
    assert shared_elsewhere, "no replica but the leader's shared its call"
    assert len({served_by(r) for r in responses}) == len(fleet.replicas)
