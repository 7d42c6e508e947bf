"""End to end: a real gateway on loopback, driven by the official openai SDK."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam

from tests.gateway.harness import KEY, fake, running_gateway


def _client(base: str, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, **kwargs)  # type: ignore[arg-type]


BASIC = {
    "providers": {
        "primary": fake("from primary", model="model-a"),
        "backup": fake("from backup", model="model-b"),
    },
    "models": {"chat": {"providers": ["primary", "backup"]}},
}


def test_non_streaming_answer(tmp_path: Path) -> None:
    """A plain completion comes back as the SDK's ChatCompletion, naming the serving model."""
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        raw = client.chat.completions.with_raw_response.create(
            model="chat", messages=[{"role": "user", "content": "hi"}]
        )
        reply = raw.parse()
        client.close()
    assert reply.choices[0].message.content == "from primary"
    assert reply.model == "model-a"
    assert raw.headers["x-tidegate-served-by"] == "primary"
    assert raw.headers["x-tidegate-tried"] == "primary=ok"
    assert raw.headers["x-request-id"]
    assert reply.usage is not None
    assert reply.usage.total_tokens > 0


def test_streaming_answer_with_usage(tmp_path: Path) -> None:
    """A stream arrives chunk by chunk, ends normally, and carries usage when asked."""
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        stream = client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        client.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == ["from", "primary"]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2
    assert any(c.choices and c.choices[0].finish_reason == "stop" for c in chunks)


def test_failover_to_the_approved_fallback(tmp_path: Path) -> None:
    """A primary answering 503 every time is retried, then the fallback serves and says so."""
    config = {
        "providers": {
            "primary": fake(model="model-a", faults=[{"kind": "http", "status": 503}]),
            "backup": fake("from backup", model="model-b"),
        },
        "models": {"chat": {"providers": ["primary", "backup"]}},
        "retry": {"attempts": 2, "base_s": 0.01, "cap_s": 0.02},
    }
    with running_gateway(tmp_path, config) as (base, _):
        client = _client(base)
        raw = client.chat.completions.with_raw_response.create(
            model="chat", messages=[{"role": "user", "content": "hi"}]
        )
        client.close()
    reply = raw.parse()
    assert reply.choices[0].message.content == "from backup"
    assert reply.model == "model-b"
    assert raw.headers["x-tidegate-served-by"] == "backup"
    assert raw.headers["x-tidegate-tried"] == "primary=overloaded, primary=overloaded, backup=ok"


def test_rate_limit_is_the_sdks_rate_limit_error(tmp_path: Path) -> None:
    """Past the per-user burst the SDK raises RateLimitError with Retry-After and RateLimit headers."""
    config = {**BASIC, "rate_limits": {"per_user": {"rate_per_s": 0.01, "burst": 2}}}
    with running_gateway(tmp_path, config) as (base, _):
        client = _client(base)
        for _ in range(2):
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "x"}]
            )
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "x"}]
            )
        client.close()
    response = caught.value.response
    assert response.status_code == 429
    assert int(response.headers["retry-after"]) >= 1
    assert "RateLimit-Policy".lower() in response.headers
    assert caught.value.body == {  # the SDK hands over the "error" object
        "type": "rate_limit_error",
        "code": "rate_limited",
        "message": caught.value.body["message"],  # type: ignore[index]
        "retryable": True,
    }


def test_kill_switch_is_an_honest_503(tmp_path: Path) -> None:
    """With answer.mode=unavailable the SDK gets a 503 InternalServerError with Retry-After."""
    import asyncio

    with running_gateway(tmp_path, BASIC) as (base, app):
        assert app.runtime is not None
        rt = app.runtime
        asyncio.run(rt.stores.flags.set("answer.mode", "unavailable", who="test", why="drill"))
        rt.flags.set("answer.mode", "unavailable", who="test", why="drill")
        client = _client(base)
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "x"}]
            )
        client.close()
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "30"
    assert caught.value.body["code"] == "unavailable"  # type: ignore[index]


def test_unknown_model_and_bad_key(tmp_path: Path) -> None:
    """An unknown alias is NotFoundError (404); a wrong key is AuthenticationError (401)."""
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]
            )
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x"}])
        models = client.models.list()
        client.close()
        bad.close()
    assert [m.id for m in models.data] == ["chat"]


