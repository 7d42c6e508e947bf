"""An Idempotency-Key means the same thing on every replica: one upstream call, one answer."""

from __future__ import annotations

import secrets

import httpx
import pytest

from tests.fleet.harness import Fleet, UpstreamServer, chat, served_by

pytestmark = pytest.mark.slow


@pytest.mark.asyncio
async def test_a_retry_on_another_replica_replays_the_first_answer(
    fleet: Fleet, upstream: UpstreamServer
) -> None:
    """A key retried on each other replica returns the same bytes; the upstream saw one call."""
    tag = f"idem-{secrets.token_hex(4)}"
    headers = {"Authorization": f"Bearer {fleet.new_user()}", "Idempotency-Key": tag}
    body = chat(f"{tag} open a ticket")
    async with httpx.AsyncClient(timeout=30.0) as client:
        first = await client.post(f"{fleet.url}/v1/chat/completions", json=body, headers=headers)
        assert first.status_code == 200, first.text
        origin = served_by(first)
        others = [r for r in fleet.replicas if r.port != origin]
        assert len(others) == len(fleet.replicas) - 1
        for replica in others:
            retry = await client.post(
                f"{replica.url}/v1/chat/completions", json=body, headers=headers
            )
            assert retry.status_code == 200, retry.text
            assert retry.headers["idempotent-replayed"] == "true"
            assert retry.headers["x-tidegate-cache"] == "idempotent-replay"
            assert retry.content == first.content
    assert len(upstream.attempts(tag)) == 1


@pytest.mark.asyncio
async def test_the_same_key_with_another_body_is_422_on_every_replica(
    fleet: Fleet, upstream: UpstreamServer
) -> None:
    """Once a key has an answer, another body under it is refused 422 wherever it lands."""
    tag = f"idem-mismatch-{secrets.token_hex(4)}"
    headers = {"Authorization": f"Bearer {fleet.new_user()}", "Idempotency-Key": tag}
    async with httpx.AsyncClient(timeout=30.0) as client:
        first = await client.post(
            f"{fleet.url}/v1/chat/completions", json=chat(f"{tag} refund order 1"), headers=headers
        )
        assert first.status_code == 200, first.text
        for replica in fleet.replicas:
            other = await client.post(
                f"{replica.url}/v1/chat/completions",
                json=chat(f"{tag} refund order 2"),
                headers=headers,
            )
            assert other.status_code == 422, (replica.index, other.text)
            assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert len(upstream.attempts(tag)) == 1
