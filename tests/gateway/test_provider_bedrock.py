"""A provider of type ``bedrock`` behind the gateway: the fake of bedrock-runtime on loopback
(tests/providers/bedrock_fake.py: SigV4 checked again, bodies validated by botocore), and what a
caller receives on ``/v1/chat/completions`` (JSON and stream) and on ``/v1/messages``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake, write_config
from tests.providers.bedrock_fake import (
    ACCESS_KEY,
    MODEL,
    REGION,
    SECRET_KEY,
    SESSION_TOKEN,
    FakeBedrock,
    Reply,
    aws_env,
    converse_answer,
    error_reply,
    text_stream,
)
from tests.providers.helpers import gateway_config
from tidegate.errors import ConfigError
from tidegate.gateway.config import load_config

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "Why are there tides?"}]}
MESSAGES = {"model": "chat", "max_tokens": 64, "messages": CHAT["messages"]}
BLOCKED = "Sorry, the model cannot answer this question."


@pytest.fixture(autouse=True)
def _aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    aws_env(monkeypatch, tmp_path)


@asynccontextmanager
async def _fake(*replies: Reply) -> AsyncIterator[tuple[str, FakeBedrock]]:
    bedrock = FakeBedrock(replies)
    runner = web.AppRunner(bedrock.app(), shutdown_timeout=0.5, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", bedrock
    finally:
        await runner.cleanup()


def _config(url: str, *, backup: bool = False, attempts: int = 1, **bedrock: Any) -> dict[str, Any]:
    providers: dict[str, Any] = {
        "rock": {
            "type": "bedrock",
            "model": MODEL,
            "base_url": url,
            "bedrock": {"region": REGION, **bedrock},
        }
    }
    if backup:
        providers["backup"] = fake("from the backup", model="backup-1")
    return gateway_config(providers, retry={"attempts": attempts, "base_s": 0.001, "cap_s": 0.002})


def _sse(text: str) -> list[dict[str, Any]]:
    """The JSON data events of an OpenAI stream, up to ``[DONE]`` (which must be there)."""
    data = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [orjson.loads(item) for item in data[:-1]]


def _one_clean_call(bedrock: FakeBedrock, operation: str) -> None:
    """The fake saw one call, of ``operation``, signed right and with a valid body."""
    [seen] = bedrock.seen
    assert (seen.operation, seen.signature_problem, seen.validation_problems) == (
        operation,
        "",
        "",
    )


@pytest.mark.asyncio
async def test_an_answer_as_json(gateway_client: AppFactory) -> None:
    async with (
        _fake(Reply(json=converse_answer())) as (url, bedrock),
        gateway_client(_config(url)) as (client, _),
    ):
        answer = await client.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["choices"][0]["message"]["content"] == "Hello from Bedrock"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == 11
    assert answer.headers["x-tidegate-served-by"] == "rock"
    _one_clean_call(bedrock, "Converse")


@pytest.mark.asyncio
async def test_an_answer_as_a_stream(gateway_client: AppFactory) -> None:
    async with (
        _fake(Reply(frames=text_stream("High ", "tide"))) as (url, bedrock),
        gateway_client(_config(url)) as (client, _),
    ):
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert streamed.status_code == 200, streamed.text
    choices = [c["choices"][0] for c in _sse(streamed.text) if c.get("choices")]
    assert "".join(choice["delta"].get("content") or "" for choice in choices) == "High tide"
    assert choices[-1]["finish_reason"] == "stop"
    _one_clean_call(bedrock, "ConverseStream")


@pytest.mark.asyncio
async def test_an_answer_on_the_messages_endpoint(gateway_client: AppFactory) -> None:
    async with (
        _fake(Reply(json=converse_answer()), Reply(frames=text_stream("Moon ", "pull"))) as (
            url,
            bedrock,
        ),
        gateway_client(_config(url)) as (client, _),
    ):
        answer = await client.post("/v1/messages", json={**MESSAGES, "system": "Be brief."})
        streamed = await client.post("/v1/messages", json={**MESSAGES, "stream": True})
    assert answer.status_code == 200, answer.text
    message = answer.json()
    assert message["type"] == "message"
    assert message["content"] == [{"type": "text", "text": "Hello from Bedrock"}]
    assert message["stop_reason"] == "end_turn"
    assert bedrock.seen[0].body["system"] == [{"text": "Be brief."}]
    assert streamed.status_code == 200, streamed.text
    events = [
        orjson.loads(line[len("data: ") :])
        for line in streamed.text.splitlines()
        if line.startswith("data: ")
    ]
    deltas = [e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"]
    assert "".join(deltas) == "Moon pull"
    assert events[-1]["type"] == "message_stop"
    assert [s.validation_problems for s in bedrock.seen] == ["", ""]


@pytest.mark.asyncio
async def test_throttling_is_retried(gateway_client: AppFactory) -> None:
    throttled = error_reply(429, "ThrottlingException", "Too many requests, please wait.")
    async with (
        _fake(throttled, Reply(json=converse_answer("after a retry"))) as (url, bedrock),
        gateway_client(_config(url, attempts=2)) as (client, _),
    ):
        answer = await client.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "after a retry"
    assert len(bedrock.seen) == 2
    assert "rate_limited" in answer.headers["x-tidegate-tried"]


@pytest.mark.asyncio
async def test_throttling_fails_over_and_a_lone_provider_is_a_429(
    gateway_client: AppFactory,
) -> None:
    throttled = error_reply(
        429,
        "ThrottlingException",
        f"slow down {SECRET_KEY} {SESSION_TOKEN}",
        headers={"Retry-After": "7"},
    )
    async with _fake(throttled) as (url, _):
        async with gateway_client(_config(url, backup=True)) as (client, _):
            served = await client.post("/v1/chat/completions", json=CHAT)
            messages = await client.post("/v1/messages", json=MESSAGES)
        async with gateway_client(_config(url)) as (client, _):
            refused = await client.post("/v1/chat/completions", json=CHAT)
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["message"]["content"] == "from the backup"
    assert served.headers["x-tidegate-tried"] == "rock=rate_limited, backup=ok"
    assert messages.json()["content"][0]["text"] == "from the backup"
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "provider_rate_limited"
    assert refused.headers["retry-after"] == "7"  # Bedrock's hint, passed on to the caller
    for response in (served, messages, refused):
        assert SECRET_KEY not in response.text
        assert SESSION_TOKEN not in response.text
        assert ACCESS_KEY not in response.text


@pytest.mark.asyncio
async def test_a_content_filter_refusal(gateway_client: AppFactory) -> None:
    refusal = Reply(json=converse_answer(BLOCKED, stop="guardrail_intervened"))
    async with (
        _fake(
            refusal, refusal, Reply(frames=text_stream(BLOCKED, stop="guardrail_intervened"))
        ) as (url, bedrock),
        gateway_client(_config(url, guardrail_identifier="gr-1", guardrail_version="DRAFT")) as (
            client,
            _,
        ),
    ):
        chat = await client.post("/v1/chat/completions", json=CHAT)
        message = await client.post("/v1/messages", json=MESSAGES)
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] == "content_filter"
    assert chat.json()["choices"][0]["message"]["content"] == BLOCKED
    assert message.status_code == 200, message.text
    assert message.json()["stop_reason"] == "refusal"
    finishes = [c["choices"][0]["finish_reason"] for c in _sse(streamed.text) if c.get("choices")]
    assert finishes[-1] == "content_filter"
    assert {orjson.dumps(s.body["guardrailConfig"]) for s in bedrock.seen} == {
        b'{"guardrailIdentifier":"gr-1","guardrailVersion":"DRAFT"}'
    }


@pytest.mark.asyncio
async def test_credentials_from_a_file_next_to_the_config(
    gateway_client: AppFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    (tmp_path / "aws-credentials").write_text(
        "[bedrock]\n"
        f"aws_access_key_id = {ACCESS_KEY}\n"
        f"aws_secret_access_key = {SECRET_KEY}\n"
        f"aws_session_token = {SESSION_TOKEN}\n",
        encoding="utf-8",
    )
    config = _config(url="", profile="bedrock", credentials_file="aws-credentials")
    async with _fake(Reply(json=converse_answer())) as (url, bedrock):
        config["providers"]["rock"]["base_url"] = url
        async with gateway_client(config) as (client, _):
            answer = await client.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200, answer.text
    assert bedrock.seen[0].signature_problem == ""


def test_an_unknown_key_in_the_bedrock_section_refuses_to_start(tmp_path: Path) -> None:
    config = _config("http://127.0.0.1:9", regoin="eu-west-1")
    path = write_config(tmp_path, config)
    with pytest.raises(ConfigError, match=r"unknown key 'providers\.rock\.bedrock\.regoin'"):
        load_config(path, env={})


def test_the_bedrock_section_is_only_for_its_type(tmp_path: Path) -> None:
    config = _config("http://127.0.0.1:9")
    config["providers"]["rock"]["type"] = "openai"
    with pytest.raises(ConfigError, match="bedrock"):
        load_config(write_config(tmp_path, config), env={})


def test_the_guardrail_needs_both_its_fields(tmp_path: Path) -> None:
    config = _config("http://127.0.0.1:9", guardrail_identifier="gr-1")
    with pytest.raises(ConfigError, match="guardrail"):
        load_config(write_config(tmp_path, config), env={})
