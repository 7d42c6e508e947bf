"""The open-requests guard of the connection (gateway.protocol.Door): a model request past the
limit is answered at the connection, before its body, without a task or the app's work."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from uvicorn.config import Config as UvicornConfig
from uvicorn.server import ServerState

from tests.gateway.harness import RecordingTransport
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import Config
from tidegate.gateway.protocol import STATE_KEY, ConnectionLimits, GuardedHttpToolsProtocol

MINIMAL: dict[str, Any] = {
    "providers": {"main": {"type": "fake", "model": "fake-1", "fake": {"text": "hi"}}},
    "models": {"chat": {"providers": ["main"]}},
}
BODY = b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}'


class _Gateway(Gateway):
    """Counts what reaches the app."""

    called = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        type(self).called += 1
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})


async def _next_round() -> None:
    """One round of the event loop: a request task the protocol made has started."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_soon(done.set_result, None)
    await done


def _request(path: str = "/v1/chat/completions", *extra: str, body: bytes = BODY) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: t", "Content-Type: application/json", *extra]
    head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _answers(written: bytes) -> list[tuple[int, dict[str, str], Any]]:
    out = []
    while written:
        head, _, rest = written.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        length = int(headers["content-length"])
        out.append((int(lines[0].split()[1]), headers, json.loads(rest[:length])))
        written = rest[length:]
    return out


@pytest.fixture
def door(tmp_path: Path) -> Any:
    gateway = _Gateway(Config.model_validate(MINIMAL), tmp_path / "tidegate.yaml")
    return gateway


async def _connection(
    gateway: Gateway, limit: int
) -> tuple[GuardedHttpToolsProtocol, RecordingTransport, ServerState]:
    opened = gateway.door()
    opened = type(opened)(limit, opened.openai, opened.messages, None)
    limits = ConnectionLimits.from_config(gateway.config.server, None, opened)
    config = UvicornConfig(app=gateway, http=GuardedHttpToolsProtocol, lifespan="off")
    config.load()
    state = ServerState()
    protocol = GuardedHttpToolsProtocol(config, state, {STATE_KEY: limits})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport, state


@pytest.mark.asyncio
async def test_past_the_limit_a_model_request_is_answered_at_the_connection(door: Any) -> None:
    """Structural: the app is never called and no request task is made; the answer is the
    documented 503 with Retry-After and a request id, and the connection stays open."""
    _Gateway.called = 0
    protocol, transport, state = await _connection(door, limit=0)
    protocol.data_received(_request("/v1/chat/completions", "X-Request-ID: abc-1"))
    protocol.data_received(_request("/v1/messages"))
    await _next_round()
    assert _Gateway.called == 0
    assert not state.tasks
    assert not transport.closed
    (status, headers, body), (m_status, m_headers, m_body) = _answers(transport.written)
    assert status == 503
    assert headers["retry-after"] == "1"
    assert headers["x-request-id"] == "abc-1"
    assert body["error"]["code"] == "queue_full"
    assert body["error"]["retryable"] is True
    assert "server.max_open_requests" in body["error"]["message"]
    # Anthropic's shape on /v1/messages, as the app writes every 503 there.
    assert m_status == 529
    assert m_body["type"] == "error"
    assert m_body["error"]["type"] == "overloaded_error"
    assert len(m_headers["x-request-id"]) >= 16
    protocol.connection_lost(None)


@pytest.mark.asyncio
async def test_under_the_limit_and_off_model_paths_the_app_answers(door: Any) -> None:
    _Gateway.called = 0
    protocol, transport, _state = await _connection(door, limit=1)
    protocol.data_received(_request())  # no request open yet: to the app
    await _next_round()
    assert _Gateway.called == 1
    assert transport.written.startswith(b"HTTP/1.1 200")
    protocol.connection_lost(None)
    protocol, transport, _ = await _connection(door, limit=0)
    protocol.data_received(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")  # never shed
    await _next_round()
    assert _Gateway.called == 2
    assert transport.written.startswith(b"HTTP/1.1 200")
    protocol.connection_lost(None)


@pytest.mark.asyncio
async def test_a_closing_request_is_answered_and_closed(door: Any) -> None:
    protocol, transport, _ = await _connection(door, limit=0)
    protocol.data_received(_request("/v1/chat/completions", "Connection: close"))
    assert transport.closed
    ((status, headers, _),) = _answers(transport.written)
    assert status == 503
    assert headers["connection"] == "close"


def test_the_default_limit_is_twice_the_admission_places(door: Any) -> None:
    admission = door.config.admission
    assert door.door_limit == 2 * (admission.slots + admission.queue_cap)
    custom = Gateway(
        Config.model_validate({**MINIMAL, "server": {"max_open_requests": 7}}), Path("x")
    )
    assert custom.door().limit == 7
