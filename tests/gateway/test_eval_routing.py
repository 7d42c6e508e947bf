"""Automatic failover respects the eval gate: a provider whose latest verdict is block is skipped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake
from tidegate.ops.eval import EvalVerdict, record_verdict

pytestmark = pytest.mark.asyncio

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def config(tmp_path: Path) -> dict[str, Any]:
    return {
        "state": {"url": f"sqlite:///{tmp_path}/state.db"},
        "providers": {
            "primary": fake(model="m-1", faults=[{"kind": "http", "status": 503}]),
            "backup": fake("from backup", model="m-2"),
        },
        "models": {"chat": {"providers": ["primary", "backup"]}},
        "retry": {"attempts": 1},
        "cache": {"enabled": False},
    }


async def test_blocked_fallback_is_skipped_even_when_all_else_is_down(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """With the primary down and the only fallback blocked, the caller gets an honest 503."""
    record_verdict(
        f"sqlite:///{tmp_path}/state.db", "backup", EvalVerdict.BLOCK, {"pass_rate": 0.5}
    )
    async with gateway_client(config(tmp_path)) as (client, app):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503
        assert response.json()["error"]["retryable"] is True
        assert (
            response.headers["x-tidegate-tried"]
            == "primary=overloaded, backup=skipped:not_approved"
        )
        assert app.runtime.providers["backup"].attempts == []


async def test_a_later_go_verdict_restores_the_fallback(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """The latest verdict counts: after block then go, the fallback serves again."""
    store = f"sqlite:///{tmp_path}/state.db"
    record_verdict(store, "backup", EvalVerdict.BLOCK, {})
    record_verdict(store, "backup", EvalVerdict.GO, {})
    async with gateway_client(config(tmp_path)) as (client, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        assert response.headers["x-tidegate-served-by"] == "backup"
