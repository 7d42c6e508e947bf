"""The Anthropic provider: translation both ways, streaming events, error mapping."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tidegate.clock import ManualClock
from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.providers.anthropic import (
    ANTHROPIC_VERSION,
    AnthropicProvider,
    AnthropicStreamTranslator,
    from_messages_response,
    messages_response_problem,
    to_messages_request,
)
from tidegate.providers.base import MalformedChunk, StreamEnd, StreamItem

from .conftest import Serve
from .helpers import WEATHER, weather_turns

K = ProviderErrorKind

MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "claude-x",
    "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " world"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 10, "output_tokens": 2},
}

EVENTS: list[dict[str, Any]] = [
    {
        "type": "message_start",
        "message": {
            **MESSAGE,
            "content": [],
            "stop_reason": None,
            "usage": {"input_tokens": 10, "output_tokens": 1},
        },
    },
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "ping"},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}},
    {"type": "content_block_stop", "index": 0},
    {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"output_tokens": 2},
    },
    {"type": "message_stop"},
]


def test_request_translation() -> None:
    """System messages join into ``system``, same-role turns merge, and knobs are renamed."""
    body = {
        "model": "claude-x",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use French."}]},
            {"role": "user", "content": "Hi"},
            {"role": "user", "content": [{"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Bon"},
        ],
        "stop": "END",
        "temperature": 0.5,
        "top_p": 0.9,
        "user": "u-1",
        "presence_penalty": 1.0,
    }
    assert to_messages_request(body, default_max_tokens=256) == {
        "model": "claude-x",
        "max_tokens": 256,
        "system": "Be brief.\n\nUse French.",
        "messages": [
            {"role": "user", "content": "Hithere"},
            {"role": "assistant", "content": "Bon"},
        ],
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "metadata": {"user_id": "u-1"},
    }


def test_max_tokens_prefers_max_completion_tokens() -> None:
    """``max_completion_tokens`` wins over ``max_tokens``; either wins over the default."""
    body = {"model": "c", "messages": [], "max_tokens": 50, "max_completion_tokens": 70}
    assert to_messages_request(body, default_max_tokens=9)["max_tokens"] == 70
    assert (
        to_messages_request({"model": "c", "max_tokens": 50}, default_max_tokens=9)["max_tokens"]
        == 50
    )


def test_images_become_image_blocks() -> None:
    """A base64 data URL becomes a base64 source and a web URL a url source."""
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
    ]
    request = to_messages_request(
        {"model": "c", "messages": [{"role": "user", "content": content}]}, default_max_tokens=9
    )
    assert request["messages"][0]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
    ]


@pytest.mark.parametrize(
    "extra",
    [
        {"functions": [{"name": "f"}]},
        {"tools": [{"type": "custom", "custom": {"name": "f"}}]},
        {"tools": True},
        {"tools": ["f"]},
        {"n": 2},
        {"logprobs": True},
        {"response_format": {"type": "json_object"}},
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "t", "function": {"name": "f", "arguments": "[1]"}}],
                }
            ]
        },
    ],
)
def test_untranslatable_features_are_refused(extra: dict[str, Any]) -> None:
    """Features the translation cannot keep raise bad_request instead of being dropped."""
    body = {"model": "c", "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(ProviderError) as caught:
        to_messages_request(body, default_max_tokens=9, provider="a")
    assert (caught.value.kind, caught.value.provider) == (K.BAD_REQUEST, "a")


def test_response_translation() -> None:
    """Text blocks join into the message, end_turn becomes stop and usage is renamed."""
    completion = from_messages_response(MESSAGE, created=7)
    assert completion["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert completion["choices"][0]["finish_reason"] == "stop"
    assert completion["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    assert (completion["id"], completion["model"], completion["created"]) == (
        "msg_1",
        "claude-x",
        7,
    )


@pytest.mark.parametrize(
    ("stop_reason", "finish"),
    [("stop_sequence", "stop"), ("max_tokens", "length"), ("refusal", "content_filter")],
)
def test_stop_reasons(stop_reason: str, finish: str) -> None:
    """Each Anthropic stop reason maps to OpenAI's finish reason."""
    completion = from_messages_response({**MESSAGE, "stop_reason": stop_reason}, created=0)
    assert completion["choices"][0]["finish_reason"] == finish


def test_cached_input_counts_as_prompt_tokens() -> None:
    """Cache reads and writes are part of prompt_tokens, and reads show as cached_tokens."""
    usage = {
        "input_tokens": 5,
        "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 20,
        "output_tokens": 1,
    }
    completion = from_messages_response({**MESSAGE, "usage": usage}, created=0)
    assert completion["usage"]["prompt_tokens"] == 125
    assert completion["usage"]["prompt_tokens_details"] == {"cached_tokens": 100}


