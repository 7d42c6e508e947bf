"""A request on its way to a connection between requests when the server shuts down is answered
(with ``Connection: close``), not reset unread; a connection that stays silent closes after
``SHUTDOWN_GRACE_S``. In process: the guarded protocol on an event loop with a transport that
records what it is told; the grace's timer is read, and run, by the test (no waiting)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from uvicorn.config import Config as UvicornConfig
from uvicorn.server import ServerState

from tests.gateway.harness import RecordingTransport
from tidegate.clock import loop_round
from tidegate.gateway.protocol import SHUTDOWN_GRACE_S, GuardedHttpToolsProtocol

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n"


async def app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _connection() -> tuple[GuardedHttpToolsProtocol, RecordingTransport]:
    config = UvicornConfig(app, http="httptools", lifespan="off", log_level="error")
    config.load()
    protocol = GuardedHttpToolsProtocol(config, ServerState(), app_state={})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport


@pytest.mark.asyncio
async def test_a_request_arriving_just_after_shutdown_is_answered_and_closes() -> None:
    protocol, transport = _connection()
    protocol.shutdown()
    assert not transport.closed
    protocol.data_received(REQUEST)
    for _ in range(10):
        await loop_round()
    assert protocol._grace is not None
    protocol._grace.cancel()
    protocol._close_if_idle()  # the grace ends after the request came: nothing to close early
    for _ in range(10):
        await loop_round()
    assert transport.written.startswith(b"HTTP/1.1 200 OK")
    assert b"connection: close" in transport.written.lower()
    assert transport.is_closing()


@pytest.mark.asyncio
async def test_a_silent_connection_closes_after_the_grace() -> None:
    protocol, transport = _connection()
    loop = asyncio.get_running_loop()
    protocol.shutdown()
    assert not transport.closed
    grace = protocol._grace
    assert grace is not None
    assert grace.when() - loop.time() == pytest.approx(SHUTDOWN_GRACE_S, abs=0.02)
    grace.cancel()
    protocol._close_if_idle()
    assert transport.is_closing()
    assert transport.written == b""
