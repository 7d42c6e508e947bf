"""``POST /v1/messages`` streamed, as Anthropic's SDK reads it: the event sequence for text and
for a tool call, a stream cut mid-answer and rescued by a fallback (the attempts the upstream
saw, the whole text received), and an unrescuable one ending with Anthropic's ``error`` event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.gateway.harness import KEY, fake, running_gateway
from tests.gateway.upstream import openai_provider, running_upstream
from tidegate.gateway.pipeline.message_stream import MessageStream

WORDS = " ".join(f"w{i}" for i in range(1, 61))
ASK: list[Any] = [{"role": "user", "content": "tell me"}]


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for block in raw.decode().strip().split("\n\n"):
        kind, data = block.split("\n")
        found.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return found


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "c1",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def test_the_event_sequence_of_text_then_a_tool_call() -> None:
    stream = MessageStream()
    raw = stream.chunk(_chunk({"role": "assistant", "content": "Let me look."}))
    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    raw += stream.chunk(_chunk({"tool_calls": [call]}))
    raw += stream.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}))
    raw += stream.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}))
    raw += stream.chunk(_chunk({}, "tool_calls"))
    raw += stream.chunk(
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    )
    raw += stream.end(None)
    events = _events(raw)
    assert [kind for kind, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == kind for kind, data in events)
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    assert events[3][1]["delta"] == {"type": "text_delta", "text": "Let me look."}
    assert events[5][1] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "call_1", "name": "f", "input": {}},
    }
    partial = "".join(data["delta"]["partial_json"] for _, data in events[6:8])
    assert json.loads(partial) == {"a": 1}
    assert events[9][1]["delta"]["stop_reason"] == "tool_use"
    assert events[9][1]["usage"] == {"input_tokens": 9, "output_tokens": 4}


def test_a_streamed_message_through_the_sdk(tmp_path: Path) -> None:
    config = {
        "providers": {"p": fake("from the stream", model="model-a")},
        "models": {"claude-alias": {"providers": ["p"]}},
    }
    with running_gateway(tmp_path, config) as (base, _):
        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
        with client.messages.stream(model="claude-alias", max_tokens=64, messages=ASK) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        client.close()
    assert text == "from the stream"
    assert final.stop_reason == "end_turn"
    assert final.model == "model-a"
    assert final.usage.output_tokens == 3
    assert [b.type for b in final.content] == ["text"]


def _rescue_config(up: Any, *, continues: bool) -> dict[str, Any]:
    """A primary and a fallback on ``up``; ``continues``: the fallback takes a prefill (so it
    continues the answer), else it may only splice one that starts alike."""
    backup = openai_provider(up, "fallback-model")
    if continues:
        backup["accepts_prefill"] = True
    return {
        "providers": {"primary": openai_provider(up, "primary-model"), "backup": backup},
        "models": {"claude-alias": {"providers": ["primary", "backup"], "per_try_timeout_s": 30}},
        "retry": {"attempts": 1},
        "cache": {"enabled": False},
    }


@pytest.mark.slow
def test_a_stream_cut_mid_answer_is_rescued(tmp_path: Path) -> None:
    """Cut after 40 of 60 tokens; the fallback continues the same answer, and the Anthropic
    client receives all of it as one message."""
    script = {
        "models": {
            "primary-model": {"text": WORDS, "faults": [{"kind": "cut_after", "tokens": 40}]},
            "fallback-model": {"text": WORDS},
        }
    }
    with (
        running_upstream(script) as up,
        running_gateway(tmp_path, _rescue_config(up, continues=True)) as (
            base,
            _,
        ),
    ):
        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=30)
        with client.messages.stream(model="claude-alias", max_tokens=500, messages=ASK) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        client.close()
        seen = up.seen()
        prefill = up.attempts("fallback-model")[0]["messages"][-1]
    assert text == WORDS
    assert prefill == {"role": "assistant", "content": " ".join(WORDS.split()[:40])}
    assert final.stop_reason == "end_turn"
    assert [model for model, _ in seen] == ["primary-model", "fallback-model"]


@pytest.mark.slow
def test_an_unrescuable_stream_ends_with_an_error_event(tmp_path: Path) -> None:
    script = {
        "models": {
            "primary-model": {"text": WORDS, "faults": [{"kind": "cut_after", "tokens": 40}]},
            "fallback-model": {"text": "a completely different answer"},
        }
    }
    received: list[str] = []
    with (
        running_upstream(script) as up,
        running_gateway(tmp_path, _rescue_config(up, continues=False)) as (
            base,
            _,
        ),
    ):
        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=30)
        with (
            pytest.raises(anthropic.APIStatusError) as ended,
            client.messages.stream(model="claude-alias", max_tokens=500, messages=ASK) as stream,
        ):
            received.extend(stream.text_stream)
        client.close()
    assert "".join(received) == " ".join(WORDS.split()[:40])
    assert "incomplete" in str(ended.value)


def test_a_streamed_tool_use_through_the_sdk(tmp_path: Path) -> None:
    """The fake streams its call's arguments in pieces; the SDK assembles Anthropic's tool_use
    block from the input_json_delta events, and a model scripted not to call answers in text."""
    tool: Any = {
        "name": "get_weather",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
    config = {
        "providers": {
            "p": fake("from the stream", model="model-a"),
            "q": fake("plain text", model="model-q", call_tools=False),
        },
        "models": {"claude-alias": {"providers": ["p"]}, "texter": {"providers": ["q"]}},
    }
    with running_gateway(tmp_path, config) as (base, _):
        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
        with client.messages.stream(
            model="claude-alias", max_tokens=64, messages=ASK, tools=[tool]
        ) as stream:
            final = stream.get_final_message()
        with client.messages.stream(
            model="texter", max_tokens=64, messages=ASK, tools=[tool]
        ) as stream:
            texted = stream.get_final_message()
        client.close()
    assert final.stop_reason == "tool_use"
    use = final.content[-1]
    assert use.type == "tool_use"
    assert (use.name, use.input) == ("get_weather", {"city": "from the stream"})
    assert texted.stop_reason == "end_turn"
    assert texted.content[0].type == "text"
