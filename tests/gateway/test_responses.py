"""``POST /v1/responses`` driven by the openai SDK on a real socket: text, a function-call
round-trip, ``text.format`` json_schema through ``.parse()``, streaming with the Responses
events, failover and a mid-stream rescue, and the refusal of ``previous_response_id``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pydantic
import pytest

from tests.gateway.harness import KEY, fake, running_gateway
from tests.gateway.test_sdk import BASIC
from tests.gateway.upstream import openai_provider, running_upstream

TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
WORDS = " ".join(f"w{i}" for i in range(1, 61))


class Answer(pydantic.BaseModel):
    city: str
    days: int


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30)


def test_text_tools_and_structured_output(tmp_path: Path) -> None:
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        plain = client.responses.create(model="chat", input="hi", instructions="Be brief.")
        first = client.responses.create(model="chat", input="Weather in Oslo?", tools=[TOOL])
        call = next(item for item in first.output if item.type == "function_call")
        second = client.responses.create(
            model="chat",
            tools=[TOOL],
            input=[
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "type": "function_call",
                    "call_id": call.call_id,
                    "name": call.name,
                    "arguments": call.arguments,
                },
                {"type": "function_call_output", "call_id": call.call_id, "output": "4 C"},
            ],
        )
        parsed = client.responses.parse(model="chat", input="hi", text_format=Answer)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="chat", input="hi", previous_response_id="resp_1")
        client.close()
    assert plain.output_text == "from primary"
    assert plain.status == "completed"
    assert plain.model == "model-a"
    assert plain.usage is not None
    assert plain.usage.output_tokens == 2
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "from primary"})
    assert second.output_text == "from primary"
    assert parsed.output_parsed == Answer(city="from primary", days=0)
    assert "previous_response_id" in refused.value.message


def test_a_stream_and_failover(tmp_path: Path) -> None:
    config = {
        "providers": {
            "primary": fake(model="model-a", faults=[{"kind": "http", "status": 500}]),
            "backup": fake("from backup", model="model-b"),
        },
        "models": {"chat": {"providers": ["primary", "backup"]}},
        "retry": {"attempts": 1},
    }
    with running_gateway(tmp_path, config) as (base, _):
        client = _client(base)
        events = list(client.responses.create(model="chat", input="hi", stream=True))
        client.close()
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "from backup"
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == "from backup"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))


@pytest.mark.slow
def test_a_stream_cut_mid_answer_is_rescued(tmp_path: Path) -> None:
    script = {
        "models": {
            "primary-model": {"text": WORDS, "faults": [{"kind": "cut_after", "tokens": 40}]},
            "fallback-model": {"text": WORDS},
        }
    }
    with running_upstream(script) as up:
        backup = {**openai_provider(up, "fallback-model"), "accepts_prefill": True}
        config = {
            "providers": {"primary": openai_provider(up, "primary-model"), "backup": backup},
            "models": {"chat": {"providers": ["primary", "backup"], "per_try_timeout_s": 30}},
            "retry": {"attempts": 1},
            "cache": {"enabled": False},
        }
        with running_gateway(tmp_path, config) as (base, _):
            client = _client(base)
            with client.responses.stream(model="chat", input="tell me") as stream:
                final = stream.get_final_response()
            client.close()
        seen = [model for model, _ in up.seen()]
    assert final.output_text == WORDS
    assert seen == ["primary-model", "fallback-model"]


def test_a_streamed_function_call(tmp_path: Path) -> None:
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        with client.responses.stream(model="chat", input="Weather?", tools=[TOOL]) as stream:
            final = stream.get_final_response()
        client.close()
    call = next(item for item in final.output if item.type == "function_call")
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "from primary"})


def test_streamed_function_call_events(tmp_path: Path) -> None:
    """A streamed call is an output item added at once, its arguments in
    response.function_call_arguments.delta events that add up to the .done ones."""
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        events = list(
            client.responses.create(model="chat", input="Weather?", tools=[TOOL], stream=True)
        )
        client.close()
    kinds = [e.type for e in events]
    added = kinds.index("response.output_item.added")
    assert kinds[added + 1] == "response.function_call_arguments.delta"
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments
    assert json.loads(pieces) == {"city": "from primary"}
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
