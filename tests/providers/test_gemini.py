"""The Gemini provider: translation both ways (checked against the google-genai SDK's types),
the stream, tool calls, errors and safety blocks, the API key's header, and Vertex AI's URL
and service-account token, against a fake of the wire protocol on loopback."""

from __future__ import annotations

import json
import sys
from contextlib import aclosing
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tidegate.clock import ManualClock
from tidegate.errors import ConfigError, ProviderError, ProviderErrorKind
from tidegate.providers.base import MalformedChunk, StreamEnd, StreamItem
from tidegate.providers.gemini import GeminiOptions, GeminiProvider, VertexOptions, build
from tidegate.providers.gemini_wire import (
    from_generate_response,
    gemini_error_for,
    to_generate_request,
)
from tidegate.providers.transport import HTTPAnswer
from tidegate.providers.wire import decode_vector

from .conftest import Serve
from .gemini_fake import (
    FakeGemini,
    Reply,
    answer,
    error_body,
    validate_generate_request,
)
from .helpers import weather_turns

K = ProviderErrorKind
SECRET = "AIzaSyFakeKeyForTidegateTests0123456789"
MODEL = "gemini-2.5-flash"
QUESTION: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
RETRY_INFO = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "12s"}


def _provider(
    base: str, session: aiohttp.ClientSession, *, key: str | None = SECRET, **options: Any
) -> GeminiProvider:
    built = build(
        "g",
        model=MODEL,
        base_url=base,
        api_key=key,
        options=GeminiOptions(**options),
        session=session,
        clock=ManualClock(wall_start=1_000.0),
        base_dir=Path("."),
    )
    assert isinstance(built, GeminiProvider)
    return built


async def _collect(provider: GeminiProvider, body: dict[str, Any]) -> list[StreamItem]:
    async with aclosing(provider.stream(body, timeout=2.0)) as stream:
        return [item async for item in stream]


def _deltas(items: list[StreamItem]) -> list[dict[str, Any]]:
    return [i["choices"][0]["delta"] for i in items if isinstance(i, dict) and i["choices"]]


# --------------------------------------------------------------------------- translation


def test_request_translation_fits_the_sdk_types() -> None:
    """System messages become systemInstruction, roles user/model, same-role turns merge,
    images inlineData, and the knobs generationConfig; the SDK's types accept the result."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use French."}]},
            {"role": "user", "content": "Hi"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
            {"role": "assistant", "content": "Bon"},
        ],
        "max_completion_tokens": 64,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": "END",
        "n": 2,
        "seed": 7,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
    }
    request = to_generate_request(body)
    assert request == {
        "systemInstruction": {"parts": [{"text": "Be brief."}, {"text": "Use French."}]},
        "contents": [
            {
                "role": "user",
                "parts": [
                    {"text": "Hi"},
                    {"text": "What is this?"},
                    {"inlineData": {"mimeType": "image/png", "data": "AAAA"}},
                ],
            },
            {"role": "model", "parts": [{"text": "Bon"}]},
        ],
        "generationConfig": {
            "maxOutputTokens": 64,
            "temperature": 0.5,
            "topP": 0.9,
            "seed": 7,
            "stopSequences": ["END"],
            "candidateCount": 2,
            "responseMimeType": "application/json",
            "responseJsonSchema": {"type": "object"},
        },
    }
    validate_generate_request(request)


def test_tools_and_a_tool_round_trip_are_translated() -> None:
    """Tools become functionDeclarations, tool_choice a functionCallingConfig, an assistant's
    calls functionCall parts and the tool's result a functionResponse named after its call."""
    body = {
        "model": MODEL,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            *weather_turns(),
            {"role": "tool", "tool_call_id": "t1", "content": '{"celsius": 4}'},
        ],
    }
    request = to_generate_request(body)
    function = WEATHER["function"]
    assert request["tools"] == [
        {
            "functionDeclarations": [
                {
                    "name": "get_weather",
                    "description": "The weather in a city",
                    "parametersJsonSchema": function["parameters"],  # type: ignore[index]
                }
            ]
        }
    ]
    assert request["toolConfig"] == {
        "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}
    }
    assert request["contents"][1:] == [
        {
            "role": "model",
            "parts": [{"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}}],
        },
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"name": "get_weather", "response": {"output": "4 C"}}},
                {"functionResponse": {"name": "get_weather", "response": {"celsius": 4}}},
            ],
        },
    ]
    validate_generate_request(request)
    for choice, mode in (("auto", "AUTO"), ("none", "NONE"), ("required", "ANY")):
        again = to_generate_request({**body, "tool_choice": choice})
        assert again["toolConfig"] == {"functionCallingConfig": {"mode": mode}}
        validate_generate_request(again)


