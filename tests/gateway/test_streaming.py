"""Streams after the first chunk: rescue by continuation, splice or reset, or an honest end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake, in_process_gateway
from tidegate.errors import ProviderError, ProviderErrorKind

pytestmark = pytest.mark.asyncio

WORDS = " ".join(f"w{i}" for i in range(1, 61))
CHAT = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "tell me"}]}


def events(raw: bytes) -> list[Any]:
    """Decode an SSE body: dicts for JSON data, the string for [DONE], ("reset", data) for resets."""
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip() or block.startswith(":"):
            continue
        lines = block.split("\n")
        data = lines[-1].removeprefix("data: ")
        if lines[0] == "event: reset":
            out.append(("reset", orjson.loads(data)))
        elif data == "[DONE]":
            out.append(data)
        else:
            out.append(orjson.loads(data))
    return out


def text_of(items: list[Any]) -> str:
    return "".join(
        (c["choices"][0]["delta"].get("content") or "")
        for c in items
        if isinstance(c, dict) and c.get("choices")
    )


def two_providers(
    primary: dict[str, Any], fallback: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    return {
        "providers": {"p": primary, "b": fallback},
        "models": {"chat": {"providers": ["p", "b"]}},
        "cache": {"enabled": False},
        **extra,
    }


async def test_cut_stream_is_completed_by_continuation(gateway_client: AppFactory) -> None:
    """A stream cut after 40 of 60 tokens is finished by a fallback that accepts the prefill."""
    primary = fake(WORDS, model="m-p", faults=[{"kind": "cut_after", "tokens": 40}])
    fallback = {**fake(WORDS, model="m-b"), "accepts_prefill": True}
    async with gateway_client(two_providers(primary, fallback)) as (client, app):
        response = await client.post("/v1/chat/completions", json=CHAT)
        items = events(response.content)
        assert text_of(items) == WORDS
        assert items[-1] == "[DONE]"
        assert b'"rescued_by":"continuation"' in response.content
        fallback_body = app.runtime.providers["b"].attempts[0].body
        assert fallback_body["messages"][-1]["role"] == "assistant"


async def test_prefill_refusal_falls_back_to_splice(gateway_client: AppFactory) -> None:
    """A fallback refusing the prefill restarts; its identical prefix is skipped; no error shows."""
    primary = fake(WORDS, model="m-p", faults=[{"kind": "cut_after", "tokens": 40}])
    fallback = {
        **fake(WORDS, model="m-b", faults=[{"kind": "refuse_prefill"}]),
        "accepts_prefill": True,
    }
    async with gateway_client(two_providers(primary, fallback)) as (client, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
        items = events(response.content)
        assert text_of(items) == WORDS
        assert items[-1] == "[DONE]"
        assert b"prefill" not in response.content
        assert b'"rescued_by":"splice"' in response.content


async def test_different_fallback_text_ends_with_an_explicit_error(
    gateway_client: AppFactory,
) -> None:
    """When the fallback would say something else, the client gets an error event and no [DONE]."""
    primary = fake(WORDS, model="m-p", faults=[{"kind": "cut_after", "tokens": 40}])
    fallback = fake("something entirely different", model="m-b")
    async with gateway_client(two_providers(primary, fallback)) as (client, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
        items = events(response.content)
        assert "[DONE]" not in items
        assert items[-1]["error"]["code"] == "stream_incomplete"
        assert items[-1]["error"]["retryable"] is True
        assert text_of(items) == " ".join(WORDS.split()[:40])


async def test_reset_opt_in_gets_the_whole_fallback_answer(gateway_client: AppFactory) -> None:
    """With X-Tidegate-Stream-Reset: allow the client gets event: reset, then a whole answer."""
    primary = fake(WORDS, model="m-p", faults=[{"kind": "cut_after", "tokens": 40}])
    fallback = fake("a different whole answer", model="m-b")
    async with gateway_client(two_providers(primary, fallback)) as (client, _):
        response = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"X-Tidegate-Stream-Reset": "allow"}
        )
        items = events(response.content)
        resets = [i for i, item in enumerate(items) if isinstance(item, tuple)]
        assert len(resets) == 1
        assert text_of(items[resets[0] :]) == "a different whole answer"
        assert items[-1] == "[DONE]"


async def test_malformed_chunk_is_skipped_and_the_answer_complete(
    gateway_client: AppFactory,
) -> None:
    """A malformed tenth chunk is skipped and counted; the answer still arrives whole."""
    config = {
        "providers": {
            "p": fake(WORDS, model="m-p", faults=[{"kind": "malformed_chunk", "chunk": 10}])
        },
        "models": {"chat": {"providers": ["p"]}},
    }
    async with gateway_client(config) as (client, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
        items = events(response.content)
        assert text_of(items) == WORDS
        assert items[-1] == "[DONE]"
        metrics = (await client.get("/metrics")).text
        assert 'tidegate_malformed_chunks_total{provider="p"} 1.0' in metrics


async def test_missing_done_is_finalised_with_usage(gateway_client: AppFactory) -> None:
    """A complete stream without [DONE] is finished by the gateway, with usage when asked."""
    config = {
        "providers": {"p": fake(WORDS, model="m-p", faults=[{"kind": "missing_done"}])},
        "models": {"chat": {"providers": ["p"]}},
    }
    body = {**CHAT, "stream_options": {"include_usage": True}}
    async with gateway_client(config) as (client, _):
        response = await client.post("/v1/chat/completions", json=body)
        items = events(response.content)
        assert text_of(items) == WORDS
        assert items[-1] == "[DONE]"
        assert items[-2]["usage"]["completion_tokens"] > 0


async def test_stall_ends_within_the_stall_limit(gateway_client: AppFactory) -> None:
    """A stream that stalls after 20 tokens ends soon after the stall limit; the next one is fine."""
    from tidegate.clock import SystemClock

    primary = {
        **fake(
            WORDS, model="m-p", faults=[{"on_attempts": [1], "kind": "stall_after", "tokens": 20}]
        ),
        "stream": {"stall_timeout_s": 0.3},
    }
    config = {"providers": {"p": primary}, "models": {"chat": {"providers": ["p"]}}}
    clock = SystemClock()
    async with gateway_client(config) as (client, _):
        started = clock.now()
        response = await client.post("/v1/chat/completions", json=CHAT)
        elapsed = clock.now() - started
        items = events(response.content)
        assert items[-1]["error"]["code"] == "stream_incomplete"
        assert elapsed < 0.3 + 1.0
        again = events((await client.post("/v1/chat/completions", json=CHAT)).content)
        assert text_of(again) == WORDS


async def test_slow_first_token_fails_over_at_the_ttft_limit(gateway_client: AppFactory) -> None:
    """A first token that would take 20 s is abandoned at the limit and the fallback answers."""
    from tidegate.clock import SystemClock

    primary = {**fake(WORDS, model="m-p", ttft=20.0), "stream": {"first_token_timeout_s": 0.3}}
    config = two_providers(primary, fake("from the fallback", model="m-b"))
    clock = SystemClock()
    async with gateway_client(config) as (client, _):
        started = clock.now()
        response = await client.post("/v1/chat/completions", json=CHAT)
        elapsed = clock.now() - started
        assert text_of(events(response.content)) == "from the fallback"
        # Headers leave before the stream: they list what failed before it, and who serves it.
        assert response.headers["x-tidegate-tried"] == "p=timeout"
        assert response.headers["x-tidegate-served-by"] == "b"
        assert elapsed < 2.0


async def test_a_rescued_stream_bills_each_provider_its_part(gateway_client: AppFactory) -> None:
    """After a continuation the primary's part (40 words, reported by nobody: estimated from its
    text) and the fallback's (its own usage) are each priced at their model's price; the usage
    the client is shown counts both, the fallback's chunks name its model, and the log line
    names both providers."""
    primary = fake(WORDS, model="m-p", faults=[{"kind": "cut_after", "tokens": 40}])
    fallback = {**fake(WORDS, model="m-b"), "accepts_prefill": True}
    prices = {
        "m-p": {"input_per_1k": 1.0, "output_per_1k": 10.0},
        "m-b": {"input_per_1k": 2.0, "output_per_1k": 20.0},
    }
    lines: list[dict[str, Any]] = []
    ask = {**CHAT, "stream_options": {"include_usage": True}}
    async with gateway_client(two_providers(primary, fallback, prices=prices)) as (client, app):
        app._log_request = lines.append
        response = await client.post("/v1/chat/completions", json=ask)
        metrics = app.runtime.metrics
        spend = {m: metrics.spend.labels(m).value for m in ("m-p", "m-b")}
        completion = {m: metrics.tokens.labels(m, "completion").value for m in ("m-p", "m-b")}
    items = events(response.content)
    assert text_of(items) == WORDS
    first_40 = " ".join(WORDS.split()[:40])
    primary_completion = len(first_40) // 4  # estimated from the text it streamed
    assert completion["m-p"] == primary_completion
    assert completion["m-b"] == 20  # the fallback's own count: the 20 words it added
    assert spend["m-p"] > 0
    assert spend["m-b"] > 0
    models = {c["model"] for c in items if isinstance(c, dict) and c.get("choices")}
    assert models == {"m-p", "m-b"}
    shown = next(c["usage"] for c in items if isinstance(c, dict) and c.get("usage"))
    assert shown["completion_tokens"] == primary_completion + 20
    line = lines[-1]
    assert line["served_by"] == "p,b"
    assert line["model"] == "m-p,m-b"
    assert line["completion_tokens"] == primary_completion + 20
    assert line["cost_usd"] == pytest.approx(spend["m-p"] + spend["m-b"], abs=1e-8)


async def test_a_stream_cut_inside_a_tool_call_ends_explicitly(tmp_path: Path) -> None:
    """Part of a tool call's arguments went out when the stream broke: no fallback is asked to
    finish it (it could not be made one well-formed call), the stream ends stream_incomplete."""

    def chunk(delta: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m-p",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }

    call = {
        "index": 0,
        "id": "t1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"ci'},
    }
    cut = [
        chunk({"role": "assistant", "content": None}),
        chunk({"tool_calls": [call]}),
        ProviderError(ProviderErrorKind.CONNECTION, "the connection dropped", provider="p"),
    ]
    fallback_called: list[int] = []

    def fallback(body: Any, number: int) -> Any:
        fallback_called.append(number)
        return {
            "id": "c2",
            "object": "chat.completion",
            "created": 1,
            "model": "m-b",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x"},
                    "finish_reason": "stop",
                }
            ],
        }

    config = two_providers(fake(model="m-p"), {**fake(model="m-b"), "accepts_prefill": True})
    async with in_process_gateway(tmp_path, config, {"p": lambda body, n: cut, "b": fallback}) as (
        client,
        _,
    ):
        response = await client.post("/v1/chat/completions", json=CHAT)
    items = events(response.content)
    assert items[-1]["error"]["code"] == "stream_incomplete"
    assert "[DONE]" not in items
    assert fallback_called == []
