"""The OpenAI-compatible provider, over real sockets on loopback."""

from __future__ import annotations

import asyncio
import socket
from contextlib import aclosing
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tidegate.clock import SystemClock
from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.providers.base import MalformedChunk, StreamEnd, StreamItem
from tidegate.providers.openai import (
    OpenAIProvider,
    chat_completion_problem,
    embeddings_problem,
    openai_answer,
)
from tidegate.providers.transport import HTTPAnswer

from .conftest import Serve, Upstream

pytestmark = pytest.mark.slow

K = ProviderErrorKind
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def _error(
    message: str, code: str | int | None = None, type: str = "invalid_request_error"
) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})


# (status, body, headers) -> (kind, retryable, retry_after)
CASES: dict[str, tuple[int, bytes, dict[str, str], K, bool, float | None]] = {
    "rate_limited": (
        429,
        _error("slow down", "rate_limit_exceeded"),
        {"Retry-After": "2"},
        K.RATE_LIMITED,
        True,
        2.0,
    ),
    "rate_limited_ms": (
        429,
        _error("slow down"),
        {"retry-after-ms": "250"},
        K.RATE_LIMITED,
        True,
        0.25,
    ),
    "insufficient_quota": (
        429,
        _error("pay up", "insufficient_quota", "insufficient_quota"),
        {"Retry-After": "9"},
        K.RATE_LIMITED,
        False,
        None,
    ),
    "timeout_408": (408, _error("slow"), {}, K.TIMEOUT, True, None),
    "timeout_504": (504, b"gateway timeout", {}, K.TIMEOUT, True, None),
    "overloaded_503": (
        503,
        _error("busy", type="server_error"),
        {"Retry-After": "3"},
        K.OVERLOADED,
        True,
        3.0,
    ),
    "overloaded_529": (529, _error("busy"), {}, K.OVERLOADED, True, None),
    "server_500": (500, _error("oops", type="server_error"), {}, K.SERVER, True, None),
    "server_502": (502, b"<html>bad gateway</html>", {}, K.SERVER, True, None),
    "not_found": (
        404,
        _error("The model `m` does not exist", "model_not_found"),
        {},
        K.NOT_FOUND,
        False,
        None,
    ),
    "context_code": (
        400,
        _error("too long", "context_length_exceeded"),
        {},
        K.CONTEXT_LENGTH,
        False,
        None,
    ),
    "context_vllm": (
        400,
        orjson.dumps(
            {
                "object": "error",
                "message": "This model's maximum context length is 4096 tokens.",
                "type": "BadRequestError",
                "code": 400,
            }
        ),
        {},
        K.CONTEXT_LENGTH,
        False,
        None,
    ),
    "content_filter": (
        400,
        _error("filtered", "content_filter"),
        {},
        K.CONTENT_FILTER,
        False,
        None,
    ),
    "content_policy": (
        400,
        _error("refused", "content_policy_violation"),
        {},
        K.CONTENT_FILTER,
        False,
        None,
    ),
    "bad_request_400": (
        400,
        _error("bad temperature", "invalid_value"),
        {},
        K.BAD_REQUEST,
        False,
        None,
    ),
    "bad_request_422": (422, b'{"detail": "unprocessable"}', {}, K.BAD_REQUEST, False, None),
    "auth_401": (401, _error("bad key", "invalid_api_key"), {}, K.AUTH, False, None),
    "auth_403": (403, _error("region"), {}, K.AUTH, False, None),
    "malformed_text": (200, b"this is not json", {}, K.MALFORMED, True, None),
    "malformed_shape": (200, b'{"object": "chat.completion"}', {}, K.MALFORMED, True, None),
    # 2xx bodies that parse but are not answers: never a success.
    "empty_choices": (200, b'{"id": "c", "choices": []}', {}, K.MALFORMED, True, None),
    "choices_not_a_list": (200, b'{"choices": {"0": {}}}', {}, K.MALFORMED, True, None),
    "choices_not_objects": (200, b'{"choices": ["hi", 3]}', {}, K.MALFORMED, True, None),
    "message_not_an_object": (
        200,
        b'{"choices": [{"index": 0, "message": "hi"}]}',
        {},
        K.MALFORMED,
        True,
        None,
    ),
    "usage_not_an_object": (
        200,
        b'{"choices": [{"message": {"content": "hi"}}], "usage": 7}',
        {},
        K.MALFORMED,
        True,
        None,
    ),
    "error_object_in_200": (200, _error("boom", type="server_error"), {}, K.MALFORMED, True, None),
    "error_beside_choices": (
        200,
        b'{"choices": [{"message": {"content": "hi"}}], "error": {"message": "partial"}}',
        {},
        K.MALFORMED,
        True,
        None,
    ),
}


