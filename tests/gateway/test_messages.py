"""``POST /v1/messages`` driven by Anthropic's own SDK on a real socket (only the base URL and
the key changed), over OpenAI-shaped fake providers: text, a system prompt and turns, a tool
round-trip, failover, Anthropic's error types (a 429 and a 529 as the SDK's own errors), and
``count_tokens``; and in-process, what the provider is sent for each block."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import anthropic
import httpx
import pytest
from anthropic.types import ToolParam

from tests.gateway.harness import KEY, fake, in_process_gateway, running_gateway
from tests.gateway.test_sdk import BASIC as SDK_BASIC
from tests.providers.helpers import weather_turns

#: test_sdk's two fakes, under a Claude-looking alias.
BASIC = {**SDK_BASIC, "models": {"claude-alias": SDK_BASIC["models"]["chat"]}}
WEATHER: ToolParam = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def _completion(body: Any, number: int) -> Any:
    """A provider's answer: cut at max_tokens, with its usage."""
    return {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }


def _client(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)


def test_a_message_with_a_system_prompt_and_turns(tmp_path: Path) -> None:
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        raw = client.messages.with_raw_response.create(
            model="claude-alias",
            max_tokens=64,
            system="Be brief.",
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
            ],
        )
        message = raw.parse()
        counted = client.messages.count_tokens(
            model="claude-alias", messages=[{"role": "user", "content": "x" * 40}]
        )
        client.close()
    assert message.type == "message"
    assert message.role == "assistant"
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [
        ("text", "from primary")
    ]
    assert message.stop_reason == "end_turn"
    assert message.model == "model-a"
    assert message.usage.output_tokens == 2
    assert message.usage.input_tokens > 0
    assert raw.headers["x-tidegate-served-by"] == "primary"
    assert counted.input_tokens == 10


def test_a_tool_round_trip(tmp_path: Path) -> None:
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        question: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
        first = client.messages.create(
            model="claude-alias", max_tokens=64, messages=question, tools=[WEATHER]
        )
        use = next(b for b in first.content if b.type == "tool_use")
        second = client.messages.create(
            model="claude-alias",
            max_tokens=64,
            tools=[WEATHER],
            messages=[
                *question,
                {
                    "role": "assistant",
                    "content": cast(Any, [b.model_dump() for b in first.content]),
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "4 C"}],
                },
            ],
        )
        client.close()
    assert first.stop_reason == "tool_use"
    assert (use.name, use.input) == ("get_weather", {"city": "from primary"})
    assert second.stop_reason == "end_turn"
    assert second.content[0].type == "text"


def test_failover_and_anthropic_errors(tmp_path: Path) -> None:
    """A failing primary fails over; a spent rate limit is the SDK's RateLimitError (429) and
    every provider overloaded its OverloadedError (529)."""
    config = {
        "providers": {
            "primary": fake(model="model-a", faults=[{"kind": "http", "status": 500}]),
            "backup": fake("from backup", model="model-b"),
            "busy": fake(model="model-c", faults=[{"kind": "http", "status": 503}]),
        },
        "models": {
            "claude-alias": {"providers": ["primary", "backup"]},
            "busy": {"providers": ["busy"]},
        },
        "retry": {"attempts": 1},
        "rate_limits": {"per_user": {"rate_per_s": 0.001, "burst": 2}},
    }
    ask: dict[str, Any] = {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    with running_gateway(tmp_path, config) as (base, _):
        client = _client(base)
        served = client.messages.with_raw_response.create(model="claude-alias", **ask)
        with pytest.raises(anthropic.OverloadedError) as overloaded:
            client.messages.create(model="busy", **ask)
        with pytest.raises(anthropic.RateLimitError) as limited:
            client.messages.create(model="claude-alias", **ask)
        client.close()
    assert served.parse().content[0].text == "from backup"
    assert served.headers["x-tidegate-tried"] == "primary=server, backup=ok"
    assert overloaded.value.status_code == 529
    assert overloaded.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": overloaded.value.body["error"]["message"]},  # type: ignore[index]
    }
    assert limited.value.response.headers["retry-after"]


@pytest.mark.asyncio
async def test_what_the_provider_is_sent(tmp_path: Path) -> None:
    """Blocks become the chat shapes any provider takes: the system prompt, an image as a data
    URL, tool calls and their results, stop sequences; Bearer works as well as x-api-key."""
    seen: list[Any] = []

    def upstream(body: Any, number: int) -> Any:
        seen.append(body)
        return _completion(body, number)

    config = {"providers": {"p": fake()}, "models": {"claude-alias": {"providers": ["p"]}}}
    body = {
        "model": "claude-alias",
        "max_tokens": 32,
        "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"],
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "t1",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "4 C"}],
            },
        ],
    }
    async with in_process_gateway(tmp_path, config, {"p": upstream}) as (client, _):
        by_key = await client.post(
            "/v1/messages", json=body, headers={"Authorization": "", "x-api-key": KEY}
        )
        by_bearer = await client.post("/v1/messages", json=body)
        no_key = await client.post("/v1/messages", json=body, headers={"Authorization": ""})
        streamed = await client.post("/v1/messages", json={**body, "stream": True})
    assert by_key.status_code == by_bearer.status_code == 200
    assert by_key.json()["stop_reason"] == "max_tokens"
    assert by_key.json()["usage"] == {"input_tokens": 5, "output_tokens": 1}
    assert no_key.status_code == 401
    assert no_key.json()["error"]["type"] == "authentication_error"
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.startswith("event: message_start\n")
    assert streamed.text.endswith('event: message_stop\ndata: {"type":"message_stop"}\n\n')
    sent = seen[0]
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
            ],
        },
        *weather_turns(),
    ]
    assert sent["stop"] == ["END"]
    assert sent["max_tokens"] == 32
    assert sent["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.asyncio
async def test_an_idempotency_key_is_not_shared_across_apis(tmp_path: Path) -> None:
    """The same key and request on chat then on messages is another request (422), never the
    chat answer replayed to an Anthropic client."""
    config = {"providers": {"p": fake()}, "models": {"claude-alias": {"providers": ["p"]}}}
    turn = [{"role": "user", "content": "hi"}]
    key = {"Idempotency-Key": "k-1"}
    async with in_process_gateway(tmp_path, config, {"p": _completion}) as (client, _):
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "claude-alias", "max_tokens": 8, "messages": turn},
            headers=key,
        )
        messages = await client.post(
            "/v1/messages",
            json={"model": "claude-alias", "max_tokens": 8, "messages": turn},
            headers=key,
        )
    assert chat.status_code == 200
    assert messages.status_code == 422
    assert messages.json()["type"] == "error"


def test_unsupported_fields_are_refused_by_name(tmp_path: Path) -> None:
    """Anthropic's 400s, naming the field: a block type not translated, a missing max_tokens."""
    with running_gateway(tmp_path, BASIC) as (base, _):
        missing = httpx.post(
            f"{base}/v1/messages",
            json={"model": "claude-alias", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": KEY},
            trust_env=False,
        )
        reply = httpx.post(
            f"{base}/v1/messages",
            json={
                "model": "claude-alias",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            },
            headers={"x-api-key": KEY},
            trust_env=False,
        )
    assert missing.status_code == 400
    assert missing.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    assert reply.status_code == 400
    assert reply.json()["error"] == {
        "type": "invalid_request_error",
        "message": "messages.0.content.0: 'document' blocks are not supported",
    }