def test_a_thought_signature_rides_in_the_call_id_and_comes_back() -> None:
    """A functionCall part's thoughtSignature is kept in the generated tool call id and sent
    back on that call's part in the next request."""
    data = answer(
        None,
        parts=[
            {"functionCall": {"name": "get_weather", "args": {}}, "thoughtSignature": "c2ln+/8="}
        ],
    )
    call = from_generate_response(data, created=0, model=MODEL)["choices"][0]["message"][
        "tool_calls"
    ][0]
    assert call["id"].startswith("call_")
    request = to_generate_request(
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
            ],
        }
    )
    assert request["contents"][1]["parts"][0]["thoughtSignature"] == "c2ln+/8="
    validate_generate_request(request)


@pytest.mark.parametrize(
    "extra",
    [
        {"functions": [{"name": "f"}]},
        {"tools": [{"type": "custom", "custom": {"name": "f"}}]},
        {"tools": True},
        {"logprobs": True},
        {"audio": {"voice": "x"}},
        {"response_format": {"type": "grammar"}},
        {"tool_choice": "sometimes"},
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": "http://x/a.png"}]}
            ]
        },
        {"messages": [{"role": "tool", "tool_call_id": "nobody", "content": "4 C"}]},
        {"messages": [{"role": "function", "content": "x"}]},
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
    """What the translation cannot keep raises bad_request instead of being dropped."""
    with pytest.raises(ProviderError) as caught:
        to_generate_request({**QUESTION, **extra}, provider="g")
    assert (caught.value.kind, caught.value.provider) == (K.BAD_REQUEST, "g")


def test_response_translation() -> None:
    """Text parts join (thought summaries left out), finishReason and usageMetadata map, and
    every candidate is a choice."""
    data = answer(
        parts=[{"text": "plan", "thought": True}, {"text": "Hello"}, {"text": " world"}],
        usage={
            "promptTokenCount": 10,
            "candidatesTokenCount": 2,
            "thoughtsTokenCount": 5,
            "cachedContentTokenCount": 4,
            "totalTokenCount": 17,
        },
    )
    data["candidates"].append(
        {
            "index": 1,
            "content": {"role": "model", "parts": [{"text": "Hi"}]},
            "finishReason": "MAX_TOKENS",
        }
    )
    completion = from_generate_response(data, created=5, model=MODEL)
    assert [c["message"]["content"] for c in completion["choices"]] == ["Hello world", "Hi"]
    assert [c["finish_reason"] for c in completion["choices"]] == ["stop", "length"]
    assert completion["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 7,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 5},
    }
    assert (completion["id"], completion["model"], completion["created"]) == (
        "resp-1",
        "gemini-test-001",
        5,
    )


def test_the_validation_rejects_a_wrong_body() -> None:
    """The fake's check refuses snake_case names, unknown parts and fields, bad base64 and a
    wrong role: a translation that wrote any of them would fail its test."""
    good = {"contents": [{"role": "user", "parts": [{"text": "x"}]}]}
    validate_generate_request(good)
    wrong = [
        {**good, "generation_config": {"maxOutputTokens": 3}},
        {**good, "generationConfig": {"max_output_tokens": 3}},
        {**good, "generationConfig": {"maxTokens": 3}},
        {"contents": [{"role": "user", "parts": [{"txt": "x"}]}]},
        {"contents": [{"role": "assistant", "parts": [{"text": "x"}]}]},
        {
            "contents": [
                {"role": "user", "parts": [{"inlineData": {"mimeType": "a/b", "data": "??"}}]}
            ]
        },
        {**good, "toolConfig": {"functionCallingConfig": {"mode": "SOMETIMES"}}},
        {"contents": []},
    ]
    for body in wrong:
        with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
            validate_generate_request(body)