def _cases_app() -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        status, body, headers, *_ = CASES[request.match_info["case"]]
        return web.Response(
            status=status, body=body, headers=headers, content_type="application/json"
        )

    app = web.Application()
    app.router.add_post("/{case}/chat/completions", handler)
    return app


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(CASES))
async def test_statuses_and_bodies_map_to_kinds(
    case: str, serve: Serve, session: aiohttp.ClientSession
) -> None:
    """Each status/body combination raises the documented kind, retryability and Retry-After."""
    status, _, _, kind, retryable, retry_after = CASES[case]
    url = await serve(_cases_app())
    provider = OpenAIProvider("up", f"{url}/{case}", "sk-test", session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(dict(CHAT), timeout=1.0)
    error = caught.value
    assert (error.kind, error.retryable, error.retry_after) == (kind, retryable, retry_after)
    assert (error.provider, error.status) == ("up", status)


@pytest.mark.asyncio
async def test_request_carries_key_mapped_model_and_stream_flag(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """The key goes in a bearer header, the model is renamed and stream is false; the caller's
    body is left untouched."""
    seen: list[tuple[str | None, dict[str, Any]]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.headers.get("Authorization"), await request.json()))
        return web.json_response({"id": "c", "choices": [{"message": {"content": "hi"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    url = await serve(app)
    provider = OpenAIProvider("up", f"{url}/v1/", "sk-test", session, model_map={"m": "served-m"})
    body = {**CHAT, "temperature": 0.2, "stream_options": {"include_usage": True}}
    answer = await provider.complete(body, timeout=1.0)
    assert answer["choices"][0]["message"]["content"] == "hi"
    auth, sent = seen[0]
    assert auth == "Bearer sk-test"
    assert sent == {
        "model": "served-m",
        "messages": CHAT["messages"],
        "temperature": 0.2,
        "stream": False,
    }
    assert body == {**CHAT, "temperature": 0.2, "stream_options": {"include_usage": True}}


@pytest.mark.asyncio
async def test_connection_refused_is_a_connection_error(session: aiohttp.ClientSession) -> None:
    """Nothing listening on the port raises a retryable connection error."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    provider = OpenAIProvider("up", f"http://127.0.0.1:{port}/v1", None, session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(dict(CHAT), timeout=1.0)
    assert (caught.value.kind, caught.value.retryable) == (K.CONNECTION, True)


@pytest.mark.asyncio
async def test_reset_before_headers_is_a_connection_error(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """A connection closed before any response header raises a connection error."""
    server = await upstream({"models": {"m": {"faults": [{"kind": "reset"}]}}})
    provider = OpenAIProvider("up", server.base_url, None, session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(dict(CHAT), timeout=1.0)
    assert caught.value.kind == K.CONNECTION


@pytest.mark.asyncio
async def test_no_response_times_out_within_the_timeout(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """A server that never answers raises a timeout error after the given timeout, not later."""
    server = await upstream({"models": {"m": {"faults": [{"kind": "no_response"}]}}})
    provider = OpenAIProvider("up", server.base_url, None, session)
    clock = SystemClock()
    started = clock.now()
    with pytest.raises(ProviderError) as caught:
        await provider.complete(dict(CHAT), timeout=0.1)
    waited = clock.now() - started
    assert caught.value.kind == K.TIMEOUT
    assert 0.09 <= waited < 0.5  # asyncio may fire a timer up to its clock resolution early


@pytest.mark.asyncio
async def test_cancellation_propagates(upstream: Upstream, session: aiohttp.ClientSession) -> None:
    """Cancelling a call in flight raises CancelledError, not a provider error."""
    server = await upstream({"models": {"m": {"faults": [{"kind": "no_response"}]}}})
    provider = OpenAIProvider("up", server.base_url, None, session)
    task = asyncio.create_task(provider.complete(dict(CHAT), timeout=5.0))
    await SystemClock().asleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _drain(
    provider: OpenAIProvider, body: dict[str, Any], **limits: float
) -> list[StreamItem]:
    options = {"timeout": 1.0, **limits}
    stream = provider.stream(body, **options)
    async with aclosing(stream):
        return [item async for item in stream]


def _text(items: list[StreamItem]) -> str:
    return "".join(
        item["choices"][0]["delta"].get("content") or ""
        for item in items
        if isinstance(item, dict) and item["choices"]
    )


@pytest.mark.asyncio
async def test_stream_parses_chunks_usage_and_done(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """A healthy stream yields the chunks, the usage chunk when asked, then StreamEnd(True)."""
    server = await upstream({"models": {"m": {"text": "one two three"}}})
    provider = OpenAIProvider("up", server.base_url, None, session)
    items = await _drain(provider, {**CHAT, "stream_options": {"include_usage": True}})
    assert _text(items) == "one two three"
    assert items[-1] == StreamEnd(done_seen=True)
    usage_chunk = items[-2]
    assert isinstance(usage_chunk, dict)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert server.attempts[0]["stream"] is True


@pytest.mark.asyncio
async def test_a_malformed_chunk_is_yielded_not_raised(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """An unparsable event comes through as MalformedChunk and the rest of the stream follows."""
    fault = {"kind": "malformed_chunk", "chunk": 2}
    server = await upstream({"models": {"m": {"text": "a b", "faults": [fault]}}})
    provider = OpenAIProvider("up", server.base_url, None, session)
    items = await _drain(provider, dict(CHAT))
    assert isinstance(items[1], MalformedChunk)
    assert _text(items) == "a b"
    assert items[-1] == StreamEnd(done_seen=True)


@pytest.mark.asyncio
async def test_missing_done_is_reported(upstream: Upstream, session: aiohttp.ClientSession) -> None:
    """A stream that ends cleanly without [DONE] ends with StreamEnd(done_seen=False)."""
    server = await upstream(
        {"models": {"m": {"text": "a b", "faults": [{"kind": "missing_done"}]}}}
    )
    provider = OpenAIProvider("up", server.base_url, None, session)
    items = await _drain(provider, dict(CHAT))
    assert _text(items) == "a b"
    assert items[-1] == StreamEnd(done_seen=False)


@pytest.mark.asyncio
async def test_a_cut_stream_is_a_connection_error_after_the_tokens_sent(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """A connection dropped mid-stream raises a connection error once the sent tokens are read."""
    fault = {"kind": "cut_after", "tokens": 2}
    server = await upstream({"models": {"m": {"text": "a b c d", "faults": [fault]}}})
    provider = OpenAIProvider("up", server.base_url, None, session)
    received: list[StreamItem] = []

    async def consume() -> None:
        async with aclosing(provider.stream(dict(CHAT), timeout=1.0)) as stream:
            async for item in stream:
                received.append(item)

    with pytest.raises(ProviderError) as caught:
        await consume()
    assert caught.value.kind == K.CONNECTION
    assert _text(received) == "a b"


@pytest.mark.asyncio
async def test_a_stall_is_a_timeout_with_chunk_timeout(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """A stream that goes silent for longer than chunk_timeout raises a timeout error."""
    fault = {"kind": "stall_after", "tokens": 1}
    server = await upstream({"models": {"m": {"text": "a b c", "faults": [fault]}}})
    provider = OpenAIProvider("up", server.base_url, None, session)
    with pytest.raises(ProviderError) as caught:
        await _drain(provider, dict(CHAT), chunk_timeout=0.05)
    assert caught.value.kind == K.TIMEOUT


@pytest.mark.asyncio
async def test_an_error_status_on_a_stream_is_raised_before_any_chunk(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """A 429 answer to a stream request raises rate_limited with its Retry-After."""
    fault = {"kind": "http", "status": 429, "retry_after": 4}
    server = await upstream({"models": {"m": {"faults": [fault]}}})
    provider = OpenAIProvider("up", server.base_url, None, session)
    with pytest.raises(ProviderError) as caught:
        await _drain(provider, dict(CHAT))
    assert (caught.value.kind, caught.value.retry_after) == (K.RATE_LIMITED, 4.0)


@pytest.mark.asyncio
async def test_an_error_event_mid_stream_is_raised(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """An ``{"error": ...}`` event inside a 200 stream raises the error it describes."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n')
        await response.write(b"data: " + _error("overloaded", 503, "server_error") + b"\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    provider = OpenAIProvider("up", f"{await serve(app)}/v1", None, session)
    with pytest.raises(ProviderError) as caught:
        await _drain(provider, dict(CHAT))
    assert (caught.value.kind, caught.value.status) == (K.OVERLOADED, 503)


@pytest.mark.asyncio
async def test_json_instead_of_a_stream_is_malformed(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A 200 JSON body where an event stream was asked for raises a malformed error."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"id": "c", "choices": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    provider = OpenAIProvider("up", f"{await serve(app)}/v1", None, session)
    with pytest.raises(ProviderError) as caught:
        await _drain(provider, dict(CHAT))
    assert caught.value.kind == K.MALFORMED


@pytest.mark.asyncio
async def test_embeddings(upstream: Upstream, session: aiohttp.ClientSession) -> None:
    """embed() returns one vector per input from the /embeddings endpoint."""
    server = await upstream({"models": {"e": {"embedding_dimensions": 4}}})
    provider = OpenAIProvider("up", server.base_url, None, session)
    answer = await provider.embed({"model": "e", "input": ["a", "b c"]}, timeout=1.0)
    assert [len(item["embedding"]) for item in answer["data"]] == [4, 4]
    assert server.attempts[0]["endpoint"] == "embeddings"


SECRET = "tidegate-upstream-secret-7f3a"  # what the provider's api_key_file holds
OTHER_KEY = "sk-proj-Zx81Qw0PlmN4bV7cX2sA9dF3gH6jK1"  # key-shaped, but nobody configured it


def _echo_app(status: int, body: bytes, headers: dict[str, str]) -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(
            status=status, body=body, headers=headers, content_type="application/json"
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return app


@pytest.mark.asyncio
@pytest.mark.parametrize("status", [401, 400, 429, 500])
async def test_an_error_echoing_the_key_is_reported_without_it(
    status: int, serve: Serve, session: aiohttp.ClientSession
) -> None:
    """An error body that echoes the configured key (and another key) yields a message with the
    status, the code and the request id, and neither key."""
    body = _error(f"Incorrect API key provided: {SECRET}; also {OTHER_KEY}", "invalid_api_key")
    url = await serve(_echo_app(status, body, {"x-request-id": "req_abc123"}))
    provider = OpenAIProvider("up", f"{url}/v1", SECRET, session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(dict(CHAT), timeout=1.0)
    message = caught.value.message
    assert SECRET not in message
    assert OTHER_KEY not in message
    assert message.startswith(f"HTTP {status} invalid_api_key: Incorrect API key provided: ")
    assert message.endswith("(request id req_abc123)")


@pytest.mark.asyncio
async def test_a_secret_in_a_header_the_provider_sends_is_kept_out_too(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A credential passed as an extra header (Azure's api-key) is removed like the api key."""
    body = _error("api-key azure-secret-value-1 is not valid for this resource")
    url = await serve(_echo_app(401, body, {}))
    provider = OpenAIProvider(
        "up", f"{url}/v1", None, session, headers={"api-key": "azure-secret-value-1"}
    )
    with pytest.raises(ProviderError) as caught:
        await provider.complete(dict(CHAT), timeout=1.0)
    assert "azure-secret-value-1" not in caught.value.message


@pytest.mark.asyncio
async def test_an_error_event_echoing_the_key_mid_stream_is_raised_without_it(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """An error event inside a 200 stream that echoes the key raises a message without it."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n')
        event = _error(f"key {SECRET} revoked", type="server_error")
        await response.write(b"data: " + event + b"\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    provider = OpenAIProvider("up", f"{await serve(app)}/v1", SECRET, session)
    with pytest.raises(ProviderError) as caught:
        await _drain(provider, dict(CHAT))
    assert caught.value.kind == K.SERVER
    assert caught.value.message == "server_error: key [redacted] revoked"


@pytest.mark.asyncio
async def test_a_non_streamed_body_cut_short_is_a_retryable_connection_error(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """A body shorter than its Content-Length (the connection dropped mid-body) raises a
    retryable connection error, not a success and not a parse failure."""
    server = await upstream({"models": {"m": {"faults": [{"kind": "cut_after", "tokens": 1}]}}})
    provider = OpenAIProvider("up", server.base_url, None, session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(dict(CHAT), timeout=1.0)
    assert (caught.value.kind, caught.value.retryable) == (K.CONNECTION, True)
    assert caught.value.message.startswith("the response was cut off")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "body",
    [
        {"object": "list"},
        {"object": "list", "data": "vectors"},
        {"object": "list", "data": [[0.1, 0.2]]},
        {"error": {"message": "boom", "type": "server_error"}},
    ],
)
async def test_embeddings_that_are_not_an_answer_are_malformed(
    body: dict[str, Any], upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    """An embeddings 200 without a list of objects in ``data`` raises a malformed error."""
    fault = {"kind": "raw", "body": body}
    server = await upstream({"models": {"e": {"faults": [fault]}}})
    provider = OpenAIProvider("up", server.base_url, None, session)
    with pytest.raises(ProviderError) as caught:
        await provider.embed({"model": "e", "input": ["a"]}, timeout=1.0)
    assert (caught.value.kind, caught.value.retryable) == (K.MALFORMED, True)


def test_a_malformed_message_says_what_was_wrong() -> None:
    """The malformed error names the problem and keeps an error object's code and text."""
    answer = HTTPAnswer(200, {"x-request-id": "req_9"}, _error("boom", "oops"))
    with pytest.raises(ProviderError) as caught:
        openai_answer(answer, endpoint="chat", provider="up", now_wall=0.0)
    assert caught.value.message == (
        "HTTP 200 but not an answer: an error object (oops): boom (request id req_9)"
    )
    empty = HTTPAnswer(200, {}, b'{"choices": []}')
    with pytest.raises(ProviderError) as caught:
        openai_answer(empty, endpoint="chat", provider="up", now_wall=0.0)
    assert caught.value.message == "HTTP 200 but not an answer: an empty choices list"


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"choices": [{"message": {"content": "hi"}}]}, None),
        ({"choices": [{"index": 0, "delta": {}}], "usage": None}, None),
        ({}, "no choices"),
        ({"choices": None}, "no choices"),
        ({"choices": "hi"}, "choices is not a list"),
        ({"choices": []}, "an empty choices list"),
        ({"choices": [None]}, "a choice that is not an object"),
        ({"choices": [{"message": ["hi"]}]}, "a message that is not an object"),
        ({"choices": [{}], "usage": "lots"}, "usage is not an object"),
        ({"error": "nope"}, "an error object"),
        ({"object": "error", "message": "nope"}, "an error object"),
    ],
)
def test_chat_completion_problem(data: dict[str, Any], problem: str | None) -> None:
    """Each way a decoded 2xx body can fail to be a chat completion is named; a good one passes."""
    assert chat_completion_problem(data) == problem


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"data": [{"embedding": [0.1]}]}, None),
        ({"data": []}, None),
        ({}, "no data"),
        ({"data": {"0": [0.1]}}, "data is not a list"),
        ({"data": [[0.1]]}, "a data item that is not an object"),
        ({"error": {"message": "x"}, "data": []}, "an error object"),
    ],
)
def test_embeddings_problem(data: dict[str, Any], problem: str | None) -> None:
    """Each way a decoded 2xx body can fail to be an embeddings response is named."""
    assert embeddings_problem(data) == problem
