"""A provider's 2xx whose usage is not a count: the answer is served, its tokens are estimated,
and the budget and the token counters are charged with the estimate (never credited)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.gateway.harness import KEY, fake, in_process_gateway
from tidegate.gateway.runtime import Runtime

pytestmark = pytest.mark.asyncio

BODY = {"model": "chat", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 10}
#: What the request's prompt estimates to (four characters a token).
ESTIMATED_PROMPT = 100
ANSWER_TEXT = "an answer of 28 characters.."


class Upstream:
    """The provider's answer, with the ``usage`` a test sets."""

    def __init__(self) -> None:
        self.usage: Any = None

    def __call__(self, body: Any, number: int) -> Any:
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ANSWER_TEXT},
                    "finish_reason": "stop",
                }
            ],
            "usage": self.usage,
        }


@pytest_asyncio.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Upstream, Runtime]]:
    config = {
        "providers": {"p": fake()},
        "models": {"chat": {"providers": ["p"]}},
        "budgets": {"tokens": 1_000_000},
        "cache": {"enabled": False},
    }
    upstream = Upstream()
    async with in_process_gateway(tmp_path, config, {"p": upstream}) as (client, rt):
        yield client, upstream, rt


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": -500, "completion_tokens": -3, "total_tokens": -503},
        {"prompt_tokens": 10**30, "completion_tokens": 1, "total_tokens": 10**30 + 1},
        {"prompt_tokens": True, "completion_tokens": 1},
        {"prompt_tokens": 9.5, "completion_tokens": 1},
        {"prompt_tokens": "9", "completion_tokens": "1"},
        [],
        None,
    ],
    ids=["negative", "huge", "bool", "float", "text", "not-an-object", "missing"],
)
async def test_a_usage_that_is_not_a_count_is_estimated(
    served: tuple[httpx.AsyncClient, Upstream, Runtime], usage: Any
) -> None:
    client, upstream, rt = served
    upstream.usage = usage
    reply = await client.post("/v1/chat/completions", json=BODY)
    assert reply.status_code == 200, reply.text
    counted = reply.json()["usage"]
    completion = len(ANSWER_TEXT) // 4
    assert (counted["prompt_tokens"], counted["completion_tokens"]) == (
        ESTIMATED_PROMPT,
        completion,
    )
    assert counted["total_tokens"] == ESTIMATED_PROMPT + completion
    identity = rt.keys.identify(f"Bearer {KEY}")
    used = await rt.stores.quotas.usage(identity.budget_subject)
    assert used.tokens == ESTIMATED_PROMPT + completion


async def test_a_bad_completion_count_alone_is_estimated(
    served: tuple[httpx.AsyncClient, Upstream, Runtime],
) -> None:
    """The provider's prompt count stands; only the completion's is estimated."""
    client, upstream, _ = served
    upstream.usage = {"prompt_tokens": 7, "completion_tokens": -1}
    reply = await client.post("/v1/chat/completions", json=BODY)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (7, len(ANSWER_TEXT) // 4)
    assert usage["total_tokens"] == 7 + len(ANSWER_TEXT) // 4
