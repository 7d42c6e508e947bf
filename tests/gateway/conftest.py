from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.harness import KEY, write_config
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config

AppFactory = Callable[..., Any]


@pytest.fixture
def gateway_client(tmp_path: Path) -> AppFactory:
    """An in-process gateway (ASGI, no sockets) and an httpx client authenticated with KEY."""

    @asynccontextmanager
    async def make(
        config: dict[str, Any], **overrides: Any
    ) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
        path = write_config(tmp_path, config)
        app = Gateway(load_config(path, env={}), path, **overrides)
        await app.startup()
        transport = httpx.ASGITransport(app=app)
        client = httpx.AsyncClient(
            transport=transport,
            base_url="http://gateway",
            headers={"Authorization": f"Bearer {KEY}"},
        )
        try:
            yield client, app
        finally:
            await client.aclose()
            await app.shutdown()

    return make
