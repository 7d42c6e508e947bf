"""Less config: a provider serving several model ids (``models``), wildcard aliases that pass the
caller's model through (``"openai/*"``), a breaker per upstream model, /v1/models listing what
a key may use; and the context-window check before sending."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests.gateway.harness import in_process_gateway
from tidegate.errors import ProviderError
from tidegate.gateway.config import Config
from tidegate.gateway.passthrough import PASSTHROUGH_REMEMBERED
from tidegate.gateway.routes import routes_from
from tidegate.gateway.upstreams import upstream_configs
from tidegate.providers.wire import chat_completion, usage

Body = dict[str, Any]


def _answer(body: Body, attempt: int) -> Body:
    """Answers with the model it was called with."""
    del attempt
    return chat_completion(
        id="c1", model=body["model"], created=1, content=body["model"], usage=usage(3, 1)
    )


def _chat(model: str, text: str = "hi", **extra: Any) -> Body:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


LISTED: Body = {
    "providers": {
        "oa": {"type": "fake", "models": ["gpt-4o", "gpt-4o-mini", "o3-mini"]},
        "any": {"type": "fake", "model": "base-1", "models": ["*"]},
    },
    "models": {
        "oa/*": {"providers": ["oa"]},
        "any/*": {"providers": ["any"]},
        "mini": {"providers": ["oa/gpt-4o-mini"]},
        "oa/o3-mini": {"providers": ["oa"], "description": "the exact alias wins"},
    },
}


def test_models_give_the_provider_its_model_and_upstreams_by_name() -> None:
    config = Config.model_validate(LISTED)
    assert config.providers["oa"].model == "gpt-4o"  # the first listed
    upstreams = upstream_configs(config)
    assert upstreams["oa/gpt-4o-mini"].model == "gpt-4o-mini"
    assert upstreams["oa/gpt-4o-mini"].models == ()
    assert "oa/gpt-4o" not in upstreams  # the provider's own model is the provider's name
    routes = routes_from(config)
    assert [s.name for s in routes["oa/gpt-4o-mini"].specs] == ["oa/gpt-4o-mini"]
    assert [s.name for s in routes["oa/gpt-4o"].specs] == ["oa"]
    assert [s.name for s in routes["oa/o3-mini"].specs] == ["oa"]  # the config's own route
    assert "oa/*" not in routes
    assert [s.name for s in routes["any/base-1"].specs] == ["any"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"models": {"x": {"providers": ["oa/gpt-5"]}}}, "names 'oa/gpt-5'"),
        ({"models": {"o*": {"providers": ["oa"]}}}, "ends with '/[*]'"),
        ({"models": {"a/*": {"providers": ["oa/gpt-4o-mini"]}}}, "is not a provider's name"),
        (
            {"providers": {"b": {"type": "bedrock", "model": "m", "models": ["*"]}}},
            "is not for type 'bedrock'",
        ),
    ],
)
def test_model_lists_and_wildcards_are_checked(change: Body, message: str) -> None:
    data = {
        "providers": {**LISTED["providers"], **change.get("providers", {})},
        "models": change.get("models", {"c": {"providers": ["oa"]}}),
    }
    with pytest.raises(ValidationError, match=message):
        Config.model_validate(data)


@pytest.mark.asyncio
async def test_a_wildcard_alias_passes_the_callers_model_through(tmp_path: Path) -> None:
    handlers = {"oa": _answer, "any": _answer}
    async with in_process_gateway(tmp_path, LISTED, handlers) as (client, rt):
        mini = await client.post("/v1/chat/completions", json=_chat("oa/gpt-4o-mini"))
        own = await client.post("/v1/chat/completions", json=_chat("oa/gpt-4o"))
        exact = await client.post("/v1/chat/completions", json=_chat("mini"))
        unknown = await client.post("/v1/chat/completions", json=_chat("oa/gpt-9"))
        passed = await client.post("/v1/chat/completions", json=_chat("any/some-model:7b"))
        again = await client.post("/v1/chat/completions", json=_chat("any/some-model:7b"))
        bad = await client.post("/v1/chat/completions", json=_chat("any/ spaced"))
        listed = await client.get("/v1/models")
    assert mini.status_code == 200
    assert mini.json()["choices"][0]["message"]["content"] == "gpt-4o-mini"
    assert mini.headers["x-tidegate-tried"] == "oa/gpt-4o-mini=ok"
    assert own.json()["choices"][0]["message"]["content"] == "gpt-4o"
    assert own.headers["x-tidegate-tried"] == "oa=ok"
    assert exact.headers["x-tidegate-tried"] == "oa/gpt-4o-mini=ok"
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert passed.status_code == again.status_code == 200
    assert passed.json()["choices"][0]["message"]["content"] == "some-model:7b"
    assert passed.headers["x-tidegate-tried"] == "any/some-model:7b=ok"
    assert bad.status_code == 404
    assert "any/some-model:7b" in rt.breakers
    assert "any/some-model:7b" in rt.passthrough
    ids = [m["id"] for m in listed.json()["data"]]
    assert {"oa/gpt-4o", "oa/gpt-4o-mini", "oa/o3-mini", "mini", "any/base-1"} <= set(ids)
    assert "oa/*" not in ids
    assert "any/some-model:7b" not in ids


@pytest.mark.asyncio
async def test_pass_through_models_are_bounded(tmp_path: Path) -> None:
    async with in_process_gateway(tmp_path, LISTED, {"oa": _answer, "any": _answer}) as (
        client,
        rt,
    ):
        for i in range(PASSTHROUGH_REMEMBERED):
            rt.passthrough[f"any/m{i}"] = rt.routes["any/base-1"]
        refused = await client.post("/v1/chat/completions", json=_chat("any/one-more"))
    assert refused.status_code == 404
    assert "passes 64 models through" in refused.json()["error"]["message"]


@pytest.mark.asyncio
async def test_each_upstream_model_has_its_own_breaker(tmp_path: Path) -> None:
    config: Body = {
        **LISTED,
        "breaker": {"consecutive_failures": 2, "minimum_calls": 100},
        "retry": {"attempts": 1},
    }

    def failing_mini(body: Body, attempt: int) -> Body | ProviderError:
        if body["model"] == "gpt-4o-mini":
            return ProviderError("server", "down", provider="oa")
        return _answer(body, attempt)

    async with in_process_gateway(tmp_path, config, {"oa": failing_mini, "any": _answer}) as (
        client,
        rt,
    ):
        for _ in range(2):
            failed = await client.post("/v1/chat/completions", json=_chat("oa/gpt-4o-mini"))
            assert failed.status_code == 502
        refused = await client.post("/v1/chat/completions", json=_chat("oa/gpt-4o-mini"))
        other = await client.post("/v1/chat/completions", json=_chat("oa/gpt-4o"))
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "circuit_open"
    assert other.status_code == 200
    assert rt.breakers["oa"].state.value == "closed"
    assert rt.breakers["oa/gpt-4o-mini"].state.value == "open"


def test_a_key_listing_a_wildcard_may_use_its_models() -> None:
    from tidegate.gateway.auth import Identity

    identity = Identity("k", "t", "u", "standard", "internal", frozenset({"oa/*"}))
    assert identity.may_use("oa/gpt-4o-mini")
    assert not identity.may_use("any/base-1")
    assert not identity.may_use("oa")


# --------------------------------------------------------------------------- context windows

WINDOWS: Body = {
    "providers": {
        "small": {"type": "fake", "model": "s-1", "context_window": 100},
        "large": {
            "type": "fake",
            "model": "l-1",
            "context_window": 10_000,
            "approved_fallback": True,
        },
    },
    "models": {
        "chat": {"providers": ["small", "large"]},
        "only-small": {"providers": ["small"]},
    },
    "budgets": {"calls": 100, "tokens": 1_000_000},
}


@pytest.mark.asyncio
async def test_a_prompt_over_a_window_skips_that_provider(tmp_path: Path) -> None:
    handlers = {"small": _answer, "large": _answer}
    long_text = "word " * 200  # about 250 tokens by the estimate
    async with in_process_gateway(tmp_path, WINDOWS, handlers) as (client, rt):
        short = await client.post("/v1/chat/completions", json=_chat("chat", max_tokens=10))
        tight = await client.post("/v1/chat/completions", json=_chat("chat", max_tokens=200))
        long = await client.post("/v1/chat/completions", json=_chat("chat", long_text))
        none = await client.post("/v1/chat/completions", json=_chat("only-small", long_text))
        calls = [(name, len(p.attempts)) for name, p in rt.providers.items()]  # type: ignore[attr-defined]
    assert short.headers["x-tidegate-tried"] == "small=ok"
    assert tight.headers["x-tidegate-tried"] == "large=ok, small=skipped:context_window"
    assert long.status_code == 200
    assert long.headers["x-tidegate-tried"] == "large=ok, small=skipped:context_window"
    assert none.status_code == 400
    assert none.json()["error"]["code"] == "context_length_exceeded"
    assert none.headers["x-tidegate-tried"] == "small=skipped:context_window"
    assert dict(calls) == {"small": 1, "large": 2}  # the refused request reached nobody


def test_the_prompt_bound_is_never_below_a_count() -> None:
    from tidegate.catalogue.tokens import prompt_counter
    from tidegate.gateway.pipeline.route import prompt_bound

    count = prompt_counter("openai", "gpt-4o")
    for text in ("hello", "汉字の文章です" * 30, "🌊🌊🌊", " ".join(["x"] * 500), ""):
        body = {
            "messages": [{"role": "user", "content": text}, {"role": "system", "content": text}]
        }
        assert prompt_bound(body) >= count(body)
    assert prompt_bound({"input": ["abc", "de"]}) == 20
    assert prompt_bound({"input": [[1, 2, 3], [4]]}) == 4
