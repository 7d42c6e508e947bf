"""What a chat request asks of the model reaches an OpenAI-compatible provider untouched: the
fields tidegate checks and every other, unknown extra fields included (only ``model`` is the
provider's model id)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gateway.harness import fake, in_process_gateway

ASKED: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    },
    "n": 2,
    "logprobs": True,
    "top_logprobs": 3,
    "seed": 7,
    "stop": ["END"],
    "user": "end-user-9",
    "temperature": 0.2,
    "max_tokens": 16,
    "x_vendor_option": {"keep": True},
}


@pytest.mark.asyncio
async def test_every_field_reaches_the_provider(tmp_path: Path) -> None:
    seen: list[Any] = []

    def upstream(body: Any, number: int) -> Any:
        seen.append(body)
        choice = {"message": {"role": "assistant", "content": "{}"}, "finish_reason": "stop"}
        return {
            "id": "c",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": i, **choice} for i in range(2)],
        }

    config = {
        "providers": {"p": fake(model="provider-model-7")},
        "models": {"chat": {"providers": ["p"]}},
    }
    async with in_process_gateway(tmp_path, config, {"p": upstream}) as (client, _):
        reply = await client.post("/v1/chat/completions", json=ASKED)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 2
    sent = dict(seen[0])
    assert sent.pop("stream") is False  # a whole answer is asked for, as the provider would be
    assert sent == {**ASKED, "model": "provider-model-7"}
