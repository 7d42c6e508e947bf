"""The Bedrock provider against a fake of bedrock-runtime on loopback: translation both ways,
ConverseStream's event-stream frames, SigV4 checked again by botocore, the error mapping, and
every request body validated against botocore's service model (see bedrock_fake)."""

from __future__ import annotations

import sys
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from botocore.eventstream import ChecksumMismatch, EventStreamBuffer  # type: ignore[import-untyped]

from tidegate.clock import ManualClock
from tidegate.errors import ConfigError, ProviderError, ProviderErrorKind
from tidegate.providers.base import Provider, StreamEnd, StreamItem
from tidegate.providers.bedrock import (
    BedrockOptions,
    build,
    default_endpoint,
    to_converse_request,
)

from .bedrock_fake import (
    ACCESS_KEY,
    MODEL,
    REGION,
    REQUEST_ID,
    SECRET_KEY,
    SESSION_TOKEN,
    FakeBedrock,
    Reply,
    aws_env,
    converse_answer,
    error_reply,
    event,
    exception,
    frame,
    text_stream,
    validation_problems,
)
from .conftest import Serve
from .helpers import WEATHER, weather_turns

K = ProviderErrorKind
ASK: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why are there tides?"},
    ],
    "max_tokens": 64,
    "temperature": 0.2,
    "top_p": 0.9,
    "stop": ["END"],
}


@pytest.fixture(autouse=True)
def _aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    aws_env(monkeypatch, tmp_path)


async def _provider(
    serve: Serve,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    *replies: Reply,
    api_key: str | None = None,
    **options: Any,
) -> tuple[Provider, FakeBedrock]:
    fake = FakeBedrock(replies, api_key=api_key)
    url = await serve(fake.app())
    provider = build(
        "rock",
        model=MODEL,
        base_url=url,
        api_key=api_key,
        options=BedrockOptions(region=REGION, **options),
        session=session,
        clock=ManualClock(0.0, wall_start=1_700_000_000.0),
        base_dir=tmp_path,
    )
    return provider, fake


async def _collect(stream: AsyncGenerator[StreamItem, None], into: list[StreamItem]) -> None:
    async with aclosing(stream):
        async for item in stream:
            into.append(item)


async def _items(provider: Provider, body: dict[str, Any]) -> list[StreamItem]:
    stream = provider.stream({**body, "stream_options": {"include_usage": True}}, timeout=5.0)
    async with aclosing(stream):
        return [item async for item in stream]


