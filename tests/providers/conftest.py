"""Fixtures for the provider tests: a client session, and servers on loopback ephemeral ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import pytest_asyncio
from aiohttp import web

from tidegate.providers.fake_upstream import FakeUpstream

Serve = Callable[[web.Application], Awaitable[str]]
Upstream = Callable[[Mapping[str, Any]], Awaitable[FakeUpstream]]


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start an aiohttp app on 127.0.0.1 and give back its base URL; stopped after the test."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[Upstream]:
    """Start a fake upstream with a script; closed after the test."""
    started: list[FakeUpstream] = []

    async def start(script: Mapping[str, Any]) -> FakeUpstream:
        server = FakeUpstream(script)
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.close()
