"""Streaming failures end to end: the openai SDK, the real gateway, the real fake upstream."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from tests.gateway.harness import KEY, running_gateway
from tests.gateway.upstream import CLOCK, RunningUpstream, openai_provider, running_upstream

pytestmark = pytest.mark.slow

WORDS = " ".join(f"w{i}" for i in range(1, 61))
FIRST_40 = " ".join(WORDS.split()[:40])
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me"}]


@contextmanager
def gateway(
    tmp_path: Path, script: dict[str, Any], fallback: dict[str, Any] | None = None, **primary: Any
) -> Iterator[tuple[openai.OpenAI, RunningUpstream]]:
    with running_upstream(script) as up:
        providers = {"primary": {**openai_provider(up, "primary-model"), **primary}}
        route = ["primary"]
        if fallback is not None:
            providers["backup"] = {**openai_provider(up, "fallback-model"), **fallback}
            route.append("backup")
        config = {
            "providers": providers,
            "models": {"chat": {"providers": route, "per_try_timeout_s": 30}},
            "retry": {"attempts": 1},
            "cache": {"enabled": False},
        }
        with running_gateway(tmp_path, config) as (base, _):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30)
            try:
                yield client, up
            finally:
                client.close()


def streamed_text(client: openai.OpenAI, **extra: Any) -> tuple[str, list[ChatCompletionChunk]]:
    chunks: list[ChatCompletionChunk] = list(
        client.chat.completions.create(model="chat", messages=ASK, stream=True, **extra)
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_cut_stream_completed_by_a_continuation_fallback(tmp_path: Path) -> None:
    """Cut after 40 of 60 tokens; a fallback accepting the prefill completes the same answer."""
    script = {
        "models": {
            "primary-model": {"text": WORDS, "faults": [{"kind": "cut_after", "tokens": 40}]},
            "fallback-model": {"text": WORDS},
        }
    }
    with gateway(tmp_path, script, fallback={"accepts_prefill": True}) as (client, up):
        text, _ = streamed_text(client)
        prefill = up.attempts("fallback-model")[0]["messages"][-1]
    assert text == WORDS
    assert prefill == {"role": "assistant", "content": FIRST_40}


def test_prefill_refusal_is_hidden_and_the_answer_spliced(tmp_path: Path) -> None:
    """A fallback refusing prefill but reproducing the text completes it; no refusal shows."""
    script = {
        "models": {
            "primary-model": {"text": WORDS, "faults": [{"kind": "cut_after", "tokens": 40}]},
            "fallback-model": {"text": WORDS, "accepts_prefill": False},
        }
    }
    with gateway(tmp_path, script, fallback={"accepts_prefill": True}) as (client, up):
        text, _ = streamed_text(client)
        outcomes = [a["outcome"] for a in up.attempts("fallback-model")]
    assert text == WORDS
    assert outcomes[0].startswith("http_400")  # the refused prefill, never shown to the caller
    assert len(outcomes) == 2


def test_different_fallback_text_is_an_explicit_error(tmp_path: Path) -> None:
    """When no fallback can finish the same answer the SDK raises instead of returning success."""
    script = {
        "models": {
            "primary-model": {"text": WORDS, "faults": [{"kind": "cut_after", "tokens": 40}]},
            "fallback-model": {"text": "a completely different answer"},
        }
    }
    received: list[str] = []

    def consume(client: openai.OpenAI) -> None:
        stream = client.chat.completions.create(model="chat", messages=ASK, stream=True)
        for chunk in stream:
            assert isinstance(chunk, ChatCompletionChunk)
            if chunk.choices:
                received.append(chunk.choices[0].delta.content or "")

    with (
        gateway(tmp_path, script, fallback={}) as (client, _),
        pytest.raises(openai.APIError) as caught,
    ):
        consume(client)
    assert "".join(received) == FIRST_40
    assert "incomplete" in caught.value.message


def test_stall_ends_within_the_limit_and_the_next_request_is_served(tmp_path: Path) -> None:
    """A stream stalled after 20 tokens ends within the stall limit plus a second."""
    script = {
        "models": {
            "primary-model": {
                "text": WORDS,
                "faults": [{"on_attempts": [1], "kind": "stall_after", "tokens": 20}],
            }
        }
    }
    with gateway(tmp_path, script, stream={"stall_timeout_s": 0.5}) as (client, _):
        started = CLOCK.now()
        with pytest.raises(openai.APIError):
            streamed_text(client)
        elapsed = CLOCK.now() - started
        text, _ = streamed_text(client)
    assert elapsed < 0.5 + 1.0
    assert text == WORDS


def test_malformed_tenth_chunk_is_skipped(tmp_path: Path) -> None:
    """A malformed tenth chunk is skipped and the whole answer still arrives."""
    script = {
        "models": {
            "primary-model": {"text": WORDS, "faults": [{"kind": "malformed_chunk", "chunk": 10}]}
        }
    }
    with gateway(tmp_path, script) as (client, _):
        text, _ = streamed_text(client)
    assert text == WORDS


def test_missing_done_is_finalised_at_once_with_usage(tmp_path: Path) -> None:
    """A complete stream without [DONE] ends within a second, with usage."""
    script = {"models": {"primary-model": {"text": WORDS, "faults": [{"kind": "missing_done"}]}}}
    with gateway(tmp_path, script) as (client, _):
        started = CLOCK.now()
        text, chunks = streamed_text(client, stream_options={"include_usage": True})
        elapsed = CLOCK.now() - started
    assert text == WORDS
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 60
    assert elapsed < 1.0


def test_slow_first_token_fails_over_at_the_limit(tmp_path: Path) -> None:
    """A first token 20 s away is abandoned at the time-to-first-token limit; the fallback answers."""
    script = {
        "models": {
            "primary-model": {"text": WORDS, "ttft": 20.0},
            "fallback-model": {"text": "from the fallback"},
        }
    }
    with gateway(tmp_path, script, fallback={}, stream={"first_token_timeout_s": 0.5}) as (
        client,
        up,
    ):
        started = CLOCK.now()
        text, _ = streamed_text(client)
        elapsed = CLOCK.now() - started
        seen = [a["model"] for a in up.attempts()]
    assert text == "from the fallback"
    assert seen == ["primary-model", "fallback-model"]
    assert elapsed < 2.0