@pytest.mark.asyncio
async def test_a_plain_answer(serve: Serve, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    provider, fake = await _provider(serve, session, tmp_path, Reply(json=converse_answer()))
    answer = await provider.complete(ASK, timeout=5.0)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Hello from Bedrock"}
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"] == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
    assert (answer["model"], answer["id"], answer["created"]) == (
        MODEL,
        f"chatcmpl-{REQUEST_ID}",
        1_700_000_000,
    )
    [seen] = fake.seen
    assert (seen.operation, seen.model_id) == ("Converse", MODEL)
    assert seen.raw_path == "/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse"
    assert seen.signature_problem == seen.validation_problems == ""
    assert seen.body == {
        "system": [{"text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"text": "Why are there tides?"}]}],
        "inferenceConfig": {
            "maxTokens": 64,
            "temperature": 0.2,
            "topP": 0.9,
            "stopSequences": ["END"],
        },
    }


@pytest.mark.asyncio
async def test_a_stream(serve: Serve, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    frames = text_stream("High ", "tide")
    provider, fake = await _provider(serve, session, tmp_path, Reply(frames=frames))
    items = await _items(provider, {**ASK, "stream": True})
    assert items[-1] == StreamEnd(done_seen=True)
    chunks = [item for item in items if isinstance(item, dict)]
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"role": "assistant", "content": ""},
        {"content": "High "},
        {"content": "tide"},
    ]
    assert chunks[3]["choices"][0]["finish_reason"] == "stop"
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
    assert {c["id"] for c in chunks} == {f"chatcmpl-{REQUEST_ID}"}
    [seen] = fake.seen
    assert seen.operation == "ConverseStream"
    assert seen.headers["Accept"] == "application/vnd.amazon.eventstream"
    assert seen.signature_problem == seen.validation_problems == ""


@pytest.mark.asyncio
async def test_a_stream_cut_before_message_stop_is_not_done(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    provider, _ = await _provider(serve, session, tmp_path, Reply(frames=text_stream("a", "b")[:3]))
    items = await _items(provider, ASK)
    assert items[-1] == StreamEnd(done_seen=False)


TOOL_HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    *weather_turns("call_1"),
    {"role": "user", "content": "And in Bergen?"},
]


@pytest.mark.asyncio
async def test_a_tool_call(serve: Serve, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    use = {"toolUseId": "tooluse_2", "name": "get_weather", "input": {"city": "Bergen"}}
    reply = Reply(json=converse_answer("Let me look.", stop="tool_use", tool_use=use))
    provider, fake = await _provider(serve, session, tmp_path, reply)
    body = {"model": MODEL, "messages": TOOL_HISTORY, "tools": [WEATHER], "tool_choice": "required"}
    answer = await provider.complete(body, timeout=5.0)
    message = answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me look."
    assert message["tool_calls"] == [
        {
            "id": "tooluse_2",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Bergen"}'},
        }
    ]
    [seen] = fake.seen
    assert seen.validation_problems == ""
    assert seen.body["messages"] == [
        {"role": "user", "content": [{"text": "Weather in Oslo?"}]},
        {
            "role": "assistant",
            "content": [
                {
                    "toolUse": {
                        "toolUseId": "call_1",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    }
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"toolResult": {"toolUseId": "call_1", "content": [{"text": "4 C"}]}},
                {"text": "And in Bergen?"},
            ],
        },
    ]
    assert seen.body["toolConfig"] == {
        "tools": [
            {
                "toolSpec": {
                    "name": "get_weather",
                    "description": "The weather in a city",
                    "inputSchema": {"json": WEATHER["function"]["parameters"]},
                }
            }
        ],
        "toolChoice": {"any": {}},
    }


@pytest.mark.asyncio
async def test_a_streamed_tool_call(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    frames = [
        event("messageStart", {"role": "assistant"}),
        event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "Checking."}}),
        event("contentBlockStop", {"contentBlockIndex": 0}),
        event(
            "contentBlockStart",
            {
                "contentBlockIndex": 1,
                "start": {"toolUse": {"toolUseId": "t9", "name": "get_weather"}},
            },
        ),
        event(
            "contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {"input": '{"ci'}}}
        ),
        event(
            "contentBlockDelta",
            {"contentBlockIndex": 1, "delta": {"toolUse": {"input": 'ty": "Oslo"}'}}},
        ),
        event("contentBlockStop", {"contentBlockIndex": 1}),
        event("messageStop", {"stopReason": "tool_use"}),
    ]
    provider, fake = await _provider(serve, session, tmp_path, Reply(frames=frames))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    items = await _items(provider, body)
    deltas = [item["choices"][0]["delta"] for item in items if isinstance(item, dict)]
    assert deltas[1] == {"content": "Checking."}
    assert deltas[2] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "t9",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    }
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[3:5])
    assert orjson.loads(arguments) == {"city": "Oslo"}
    finish = [item for item in items if isinstance(item, dict)][-1]
    assert finish["choices"][0]["finish_reason"] == "tool_calls"
    assert items[-1] == StreamEnd(done_seen=True)  # no metadata event: messageStop is the end
    assert fake.seen[0].body["toolConfig"]["toolChoice"] == {"tool": {"name": "get_weather"}}
    assert fake.seen[0].validation_problems == ""


@pytest.mark.parametrize("retry_after", [None, "3"])
@pytest.mark.asyncio
async def test_throttling_is_a_retryable_rate_limit(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path, retry_after: str | None
) -> None:
    headers = {} if retry_after is None else {"Retry-After": retry_after}
    reply = error_reply(
        429, "ThrottlingException", "Too many requests, please wait.", headers=headers
    )
    provider, _ = await _provider(serve, session, tmp_path, reply)
    with pytest.raises(ProviderError) as raised:
        await provider.complete(ASK, timeout=5.0)
    error = raised.value
    assert (error.kind, error.retryable, error.status) == (K.RATE_LIMITED, True, 429)
    assert error.retry_after == (None if retry_after is None else 3.0)
    assert "ThrottlingException" in error.message
    assert REQUEST_ID in error.message


