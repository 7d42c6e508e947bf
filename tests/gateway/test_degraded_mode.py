"""Degraded mode end to end: no model can answer, so the gateway answers from what it has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake

pytestmark = pytest.mark.asyncio

CHAT = {
    "model": "chat",
    "messages": [{"role": "user", "content": "How do I rotate the signing keys?"}],
}
DOWN = [{"kind": "http", "status": 503}]


def corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "keys.md").write_text(
        "# Key management\n\n## Rotating signing keys\n\nRotate the signing keys every 90 days "
        "with `keyctl rotate`; the old key stays valid for a day.\n",
        encoding="utf-8",
    )
    (folder / "billing.md").write_text(
        "# Billing\n\nInvoices are sent monthly.\n", encoding="utf-8"
    )
    return folder


def both_down(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "providers": {"p": fake(model="m-1", faults=DOWN), "b": fake(model="m-2", faults=DOWN)},
        "models": {"chat": {"providers": ["p", "b"]}},
        "retry": {"attempts": 1},
        "degraded": {"corpus_dir": str(corpus(tmp_path))},
        "budgets": {"calls": 10},
        **extra,
    }


async def test_both_models_down_gives_a_cited_degraded_answer(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """Excerpts with citations, the header set, the budget refunded, and nothing cached."""
    async with gateway_client(both_down(tmp_path)) as (client, app):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        assert response.headers["x-tidegate-degraded"] == "true"
        answer = response.json()
        content = answer["choices"][0]["message"]["content"]
        assert answer["choices"][0]["finish_reason"] == "degraded"
        assert "keyctl rotate" in content
        assert "[Key management \u203a Rotating signing keys] (keys.md)" in content
        usage = await app.runtime.stores.quotas.usage("t1:u1")
        assert (usage.calls, usage.reserved_calls) == (0, 0)
        again = await client.post("/v1/chat/completions", json=CHAT)
        assert again.headers.get("x-tidegate-cache") != "hit"
        assert len(app.runtime.providers["p"].attempts) == 2  # the second request asked again


async def test_degraded_stream_is_labelled_too(gateway_client: AppFactory, tmp_path: Path) -> None:
    """A streaming request gets the excerpts as chunks, ending normally, with the header."""
    async with gateway_client(both_down(tmp_path)) as (client, _):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert response.headers["x-tidegate-degraded"] == "true"
        assert b"keyctl rotate" in response.content
        assert response.content.endswith(b"data: [DONE]\n\n")


async def test_stale_cache_answers_before_the_corpus(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """An expired cached answer to the same request is served, marked stale and degraded."""
    config = {
        "providers": {
            "p": fake(
                "the real answer",
                model="m-1",
                faults=[{"on_attempts": [2], "kind": "http", "status": 503}],
            )
        },
        "models": {"chat": {"providers": ["p"]}},
        "retry": {"attempts": 1},
        "cache": {"ttl_s": 0.001, "stale_ttl_s": 3600},
    }
    async with gateway_client(config) as (client, app):
        first = await client.post("/v1/chat/completions", json=CHAT)
        assert first.json()["choices"][0]["message"]["content"] == "the real answer"
        await app.runtime.sleep(0.01)
        second = await client.post("/v1/chat/completions", json=CHAT)
        assert second.status_code == 200
        assert second.headers["x-tidegate-degraded"] == "true"
        assert second.headers["x-tidegate-cache"] == "stale"
        assert second.json()["choices"][0]["message"]["content"] == "the real answer"
        assert second.json()["tidegate"]["source"] == "stale_cache"


async def test_nothing_to_offer_is_an_honest_retryable_error(gateway_client: AppFactory) -> None:
    """Without a corpus or cache the caller gets the provider's error, retryable, with Retry-After."""
    config = {
        "providers": {
            "p": fake(model="m-1", faults=[{"kind": "http", "status": 503, "retry_after": 7}])
        },
        "models": {"chat": {"providers": ["p"]}},
        "retry": {"attempts": 1},
    }
    async with gateway_client(config) as (client, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503
        assert response.json()["error"]["retryable"] is True
        assert response.headers["retry-after"] == "7"


async def test_kill_switch_degraded_mode_skips_the_models(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """answer.mode=degraded answers from the corpus without calling any provider."""
    config = both_down(tmp_path)
    async with gateway_client(config) as (client, app):
        app.runtime.flags.set("answer.mode", "degraded", who="oncall", why="provider incident")
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.headers["x-tidegate-degraded"] == "true"
        assert app.runtime.providers["p"].attempts == []


async def test_denied_text_is_redacted_in_excerpts_and_model_text(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """output.deny_patterns apply to model answers and to degraded excerpts alike."""
    config = {
        "providers": {"p": fake("the key is keyctl\u200b rotate", model="m-1")},
        "models": {"chat": {"providers": ["p"]}},
        "output": {"deny_patterns": ["keyctl"]},
    }
    async with gateway_client(config) as (client, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.json()["choices"][0]["message"]["content"] == "the key is [redacted] rotate"
    async with gateway_client({**both_down(tmp_path), "output": {"deny_patterns": ["keyctl"]}}) as (
        client,
        _,
    ):
        response = await client.post("/v1/chat/completions", json=CHAT)
        content = response.json()["choices"][0]["message"]["content"]
        assert "keyctl" not in content
        assert "[redacted]" in content


async def test_readiness_fails_when_the_configured_corpus_is_empty(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """A configured but empty corpus makes the instance not ready."""
    (tmp_path / "empty").mkdir()
    config = {**both_down(tmp_path), "degraded": {"corpus_dir": str(tmp_path / "empty")}}
    async with gateway_client(config) as (client, _):
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert "corpus" in ready.json()["problems"][0]


async def test_degraded_answers_on_the_messages_api(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """/v1/messages gets the same degraded answer in Anthropic's shapes, whole and streamed."""
    ask = {**CHAT, "max_tokens": 64}
    async with gateway_client(both_down(tmp_path)) as (client, _):
        whole = await client.post("/v1/messages", json=ask)
        streamed = await client.post("/v1/messages", json={**ask, "stream": True})
    assert whole.status_code == 200
    assert whole.headers["x-tidegate-degraded"] == "true"
    message = whole.json()
    assert message["type"] == "message"
    assert "keyctl rotate" in message["content"][0]["text"]
    assert streamed.headers["x-tidegate-degraded"] == "true"
    assert streamed.content.startswith(b"event: message_start\n")
    assert b"keyctl rotate" in streamed.content
    assert streamed.content.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
