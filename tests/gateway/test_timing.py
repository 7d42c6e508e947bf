"""At start-up the gateway checks its own timeout chain (the layers ``tidegate check timeouts``
checks) and warns about each layer that does not nest, instead of starting silently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog

from tidegate.gateway import timing
from tidegate.gateway.config import Config
from tidegate.gateway.runtime import build_runtime, close_runtime

NESTED: dict[str, Any] = {
    "providers": {"p": {"type": "fake", "model": "m-1", "stream": {"max_duration_s": 30}}},
    "models": {"chat": {"providers": ["p"], "per_try_timeout_s": 5}},
    "state": {"url": "memory://"},
}


def _warnings(config: Config, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    with structlog.testing.capture_logs() as logs:
        monkeypatch.setattr(timing, "log", structlog.get_logger("tidegate"))
        timing.warn_timeouts(config)
    return [dict(line) for line in logs if line["event"] == "timeout_chain_does_not_nest"]


def test_a_nested_chain_warns_about_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _warnings(Config.model_validate(NESTED), monkeypatch) == []


def test_each_layer_that_outlives_its_caller_is_warned_about_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = Config.model_validate(
        {
            **NESTED,
            "providers": {
                "p": {"type": "fake", "model": "m-1", "models": ["m-2"]},  # stream 55s default
            },
            "models": {
                "chat": {"providers": ["p", "p/m-2"], "per_try_timeout_s": 30},
                "other": {"providers": ["p"], "per_try_timeout_s": 5},
            },
            "server": {"request_timeout_s": 50},
        }
    )
    found = _warnings(config, monkeypatch)
    assert [(w["key"], w["log_level"]) for w in found] == [
        ("providers.p.stream.max_duration_s", "warning"),
        ("models.chat.per_try_timeout_s, retry", "warning"),
        ("providers.p.stream.max_duration_s", "warning"),  # the stream limit of p/m-2
    ]
    assert "provider p/m-2 (55s)" in found[2]["problem"]
    assert "stream limit of provider p (55s) outlives gateway request (50s)" in found[0]["problem"]
    assert found[1]["detail"] == "3 tries x 30s + 1.5s worst backoff"
    assert all(w["check"] == "tidegate check timeouts" for w in found)


@pytest.mark.asyncio
async def test_start_up_runs_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = Config.model_validate({**NESTED, "server": {"request_timeout_s": 10}})
    with structlog.testing.capture_logs() as logs:
        monkeypatch.setattr(timing, "log", structlog.get_logger("tidegate"))
        rt = await build_runtime(config, tmp_path / "tidegate.yaml")
    await close_runtime(rt)
    keys = [line["key"] for line in logs if line["event"] == "timeout_chain_does_not_nest"]
    assert keys == ["providers.p.stream.max_duration_s", "models.chat.per_try_timeout_s, retry"]