@pytest.mark.asyncio
async def test_throttling_inside_a_stream(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    frames = [
        event("messageStart", {"role": "assistant"}),
        exception("throttlingException", "Too many tokens, please wait."),
    ]
    provider, _ = await _provider(serve, session, tmp_path, Reply(frames=frames))
    seen: list[StreamItem] = []
    with pytest.raises(ProviderError) as raised:
        await _collect(provider.stream(ASK, timeout=5.0), seen)
    assert len(seen) == 1  # the role chunk, then the exception
    assert (raised.value.kind, raised.value.retryable, raised.value.status) == (
        K.RATE_LIMITED,
        True,
        429,
    )


@pytest.mark.parametrize(
    ("status", "error_type"),
    [(503, "ServiceUnavailableException"), (429, "ModelNotReadyException")],
)
@pytest.mark.asyncio
async def test_overload_is_retryable(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path, status: int, error_type: str
) -> None:
    provider, _ = await _provider(serve, session, tmp_path, error_reply(status, error_type, "busy"))
    with pytest.raises(ProviderError) as raised:
        await provider.complete(ASK, timeout=5.0)
    assert (raised.value.kind, raised.value.retryable) == (K.OVERLOADED, True)


@pytest.mark.asyncio
async def test_a_stream_error_before_the_stream(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    reply = error_reply(503, "ServiceUnavailableException", "Service unavailable", in_body=True)
    provider, _ = await _provider(serve, session, tmp_path, reply)
    with pytest.raises(ProviderError) as raised:
        await _items(provider, ASK)
    assert raised.value.kind is K.OVERLOADED
    assert raised.value.status == 503


@pytest.mark.asyncio
async def test_a_guardrail_intervention_is_a_content_filter(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    blocked = "Sorry, I cannot help with that."
    provider, fake = await _provider(
        serve,
        session,
        tmp_path,
        Reply(json=converse_answer(blocked, stop="guardrail_intervened")),
        Reply(frames=text_stream(blocked, stop="content_filtered")),
        guardrail_identifier="gr-123",
        guardrail_version="2",
    )
    answer = await provider.complete(ASK, timeout=5.0)
    assert answer["choices"][0]["finish_reason"] == "content_filter"
    assert answer["choices"][0]["message"]["content"] == blocked
    items = await _items(provider, ASK)
    finishes = [
        c["choices"][0]["finish_reason"] for c in items if isinstance(c, dict) and c["choices"]
    ]
    assert finishes[-1] == "content_filter"
    assert [s.body["guardrailConfig"] for s in fake.seen] == [
        {"guardrailIdentifier": "gr-123", "guardrailVersion": "2"}
    ] * 2
    assert [s.validation_problems for s in fake.seen] == ["", ""]


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("Input is too long for requested model.", K.CONTEXT_LENGTH),
        ("prompt is too long: 210000 tokens > 200000 maximum", K.CONTEXT_LENGTH),
        ("The maximum tokens you requested exceeds the model limit", K.BAD_REQUEST),
    ],
)
@pytest.mark.asyncio
async def test_validation_errors(
    serve: Serve,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    message: str,
    kind: ProviderErrorKind,
) -> None:
    reply = error_reply(400, "ValidationException", message, in_body=True)
    provider, _ = await _provider(serve, session, tmp_path, reply)
    with pytest.raises(ProviderError) as raised:
        await provider.complete(ASK, timeout=5.0)
    assert (raised.value.kind, raised.value.retryable) == (kind, False)


@pytest.mark.parametrize(
    ("status", "error_type", "kind"),
    [
        (403, "AccessDeniedException", K.AUTH),
        (403, "UnrecognizedClientException", K.AUTH),
        (404, "ResourceNotFoundException", K.NOT_FOUND),
        (408, "ModelTimeoutException", K.TIMEOUT),
        (500, "InternalServerException", K.SERVER),
        (424, "ModelErrorException", K.SERVER),
        (502, "", K.SERVER),
    ],
)
@pytest.mark.asyncio
async def test_the_other_errors(
    serve: Serve,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    status: int,
    error_type: str,
    kind: ProviderErrorKind,
) -> None:
    reply = error_reply(status, error_type, "no") if error_type else Reply(status, json={})
    provider, _ = await _provider(serve, session, tmp_path, reply)
    with pytest.raises(ProviderError) as raised:
        await provider.complete(ASK, timeout=5.0)
    assert (raised.value.kind, raised.value.status) == (kind, status)


@pytest.mark.asyncio
async def test_the_request_is_signed_with_sigv4(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fake signs the received request again with the test credentials and compares; a
    provider holding another secret is refused (so the check can fail)."""
    provider, fake = await _provider(serve, session, tmp_path, Reply(json=converse_answer()))
    await provider.complete(ASK, timeout=5.0)
    headers = fake.seen[0].headers
    assert headers["Authorization"].startswith(
        f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{headers['X-Amz-Date'][:8]}/{REGION}/bedrock/"
    )
    assert headers["X-Amz-Security-Token"] == SESSION_TOKEN
    assert fake.seen[0].signature_problem == ""

    (tmp_path / "creds").write_text(
        f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = not-the-secret\n",
        encoding="utf-8",
    )
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    other, fake = await _provider(
        serve, session, tmp_path, Reply(json=converse_answer()), credentials_file=Path("creds")
    )
    with pytest.raises(ProviderError) as raised:
        await other.complete(ASK, timeout=5.0)
    assert raised.value.kind is K.AUTH
    assert fake.seen[0].signature_problem


@pytest.mark.asyncio
async def test_a_bedrock_api_key_is_a_bearer_token(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    key = "ABSKQmVkcm9ja0FQSUtleS1leGFtcGxlLWtleS0xMjM0NTY3ODkw"
    provider, fake = await _provider(
        serve,
        session,
        tmp_path,
        Reply(json=converse_answer()),
        error_reply(403, "AccessDeniedException", f"Invalid API key {key}"),
        api_key=key,
    )
    assert (await provider.complete(ASK, timeout=5.0))["choices"][0]["message"]["content"]
    assert "X-Amz-Date" not in fake.seen[0].headers
    with pytest.raises(ProviderError) as raised:
        await provider.complete(ASK, timeout=5.0)
    assert raised.value.kind is K.AUTH
    assert key not in raised.value.message


@pytest.mark.asyncio
async def test_secrets_never_reach_an_error_message(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    echo = f"The security token {SESSION_TOKEN} with secret {SECRET_KEY} is invalid"
    provider, _ = await _provider(
        serve,
        session,
        tmp_path,
        error_reply(403, "UnrecognizedClientException", echo),
        Reply(frames=[event("messageStart", {}), exception("validationException", echo)]),
    )
    with pytest.raises(ProviderError) as plain:
        await provider.complete(ASK, timeout=5.0)
    with pytest.raises(ProviderError) as streamed:
        await _items(provider, ASK)
    for error in (plain.value, streamed.value):
        assert "is invalid" in error.message
        assert SECRET_KEY not in error.message
        assert SESSION_TOKEN not in error.message
        assert SECRET_KEY not in repr(error)
    assert plain.value.kind is K.AUTH
    assert streamed.value.kind is K.BAD_REQUEST


@pytest.mark.asyncio
async def test_a_damaged_frame_is_malformed(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    good = event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "x"}})
    damaged = good[:-5] + bytes([good[-5] ^ 0xFF]) + good[-4:]
    frames = [event("messageStart", {"role": "assistant"}), damaged]
    provider, _ = await _provider(serve, session, tmp_path, Reply(frames=frames))
    with pytest.raises(ProviderError) as raised:
        await _items(provider, ASK)
    assert raised.value.kind is K.MALFORMED


@pytest.mark.asyncio
async def test_a_200_that_is_not_an_answer_is_malformed(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    provider, _ = await _provider(
        serve,
        session,
        tmp_path,
        Reply(json={"output": {}}),
        Reply(json=converse_answer(stop="malformed_tool_use")),
    )
    for _ in range(2):
        with pytest.raises(ProviderError) as raised:
            await provider.complete(ASK, timeout=5.0)
        assert (raised.value.kind, raised.value.retryable) == (K.MALFORMED, True)


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 2},
        {"logprobs": True},
        {"response_format": {"type": "json_object"}},
        {"temperature": 1.5},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}],
                }
            ]
        },
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
    ],
)
@pytest.mark.asyncio
async def test_what_cannot_be_translated_is_refused_without_a_call(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path, extra: dict[str, Any]
) -> None:
    provider, fake = await _provider(serve, session, tmp_path, Reply(json=converse_answer()))
    with pytest.raises(ProviderError) as raised:
        await provider.complete({**ASK, **extra}, timeout=5.0)
    assert raised.value.kind is K.BAD_REQUEST
    assert fake.seen == []


@pytest.mark.asyncio
async def test_images_and_prefill_pass_validation(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/jpg;base64,/9j/4AAQ"}},
        {"type": "image_url", "image_url": {"url": "s3://my-bucket/pics/a.webp"}},
    ]
    body = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": "It is"},
        ],
    }
    provider, fake = await _provider(serve, session, tmp_path, Reply(json=converse_answer()))
    await provider.complete(body, timeout=5.0)
    assert fake.seen[0].validation_problems == ""
    assert fake.seen[0].body["messages"][0]["content"][1:] == [
        {"image": {"format": "jpeg", "source": {"bytes": "/9j/4AAQ"}}},
        {
            "image": {
                "format": "webp",
                "source": {"s3Location": {"uri": "s3://my-bucket/pics/a.webp"}},
            }
        },
    ]


@pytest.mark.asyncio
async def test_embeddings_are_not_offered(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    provider, fake = await _provider(serve, session, tmp_path, Reply(json=converse_answer()))
    with pytest.raises(ProviderError) as raised:
        await provider.embed({"model": MODEL, "input": "x"}, timeout=5.0)
    assert raised.value.kind is K.BAD_REQUEST
    assert fake.seen == []


def test_the_fake_refuses_what_botocore_refuses() -> None:
    """The fake's validation is botocore's: a body Bedrock would refuse fails it."""
    good = to_converse_request(ASK)
    assert validation_problems("Converse", good, MODEL) == ""
    assert validation_problems("Converse", {**good, "inferenceConfig": {"maxTokens": 0}}, MODEL)
    assert validation_problems("ConverseStream", {"messages": [{"role": "user"}]}, MODEL)
    assert validation_problems("Converse", {**good, "temperature": 0.5}, MODEL)


def test_the_test_encoder_passes_botocores_crc_checks() -> None:
    data = frame({":event-type": "messageStop", ":message-type": "event"}, b'{"stopReason":"x"}')
    buffer = EventStreamBuffer()
    buffer.add_data(data)
    [message] = list(buffer)
    assert message.headers[":event-type"] == "messageStop"
    assert message.payload == b'{"stopReason":"x"}'
    damaged = EventStreamBuffer()
    damaged.add_data(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ChecksumMismatch):
        list(damaged)


def test_building_needs_credentials_and_a_region(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    aws_env(monkeypatch, tmp_path, keys=False)
    common: dict[str, Any] = {
        "model": MODEL,
        "base_url": None,
        "api_key": None,
        "session": None,
        "clock": ManualClock(),
        "base_dir": tmp_path,
    }
    with pytest.raises(ConfigError, match="no AWS credentials"):
        build("rock", options=BedrockOptions(region=REGION), **common)
    with pytest.raises(ConfigError, match=r"providers\.rock\.bedrock\.region"):
        build("rock", options=None, **common)
    with pytest.raises(ConfigError, match="nope"):
        build("rock", options=BedrockOptions(region=REGION, profile="nope"), **common)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    keyed = build("rock", options=None, **{**common, "api_key": "k"})
    assert keyed.target.endpoint == default_endpoint("eu-west-3")  # type: ignore[attr-defined]
    assert default_endpoint("eu-west-3") == "https://bedrock-runtime.eu-west-3.amazonaws.com"
    assert default_endpoint("cn-north-1").endswith(".amazonaws.com.cn")


def test_a_missing_botocore_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "botocore.session", None)
    with pytest.raises(ConfigError, match=r"tidegate\[bedrock\]"):
        build(
            "rock",
            model=MODEL,
            base_url=None,
            api_key=None,
            options=None,
            session=None,  # type: ignore[arg-type]
            clock=ManualClock(),
            base_dir=tmp_path,
        )
