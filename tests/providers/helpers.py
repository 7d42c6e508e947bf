"""Bodies and configs that the provider tests, and the gateway tests of each provider type, share."""

from __future__ import annotations

from typing import Any

#: An OpenAI function tool: the weather in a city.
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def weather_turns(call_id: str = "t1", *, content: str | None = None) -> list[dict[str, Any]]:
    """An assistant's call of ``get_weather`` for Oslo (with ``content`` beside it) and the
    tool's answer, ``4 C``, as OpenAI chat messages."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    return [
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "4 C"},
    ]


def gateway_config(
    providers: dict[str, Any], *, retry: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    """A gateway config whose one model, ``chat``, is served by ``providers`` in their order,
    with no cache (every request reaches an upstream) and one attempt unless ``retry`` says
    otherwise; ``extra`` adds top-level sections."""
    return {
        "providers": providers,
        "models": {"chat": {"providers": list(providers)}},
        "retry": {"attempts": 1} if retry is None else retry,
        "cache": {"enabled": False},
        **extra,
    }