def test_one_model_and_the_legacy_completions_pointer(tmp_path: Path) -> None:
    """``models.retrieve`` gives an alias as the SDK's ``Model``; an unknown alias is the SDK's
    NotFoundError, and so is the legacy completions API, whose message names the chat one."""
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        model = client.models.retrieve("chat")
        with pytest.raises(openai.NotFoundError) as unknown:
            client.models.retrieve("nope")
        with pytest.raises(openai.NotFoundError) as legacy:
            client.completions.create(model="chat", prompt="hi")
        client.close()
    assert (model.id, model.object, model.owned_by) == ("chat", "model", "tidegate")
    assert unknown.value.code == "model_not_found"
    assert legacy.value.code == "not_found"
    assert "/v1/chat/completions" in legacy.value.message


class Weather(pydantic.BaseModel):
    city: str
    celsius: int
    tags: list[str]


WEATHER_TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city", "days"],
        },
    },
}


def test_a_tool_round_trip(tmp_path: Path) -> None:
    """Tools reach the provider: the model calls the tool, the caller sends the tool's result,
    and the model answers in text."""
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
        first = client.chat.completions.create(
            model="chat", messages=messages, tools=[WEATHER_TOOL]
        )
        call = first.choices[0].message.tool_calls
        assert call is not None
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call[0].id, "content": '{"celsius": 4}'},
        ]
        second = client.chat.completions.create(
            model="chat", messages=messages, tools=[WEATHER_TOOL]
        )
        client.close()
    assert first.choices[0].finish_reason == "tool_calls"
    function = call[0].function  # type: ignore[union-attr]
    assert function.name == "get_weather"
    assert json.loads(function.arguments) == {"city": "from primary", "days": 1}
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "from primary"


def test_structured_output_and_n(tmp_path: Path) -> None:
    """``response_format`` json_schema through the SDK's ``.parse()``, json_object, and ``n=2``
    answered with two choices."""
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        parsed = client.chat.completions.parse(
            model="chat", messages=[{"role": "user", "content": "hi"}], response_format=Weather
        )
        as_json = client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_object"},
        )
        two = client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], n=2
        )
        client.close()
    assert parsed.choices[0].message.parsed == Weather(
        city="from primary", celsius=0, tags=["from primary"]
    )
    assert json.loads(as_json.choices[0].message.content or "") == {"answer": "from primary"}
    assert [c.index for c in two.choices] == [0, 1]
    assert {c.message.content for c in two.choices} == {"from primary"}
    assert two.usage is not None
    assert two.usage.completion_tokens == 4  # two choices of two tokens


def test_langchain_chat_openai_with_bound_tools(tmp_path: Path) -> None:
    """LangChain's ``ChatOpenAI`` pointed at the gateway: a tool bound with ``bind_tools`` comes
    back as LangChain's tool call, and a plain invoke as text."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "4 C"

    with running_gateway(tmp_path, BASIC) as (base, _):
        model = ChatOpenAI(model="chat", base_url=f"{base}/v1", api_key=KEY, max_retries=0)  # type: ignore[arg-type]
        called = model.bind_tools([get_weather]).invoke("Weather in Oslo?")
        plain = model.invoke("hi")
    assert [(c["name"], c["args"]) for c in called.tool_calls] == [
        ("get_weather", {"city": "from primary"})
    ]
    assert plain.content == "from primary"


def test_a_streamed_tool_call(tmp_path: Path) -> None:
    """A tool call streamed in pieces reaches the SDK as tool_calls deltas that add up to the
    whole call, ending with finish_reason tool_calls."""
    with running_gateway(tmp_path, BASIC) as (base, _):
        client = _client(base)
        chunks = list(
            client.chat.completions.create(
                model="chat",
                messages=[{"role": "user", "content": "Weather in Oslo?"}],
                tools=[WEATHER_TOOL],
                stream=True,
            )
        )
        client.close()
    calls = [
        call
        for chunk in chunks
        if chunk.choices
        for call in chunk.choices[0].delta.tool_calls or ()
    ]
    assert calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    arguments = "".join((c.function.arguments or "") for c in calls if c.function)
    assert json.loads(arguments) == {"city": "from primary", "days": 1}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
