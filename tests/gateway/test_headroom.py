"""Provider-reported headroom through the gateway: an OpenAI-compatible fake on a loopback socket
counts its remaining requests down in ``x-ratelimit-*`` headers; the gateway records it
(``/readyz``, ``/metrics``) and, with ``headroom.prefer_others``, sends the route's traffic to
its approved fallback before the primary's 429 arrives."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake
from tests.providers.helpers import gateway_config

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "When is high tide?"}]}
LIMIT = 20


class CountingDown:
    """Answers chat completions, saying after each how many of its ``LIMIT`` requests are left;
    past the limit it answers 429, as a provider would."""

    def __init__(self) -> None:
        self.answered = 0

    async def chat(self, request: web.Request) -> web.Response:
        await request.json()
        if self.answered >= LIMIT:
            return web.json_response(
                {"error": {"message": "Rate limit reached", "type": "requests", "code": None}},
                status=429,
                headers={"retry-after": "30", **self._headers()},
            )
        self.answered += 1
        body = {
            "id": f"chatcmpl-{self.answered}",
            "object": "chat.completion",
            "created": 1_767_225_600,
            "model": "tide-1",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Twice a day."},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        }
        return web.json_response(body, headers=self._headers())

    def _headers(self) -> dict[str, str]:
        return {
            "x-ratelimit-limit-requests": str(LIMIT),
            "x-ratelimit-remaining-requests": str(LIMIT - self.answered),
            "x-ratelimit-reset-requests": "1m0s",
        }


@asynccontextmanager
async def _upstream() -> AsyncIterator[tuple[CountingDown, str]]:
    counting = CountingDown()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", counting.chat)
    runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield counting, f"http://{host}:{port}/v1"
    finally:
        await runner.cleanup()


def _config(base: str, **headroom: Any) -> dict[str, Any]:
    providers = {
        "primary": {"type": "openai", "model": "tide-1", "base_url": base},
        "backup": fake("from the backup", model="backup-1"),
    }
    return gateway_config(providers, headroom={"low_fraction": 0.1, **headroom})


async def _served_by(client: Any, count: int) -> list[str]:
    served = []
    for _ in range(count):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        served.append(response.headers["x-tidegate-served-by"])
    return served


@pytest.mark.asyncio
async def test_traffic_moves_to_the_fallback_before_the_429(
    gateway_client: AppFactory,
) -> None:
    async with (
        _upstream() as (counting, base),
        gateway_client(_config(base, prefer_others=True)) as (client, _),
    ):
        served = await _served_by(client, 30)
        # The 18th answer says 2 of 20 are left (10%): low, so the rest go to the backup, and
        # the primary never reaches its limit.
        assert served == ["primary"] * 18 + ["backup"] * 12
        assert counting.answered == 18
        ready = (await client.get("/readyz")).json()
        assert ready["headroom"]["primary"]["low"] is True
        assert ready["headroom"]["primary"]["requests"]["remaining"] == 2
        assert ready["headroom"]["primary"]["requests"]["limit"] == LIMIT
        assert 59 < ready["headroom"]["primary"]["requests"]["reset_in_s"] <= 60
        scrape = (await client.get("/metrics")).text
        line = 'tidegate_provider_headroom_remaining{provider="primary",resource="requests"} 2.0'
        assert line in scrape


@pytest.mark.asyncio
async def test_off_by_default_headroom_is_recorded_and_the_route_order_kept(
    gateway_client: AppFactory,
) -> None:
    async with (
        _upstream() as (counting, base),
        gateway_client(_config(base)) as (client, _),
    ):
        served = await _served_by(client, 20)
        assert served == ["primary"] * 20
        assert counting.answered == LIMIT
        # The 21st meets the 429 (it reports nothing left) and fails over, as before.
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        assert response.headers["x-tidegate-served-by"] == "backup"
        assert response.headers["x-tidegate-tried"].startswith("primary=rate_limit")
        ready = (await client.get("/readyz")).json()
        assert ready["headroom"]["primary"]["requests"]["remaining"] == 0


@pytest.mark.asyncio
async def test_a_low_primary_alone_on_its_route_is_still_called(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    async with _upstream() as (counting, base):
        config = gateway_config(
            {"primary": {"type": "openai", "model": "tide-1", "base_url": base}},
            headroom={"prefer_others": True, "low_fraction": 0.5},
        )
        async with gateway_client(config) as (client, _):
            served = await _served_by(client, 15)
            assert served == ["primary"] * 15
            assert counting.answered == 15
