"""The azure_openai provider, over real sockets on loopback against a fake of Azure's wire
protocol (tests/providers/azure_fake.py) that checks every request body against the ``openai``
SDK's own request types."""

from __future__ import annotations

import os
from contextlib import aclosing
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tidegate.clock import SystemClock
from tidegate.errors import ConfigError, ProviderError, ProviderErrorKind
from tidegate.providers.azure_openai import (
    DEFAULT_API_VERSION,
    AzureOpenAIOptions,
    AzureOpenAIProvider,
    build,
)
from tidegate.providers.base import MalformedChunk, Provider, StreamEnd, StreamItem

from .azure_fake import FakeAzure, Reply, azure_error, chunk, filter_results
from .conftest import Serve
from .helpers import WEATHER

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

K = ProviderErrorKind
KEY = "azure-key-blue-heron-42"  # not shaped like a key: only the config knows it
TOKEN = "entra-token-one-5b7c9d1e3f"
NEW_TOKEN = "entra-token-two-8a6c4e2f0b"
CHAT: dict[str, Any] = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Tides?"}]}


def _provider(
    base: str,
    session: aiohttp.ClientSession,
    *,
    api_key: str | None = KEY,
    base_dir: Path = Path("."),
    model: str = "chat-deploy",
    **options: Any,
) -> Provider:
    return build(
        "azure",
        model=model,
        base_url=base,
        api_key=api_key,
        options=AzureOpenAIOptions(**options) if options else None,
        session=session,
        clock=SystemClock(),
        base_dir=base_dir,
    )


async def _items(provider: Provider, body: dict[str, Any]) -> list[StreamItem]:
    async with aclosing(provider.stream(body, timeout=5.0)) as stream:
        return [item async for item in stream]


async def _failure(provider: Provider, body: dict[str, Any] = CHAT) -> ProviderError:
    with pytest.raises(ProviderError) as caught:
        await provider.complete(body, timeout=5.0)
    return caught.value


def _text(items: list[StreamItem]) -> str:
    return "".join(
        choice["delta"].get("content") or ""
        for item in items
        if isinstance(item, dict)
        for choice in item["choices"]
    )


# --------------------------------------------------------------------------- answers


