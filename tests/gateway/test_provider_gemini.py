"""Providers of ``type: gemini`` through the whole gateway, on real sockets: the gateway in one
thread, a fake of the Gemini API in another, the official OpenAI and Anthropic SDKs as callers.
What the caller receives on ``/v1/chat/completions`` (JSON and stream) and ``/v1/messages`` for
an answer, a rate limit (retried after the provider's retryDelay, then failed over), and a safety
refusal; and the config refusing an unknown key in the ``gemini:`` section."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.gateway.harness import KEY, running_gateway, write_config
from tests.gateway.upstream import CLOCK
from tests.providers.gemini_fake import FakeGemini, Reply, answer, error_body, serving
from tidegate.errors import ConfigError
from tidegate.gateway.config import load_config

pytestmark = pytest.mark.slow

GEMINI_KEY = "AIzaSyGatewayTestKey000000000000000000"
PRIMARY = "gemini-primary"
BACKUP = "gemini-backup"
ASK: list[Any] = [{"role": "user", "content": "hi"}]
BLOCKED = {
    "promptFeedback": {"blockReason": "PROHIBITED_CONTENT"},
    "usageMetadata": {"promptTokenCount": 3, "totalTokenCount": 3},
}


def _rate_limited(delay: str) -> Reply:
    detail = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}
    return Reply(429, error_body(429, "RESOURCE_EXHAUSTED", "Quota exceeded", detail))


@pytest.fixture
def fake() -> FakeGemini:
    return FakeGemini()


@pytest.fixture
def base_url(fake: FakeGemini) -> Iterator[str]:
    with serving(fake.app()) as url:
        yield url


def _config(tmp_path: Path, base_url: str, route: list[str]) -> dict[str, Any]:
    (tmp_path / "gemini.key").write_text(GEMINI_KEY + "\n", encoding="utf-8")
    section = {"type": "gemini", "base_url": base_url, "api_key_file": "gemini.key"}
    return {
        "providers": {
            "primary": {**section, "model": PRIMARY},
            "backup": {**section, "model": BACKUP, "approved_fallback": True},  # no eval verdict
        },
        "models": {"chat": {"providers": route, "per_try_timeout_s": 5.0}},
        "retry": {"attempts": 2, "base_s": 0.01, "cap_s": 0.02},
        "cache": {"enabled": False},  # every request reaches the fake
    }


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=10.0)


def _anthropic(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=10.0)


def test_an_answer_on_every_endpoint(tmp_path: Path, fake: FakeGemini, base_url: str) -> None:
    """A Gemini answer reaches the caller as a chat completion, as a chat stream and as an
    Anthropic message; every request the gateway sent fits the SDK's types and carried the key
    in x-goog-api-key."""
    fake.reply_with(
        Reply.json(answer()),
        Reply.stream([answer("Hello", finish=None), answer(" world")]),
        Reply.json(answer()),
    )
    with running_gateway(tmp_path, _config(tmp_path, base_url, ["primary"])) as (base, _):
        client = _openai(base)
        raw = client.chat.completions.with_raw_response.create(model="chat", messages=ASK)
        completion = raw.parse()
        stream = client.chat.completions.create(
            model="chat", messages=ASK, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        client.close()
        messages = _anthropic(base)
        message = messages.messages.create(model="chat", max_tokens=32, messages=ASK)
        messages.close()
    assert completion.choices[0].message.content == "Hello world"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.total_tokens == 9
    assert raw.headers["x-tidegate-served-by"] == "primary"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2
    assert [b.text for b in message.content if b.type == "text"] == ["Hello world"]
    assert message.stop_reason == "end_turn"
    assert [seen.problem for seen in fake.requests] == [None, None, None]
    assert [seen.path.rpartition(":")[2] for seen in fake.requests] == [
        "generateContent",
        "streamGenerateContent",
        "generateContent",
    ]
    assert {seen.headers["x-goog-api-key"] for seen in fake.requests} == {GEMINI_KEY}
    assert fake.requests[2].body["generationConfig"] == {"maxOutputTokens": 32}


def test_a_rate_limit_is_retried_after_its_delay_then_failed_over(
    tmp_path: Path, fake: FakeGemini, base_url: str
) -> None:
    """A 429 whose RetryInfo says 0.2s is retried on the same provider after that wait; a
    provider still limited is failed over to the backup, and the caller sees the answer."""
    fake.reply_for(PRIMARY, _rate_limited("0.2s"), Reply.json(answer("after the wait")))
    fake.reply_for(BACKUP, Reply.json(answer("from the backup")))
    config = _config(tmp_path, base_url, ["primary", "backup"])
    with running_gateway(tmp_path, config) as (base, _):
        client = _openai(base)
        started = CLOCK.now()
        retried = client.chat.completions.with_raw_response.create(model="chat", messages=ASK)
        waited = CLOCK.now() - started
        fake.reply_for(PRIMARY, _rate_limited("0.01s"))
        failed_over = client.chat.completions.with_raw_response.create(model="chat", messages=ASK)
        client.close()
    assert retried.parse().choices[0].message.content == "after the wait"
    assert retried.headers["x-tidegate-tried"] == "primary=rate_limited, primary=ok"
    assert waited >= 0.2
    assert failed_over.parse().choices[0].message.content == "from the backup"
    assert failed_over.headers["x-tidegate-served-by"] == "backup"
    assert failed_over.headers["x-tidegate-tried"].endswith("backup=ok")
    assert "primary=rate_limited" in failed_over.headers["x-tidegate-tried"]


def test_a_rate_limit_everywhere_reaches_the_caller_with_its_delay(
    tmp_path: Path, fake: FakeGemini, base_url: str
) -> None:
    """When every provider is limited for longer than the request can wait, the caller gets a
    429 (OpenAI's RateLimitError, Anthropic's too) with Retry-After from the retryDelay."""
    fake.reply_with(_rate_limited("600s"))  # longer than the request may last
    with running_gateway(tmp_path, _config(tmp_path, base_url, ["primary"])) as (base, _):
        client = _openai(base)
        with pytest.raises(openai.RateLimitError) as limited:
            client.chat.completions.create(model="chat", messages=ASK)
        client.close()
        messages = _anthropic(base)
        with pytest.raises(anthropic.RateLimitError) as anthropic_limited:
            messages.messages.create(model="chat", max_tokens=16, messages=ASK)
        messages.close()
    assert limited.value.response.headers["retry-after"] == "600"
    assert anthropic_limited.value.response.headers["retry-after"] == "600"
    assert GEMINI_KEY not in limited.value.response.text


def test_a_safety_refusal(tmp_path: Path, fake: FakeGemini, base_url: str) -> None:
    """A blocked prompt is the provider's content_filter: a 400 on chat (JSON and stream) and
    on /v1/messages, not retried and not failed over."""
    fake.reply_for(PRIMARY, Reply.json(BLOCKED), Reply.stream([BLOCKED]), Reply.json(BLOCKED))
    fake.reply_for(BACKUP, Reply.json(answer("should not be asked")))
    config = _config(tmp_path, base_url, ["primary", "backup"])
    with running_gateway(tmp_path, config) as (base, _):
        client = _openai(base)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="chat", messages=ASK)
        with pytest.raises(openai.BadRequestError) as refused_stream:
            list(client.chat.completions.create(model="chat", messages=ASK, stream=True))
        client.close()
        messages = _anthropic(base)
        with pytest.raises(anthropic.BadRequestError) as refused_message:
            messages.messages.create(model="chat", max_tokens=16, messages=ASK)
        messages.close()
    for error in (refused.value, refused_stream.value):
        assert error.status_code == 400
        assert isinstance(error.body, dict)
        assert error.body["code"] == "provider_content_filter"
        assert "blocked the prompt (PROHIBITED_CONTENT)" in error.body["message"]
    assert refused_message.value.status_code == 400
    assert refused_message.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": refused_message.value.body["error"]["message"],  # type: ignore[index]
        },
    }
    assert [seen.path.partition(":")[0].rpartition("/")[2] for seen in fake.requests] == [
        PRIMARY
    ] * 3


def test_an_unknown_key_in_the_gemini_section_stops_the_start(tmp_path: Path) -> None:
    """A misspelt option in ``gemini:`` (or in ``gemini.vertex:``) is refused, naming it."""
    for section, key in (
        ({"safety_setings": []}, "providers.g.gemini.safety_setings"),
        (
            {"vertex": {"service_account_file": "sa.json", "region": "x"}},
            "providers.g.gemini.vertex.region",
        ),
    ):
        path = write_config(
            tmp_path,
            {
                "providers": {
                    "g": {"type": "gemini", "model": "gemini-2.5-flash", "gemini": section}
                },
                "models": {"chat": {"providers": ["g"]}},
            },
        )
        with pytest.raises(ConfigError) as caught:
            load_config(path, env={})
        assert key in str(caught.value)
