"""The fake upstream HTTP server: endpoints, attempt log, and each fault over a real socket."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any

import aiohttp
import pytest

from tidegate.clock import SystemClock
from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.providers.base import StreamEnd, StreamItem
from tidegate.providers.fake_upstream import FakeUpstream
from tidegate.providers.openai import OpenAIProvider

from .conftest import Upstream

pytestmark = pytest.mark.slow

K = ProviderErrorKind
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "one two three"}]}


def one_model(**model: Any) -> dict[str, Any]:
    return {"models": {"m": model}}


async def call(
    server: FakeUpstream, session: aiohttp.ClientSession, body: dict[str, Any], limit: float = 1.0
) -> ProviderError:
    provider = OpenAIProvider("up", server.base_url, None, session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(body, timeout=limit)
    return caught.value


async def stream_items(
    server: FakeUpstream, session: aiohttp.ClientSession, body: dict[str, Any]
) -> list[StreamItem]:
    provider = OpenAIProvider("up", server.base_url, None, session)
    stream = provider.stream({**body, "stream": True}, timeout=1.0)
    async with aclosing(stream):
        return [item async for item in stream]


@pytest.mark.asyncio
async def test_models_lists_the_named_models(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """GET /v1/models lists every named model and leaves out the wildcard."""
    server = await upstream({"models": {"b": {}, "a": {}, "*": {}}})
    async with session.get(f"{server.base_url}/models") as response:
        listing = await response.json()
    assert [model["id"] for model in listing["data"]] == ["b", "a"]


@pytest.mark.asyncio
async def test_attempts_are_logged_filtered_and_reset(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """Every attempt is logged with its model, number, stream flag, messages, fault and outcome."""
    server = await upstream(
        {
            "models": {
                "m": {"faults": [{"on_attempts": [1], "kind": "http", "status": 503}]},
                "*": {},
            }
        }
    )
    await call(server, session, dict(CHAT))
    await stream_items(server, session, dict(CHAT))
    await stream_items(server, session, {**CHAT, "model": "other"})
    async with session.get(f"{server.url}/_fake/attempts", params={"model": "m"}) as response:
        attempts = (await response.json())["attempts"]
    assert [(a["attempt"], a["stream"], a["fault"], a["outcome"]) for a in attempts] == [
        (1, False, "http", "http_503"),
        (2, True, None, "ok"),
    ]
    assert attempts[0]["messages"] == CHAT["messages"]
    assert isinstance(attempts[0]["received_at"], float)
    async with session.post(f"{server.url}/_fake/reset") as response:
        assert response.status == 200
    assert server.attempts == []
    assert (await call(server, session, dict(CHAT))).kind == K.OVERLOADED  # counters restarted


@pytest.mark.asyncio
async def test_replacing_the_script(upstream: Upstream, session: aiohttp.ClientSession) -> None:
    """POST /_fake/script swaps the script; an invalid one is refused naming the key."""
    server = await upstream(one_model())
    async with session.post(
        f"{server.url}/_fake/script", json=one_model(faults=[{"kind": "reset"}])
    ) as response:
        assert response.status == 200
    assert (await call(server, session, dict(CHAT))).kind == K.CONNECTION
    async with session.post(f"{server.url}/_fake/script", json=one_model(latnecy=1)) as response:
        refusal = await response.json()
    assert response.status == 400
    assert "models.m.latnecy: unknown key" in refusal["error"]["message"]


@pytest.mark.asyncio
async def test_an_invalid_body_is_refused_and_logged(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """A body that is not a JSON object with a model gets a 400 and an invalid_request log entry."""
    server = await upstream(one_model())
    async with session.post(f"{server.base_url}/chat/completions", data=b"[1, 2]") as response:
        assert response.status == 400
    assert server.attempts[0]["outcome"] == "invalid_request"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("model", "body", "kind"),
    [
        ({"faults": [{"kind": "content_filter"}]}, CHAT, K.CONTENT_FILTER),
        ({"faults": [{"kind": "context_length_exceeded"}]}, CHAT, K.CONTEXT_LENGTH),
        ({"context_window": 2}, CHAT, K.CONTEXT_LENGTH),
        (
            {"faults": [{"kind": "refuse_prefill"}]},
            {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Well"}]},
            K.BAD_REQUEST,
        ),
        ({"faults": [{"kind": "http", "status": 401, "code": "invalid_api_key"}]}, CHAT, K.AUTH),
        ({}, {**CHAT, "model": "unknown"}, K.NOT_FOUND),
        ({"faults": [{"kind": "cut_after", "tokens": 1}]}, CHAT, K.CONNECTION),
        ({"faults": [{"kind": "malformed_chunk"}]}, CHAT, K.MALFORMED),
        ({"faults": [{"kind": "raw", "body": {"choices": []}}]}, CHAT, K.MALFORMED),
        ({"faults": [{"kind": "raw", "status": 503, "body": "busy"}]}, CHAT, K.OVERLOADED),
    ],
)
async def test_refusals_and_broken_bodies(
    model: dict[str, Any],
    body: dict[str, Any],
    kind: K,
    upstream: Upstream,
    session: aiohttp.ClientSession,
) -> None:
    """Each scripted refusal or damaged non-streamed body raises the kind a real one would."""
    server = await upstream(one_model(**model))
    assert (await call(server, session, dict(body))).kind == kind


@pytest.mark.asyncio
async def test_a_stalled_body_times_out(upstream: Upstream, session: aiohttp.ClientSession) -> None:
    """A non-streamed body that stops halfway times out at the call's timeout."""
    server = await upstream(one_model(faults=[{"kind": "stall_after", "tokens": 1}]))
    assert (await call(server, session, dict(CHAT), limit=0.05)).kind == K.TIMEOUT