async def test_a_plain_answer_goes_to_the_deployment_with_the_api_key(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """The request goes to the deployment's URL with the GA api-version and the api-key
    header; the body's model is the deployment; Azure's answer comes back as it is."""
    fake = FakeAzure(key=KEY)
    provider = _provider(await serve(fake.app()), session)
    answer = await provider.complete({**CHAT, "stream_options": {"include_usage": True}}, timeout=5)
    assert answer["choices"][0]["message"]["content"] == fake.text
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["total_tokens"] == 16
    (seen,) = fake.seen
    assert seen.path == "/openai/deployments/chat-deploy/chat/completions"
    assert seen.query == {"api-version": DEFAULT_API_VERSION} == {"api-version": "2024-10-21"}
    assert seen.headers["api-key"] == KEY
    assert "Authorization" not in seen.headers
    assert seen.headers["Content-Type"] == "application/json"
    assert seen.body["model"] == "chat-deploy"
    assert seen.body["stream"] is False
    assert "stream_options" not in seen.body
    assert fake.problems == []


async def test_deployment_api_version_and_a_path_prefix_are_honoured(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A configured deployment wins over the model; the api-version is the configured one; a
    base URL with a path (an API gateway in front of Azure) and a trailing slash is kept."""
    fake = FakeAzure(key=KEY, deployments=("prod-gpt4o",))
    base = await serve(fake.app())
    provider = _provider(
        f"{base}/apim/", session, deployment="prod-gpt4o", api_version="2025-01-01-preview"
    )
    await provider.complete(CHAT, timeout=5.0)
    (seen,) = fake.seen
    assert seen.path == "/apim/openai/deployments/prod-gpt4o/chat/completions"
    assert seen.query == {"api-version": "2025-01-01-preview"}
    assert seen.body["model"] == "prod-gpt4o"
    assert isinstance(provider, AzureOpenAIProvider)
    assert KEY not in repr(provider)


async def test_a_stream_drops_the_prompt_filter_chunk_and_ends_with_done(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A stream yields Azure's chunks (without the opening one that only carries
    ``prompt_filter_results``), the usage chunk asked for, and StreamEnd(done_seen=True)."""
    fake = FakeAzure(key=KEY)
    provider = _provider(await serve(fake.app()), session)
    items = await _items(provider, {**CHAT, "stream_options": {"include_usage": True}})
    assert items[-1] == StreamEnd(done_seen=True)
    chunks = [item for item in items if isinstance(item, dict)]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert not any("prompt_filter_results" in chunk for chunk in chunks)
    assert _text(items) == fake.text
    assert chunks[-1]["usage"]["total_tokens"] == 16
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    (seen,) = fake.seen
    assert seen.body["stream"] is True
    assert seen.body["stream_options"] == {"include_usage": True}
    assert seen.headers["Accept"] == "text/event-stream"
    assert fake.problems == []


async def test_a_malformed_event_is_yielded_and_the_stream_goes_on(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    fake = FakeAzure(key=KEY).then(
        Reply(events=[chunk({"content": "a"}), "{not json", chunk({}, "stop")])
    )
    provider = _provider(await serve(fake.app()), session)
    items = await _items(provider, CHAT)
    assert items[1] == MalformedChunk("{not json")
    assert items[-1] == StreamEnd(done_seen=False)  # no [DONE]: maybe truncated


async def test_a_tool_call_and_its_round_trip(serve: Serve, session: aiohttp.ClientSession) -> None:
    """A tool call comes back whole; the round trip (the assistant's call, the tool's result)
    is sent in a body the SDK's request type accepts."""
    fake = FakeAzure(key=KEY)
    provider = _provider(await serve(fake.app()), session)
    ask = {**CHAT, "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False}
    first = await provider.complete(ask, timeout=5.0)
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    second = await provider.complete(
        {
            **ask,
            "messages": [
                *CHAT["messages"],
                choice["message"],
                {"role": "tool", "tool_call_id": call["id"], "content": "4 C"},
            ],
        },
        timeout=5.0,
    )
    assert second["choices"][0]["message"]["content"] == fake.text
    assert [seen.body["tools"] for seen in fake.seen] == [[WEATHER], [WEATHER]]
    assert fake.problems == []


async def test_a_streamed_tool_call_arrives_in_pieces(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    fake = FakeAzure(key=KEY)
    provider = _provider(await serve(fake.app()), session)
    items = await _items(provider, {**CHAT, "tools": [WEATHER]})
    deltas = [
        call
        for item in items
        if isinstance(item, dict)
        for choice in item["choices"]
        for call in choice["delta"].get("tool_calls") or ()
    ]
    assert deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Oslo"}'
    finishes = [c["choices"][0]["finish_reason"] for c in items if isinstance(c, dict)]
    assert finishes[-1] == "tool_calls"
    assert items[-1] == StreamEnd(done_seen=True)
    assert fake.problems == []


async def test_embeddings_go_to_the_deployment(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    fake = FakeAzure(key=KEY)
    provider = _provider(await serve(fake.app()), session, model="embed-deploy")
    answer = await provider.embed({"model": "x", "input": ["a", "b"]}, timeout=5.0)
    assert [item["index"] for item in answer["data"]] == [0, 1]
    (seen,) = fake.seen
    assert seen.path == "/openai/deployments/embed-deploy/embeddings"
    assert seen.query == {"api-version": DEFAULT_API_VERSION}
    assert seen.body == {"model": "embed-deploy", "input": ["a", "b"]}
    assert fake.problems == []


async def test_the_fake_refuses_a_body_outside_the_sdk_types(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """The schema check is live: a message role the SDK's types do not have is refused."""
    fake = FakeAzure(key=KEY)
    provider = _provider(await serve(fake.app()), session)
    error = await _failure(provider, {**CHAT, "messages": [{"role": "robot", "content": "x"}]})
    assert error.kind is K.BAD_REQUEST
    assert fake.problems
    assert "role" in fake.problems[0]


# --------------------------------------------------------------------------- errors


def _rate_limited(headers: dict[str, str]) -> Reply:
    message = (
        "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version"
        " 2024-10-21 have exceeded token rate limit of your current pricing tier."
    )
    return Reply(429, azure_error(message, "429"), headers)


@pytest.mark.parametrize(
    ("headers", "retry_after"),
    [
        ({"retry-after": "6", "retry-after-ms": "5500"}, 5.5),
        ({"Retry-After": "2"}, 2.0),
        ({}, None),
    ],
)
async def test_a_rate_limit_keeps_its_retry_hint(
    headers: dict[str, str],
    retry_after: float | None,
    serve: Serve,
    session: aiohttp.ClientSession,
) -> None:
    """A 429 is rate_limited and retryable; ``retry-after-ms`` (finer) wins over
    ``Retry-After``; streamed or not."""
    fake = FakeAzure(key=KEY).then(_rate_limited(headers), _rate_limited(headers))
    provider = _provider(await serve(fake.app()), session)
    for error in (await _failure(provider), await _stream_failure(provider)):
        assert (error.kind, error.retryable, error.retry_after) == (
            K.RATE_LIMITED,
            True,
            retry_after,
        )
        assert error.status == 429
        assert error.message.startswith("HTTP 429 429: Requests to the ChatCompletions_Create")


async def _stream_failure(provider: Provider, body: dict[str, Any] = CHAT) -> ProviderError:
    with pytest.raises(ProviderError) as caught:
        await _items(provider, body)
    return caught.value


PROMPT_FILTERED = Reply(
    400,
    azure_error(
        "The response was filtered due to the prompt triggering Azure OpenAI's content"
        " management policy. Please modify your prompt and retry.",
        "content_filter",
        param="prompt",
        inner={
            "code": "ResponsibleAIPolicyViolation",
            "content_filter_result": {
                **filter_results("violence", "hate"),
                "jailbreak": {"filtered": False, "detected": False},
            },
        },
    ),
    {"x-request-id": "req-cf-9"},
)


@pytest.mark.parametrize(
    ("reply", "kind", "retryable", "head"),
    [
        (
            Reply(503, azure_error("The service is temporarily unable to process.", "503")),
            K.OVERLOADED,
            True,
            "HTTP 503 503",
        ),
        (
            Reply(500, azure_error("The server had an error while processing.", "500")),
            K.SERVER,
            True,
            "HTTP 500 500",
        ),
        (
            Reply(
                400,
                azure_error(
                    "This model's maximum context length is 128000 tokens.",
                    "context_length_exceeded",
                    param="messages",
                ),
            ),
            K.CONTEXT_LENGTH,
            False,
            "HTTP 400 context_length_exceeded",
        ),
        (PROMPT_FILTERED, K.CONTENT_FILTER, False, "HTTP 400 content_filter (hate, violence)"),
        (
            Reply(403, azure_error("Public access is disabled.", "AuthenticationTypeDisabled")),
            K.AUTH,
            False,
            "HTTP 403 AuthenticationTypeDisabled",
        ),
        (
            Reply(400, azure_error("Unrecognized request argument: colour", "invalid_value")),
            K.BAD_REQUEST,
            False,
            "HTTP 400 invalid_value",
        ),
        (Reply(200, {"error": {"code": "x", "message": "y"}}), K.MALFORMED, True, "HTTP 200"),
    ],
    ids=["overloaded", "server", "context", "content_filter", "auth_403", "bad_request", "2xx"],
)
async def test_errors_map_to_their_kinds(
    reply: Reply,
    kind: ProviderErrorKind,
    retryable: bool,
    head: str,
    serve: Serve,
    session: aiohttp.ClientSession,
) -> None:
    fake = FakeAzure(key=KEY).then(reply)
    provider = _provider(await serve(fake.app()), session)
    error = await _failure(provider)
    assert (error.kind, error.retryable, error.status) == (kind, retryable, reply.status)
    assert error.message.startswith(head)


async def test_a_refused_prompt_names_the_categories_and_the_request_id(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """Azure's prompt filter (400 ``content_filter``) is ``content_filter``, streamed or not;
    the message names the filtered categories and keeps the request id."""
    fake = FakeAzure(key=KEY).then(PROMPT_FILTERED, PROMPT_FILTERED)
    provider = _provider(await serve(fake.app()), session)
    for error in (await _failure(provider), await _stream_failure(provider)):
        assert error.kind is K.CONTENT_FILTER
        assert not error.retryable
        assert error.message == (
            "HTTP 400 content_filter (hate, violence): The response was filtered due to the"
            " prompt triggering Azure OpenAI's content management policy. Please modify your"
            " prompt and retry. (request id req-cf-9)"
        )


async def test_a_filtered_completion_is_an_answer_that_says_so(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """Azure's completion filter (a 200 whose choice ends with ``content_filter``) reaches the
    caller as an answer with that finish reason, streamed or not, with its usage."""
    answer = {
        "id": "chatcmpl-f",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4o",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None},
                "finish_reason": "content_filter",
                "content_filter_results": filter_results("sexual"),
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
    }
    events = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Once"}),
        chunk({}, "content_filter"),
        "[DONE]",
    ]
    fake = FakeAzure(key=KEY).then(Reply(body=answer), Reply(events=events))
    provider = _provider(await serve(fake.app()), session)
    whole = await provider.complete(CHAT, timeout=5.0)
    assert whole["choices"][0]["finish_reason"] == "content_filter"
    assert whole["usage"]["completion_tokens"] == 3
    items = await _items(provider, CHAT)
    assert _text(items) == "Once"
    last = items[-2]
    assert isinstance(last, dict)
    assert last["choices"][0]["finish_reason"] == "content_filter"
    assert items[-1] == StreamEnd(done_seen=True)


async def test_a_missing_deployment_is_not_found(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    fake = FakeAzure(key=KEY)
    provider = _provider(await serve(fake.app()), session, deployment="nowhere")
    error = await _failure(provider)
    assert (error.kind, error.retryable, error.status) == (K.NOT_FOUND, False, 404)
    assert error.message.startswith("HTTP 404 DeploymentNotFound: The API deployment")


async def test_an_error_event_inside_a_stream_is_raised(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    event = azure_error("The server had an error.", "server_error")
    fake = FakeAzure(key=KEY).then(Reply(events=[chunk({"content": "a"}), event]))
    provider = _provider(await serve(fake.app()), session)
    error = await _stream_failure(provider)
    assert error.kind is K.SERVER


# --------------------------------------------------------------------------- auth


async def test_a_wrong_key_is_auth_and_never_shown(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    fake = FakeAzure(key="the-right-key-3c9a")
    provider = _provider(await serve(fake.app()), session)
    error = await _failure(provider)
    assert (error.kind, error.retryable, error.status) == (K.AUTH, False, 401)
    assert error.message.startswith("HTTP 401 401: Access denied")


async def test_a_bearer_token_file_is_sent_and_a_rotation_picked_up(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """The token file (relative to base_dir) is sent as a bearer token, without an api-key; a
    rotated file (replaced, or rewritten in place) is read before the next request; a file
    missing mid-rotation leaves the last token in use."""
    (tmp_path / "token.txt").write_text(TOKEN + "\n", encoding="utf-8")
    fake = FakeAzure(token=TOKEN)
    provider = _provider(
        await serve(fake.app()), session, api_key=None, base_dir=tmp_path, token_file="token.txt"
    )
    await provider.complete(CHAT, timeout=5.0)
    assert fake.seen[-1].headers["Authorization"] == f"Bearer {TOKEN}"
    assert "api-key" not in fake.seen[-1].headers

    fake.token = NEW_TOKEN
    staged = tmp_path / "token.next"
    staged.write_text(NEW_TOKEN, encoding="utf-8")
    os.replace(staged, tmp_path / "token.txt")  # how a rotating agent swaps the file
    await _items(provider, CHAT)
    assert fake.seen[-1].headers["Authorization"] == f"Bearer {NEW_TOKEN}"

    (tmp_path / "token.txt").unlink()
    await provider.complete(CHAT, timeout=5.0)
    assert fake.seen[-1].headers["Authorization"] == f"Bearer {NEW_TOKEN}"

    fake.token = "entra-token-three-5e1a"
    (tmp_path / "token.txt").write_text(fake.token, encoding="utf-8")  # back, a new file
    await provider.complete(CHAT, timeout=5.0)
    assert fake.seen[-1].headers["Authorization"] == f"Bearer {fake.token}"

    fake.token = "entra-token-four-rewritten-in-place-7c"
    inode = (tmp_path / "token.txt").stat().st_ino
    (tmp_path / "token.txt").write_text(fake.token, encoding="utf-8")  # truncated, rewritten
    assert (tmp_path / "token.txt").stat().st_ino == inode
    await provider.complete(CHAT, timeout=5.0)
    assert fake.seen[-1].headers["Authorization"] == f"Bearer {fake.token}"
    assert fake.problems == []


async def test_an_expired_token_is_auth(
    serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (tmp_path / "token.txt").write_text(TOKEN, encoding="utf-8")
    fake = FakeAzure(token=NEW_TOKEN)
    provider = _provider(
        await serve(fake.app()), session, api_key=None, token_file=tmp_path / "token.txt"
    )
    error = await _stream_failure(provider)
    assert (error.kind, error.status) == (K.AUTH, 401)


def _echo(secret: str) -> list[Reply]:
    text = f"Access denied for {secret}; header api-key: {secret.upper()} (Bearer {secret})"
    filtered = azure_error(
        f"Filtered prompt from {secret}",
        "content_filter",
        inner={"content_filter_result": filter_results("violence")},
    )
    return [
        Reply(401, azure_error(text, "401"), {"x-request-id": secret}),
        Reply(400, filtered),
        Reply(500, text, {"Content-Type": "text/plain"}),
        Reply(events=[chunk({"content": "a"}), azure_error(text, "server_error")]),
    ]


@pytest.mark.parametrize("auth", ["api_key", "token_file"])
async def test_the_configured_secret_never_appears_in_an_error(
    auth: str, serve: Serve, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Azure error bodies (and a request id header) that echo the key or the token, in any
    case, reach no error message, streamed or not."""
    (tmp_path / "token.txt").write_text(TOKEN, encoding="utf-8")
    secret = KEY if auth == "api_key" else TOKEN
    fake = FakeAzure(key=KEY, token=TOKEN).then(*_echo(secret))
    options: dict[str, Any] = {} if auth == "api_key" else {"token_file": "token.txt"}
    provider = _provider(
        await serve(fake.app()),
        session,
        api_key=KEY if auth == "api_key" else None,
        base_dir=tmp_path,
        **options,
    )
    errors = [await _failure(provider) for _ in range(3)] + [await _stream_failure(provider)]
    assert [e.kind for e in errors] == [K.AUTH, K.CONTENT_FILTER, K.SERVER, K.SERVER]
    for error in errors:
        assert secret not in error.message
        assert secret.upper() not in error.message
        assert secret not in repr(error)
        assert "[redacted]" in error.message
    assert " ".join(fake.seen[0].headers.values()).count(secret) == 1  # it was sent


# --------------------------------------------------------------------------- configuration


async def test_build_refuses_a_bad_configuration_naming_the_key(
    session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (tmp_path / "token.txt").write_text(TOKEN, encoding="utf-8")
    (tmp_path / "empty.txt").write_text("\n", encoding="utf-8")
    base = "https://example-resource.openai.azure.com"
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"api_key": None},
            r"providers\.azure\.api_key_file: .* needs api_key_file or azure_openai\.token_file",
        ),
        (
            {"token_file": "token.txt"},
            r"providers\.azure\.azure_openai\.token_file: set either .* not both",
        ),
        ({"api_key": ""}, r"providers\.azure\.api_key_file: the file is empty"),
        (
            {"api_key": None, "token_file": "missing.txt"},
            r"providers\.azure\.azure_openai\.token_file: cannot read .*missing\.txt",
        ),
        (
            {"api_key": None, "token_file": "empty.txt"},
            r"providers\.azure\.azure_openai\.token_file: .*the file is empty",
        ),
        (
            {"base": f"{base}/openai/deployments/x"},
            r"providers\.azure\.base_url: the resource's endpoint only",
        ),
        (
            {"base": f"{base}?api-version=1"},
            r"providers\.azure\.base_url: the resource's endpoint only",
        ),
        ({"base": "example.openai.azure.com"}, r"providers\.azure\.base_url: an http\(s\) URL"),
        (
            {"model": "gpt 4o/../x"},
            r"providers\.azure\.model: 'gpt 4o/\.\./x' is not an Azure deployment",
        ),
    ]
    for case, message in cases:
        case = dict(case)
        url = case.pop("base", base)
        with pytest.raises(ConfigError, match=message):
            _provider(url, session, base_dir=tmp_path, **case)


async def test_leaving_a_stream_early_releases_it(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A caller that stops after the first chunk closes the stream; the next call works."""
    fake = FakeAzure(key=KEY)
    provider = _provider(await serve(fake.app()), session)
    async with aclosing(provider.stream(CHAT, timeout=5.0)) as stream:
        first = await anext(stream)
    assert isinstance(first, dict)
    assert first["choices"][0]["delta"]["role"] == "assistant"  # the filter chunk was skipped
    answer = await provider.complete(CHAT, timeout=5.0)
    assert answer["choices"][0]["message"]["content"] == fake.text
    assert len(fake.seen) == 2
