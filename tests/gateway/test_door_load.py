"""The door under a burst over real sockets: while admission is full, hundreds of concurrent
callers are answered at the connection (uvicorn with the guarded protocol, as ``tidegate serve``
runs it), each with admission's refusal, counted once; the admitted requests are still served,
and once a slot frees the door lets callers in again."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.gateway.harness import KEY, fake, serving, write_config
from tests.gateway.upstream import metric, wait_until
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config
from tidegate.gateway.protocol import GuardedHttpToolsProtocol

pytestmark = pytest.mark.slow

#: Admission of 2 slots and 2 waiting places per class, answers taking this long.
ANSWER_S = 1.5
BURST = 300
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def _config() -> dict[str, Any]:
    return {
        "providers": {"main": fake(latency=ANSWER_S)},
        "models": {"chat": {"providers": ["main"]}},
        "admission": {"slots": 2, "queue_cap": 2},
        "cache": {"enabled": False},
        "server": {"max_open_requests": 1000},  # the open-requests limit stays out of it
    }


async def _burst(base: str, count: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30.0, trust_env=False) as c:
        return list(
            await asyncio.gather(
                *(c.post("/v1/chat/completions", json=BODY, headers=AUTH) for _ in range(count))
            )
        )


def test_a_burst_against_full_admission_is_refused_at_the_door(tmp_path: Path) -> None:
    path = write_config(tmp_path, _config())
    app = Gateway(load_config(path, env={}), path)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=GuardedHttpToolsProtocol,
        lifespan="on",
        log_level="warning",
        access_log=False,
    )
    server = uvicorn.Server(config)
    with serving(server):
        port = server.servers[0].sockets[0].getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        runtime = app.runtime
        assert runtime is not None
        controller = runtime.admission.controller
        # Four callers fill the two slots and the two waiting places.
        admitted: list[httpx.Response] = []
        first = threading.Thread(target=lambda: admitted.extend(asyncio.run(_burst(base, 4))))
        first.start()
        assert wait_until(lambda: controller.saturated("standard") is not None, within=10.0)
        refused = asyncio.run(_burst(base, BURST))
        first.join(timeout=30.0)
        assert [r.status_code for r in admitted] == [200] * 4
        assert [r.status_code for r in refused] == [503] * BURST
        bodies = [r.json()["error"] for r in refused]
        assert {b["code"] for b in bodies} == {"queue_full"}
        assert all(r.headers["retry-after"].isdigit() for r in refused)
        assert len({r.headers["x-request-id"] for r in refused}) == BURST
        # Every one was answered at the door (route -), and admission counted each.
        at_door = metric(base, "tidegate_requests_total", route="-", outcome="queue_full")
        assert at_door == BURST
        assert controller.snapshot().refused["standard"]["queue_full"] == BURST
        # With the slots free again, the door lets a caller in.
        (again,) = asyncio.run(_burst(base, 1))
        assert again.status_code == 200
