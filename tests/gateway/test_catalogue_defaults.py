"""The model catalogue as the gateway's default: prices and context windows the config leaves
out, the warning for a model priced nowhere, the production refusal, and ``tidegate models``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from typer.testing import CliRunner

from tests.gateway.harness import KEY, fake, write_config
from tidegate.catalogue.tokens import estimate_prompt_tokens
from tidegate.cli import app
from tidegate.clock import ManualClock
from tidegate.gateway import pricing
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import Config, load_config, profile_problems
from tidegate.gateway.pricing import context_window_of, effective_prices, price_sources
from tidegate.gateway.routes import routes_from
from tidegate.gateway.runtime import build_runtime, close_runtime

LOCAL = "http://127.0.0.1:9/v1"  # never called: these runtimes send nothing


def _config(**extra: Any) -> Config:
    data: dict[str, Any] = {
        "providers": {
            "gpt": {"type": "openai", "model": "gpt-4o", "base_url": LOCAL},
            "claude": {
                "type": "anthropic",
                "model": "claude-sonnet-4-5-20250929",
                "base_url": LOCAL,
                "context_window": 100_000,
            },
            "local": {"type": "openai", "model": "my-local-model", "base_url": LOCAL},
        },
        "models": {"chat": {"providers": ["gpt", "claude", "local"]}},
        **extra,
    }
    return Config.model_validate(data)


def test_the_catalogue_prices_and_windows_what_the_config_leaves_out() -> None:
    config = _config()
    prices = effective_prices(config)
    assert prices["gpt-4o"].input_per_1k == pytest.approx(0.0025)
    assert prices["gpt-4o"].output_per_1k == pytest.approx(0.01)
    assert prices["claude-sonnet-4-5-20250929"].output_per_1k == pytest.approx(0.015)
    assert "my-local-model" not in prices
    assert price_sources(config) == {"gpt": "catalogue", "claude": "catalogue", "local": "none"}
    windows = {spec.name: spec.context_window for spec in routes_from(config)["chat"].specs}
    assert windows == {"gpt": 128_000, "claude": 100_000, "local": None}


def test_config_entries_override_the_catalogue() -> None:
    config = _config(prices={"gpt-4o": {"input_per_1k": 0.001, "output_per_1k": 0.002}})
    assert effective_prices(config)["gpt-4o"].input_per_1k == 0.001
    assert price_sources(config)["gpt"] == "config"
    assert context_window_of(config.providers["claude"]) == 100_000  # the catalogue says 200k


@pytest.mark.asyncio
async def test_an_unpriced_model_is_warned_about_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config()
    with structlog.testing.capture_logs() as logs:
        # A fresh logger: the module's may be bound already (cached on first use elsewhere).
        monkeypatch.setattr(pricing, "log", structlog.get_logger("tidegate"))
        rt = await build_runtime(config, tmp_path / "tidegate.yaml")
    await close_runtime(rt)
    unpriced = [line for line in logs if line["event"] == "model_unpriced"]
    assert [(line["provider"], line["model"]) for line in unpriced] == [("local", "my-local-model")]
    assert unpriced[0]["log_level"] == "warning"
    assert rt.prices_per_1k["gpt-4o"] == pytest.approx((0.0025, 0.01))
    assert rt.prompt_counters["claude"] is estimate_prompt_tokens
    assert rt.prompt_counters["local"] is estimate_prompt_tokens
    assert rt.prompt_counters["gpt"] is not estimate_prompt_tokens


def test_production_refuses_an_unpriced_model_when_cost_is_budgeted() -> None:
    controls: dict[str, Any] = {
        "profile": "production",
        "auth": {"keys_file": "keys.yaml"},
        "rate_limits": {"per_user": {"rate_per_s": 1, "burst": 1}},
    }
    costed = _config(**controls, budgets={"cost_usd": 10})
    problems = profile_problems(costed)
    assert len(problems) == 1
    assert "providers.local" in problems[0]
    assert "'my-local-model'" in problems[0]
    assert "budgets.cost_usd" in problems[0]
    assert profile_problems(_config(**controls, budgets={"calls": 10})) == []
    priced = {"my-local-model": {"input_per_1k": 0.001, "output_per_1k": 0.001}}
    assert profile_problems(_config(**controls, budgets={"cost_usd": 10}, prices=priced)) == []


@pytest.mark.asyncio
async def test_context_length_fails_over_to_a_model_the_catalogue_knows_is_larger(
    tmp_path: Path,
) -> None:
    """No context_window in the config: gpt-4o's 128k and gpt-4.1's 1M come from the catalogue,
    so the refusal goes to the larger one and not to the smaller mini model."""
    refuses = fake("too long", model="gpt-4o", faults=[{"kind": "context_length_exceeded"}])
    config = {
        "providers": {
            "primary": refuses,
            "smaller": fake("from the smaller one", model="gpt-4o-mini-2024-07-18"),
            "larger": fake("from the larger one", model="gpt-4.1"),
        },
        "models": {"chat": {"providers": ["primary", "smaller", "larger"]}},
        "cache": {"enabled": False},
    }
    path = write_config(tmp_path, config)
    loaded = load_config(path, env={})
    assert all(p.context_window is None for p in loaded.providers.values())
    clock = ManualClock(0.0, wall_start=1_000_000.0)
    rt = await build_runtime(loaded, path, clock=clock, sleep=clock.asleep, rng=random.Random(1))
    transport = httpx.ASGITransport(app=Gateway(loaded, path, runtime=rt))
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://gw", headers={"Authorization": f"Bearer {KEY}"}
        ) as client:
            reply = await client.post(
                "/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "a long one"}]},
            )
    finally:
        await close_runtime(rt)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-tidegate-served-by"] == "larger"
    assert reply.headers["x-tidegate-tried"] == "primary=context_length, larger=ok"
    assert reply.json()["choices"][0]["message"]["content"] == "from the larger one"


def test_tidegate_models_prints_the_catalogue_and_the_effective_table(tmp_path: Path) -> None:
    runner = CliRunner()
    everything = runner.invoke(app, ["models"])
    assert everything.exit_code == 0, everything.output
    assert "compiled 2026-12-01" in everything.output
    assert "gpt-4o" in everything.output
    assert "gemini-2.5-flash" in everything.output
    assert "https://platform.claude.com/docs/en/about-claude/pricing" in everything.output
    one = runner.invoke(app, ["models", "--provider", "groq"])
    assert one.exit_code == 0, one.output
    assert "llama-3.3-70b-versatile" in one.output
    assert "gpt-4o" not in one.output
    assert runner.invoke(app, ["models", "--provider", "nobody"]).exit_code == 2
    path = write_config(
        tmp_path,
        {
            "providers": {
                "gpt": {"type": "openai", "model": "gpt-4o", "base_url": LOCAL},
                "mine": {"type": "fake", "model": "fake-1", "context_window": 4096},
            },
            "models": {"chat": {"providers": ["gpt", "mine"]}},
            "prices": {"fake-1": {"input_per_1k": 0.001, "output_per_1k": 0.002}},
        },
    )
    effective = runner.invoke(app, ["models", "--provider", "openai", "--config", str(path)])
    assert effective.exit_code == 0, effective.output
    rows = {
        line.split("│")[1].strip(): line for line in effective.output.splitlines() if "│" in line
    }
    assert "catalogue" in rows["gpt"]
    assert "128,000" in rows["gpt"]
    assert "config" in rows["mine"]
    assert "4,096" in rows["mine"]