@pytest.mark.asyncio
async def test_content_filter_after_tokens_finishes_the_stream(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """With after_tokens the stream stops there with finish_reason content_filter."""
    server = await upstream(
        one_model(text="a b c", faults=[{"kind": "content_filter", "after_tokens": 1}])
    )
    items = await stream_items(server, session, dict(CHAT))
    finishes = [
        i["choices"][0]["finish_reason"] for i in items if isinstance(i, dict) and i["choices"]
    ]
    assert finishes[-1] == "content_filter"
    assert items[-1] == StreamEnd(done_seen=True)


@pytest.mark.asyncio
async def test_latency_delays_the_answer(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """A scripted latency holds the answer back at least that long."""
    server = await upstream(one_model(latency=0.05))
    provider = OpenAIProvider("up", server.base_url, None, session)
    clock = SystemClock()
    started = clock.now()
    await provider.complete(dict(CHAT), timeout=1.0)
    assert clock.now() - started >= 0.05


@pytest.mark.asyncio
async def test_closing_does_not_wait_for_a_hung_request(session: aiohttp.ClientSession) -> None:
    """Shutting the server down ends a no_response request at once instead of waiting it out."""
    server = FakeUpstream(one_model(faults=[{"kind": "no_response"}]))
    await server.start()
    provider = OpenAIProvider("up", server.base_url, None, session)
    task = asyncio.create_task(provider.complete(dict(CHAT), timeout=5.0))
    while not server.attempts:
        await SystemClock().asleep(0.01)
    clock = SystemClock()
    started = clock.now()
    await server.close()
    assert clock.now() - started < 0.5
    assert server.attempts[0]["outcome"] == "no_response"
    with pytest.raises(ProviderError):
        await task


@pytest.mark.asyncio
async def test_a_raw_fault_is_sent_byte_for_byte(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """A raw fault's status, headers and body arrive exactly as scripted, even on a stream
    request, and the attempt's outcome names the status."""
    stream = 'data: {"error": {"message": "mid-stream"}}\n\n'
    fault = {
        "kind": "raw",
        "status": 200,
        "body": stream,
        "content_type": "text/event-stream",
        "headers": {"x-request-id": "req_42"},
    }
    server = await upstream(one_model(faults=[fault]))
    async with session.post(
        f"{server.base_url}/chat/completions", json={**CHAT, "stream": True}
    ) as response:
        assert response.status == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert response.headers["x-request-id"] == "req_42"
        assert await response.text() == stream
    assert server.attempts[0]["outcome"] == "raw_200"
