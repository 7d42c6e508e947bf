"""Presets of OpenAI-compatible services in the config, and through the gateway: a field the
preset refuses is a 400 before any upstream call, with nothing spent."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from tidegate.errors import ConfigError
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config
from tidegate.gateway.runtime import build_runtime, close_runtime
from tidegate.providers.openai import OpenAIProvider

from .harness import KEY, write_config

MODELS = {"chat": {"providers": ["g"]}}


def _load(tmp_path: Path, provider: dict[str, Any]) -> Any:
    path = tmp_path / "tidegate.yaml"
    path.write_text(
        yaml.safe_dump({"providers": {"g": provider}, "models": MODELS}), encoding="utf-8"
    )
    return load_config(path, env={})


def test_preset_with_another_type_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"providers\.g") as raised:
        _load(
            tmp_path, {"type": "anthropic", "model": "m", "base_url": "http://x", "preset": "groq"}
        )
    assert "'preset' is only for providers of type openai" in str(raised.value)


def test_an_unknown_preset_is_refused_listing_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        _load(tmp_path, {"type": "openai", "model": "m", "preset": "grok"})
    message = str(raised.value)
    assert "unknown preset 'grok'" in message
    for name in ("deepseek", "groq", "llamacpp", "mistral", "ollama", "openrouter", "together"):
        assert name in message


def test_base_url_defaults_from_the_preset(tmp_path: Path) -> None:
    config = _load(tmp_path, {"type": "openai", "model": "llama3.2", "preset": "ollama"})
    provider = config.providers["g"]
    assert provider.preset == "ollama"
    assert provider.base_url is None
    from tidegate.clock import SystemClock
    from tidegate.gateway.build import build_provider

    async def build() -> OpenAIProvider:
        async with aiohttp.ClientSession() as session:
            built = build_provider(
                "g", provider, session=session, config_path=tmp_path / "t.yaml", clock=SystemClock()
            )
            assert isinstance(built, OpenAIProvider)
            return built

    import asyncio

    built = asyncio.run(build())
    assert built.base_url == "http://localhost:11434/v1"
    assert built.preset is not None
    assert built.preset.name == "ollama"


def test_a_configured_base_url_wins_over_the_preset(tmp_path: Path) -> None:
    config = _load(
        tmp_path, {"type": "openai", "model": "m", "preset": "vllm", "base_url": "http://h:9/v1"}
    )
    assert config.providers["g"].base_url == "http://h:9/v1"


def test_openai_without_preset_still_needs_base_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs base_url"):
        _load(tmp_path, {"type": "openai", "model": "m"})


def test_a_cloud_preset_needs_a_key_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="preset 'groq' needs api_key_file"):
        _load(tmp_path, {"type": "openai", "model": "m", "preset": "groq"})


ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "model": "llama-3.1-8b-instant",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


@pytest_asyncio.fixture
async def groq_fake() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A Groq stand-in on loopback: its base URL (with Groq's path) and the bodies it got."""
    seen: list[dict[str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        assert request.path == "/openai/v1/chat/completions"
        seen.append(await request.json())
        return web.json_response(ANSWER)

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}/openai/v1", seen
    await runner.cleanup()


def _total(exposition: str, metric: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in exposition.splitlines()
        if line.startswith(metric) and "_created" not in line
    )


@pytest.mark.asyncio
async def test_a_refused_field_is_a_400_with_no_upstream_call_and_nothing_spent(
    tmp_path: Path, groq_fake: tuple[str, list[dict[str, Any]]]
) -> None:
    base_url, seen = groq_fake
    (tmp_path / "groq.key").write_text("gsk-test\n", encoding="utf-8")
    provider = {
        "type": "openai",
        "model": "llama-3.1-8b-instant",
        "preset": "groq",
        "base_url": base_url,
        "api_key_file": "groq.key",
    }
    config = {
        "providers": {"g": provider},
        "models": MODELS,
        "prices": {"llama-3.1-8b-instant": {"input_per_1k": 1.0, "output_per_1k": 1.0}},
    }
    path = write_config(tmp_path, config)
    loaded = load_config(path, env={})
    async with aiohttp.ClientSession() as session:
        rt = await build_runtime(loaded, path, rng=random.Random(1), session=session)
        transport = httpx.ASGITransport(app=Gateway(loaded, path, runtime=rt))
        headers = {"Authorization": f"Bearer {KEY}"}
        try:
            async with httpx.AsyncClient(
                transport=transport, base_url="http://gw", headers=headers
            ) as client:
                messages = [{"role": "user", "content": "hi"}]
                refused = await client.post(
                    "/v1/chat/completions",
                    json={"model": "chat", "messages": messages, "logprobs": True},
                )
                metrics = rt.metrics.exposition().decode()
                served = await client.post(
                    "/v1/chat/completions", json={"model": "chat", "messages": messages, "n": 1}
                )
                after = rt.metrics.exposition().decode()
        finally:
            await close_runtime(rt)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["retryable"] is False
    assert "'logprobs'" in error["message"]
    assert "preset 'groq'" in error["message"]
    assert _total(metrics, "tidegate_spend_usd") == 0
    assert _total(metrics, "tidegate_tokens") == 0
    assert _total(metrics, "tidegate_retries") == 0
    # Nothing reached the upstream for the refused request; the next one went through, its
    # neutral ``n: 1`` dropped as Groq's rule says.
    assert served.status_code == 200, served.text
    assert len(seen) == 1
    assert "n" not in seen[0]
    assert "logprobs" not in seen[0]
    assert _total(after, "tidegate_spend_usd") > 0  # the metric does count a served answer