def test_stream_translation() -> None:
    """The event sequence becomes role, text deltas, finish and (asked for) usage chunks."""
    translator = AnthropicStreamTranslator(created=3, include_usage=True)
    chunks = [chunk for event in EVENTS for chunk in translator.feed(event)]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
        {},
    ]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    assert {chunk["id"] for chunk in chunks} == {"msg_1"}
    assert translator.done


def test_stream_error_event_is_raised() -> None:
    """An ``error`` event raises the kind its error type names."""
    translator = AnthropicStreamTranslator(created=0, provider="a")
    with pytest.raises(ProviderError) as caught:
        translator.feed(
            {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
        )
    assert (caught.value.kind, caught.value.message) == (
        K.OVERLOADED,
        "overloaded_error: Overloaded",
    )


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(
        f"event: {e['type']}\ndata: ".encode() + orjson.dumps(e) + b"\n\n" for e in events
    )


class FakeMessagesAPI:
    """A small Messages API: records requests, answers with a canned message or stream."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.reply: tuple[int, bytes, str, dict[str, str]] = (
            200,
            orjson.dumps(MESSAGE),
            "application/json",
            {},
        )

    def app(self) -> web.Application:
        async def handler(request: web.Request) -> web.Response:
            self.requests.append((request.path, dict(request.headers), await request.json()))
            status, body, content_type, headers = self.reply
            return web.Response(
                status=status, body=body, content_type=content_type, headers=headers
            )

        app = web.Application()
        app.router.add_post("/v1/messages", handler)
        return app


@pytest.mark.slow
@pytest.mark.asyncio
async def test_complete_sends_messages_request_with_headers(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """complete() posts a Messages request with the key and version headers and translates back."""
    api = FakeMessagesAPI()
    clock = ManualClock(wall_start=1_000.0)
    provider = AnthropicProvider(
        "a", await serve(api.app()), "sk-ant", session, default_max_tokens=64, clock=clock
    )
    body = {
        "model": "claude-x",
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
    }
    completion = await provider.complete(body, timeout=1.0)
    assert completion["choices"][0]["message"]["content"] == "Hello world"
    assert completion["created"] == 1000
    path, headers, sent = api.requests[0]
    assert path == "/v1/messages"
    assert (headers["x-api-key"], headers["anthropic-version"]) == ("sk-ant", ANTHROPIC_VERSION)
    assert sent == {
        "model": "claude-x",
        "max_tokens": 64,
        "system": "S",
        "messages": [{"role": "user", "content": "Q"}],
        "stream": False,
    }


@pytest.mark.slow
@pytest.mark.asyncio
async def test_stream_translates_an_event_sequence(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """stream() turns Messages events into OpenAI chunks and ends with StreamEnd(True)."""
    api = FakeMessagesAPI()
    events = [*EVENTS[:3], {"type": "future_event"}, *EVENTS[3:]]
    api.reply = (
        200,
        _sse(events[:4]) + b"data: {oops\n\n" + _sse(events[4:]),
        "text/event-stream",
        {},
    )
    provider = AnthropicProvider("a", await serve(api.app()), "k", session)
    body = {
        "model": "claude-x",
        "messages": [{"role": "user", "content": "Q"}],
        "stream_options": {"include_usage": True},
    }
    stream = provider.stream(body, timeout=1.0)
    async with aclosing(stream):
        items: list[StreamItem] = [item async for item in stream]
    assert api.requests[0][2]["stream"] is True
    assert sum(isinstance(item, MalformedChunk) for item in items) == 1
    text = "".join(
        item["choices"][0]["delta"].get("content", "")
        for item in items
        if isinstance(item, dict) and item["choices"]
    )
    assert text == "Hello"
    assert items[-1] == StreamEnd(done_seen=True)
    assert isinstance(items[-2], dict)
    assert items[-2]["usage"]["completion_tokens"] == 2


@pytest.mark.slow
@pytest.mark.asyncio
async def test_stream_without_message_stop_is_not_done(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A stream that ends before message_stop ends with StreamEnd(done_seen=False)."""
    api = FakeMessagesAPI()
    api.reply = (200, _sse(EVENTS[:-1]), "text/event-stream", {})
    provider = AnthropicProvider("a", await serve(api.app()), "k", session)
    stream = provider.stream(
        {"model": "c", "messages": [{"role": "user", "content": "Q"}]}, timeout=1.0
    )
    async with aclosing(stream):
        items = [item async for item in stream]
    assert items[-1] == StreamEnd(done_seen=False)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_stream_error_event_over_http(serve: Serve, session: aiohttp.ClientSession) -> None:
    """An error event in the middle of a stream raises after the text before it."""
    api = FakeMessagesAPI()
    error = {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    api.reply = (200, _sse([*EVENTS[:4], error]), "text/event-stream", {})
    provider = AnthropicProvider("a", await serve(api.app()), "k", session)
    received: list[StreamItem] = []

    async def consume() -> None:
        async with aclosing(provider.stream({"model": "c", "messages": []}, timeout=1.0)) as stream:
            async for item in stream:
                received.append(item)

    with pytest.raises(ProviderError) as caught:
        await consume()
    assert caught.value.kind == K.SERVER
    assert len(received) == 2  # the role chunk and "Hel"


def _anthropic_error(kind: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("status", "error_type", "message", "kind"),
    [
        (429, "rate_limit_error", "slow down", K.RATE_LIMITED),
        (529, "overloaded_error", "Overloaded", K.OVERLOADED),
        (500, "api_error", "internal", K.SERVER),
        (504, "timeout_error", "timed out", K.TIMEOUT),
        (
            400,
            "invalid_request_error",
            "prompt is too long: 200001 tokens > 200000 maximum",
            K.CONTEXT_LENGTH,
        ),
        (400, "invalid_request_error", "temperature: must be at most 1", K.BAD_REQUEST),
        (413, "request_too_large", "too big", K.BAD_REQUEST),
        (401, "authentication_error", "bad key", K.AUTH),
        (403, "permission_error", "no", K.AUTH),
        (404, "not_found_error", "model: claude-nope", K.NOT_FOUND),
    ],
)
async def test_errors_map_to_kinds(
    status: int,
    error_type: str,
    message: str,
    kind: K,
    serve: Serve,
    session: aiohttp.ClientSession,
) -> None:
    """Each Messages API error status and type raises the documented kind, its message led by
    the status and the error type."""
    api = FakeMessagesAPI()
    api.reply = (
        status,
        _anthropic_error(error_type, message),
        "application/json",
        {"retry-after": "5"},
    )
    provider = AnthropicProvider("a", await serve(api.app()), "k", session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete({"model": "c", "messages": []}, timeout=1.0)
    shown = f"HTTP {status} {error_type}: {message}"
    assert (caught.value.kind, caught.value.message, caught.value.status) == (kind, shown, status)
    assert caught.value.retry_after == 5.0


@pytest.mark.asyncio
async def test_embeddings_are_refused_without_a_call() -> None:
    """embed() raises bad_request: Anthropic has no embeddings endpoint."""
    async with aiohttp.ClientSession() as session:
        provider = AnthropicProvider("a", "http://127.0.0.1:1", "k", session)
        with pytest.raises(ProviderError) as caught:
            await provider.embed({"model": "c", "input": "x"}, timeout=1.0)
    assert (caught.value.kind, caught.value.retryable) == (K.BAD_REQUEST, False)


@pytest.mark.asyncio
async def test_default_max_tokens_must_be_positive(session: aiohttp.ClientSession) -> None:
    """A default_max_tokens below one is a ValueError."""
    with pytest.raises(ValueError, match="default_max_tokens"):
        AnthropicProvider("a", "http://x", "k", session, default_max_tokens=0)


SECRET = "tidegate-upstream-secret-7f3a"  # what the provider's api_key_file holds


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize(
    "body",
    [
        {**MESSAGE, "content": None},
        {key: value for key, value in MESSAGE.items() if key != "content"},
        {**MESSAGE, "content": "Hello world"},
        {**MESSAGE, "content": ["Hello", 3]},
        {**MESSAGE, "usage": "lots"},
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
        {"type": "error", "error": {"type": "api_error", "message": "boom"}},
        {"id": "msg_1", "role": "assistant", "content": []},
    ],
)
async def test_a_200_that_is_not_a_message_is_malformed(
    body: dict[str, Any], serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A 200 whose body is not a message with a content list (an error body included) raises a
    retryable malformed error rather than an empty success."""
    api = FakeMessagesAPI()
    api.reply = (200, orjson.dumps(body), "application/json", {})
    provider = AnthropicProvider("a", await serve(api.app()), "k", session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete({"model": "c", "messages": []}, timeout=1.0)
    assert (caught.value.kind, caught.value.retryable) == (K.MALFORMED, True)
    assert caught.value.message.startswith("HTTP 200 but not an answer: ")


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("status", [401, 400, 429, 500])
async def test_an_error_echoing_the_key_is_reported_without_it(
    status: int, serve: Serve, session: aiohttp.ClientSession
) -> None:
    """An error body echoing the x-api-key gives a message with the status, the type and the
    request-id, and without the key."""
    api = FakeMessagesAPI()
    api.reply = (
        status,
        _anthropic_error("authentication_error", f"invalid x-api-key {SECRET}"),
        "application/json",
        {"request-id": "req_011CSHoEeqs5C35K2UUqR7Fy"},
    )
    provider = AnthropicProvider("a", await serve(api.app()), SECRET, session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete({"model": "c", "messages": []}, timeout=1.0)
    assert caught.value.message == (
        f"HTTP {status} authentication_error: invalid x-api-key [redacted] "
        "(request id req_011CSHoEeqs5C35K2UUqR7Fy)"
    )


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_stream_error_event_echoing_the_key_is_raised_without_it(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """An error event inside a stream that echoes the key raises a message without it."""
    api = FakeMessagesAPI()
    error = {"type": "error", "error": {"type": "api_error", "message": f"bad key {SECRET}"}}
    api.reply = (200, _sse([*EVENTS[:4], error]), "text/event-stream", {})
    provider = AnthropicProvider("a", await serve(api.app()), SECRET, session)

    async def consume() -> None:
        async with aclosing(provider.stream({"model": "c", "messages": []}, timeout=1.0)) as stream:
            async for _ in stream:
                pass

    with pytest.raises(ProviderError) as caught:
        await consume()
    assert caught.value.message == "api_error: bad key [redacted]"


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (MESSAGE, None),
        ({**MESSAGE, "content": []}, None),
        ({**MESSAGE, "usage": None}, None),
        ({"type": "error", "error": {"type": "api_error"}}, "an error object"),
        ({**MESSAGE, "error": {"message": "x"}}, "an error object"),
        ({**MESSAGE, "type": "completion"}, "not a message"),
        ({**MESSAGE, "content": None}, "no content"),
        ({**MESSAGE, "content": {"type": "text"}}, "content is not a list"),
        ({**MESSAGE, "content": ["Hello"]}, "a content block that is not an object"),
        ({**MESSAGE, "usage": [1]}, "usage is not an object"),
    ],
)
def test_messages_response_problem(data: dict[str, Any], problem: str | None) -> None:
    """Each way a decoded 2xx body can fail to be a Messages response is named; an empty
    content list is an answer."""
    assert messages_response_problem(data) == problem


def test_usage_counts_that_are_not_numbers_count_as_none() -> None:
    """A usage count of the wrong type is counted as zero instead of crashing the translation."""
    data = {**MESSAGE, "usage": {"input_tokens": "many", "output_tokens": None}}
    completion = from_messages_response(data, created=0)
    assert completion["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def _valid_for_anthropic(request: dict[str, Any]) -> None:
    """``request`` fits the Messages API request type Anthropic's own SDK publishes."""
    from anthropic.types.message_create_params import MessageCreateParamsNonStreaming
    from pydantic import TypeAdapter

    TypeAdapter(MessageCreateParamsNonStreaming).validate_python(request, strict=False)


def test_tools_and_a_tool_round_trip_are_translated() -> None:
    """Tools, the tool choice, an assistant's tool calls and the tool's result become Anthropic's
    tools, tool_choice, tool_use and tool_result blocks, in a request Anthropic's types accept."""
    body = {
        "model": "c",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            *weather_turns(content="Looking."),
        ],
    }
    request = to_messages_request(body, default_max_tokens=9)
    assert request["tools"] == [
        {
            "name": "get_weather",
            "input_schema": WEATHER["function"]["parameters"],
            "description": "The weather in a city",
        }
    ]
    assert request["tool_choice"] == {
        "type": "tool",
        "name": "get_weather",
        "disable_parallel_tool_use": True,
    }
    assert request["messages"][1:] == [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "4 C"}],
        },
    ]
    _valid_for_anthropic(request)
    _valid_for_anthropic(
        to_messages_request({**body, "tool_choice": "required"}, default_max_tokens=9)
    )


def test_a_tool_use_answer_is_a_tool_call() -> None:
    data = {
        "id": "msg_1",
        "type": "message",
        "model": "claude-x",
        "stop_reason": "tool_use",
        "content": [
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
        ],
        "usage": {"input_tokens": 5, "output_tokens": 7},
    }
    choice = from_messages_response(data, created=1)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Looking."
    assert choice["message"]["tool_calls"] == [
        {
            "id": "t1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
        }
    ]


def test_a_streamed_tool_use_is_a_tool_call_delta() -> None:
    translator = AnthropicStreamTranslator(created=1)
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "m", "model": "claude-x", "usage": {}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hm."}},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"city"'},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": ': "Oslo"}'},
        },
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": 9},
        },
    ]
    deltas = [c["choices"][0] for e in events for c in translator.feed(e)]
    calls = [d["delta"]["tool_calls"][0] for d in deltas if "tool_calls" in d["delta"]]
    assert calls[0] == {
        "index": 0,
        "id": "t1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    assert deltas[-1]["finish_reason"] == "tool_calls"