# --------------------------------------------------------------------------- over HTTP


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_plain_answer_with_the_key_in_the_header(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """complete() posts to /v1beta/models/{model}:generateContent with x-goog-api-key, never
    the key in the URL, and translates the answer."""
    fake = FakeGemini()
    provider = _provider(
        await serve(fake.app()),
        session,
        safety_settings=[{"category": "HARM_CATEGORY_HATE_SPEECH", "threshold": "BLOCK_NONE"}],
    )
    completion = await provider.complete(QUESTION, timeout=2.0)
    assert completion["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert completion["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    assert completion["created"] == 1000
    (seen,) = fake.requests
    assert seen.problem is None
    assert seen.path == f"/v1beta/models/{MODEL}:generateContent"
    assert seen.query == {}
    assert seen.headers["x-goog-api-key"] == SECRET
    assert "Authorization" not in seen.headers
    assert SECRET not in seen.path
    assert seen.body["safetySettings"] == [
        {"category": "HARM_CATEGORY_HATE_SPEECH", "threshold": "BLOCK_NONE"}
    ]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_stream(serve: Serve, session: aiohttp.ClientSession) -> None:
    """stream() posts to :streamGenerateContent?alt=sse and yields role, text, finish and
    usage chunks; a bad event is a MalformedChunk; the finishReason makes done_seen."""
    events = [
        answer("Hel", finish=None, usage={"promptTokenCount": 7}),
        answer("lo", finish=None),
        answer(
            "",
            finish="STOP",
            parts=[],
            usage={"promptTokenCount": 7, "candidatesTokenCount": 2, "totalTokenCount": 9},
        ),
    ]
    fake = FakeGemini(
        Reply(
            200,
            Reply.stream(events[:1]).body + b"data: {oops\r\n\r\n" + Reply.stream(events[1:]).body,
            "text/event-stream",
        )
    )
    provider = _provider(await serve(fake.app()), session)
    items = await _collect(provider, {**QUESTION, "stream_options": {"include_usage": True}})
    (seen,) = fake.requests
    assert (seen.path, seen.query, seen.problem) == (
        f"/v1beta/models/{MODEL}:streamGenerateContent",
        {"alt": ["sse"]},
        None,
    )
    assert _deltas(items) == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
        {},
    ]
    assert sum(isinstance(item, MalformedChunk) for item in items) == 1
    finish = [i for i in items if isinstance(i, dict) and i["choices"]][-1]
    assert finish["choices"][0]["finish_reason"] == "stop"
    usage = items[-2]
    assert isinstance(usage, dict)
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    assert items[-1] == StreamEnd(done_seen=True)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_stream_without_a_finish_reason_is_not_done(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A stream that ends before any finishReason ends with StreamEnd(done_seen=False)."""
    fake = FakeGemini(Reply.stream([answer("Hel", finish=None)]))
    items = await _collect(_provider(await serve(fake.app()), session), QUESTION)
    assert items[-1] == StreamEnd(done_seen=False)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_tool_call(serve: Serve, session: aiohttp.ClientSession) -> None:
    """A functionCall part becomes a tool call with a generated id and finish_reason
    tool_calls; the request carried the declarations the SDK accepts."""
    call = {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}}
    fake = FakeGemini(Reply.json(answer(None, parts=[call])))
    provider = _provider(await serve(fake.app()), session)
    completion = await provider.complete({**QUESTION, "tools": [WEATHER]}, timeout=2.0)
    choice = completion["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (made,) = choice["message"]["tool_calls"]
    assert made["id"].startswith("call_")
    assert made["type"] == "function"
    assert made["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    assert choice["message"]["content"] is None
    assert fake.requests[0].problem is None
    assert fake.requests[0].body["tools"][0]["functionDeclarations"][0]["name"] == "get_weather"


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_streamed_tool_call(serve: Serve, session: aiohttp.ClientSession) -> None:
    """A streamed functionCall arrives whole as one tool_calls delta, then finish tool_calls."""
    events = [
        answer("Let me look.", finish=None),
        answer(None, parts=[{"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}}]),
    ]
    fake = FakeGemini(Reply.stream(events))
    items = await _collect(
        _provider(await serve(fake.app()), session), {**QUESTION, "tools": [WEATHER]}
    )
    deltas = _deltas(items)
    assert deltas[1] == {"content": "Let me look."}
    (call,) = deltas[2]["tool_calls"]
    assert (call["index"], call["type"], call["function"]) == (
        0,
        "function",
        {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
    )
    assert call["id"].startswith("call_")
    finish = [i for i in items if isinstance(i, dict) and i["choices"]][-1]
    assert finish["choices"][0]["finish_reason"] == "tool_calls"
    assert items[-1] == StreamEnd(done_seen=True)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_rate_limit_honours_retry_delay(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A 429 RESOURCE_EXHAUSTED is rate_limited, retry_after from RetryInfo's retryDelay; a
    Retry-After header wins over it."""
    body = error_body(429, "RESOURCE_EXHAUSTED", "Quota exceeded for metric", RETRY_INFO)
    fake = FakeGemini(Reply(429, body), Reply(429, body, headers={"Retry-After": "3"}))
    provider = _provider(await serve(fake.app()), session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(QUESTION, timeout=2.0)
    assert (caught.value.kind, caught.value.retryable, caught.value.retry_after) == (
        K.RATE_LIMITED,
        True,
        12.0,
    )
    assert caught.value.message == "HTTP 429 RESOURCE_EXHAUSTED: Quota exceeded for metric"
    with pytest.raises(ProviderError) as again:
        await provider.complete(QUESTION, timeout=2.0)
    assert again.value.retry_after == 3.0


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("status", "name", "message", "kind"),
    [
        (503, "UNAVAILABLE", "The model is overloaded. Please try again later.", K.OVERLOADED),
        (500, "INTERNAL", "An internal error has occurred.", K.SERVER),
        (504, "DEADLINE_EXCEEDED", "Deadline expired before operation could complete.", K.TIMEOUT),
        (
            400,
            "INVALID_ARGUMENT",
            "The input token count (1200293) exceeds the maximum number of tokens allowed (1048576).",
            K.CONTEXT_LENGTH,
        ),
        (
            400,
            "INVALID_ARGUMENT",
            "Invalid value at 'generation_config.temperature'",
            K.BAD_REQUEST,
        ),
        (400, "INVALID_ARGUMENT", "API key not valid. Please pass a valid API key.", K.AUTH),
        (403, "PERMISSION_DENIED", "Permission denied on resource project", K.AUTH),
        (401, "UNAUTHENTICATED", "Request had invalid authentication credentials.", K.AUTH),
        (404, "NOT_FOUND", "models/gemini-nope is not found for API version v1beta", K.NOT_FOUND),
    ],
)
async def test_errors_map_to_kinds(
    status: int, name: str, message: str, kind: K, serve: Serve, session: aiohttp.ClientSession
) -> None:
    """Each Gemini error status raises the documented kind, led by the status and its name."""
    fake = FakeGemini(Reply(status, error_body(status, name, message)))
    provider = _provider(await serve(fake.app()), session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(QUESTION, timeout=2.0)
    assert (caught.value.kind, caught.value.status) == (kind, status)
    assert caught.value.message == f"HTTP {status} {name}: {message}"


@pytest.mark.slow
@pytest.mark.asyncio
async def test_an_overload_in_a_stream(serve: Serve, session: aiohttp.ClientSession) -> None:
    """A 503 answer to a stream raises overloaded before any chunk; an error event in the
    middle of a stream raises the kind its status names, after the text before it."""
    overloaded = error_body(503, "UNAVAILABLE", "The model is overloaded.")
    fake = FakeGemini(Reply(503, overloaded))
    provider = _provider(await serve(fake.app()), session)
    with pytest.raises(ProviderError) as caught:
        await _collect(provider, QUESTION)
    assert (caught.value.kind, caught.value.retryable) == (K.OVERLOADED, True)
    fake.reply_with(
        Reply(
            200,
            Reply.stream([answer("Hel", finish=None)]).body + b"data: " + overloaded + b"\r\n\r\n",
            "text/event-stream",
        )
    )
    received: list[StreamItem] = []

    async def consume() -> None:
        async with aclosing(provider.stream(QUESTION, timeout=2.0)) as stream:
            async for item in stream:
                received.append(item)

    with pytest.raises(ProviderError) as mid:
        await consume()
    assert mid.value.kind == K.OVERLOADED
    assert mid.value.message == "UNAVAILABLE: The model is overloaded."
    assert len(received) == 2


BLOCKED_PROMPT = {
    "promptFeedback": {
        "blockReason": "SAFETY",
        "safetyRatings": [{"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": "HIGH"}],
    },
    "usageMetadata": {"promptTokenCount": 7, "totalTokenCount": 7},
    "modelVersion": "gemini-test-001",
}


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("data", "where"),
    [
        (BLOCKED_PROMPT, "prompt (SAFETY)"),
        (answer(None, finish="SAFETY"), "answer (SAFETY)"),
        (answer("partial", finish="RECITATION"), "answer (RECITATION)"),
        (answer(None, finish="PROHIBITED_CONTENT"), "answer (PROHIBITED_CONTENT)"),
    ],
)
async def test_a_safety_refusal(
    data: dict[str, Any], where: str, serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A blocked prompt (promptFeedback.blockReason) and a candidate stopped by a safety
    finishReason raise content_filter, not retryable, streamed or not."""
    fake = FakeGemini(Reply.json(data), Reply.stream([data]))
    provider = _provider(await serve(fake.app()), session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(QUESTION, timeout=2.0)
    assert (caught.value.kind, caught.value.retryable) == (K.CONTENT_FILTER, False)
    assert caught.value.message == f"Gemini's safety filter blocked the {where}"
    with pytest.raises(ProviderError) as streamed:
        await _collect(provider, QUESTION)
    assert streamed.value.kind == K.CONTENT_FILTER


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("status", [400, 403, 429, 500])
async def test_secrets_never_reach_error_messages(
    status: int, serve: Serve, session: aiohttp.ClientSession
) -> None:
    """An error body, or an error event in a stream, that echoes the key gives a message
    without it."""
    echo = error_body(status, "INVALID_ARGUMENT", f"API key {SECRET} was refused (key={SECRET})")
    fake = FakeGemini(
        Reply(status, echo), Reply(200, b"data: " + echo + b"\r\n\r\n", "text/event-stream")
    )
    provider = _provider(await serve(fake.app()), session)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(QUESTION, timeout=2.0)
    with pytest.raises(ProviderError) as streamed:
        await _collect(provider, QUESTION)
    for error in (caught.value, streamed.value):
        assert SECRET not in error.message
        assert SECRET[:20] not in repr(error)
        assert "[redacted]" in error.message


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_200_that_is_not_an_answer_is_malformed(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A 200 without candidates, or with a broken function call, is a retryable malformed."""
    broken = answer(None, finish="MALFORMED_FUNCTION_CALL")
    fake = FakeGemini(Reply.json({"modelVersion": "x"}), Reply.json(broken))
    provider = _provider(await serve(fake.app()), session)
    for _ in range(2):
        with pytest.raises(ProviderError) as caught:
            await provider.complete(QUESTION, timeout=2.0)
        assert (caught.value.kind, caught.value.retryable) == (K.MALFORMED, True)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_embeddings(serve: Serve, session: aiohttp.ClientSession) -> None:
    """embed() posts one batchEmbedContents request per call and answers OpenAI's shape."""
    fake = FakeGemini(Reply.json({"embeddings": [{"values": [0.5, 1.0]}, {"values": [0.0, -1.0]}]}))
    provider = _provider(await serve(fake.app()), session)
    body = {"model": "gemini-embedding-001", "input": ["a", "b"], "dimensions": 2}
    result = await provider.embed({**body, "encoding_format": "base64"}, timeout=2.0)
    (seen,) = fake.requests
    assert (seen.path, seen.problem) == (
        "/v1beta/models/gemini-embedding-001:batchEmbedContents",
        None,
    )
    assert seen.body["requests"][1] == {
        "model": "models/gemini-embedding-001",
        "outputDimensionality": 2,
        "content": {"parts": [{"text": "b"}]},
    }
    assert [decode_vector(item["embedding"]) for item in result["data"]] == [
        [0.5, 1.0],
        [0.0, -1.0],
    ]
    assert result["model"] == "gemini-embedding-001"


# --------------------------------------------------------------------------- Vertex AI


def _service_account(tmp_path: Path, token_uri: str) -> Path:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    info = {
        "type": "service_account",
        "project_id": "proj-from-file",
        "private_key_id": "k1",
        "private_key": pem,
        "client_email": "gateway@proj-from-file.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_uri,
    }
    path = tmp_path / "sa.json"
    path.write_text(json.dumps(info), encoding="utf-8")
    return path


def _vertex(
    base: str, session: aiohttp.ClientSession, tmp_path: Path, **vertex: Any
) -> GeminiProvider:
    _service_account(tmp_path, f"{base}/token")
    built = build(
        "v",
        model=MODEL,
        base_url=base,
        api_key=None,
        options=GeminiOptions(vertex=VertexOptions(service_account_file=Path("sa.json"), **vertex)),
        session=session,
        clock=ManualClock(),
        base_dir=tmp_path,
    )
    assert isinstance(built, GeminiProvider)
    return built


@pytest.mark.slow
@pytest.mark.asyncio
async def test_vertex_url_and_bearer_token(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Vertex AI: the project/location URL, a bearer token from the service account's token
    endpoint (a signed JWT grant), reused while valid; no key header."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    fake = FakeGemini(Reply.json(answer()), Reply.stream([answer()]))
    base = await serve(fake.app())
    provider = _vertex(base, session, tmp_path, location="europe-west4")
    await provider.complete(QUESTION, timeout=5.0)
    await _collect(provider, QUESTION)
    assert len(fake.tokens) == 1
    assert fake.tokens[0]["grant_type"] == ["urn:ietf:params:oauth:grant-type:jwt-bearer"]
    prefix = "/v1/projects/proj-from-file/locations/europe-west4/publishers/google/models/"
    assert [seen.path for seen in fake.requests] == [
        prefix + f"{MODEL}:generateContent",
        prefix + f"{MODEL}:streamGenerateContent",
    ]
    for seen in fake.requests:
        assert seen.problem is None
        assert seen.headers["Authorization"] == "Bearer ya29.fake-access-token-0001"
        assert "x-goog-api-key" not in seen.headers
    with pytest.raises(ProviderError) as caught:
        await provider.embed({"model": "text-embedding-005", "input": "x"}, timeout=1.0)
    assert caught.value.kind == K.BAD_REQUEST


@pytest.mark.slow
@pytest.mark.asyncio
async def test_vertex_refreshes_an_expired_token(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token inside google-auth's expiry margin is refreshed before the next call, and an
    error echoing the current token does not show it."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    fake = FakeGemini(token_lifetime=1)  # always within the refresh margin: expired at once
    base = await serve(fake.app())
    provider = _vertex(base, session, tmp_path, project="other-proj")
    await provider.complete(QUESTION, timeout=5.0)
    token = "ya29.fake-access-token-0002"
    fake.reply_with(Reply(403, error_body(403, "PERMISSION_DENIED", f"token {token} may not")))
    with pytest.raises(ProviderError) as caught:
        await provider.complete(QUESTION, timeout=5.0)
    assert len(fake.tokens) == 2
    assert fake.requests[1].headers["Authorization"] == f"Bearer {token}"
    assert fake.requests[1].path.startswith("/v1/projects/other-proj/locations/us-central1/")
    assert caught.value.kind == K.AUTH
    assert token not in caught.value.message


@pytest.mark.slow
@pytest.mark.asyncio
async def test_vertex_token_refusal_is_an_auth_error(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token endpoint that refuses the grant gives auth, without calling the model."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    fake = FakeGemini()
    fake.token_status = 400
    provider = _vertex(await serve(fake.app()), session, tmp_path)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(QUESTION, timeout=5.0)
    assert (caught.value.kind, caught.value.retryable) == (K.AUTH, False)
    assert "invalid_grant" in caught.value.message
    assert fake.requests == []


# --------------------------------------------------------------------------- build


@pytest.mark.asyncio
async def test_build_refuses_what_cannot_work(
    session: aiohttp.ClientSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key and no Vertex section, a key with Vertex, an unreadable or wrong key file and a
    missing google-auth each stop the start with a ConfigError naming the key."""

    def make(api_key: str | None, options: GeminiOptions) -> None:
        build(
            "g",
            model=MODEL,
            base_url=None,
            api_key=api_key,
            options=options,
            session=session,
            clock=ManualClock(),
            base_dir=tmp_path,
        )

    vertex = GeminiOptions(vertex=VertexOptions(service_account_file=Path("sa.json")))
    with pytest.raises(ConfigError, match=r"providers\.g: the Gemini API needs api_key_file"):
        make(None, GeminiOptions())
    with pytest.raises(ConfigError, match=r"providers\.g\.api_key_file: Vertex AI uses"):
        make(SECRET, vertex)
    with pytest.raises(ConfigError, match=r"service_account_file: cannot read .*sa\.json"):
        make(None, vertex)
    (tmp_path / "sa.json").write_text('{"type": "service_account"}', encoding="utf-8")
    with pytest.raises(ConfigError, match="is not a service account key"):
        make(None, vertex)
    monkeypatch.setitem(sys.modules, "google.oauth2", None)
    with pytest.raises(
        ConfigError, match=r"needs google-auth \(pip install 'tidegate\[gemini\]'\)"
    ):
        make(None, vertex)


@pytest.mark.asyncio
async def test_default_endpoints(session: aiohttp.ClientSession, tmp_path: Path) -> None:
    """Without base_url: the Gemini API's host, or the Vertex region's (global: no region)."""
    api = _provider(None, session)  # type: ignore[arg-type]
    assert api.models_url == "https://generativelanguage.googleapis.com/v1beta/models"
    _service_account(tmp_path, "http://127.0.0.1:9/token")
    for location, host in (
        ("us-central1", "https://us-central1-aiplatform.googleapis.com"),
        ("global", "https://aiplatform.googleapis.com"),
    ):
        built = build(
            "v",
            model=MODEL,
            base_url=None,
            api_key=None,
            options=GeminiOptions(
                vertex=VertexOptions(service_account_file=tmp_path / "sa.json", location=location)
            ),
            session=session,
            clock=ManualClock(),
            base_dir=Path("/nonexistent"),
        )
        assert isinstance(built, GeminiProvider)
        assert built.models_url == (
            f"{host}/v1/projects/proj-from-file/locations/{location}/publishers/google/models"
        )


def test_an_error_event_names_its_status() -> None:
    """An error inside a 200 (no HTTP status of its own) maps by its code and status name;
    a list-wrapped body (Vertex's stream errors) is read too."""
    body = orjson.dumps([{"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message": "x"}}])
    error = gemini_error_for(HTTPAnswer(200, {}, body), provider="g", now_wall=0.0)
    assert (error.kind, error.status, error.message) == (
        K.RATE_LIMITED,
        429,
        "RESOURCE_EXHAUSTED: x",
    )
