"""The gateway in front of a provider of ``type: azure_openai``: the fake of Azure's wire
protocol (tests/providers/azure_fake.py) on a loopback socket, the gateway in-process with the
provider built from the config as in production (its key from ``api_key_file``). What the caller
receives on ``/v1/chat/completions`` (JSON and stream) and ``/v1/messages`` for an answer, a rate
limit (the retry hint honoured, failover, the final 429) and a content-filter refusal; and the
configuration refusals."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml
from aiohttp import web

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake
from tests.providers.azure_fake import FakeAzure, Reply, azure_error, chunk, filter_results
from tests.providers.helpers import gateway_config
from tidegate.clock import SystemClock
from tidegate.errors import ConfigError
from tidegate.gateway.build import build_provider
from tidegate.gateway.config import load_config

CLOCK = SystemClock()
SECRET = "azure-gateway-key-4e8b2d"
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "When is high tide?"}]}
MESSAGE = {"model": "chat", "max_tokens": 64, "messages": CHAT["messages"]}
TEXT = "The tide turns twice a day."
FILTERED_PROMPT = Reply(
    400,
    azure_error(
        "The response was filtered due to the prompt triggering Azure OpenAI's content"
        " management policy.",
        "content_filter",
        param="prompt",
        inner={
            "code": "ResponsibleAIPolicyViolation",
            "content_filter_result": filter_results("violence"),
        },
    ),
)
FILTER_MESSAGE = (
    "HTTP 400 content_filter (violence): The response was filtered due to the prompt"
    " triggering Azure OpenAI's content management policy."
)


def _rate_limited(ms: int) -> Reply:
    body = azure_error("Requests have exceeded the token rate limit of your tier.", "429")
    return Reply(429, body, {"retry-after": str(max(1, ms // 1000)), "retry-after-ms": str(ms)})


@asynccontextmanager
async def _azure(*replies: Reply) -> AsyncIterator[tuple[FakeAzure, str]]:
    """The fake on 127.0.0.1 (an ephemeral port), with ``replies`` queued."""
    azure = FakeAzure(key=SECRET).then(*replies)
    runner = web.AppRunner(azure.app(), shutdown_timeout=0.5, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield azure, f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def _config(tmp_path: Path, base: str, *, backup: bool = False, **extra: Any) -> dict[str, Any]:
    (tmp_path / "azure-key.txt").write_text(SECRET + "\n", encoding="utf-8")
    providers: dict[str, Any] = {
        "azure": {
            "type": "azure_openai",
            "model": "chat-deploy",  # the deployment, by default
            "base_url": base,
            "api_key_file": "azure-key.txt",
            "azure_openai": {"api_version": "2024-10-21"},
        }
    }
    if backup:
        providers["backup"] = fake("from the backup", model="backup-1")
    return gateway_config(providers, **extra)


@asynccontextmanager
async def _gateway(
    gateway_client: AppFactory, tmp_path: Path, *replies: Reply, **options: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeAzure]]:
    async with (
        _azure(*replies) as (azure, base),
        gateway_client(_config(tmp_path, base, **options)) as (client, _),
    ):
        yield client, azure
    assert azure.problems == [], "a request body did not fit the SDK's types"


def _chat_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def _message_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n", 1)
        found.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return found


# --------------------------------------------------------------------------- answers


@pytest.mark.asyncio
async def test_an_answer_on_chat_completions_json_and_stream(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    async with _gateway(gateway_client, tmp_path) as (client, azure):
        whole = await client.post("/v1/chat/completions", json=CHAT)
        streamed = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        )
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert answer["choices"][0]["message"]["content"] == TEXT
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["total_tokens"] == 16
    assert whole.headers["x-tidegate-served-by"] == "azure"
    assert whole.headers["x-tidegate-tried"] == "azure=ok"
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = _chat_events(streamed.text)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == TEXT
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert not any("prompt_filter_results" in c for c in chunks)
    assert chunks[-1]["usage"]["total_tokens"] == 16
    assert [seen.path for seen in azure.seen] == [
        "/openai/deployments/chat-deploy/chat/completions"
    ] * 2
    assert [seen.body["stream"] for seen in azure.seen] == [False, True]
    assert all(seen.headers["api-key"] == SECRET for seen in azure.seen)
    assert all(seen.body["model"] == "chat-deploy" for seen in azure.seen)


@pytest.mark.asyncio
async def test_an_answer_on_messages_json_and_stream(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    async with _gateway(gateway_client, tmp_path) as (client, azure):
        whole = await client.post("/v1/messages", json=MESSAGE)
        streamed = await client.post("/v1/messages", json={**MESSAGE, "stream": True})
    assert whole.status_code == 200, whole.text
    message = whole.json()
    assert message["type"] == "message"
    assert message["content"] == [{"type": "text", "text": TEXT}]
    assert message["stop_reason"] == "end_turn"
    assert message["usage"]["output_tokens"] == 7
    events = _message_events(streamed.text)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    deltas = [data["delta"]["text"] for kind, data in events if kind == "content_block_delta"]
    assert "".join(deltas) == TEXT
    (stop,) = [data for kind, data in events if kind == "message_delta"]
    assert stop["delta"]["stop_reason"] == "end_turn"
    assert len(azure.seen) == 2


# --------------------------------------------------------------------------- rate limits


@pytest.mark.asyncio
async def test_a_rate_limit_is_retried_after_the_hint(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """A 429 with ``retry-after-ms`` is retried on the same deployment, no sooner than the hint
    (the backoff alone would wait at most a millisecond), and the caller gets the answer."""
    retry = {"attempts": 2, "base_s": 0.001, "cap_s": 0.001}
    async with _gateway(gateway_client, tmp_path, _rate_limited(60), retry=retry) as (
        client,
        azure,
    ):
        reply = await client.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == TEXT
    assert reply.headers["x-tidegate-tried"] == "azure=rate_limited, azure=ok"
    first, second = azure.seen
    assert second.at - first.at >= 0.06


@pytest.mark.asyncio
async def test_a_rate_limit_fails_over(gateway_client: AppFactory, tmp_path: Path) -> None:
    async with _gateway(
        gateway_client, tmp_path, _rate_limited(30_000), _rate_limited(30_000), backup=True
    ) as (client, _):
        started = CLOCK.now()
        chat = await client.post("/v1/chat/completions", json=CHAT)
        message = await client.post("/v1/messages", json=MESSAGE)
    assert CLOCK.now() - started < 5.0  # the 30 s hint was not waited for
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == "from the backup"
    assert chat.headers["x-tidegate-tried"] == "azure=rate_limited, backup=ok"
    assert message.status_code == 200
    assert message.json()["content"][0]["text"] == "from the backup"
    assert message.headers["x-tidegate-served-by"] == "backup"


@pytest.mark.asyncio
async def test_a_final_rate_limit_reaches_the_caller_with_its_retry_after(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    limited = [_rate_limited(7_000)] * 3
    async with _gateway(gateway_client, tmp_path, *limited) as (client, _):
        chat = await client.post("/v1/chat/completions", json=CHAT)
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        message = await client.post("/v1/messages", json=MESSAGE)
    for reply in (chat, streamed):
        assert reply.status_code == 429, reply.text
        assert reply.headers["retry-after"] == "7"
        error = reply.json()["error"]
        assert (error["code"], error["retryable"]) == ("provider_rate_limited", True)
        assert error["message"].startswith("HTTP 429 429: Requests have exceeded")
    assert message.status_code == 429
    assert message.headers["retry-after"] == "7"
    assert message.json()["type"] == "error"
    assert message.json()["error"]["type"] == "rate_limit_error"


# --------------------------------------------------------------------------- content filter


@pytest.mark.asyncio
async def test_a_refused_prompt_is_final_and_says_why(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """Azure's 400 ``content_filter`` is the caller's 400 ``provider_content_filter``, with no
    retry and no failover, on both endpoints and for a stream."""
    refusals = [FILTERED_PROMPT] * 3
    retry = {"attempts": 3, "base_s": 0.001, "cap_s": 0.001}
    async with _gateway(gateway_client, tmp_path, *refusals, backup=True, retry=retry) as (
        client,
        azure,
    ):
        chat = await client.post("/v1/chat/completions", json=CHAT)
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        message = await client.post("/v1/messages", json=MESSAGE)
    for reply in (chat, streamed):
        assert reply.status_code == 400, reply.text
        assert reply.headers["x-tidegate-tried"] == "azure=content_filter"
        assert reply.json()["error"] == {
            "type": "invalid_request_error",
            "code": "provider_content_filter",
            "message": FILTER_MESSAGE,
            "retryable": False,
        }
    assert message.status_code == 400
    assert message.json()["error"]["type"] == "invalid_request_error"
    assert message.json()["error"]["message"] == FILTER_MESSAGE
    assert len(azure.seen) == 3  # one attempt per request


@pytest.mark.asyncio
async def test_a_filtered_completion_is_an_answer_that_says_so(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """Azure's 200 whose choice ends with ``content_filter`` is an answer: ``finish_reason:
    content_filter`` on chat completions, ``stop_reason: refusal`` on messages."""
    answer = {
        "id": "chatcmpl-f",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4o-2024-08-06",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Once upon"},
                "finish_reason": "content_filter",
                "content_filter_results": filter_results("violence"),
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
    }
    events = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Once"}),
        chunk({}, "content_filter"),
        "[DONE]",
    ]
    replies = [Reply(body=answer), Reply(body=answer), Reply(events=events), Reply(events=events)]
    async with _gateway(gateway_client, tmp_path, *replies) as (client, _):
        chat = await client.post("/v1/chat/completions", json=CHAT)
        message = await client.post("/v1/messages", json=MESSAGE)
        chat_stream = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        message_stream = await client.post("/v1/messages", json={**MESSAGE, "stream": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] == "content_filter"
    assert chat.json()["choices"][0]["message"]["content"] == "Once upon"
    assert message.status_code == 200, message.text
    assert message.json()["stop_reason"] == "refusal"
    finishes = [c["choices"][0]["finish_reason"] for c in _chat_events(chat_stream.text)]
    assert finishes[-1] == "content_filter"
    (stop,) = [d for k, d in _message_events(message_stream.text) if k == "message_delta"]
    assert stop["delta"]["stop_reason"] == "refusal"


# --------------------------------------------------------------------------- configuration


def _write(tmp_path: Path, section: dict[str, Any]) -> Path:
    config = _config(tmp_path, "https://example-resource.openai.azure.com")
    config["providers"]["azure"]["azure_openai"] = section
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def test_an_unknown_key_in_the_section_refuses_to_start(tmp_path: Path) -> None:
    path = _write(tmp_path, {"deployment": "chat-deploy", "api_versoin": "2024-10-21"})
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert "unknown key 'providers.azure.azure_openai.api_versoin'" in caught.value.message
    assert str(path) in caught.value.message


def test_a_bad_value_in_the_section_names_its_key(tmp_path: Path) -> None:
    path = _write(tmp_path, {"api_version": "latest"})
    with pytest.raises(ConfigError, match=r"providers\.azure\.azure_openai\.api_version: "):
        load_config(path, env={})
    path = _write(tmp_path, {"deployment": "a/b"})
    with pytest.raises(ConfigError, match=r"providers\.azure\.azure_openai\.deployment: "):
        load_config(path, env={})
    path = _write(tmp_path, {})
    assert load_config(path, env={}).providers["azure"].azure_openai is not None


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("key_file", "token_file", "refusal"),
    [
        (True, True, r"providers\.azure\.azure_openai\.token_file: set either api_key_file"),
        (False, False, r"providers\.azure\.api_key_file: an azure_openai provider needs"),
    ],
)
async def test_a_key_and_a_token_file_are_one_or_the_other(
    key_file: bool, token_file: bool, refusal: str, tmp_path: Path
) -> None:
    """Both credentials, or neither, refuse to start when the providers are built (start-up:
    the config's provider section cannot see its type's section)."""
    (tmp_path / "token.txt").write_text("entra-token", encoding="utf-8")
    path = _write(tmp_path, {"token_file": "token.txt"} if token_file else {})
    if not key_file:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
        del config["providers"]["azure"]["api_key_file"]
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
    cfg = load_config(path, env={}).providers["azure"]
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ConfigError, match=refusal):
            build_provider("azure", cfg, session=session, config_path=path, clock=CLOCK)
