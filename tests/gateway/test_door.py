"""The process's door (gateway.protocol.Door, gateway.door): a model request past the open-requests
limit, or one admission would refuse, is answered at the connection, before its body, without a
task or the app's work."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from uvicorn.config import Config as UvicornConfig
from uvicorn.server import ServerState

from tests.gateway.harness import KEY, LOW_KEY, RecordingTransport, fake, write_config
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import Config, load_config
from tidegate.gateway.door import MAX_HINT_S
from tidegate.gateway.pipeline.dialect import OPENAI
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


@pytest_asyncio.fixture
async def door(tmp_path: Path) -> Any:
    gateway = _Gateway(Config.model_validate(MINIMAL), tmp_path / "tidegate.yaml")
    await gateway.startup()
    yield gateway
    await gateway.shutdown()


async def _connection(
    gateway: Gateway, limit: int | None = None
) -> tuple[GuardedHttpToolsProtocol, RecordingTransport, ServerState]:
    """A connection of ``gateway``'s door; ``limit`` replaces its open-requests limit."""
    opened = gateway.door()
    if limit is not None:
        opened = type(opened)(limit, opened.openai, opened.messages, None, opened.full)
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


@pytest.mark.asyncio
async def test_a_request_refused_while_the_server_drains_is_its_connections_last(
    door: Any,
) -> None:
    protocol, transport, _ = await _connection(door, limit=0)
    protocol.shutdown()  # uvicorn's graceful shutdown began, between requests
    protocol.data_received(_request("/v1/chat/completions"))
    ((status, headers, _),) = _answers(transport.written)
    assert status == 503
    assert headers["connection"] == "close"
    assert transport.closed


@pytest.mark.asyncio
async def test_the_default_limit_is_twice_the_admission_places(door: Any) -> None:
    admission = door.config.admission
    assert door.door_limit == 2 * (admission.slots + admission.queue_cap)
    custom = Gateway(
        Config.model_validate({**MINIMAL, "server": {"max_open_requests": 7}}), Path("x")
    )
    assert custom.door_limit == 7


@pytest.mark.asyncio
async def test_count_tokens_past_the_limit_is_refused_in_anthropics_shape(door: Any) -> None:
    protocol, transport, _ = await _connection(door, limit=0)
    protocol.data_received(_request("/v1/messages/count_tokens"))
    ((status, _, body),) = _answers(transport.written)
    assert status == 529
    assert body["error"]["type"] == "overloaded_error"
    protocol.connection_lost(None)


# --------------------------------------------------------------------------- full admission


FULL: dict[str, Any] = {
    "providers": {"main": fake()},
    "models": {"chat": {"providers": ["main"]}},
    "admission": {"slots": 1, "queue_cap": 1},
    "cache": {"enabled": False},
}


@pytest_asyncio.fixture
async def make_full(tmp_path: Path) -> Any:
    """Started gateways (counting what reaches their app) made from FULL and ``changes``."""
    made: list[Gateway] = []

    async def make(**changes: Any) -> Gateway:
        path = write_config(tmp_path, {**FULL, **changes})
        gateway = _Gateway(load_config(path, env={}), path)
        await gateway.startup()
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        await gateway.shutdown()


def _fill(gateway: Gateway, klass: str = "standard") -> None:
    """Take the one slot and fill ``klass``'s one waiting place, as two callers would."""
    runtime = gateway.runtime
    assert runtime is not None
    controller = runtime.admission.controller
    for rid in ("held", "waiting"):
        controller.offer(request_id=rid, klass=klass, tenant="other", deadline_at=None)
    assert not controller.has_room()


def _bearer(key: str = KEY) -> str:
    return f"Authorization: Bearer {key}"


@pytest.mark.asyncio
async def test_a_full_class_is_refused_at_the_connection_with_admissions_answer(
    make_full: Any,
) -> None:
    """Structural: the app is never called, no request task is made; the answer is the 503
    ``queue_full`` admission gives, with its Retry-After, the request id, and it is counted
    as admission counts a refusal of the caller's class."""
    gateway = await make_full()
    _fill(gateway)
    runtime = gateway.runtime
    assert runtime is not None
    _Gateway.called = 0
    protocol, transport, state = await _connection(gateway)
    protocol.data_received(_request("/v1/chat/completions", _bearer(), "X-Request-ID: full-1"))
    protocol.data_received(_request("/v1/messages", _bearer()))
    await _next_round()
    assert _Gateway.called == 0
    assert not state.tasks
    assert not transport.closed
    (status, headers, body), (m_status, _, m_body) = _answers(transport.written)
    assert status == 503
    assert body["error"]["code"] == "queue_full"
    assert "class" in body["error"]["message"]
    hint = runtime.admission.controller.saturated("standard")
    assert hint is not None
    assert headers["retry-after"] == str(max(1, math.ceil(hint)))
    assert headers["x-request-id"] == "full-1"
    assert m_status == 529
    assert m_body["error"]["type"] == "overloaded_error"
    refused = runtime.admission.controller.snapshot().refused
    assert refused["standard"]["queue_full"] == 2
    exposition = runtime.metrics.exposition().decode()
    assert 'tidegate_refusals_total{klass="standard",reason="queue_full"} 2.0' in exposition
    protocol.connection_lost(None)


