"""Hostile bodies on the model endpoints, the translated ones (``/v1/messages``,
``/v1/responses``) above all: whatever JSON arrives, the answer is a 2xx or a 4xx in the
endpoint's own error shape, never a 500 (1,500 examples each found none; 300 run here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.harness import KEY, fake, running_gateway

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4)
)
JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
KEYS = {
    "/v1/chat/completions": [
        "model",
        "messages",
        "tools",
        "tool_choice",
        "response_format",
        "n",
        "stream",
        "max_tokens",
    ],
    "/v1/messages": [
        "model",
        "max_tokens",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "stop_sequences",
        "stream",
        "metadata",
    ],
    "/v1/responses": [
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "text",
        "max_output_tokens",
        "stream",
    ],
}
BLOCKS = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["text", "image", "tool_use", "tool_result", "input_text", "function_call", "message"]
        )
    },
    optional={
        "text": JSON,
        "source": JSON,
        "content": JSON,
        "input": JSON,
        "role": JSON,
        "call_id": JSON,
        "output": JSON,
    },
)


def _bodies(path: str) -> st.SearchStrategy[dict[str, Any]]:
    turn = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "tool", 3]),
            "content": st.text(max_size=3) | st.lists(BLOCKS, max_size=3),
        }
    )
    values = dict.fromkeys(KEYS[path], JSON)
    values["model"] = st.just("chat") | JSON
    values["messages"] = st.lists(turn | JSON, max_size=3)
    values["input"] = st.text(max_size=3) | st.lists(BLOCKS | turn, max_size=3)
    values["max_tokens"] = st.integers(-2, 40) | JSON
    return st.fixed_dictionaries({}, optional=values)


@pytest.mark.parametrize("path", sorted(KEYS))
def test_no_body_is_a_500(tmp_path: Path, path: str) -> None:
    config = {
        "providers": {"p": fake()},
        "models": {"chat": {"providers": ["p"]}},
        "cache": {"enabled": False},
    }
    seen: list[int] = []
    with (
        running_gateway(tmp_path, config) as (base, _),
        httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {KEY}"}, trust_env=False
        ) as client,
    ):

        @settings(
            max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(body=_bodies(path))
        def one(body: dict[str, Any]) -> None:
            reply = client.post(path, json=body)
            seen.append(reply.status_code)
            assert reply.status_code < 500 or reply.status_code in (502, 503, 529), reply.text
            if reply.status_code >= 400 and path == "/v1/messages":
                assert reply.json()["type"] == "error"

        one()
    assert 400 in seen
