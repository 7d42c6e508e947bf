"""Slow start through the gateway: once a primary's breaker closes, the primary gets its share of
the route back over ``breaker.slow_start_s`` (the rest goes to the approved fallback), on a
manual clock; with the window at 0 it gets it all back at once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.harness import in_process_gateway
from tidegate.clock import ManualClock
from tidegate.errors import ProviderError, ProviderErrorKind

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "When is high tide?"}]}


class Primary:
    """Fails while ``down``, answers otherwise."""

    def __init__(self) -> None:
        self.down = True

    def __call__(self, request: Any, attempt: int) -> Any:
        if self.down:
            return ProviderError(ProviderErrorKind.SERVER, "HTTP 500", provider="primary")
        return {"text": "from the primary", "prompt_tokens": 3, "completion_tokens": 2}


def backup(request: Any, attempt: int) -> Any:
    return {"text": "from the backup", "prompt_tokens": 3, "completion_tokens": 2}


def _config(slow_start_s: float) -> dict[str, Any]:
    return {
        "providers": {
            "primary": {"type": "fake", "model": "p-1"},
            "backup": {"type": "fake", "model": "b-1", "approved_fallback": True},
        },
        "models": {"chat": {"providers": ["primary", "backup"]}},
        "retry": {"attempts": 1},
        "cache": {"enabled": False},
        "breaker": {
            "consecutive_failures": 1,
            "recovery_s": 1.0,
            "recovery_jitter": 0.0,
            "slow_start_s": slow_start_s,
        },
    }


async def _served(client: Any, count: int) -> Counter[str]:
    served: Counter[str] = Counter()
    for _ in range(count):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        served[response.headers["x-tidegate-served-by"]] += 1
    return served


def _clock(rt: Any) -> ManualClock:
    clock = rt.clock
    assert isinstance(clock, ManualClock)
    return clock


async def _recovered(client: Any, rt: Any, primary: Primary) -> None:
    """The primary fails once (its breaker opens), recovers, and its probe closes the breaker."""
    assert await _served(client, 1) == {"backup": 1}
    assert rt.breakers["primary"].state.value == "open"
    primary.down = False
    _clock(rt).advance(1.0)
    assert await _served(client, 1) == {"primary": 1}  # the half-open probe
    assert rt.breakers["primary"].state.value == "closed"


@pytest.mark.asyncio
async def test_a_recovered_primary_gets_its_share_back_over_the_window(tmp_path: Path) -> None:
    primary = Primary()
    handlers: dict[str, Callable[[Any, int], Any]] = {"primary": primary, "backup": backup}
    async with in_process_gateway(tmp_path, _config(10.0), handlers) as (client, rt):
        await _recovered(client, rt, primary)
        first = await _served(client, 300)  # at once: the floor, 10%
        _clock(rt).advance(5.0)
        halfway = await _served(client, 300)  # half the window: 50%
        ready = (await client.get("/readyz")).json()
        _clock(rt).advance(5.0)
        after = await _served(client, 50)
    # Binomial(300, p), about 6 standard deviations either side.
    assert 9 <= first["primary"] <= 60
    assert 100 <= halfway["primary"] <= 200
    assert after == {"primary": 50}
    assert ready["slow_start"] == {"primary": pytest.approx(0.5)}


@pytest.mark.asyncio
async def test_without_a_window_the_primary_gets_everything_back_at_once(tmp_path: Path) -> None:
    primary = Primary()
    handlers: dict[str, Callable[[Any, int], Any]] = {"primary": primary, "backup": backup}
    async with in_process_gateway(tmp_path, _config(0.0), handlers) as (client, rt):
        await _recovered(client, rt, primary)
        assert await _served(client, 100) == {"primary": 100}
        assert (await client.get("/readyz")).json()["slow_start"] == {}