@pytest.mark.asyncio
async def test_what_admission_would_let_in_goes_to_the_app(make_full: Any) -> None:
    """Another class with room, no valid key, an Idempotency-Key, count_tokens: the app."""
    gateway = await make_full()
    _fill(gateway)  # standard is full; batch is not
    for extra in (
        (_bearer(LOW_KEY),),  # the batch key: its class has room
        ("Authorization: Bearer nobody",),  # 401 is the app's to say
        (),  # no key at all
        (_bearer(), "Idempotency-Key: k-1"),  # a stored answer may be replayed without a slot
    ):
        _Gateway.called = 0
        protocol, _, _ = await _connection(gateway)
        protocol.data_received(_request("/v1/chat/completions", *extra))
        await _next_round()
        assert _Gateway.called == 1, extra
        protocol.connection_lost(None)
    _Gateway.called = 0
    protocol, _, _ = await _connection(gateway)
    protocol.data_received(_request("/v1/messages/count_tokens", _bearer()))  # takes no slot
    await _next_round()
    assert _Gateway.called == 1
    protocol.connection_lost(None)


@pytest.mark.asyncio
async def test_a_priority_header_lowers_the_class_the_door_judges(make_full: Any) -> None:
    gateway = await make_full()
    _fill(gateway, "batch")  # batch is full; the standard key asks to be judged as batch
    _Gateway.called = 0
    protocol, transport, _ = await _connection(gateway)
    protocol.data_received(_request("/v1/chat/completions", _bearer()))
    await _next_round()
    assert _Gateway.called == 1  # its own class, standard, has room
    protocol.connection_lost(None)
    protocol, transport, _ = await _connection(gateway)
    protocol.data_received(
        _request("/v1/chat/completions", _bearer(), "X-Tidegate-Priority: batch")
    )
    ((status, _, _),) = _answers(transport.written)
    assert status == 503
    protocol.connection_lost(None)


@pytest.mark.asyncio
async def test_with_the_cache_on_or_the_kill_switch_set_the_app_answers(make_full: Any) -> None:
    cached = await make_full(cache={"enabled": True})
    _fill(cached)
    _Gateway.called = 0
    protocol, transport, _ = await _connection(cached)
    protocol.data_received(_request("/v1/chat/completions", _bearer()))
    await _next_round()
    assert _Gateway.called == 1  # a hit is served without a slot: the app must look
    protocol.connection_lost(None)
    protocol, transport, _ = await _connection(cached)
    protocol.data_received(_request("/v1/embeddings", _bearer()))  # embeddings are not cached
    ((status, _, _),) = _answers(transport.written)
    assert status == 503
    assert _Gateway.called == 1
    protocol.connection_lost(None)
    gateway = await make_full()
    _fill(gateway)
    runtime = gateway.runtime
    assert runtime is not None
    runtime.flags.set("answer.mode", "degraded", who="test", why="door")
    _Gateway.called = 0
    protocol, _, _ = await _connection(gateway)
    protocol.data_received(_request("/v1/chat/completions", _bearer()))
    await _next_round()
    assert _Gateway.called == 1  # degraded answers need no slot
    protocol.connection_lost(None)


@pytest.mark.asyncio
async def test_the_door_keeps_one_rendering_per_hint_and_caps_it(make_full: Any) -> None:
    gateway = await make_full()
    door = gateway.door()
    assert door.full is not None
    _fill(gateway)
    refusals = [
        door.full.refusal(b"/v1/chat/completions", [(b"authorization", f"Bearer {KEY}".encode())])
        for _ in range(3)
    ]
    first = refusals[0]
    assert first is not None
    assert all(r is not None and r[0] is first[0] for r in refusals)  # rendered once
    shed = door.full._shed(OPENAI, 1e9)
    assert f"retry-after: {MAX_HINT_S}".encode() in shed.head
