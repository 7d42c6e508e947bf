"""Automatic failover goes by the eval gate: a fallback is used only when its latest verdict is go
or review, or the config approves it (an override, which a block verdict still beats)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake, unvetted
from tidegate.ops.eval import EvalVerdict, record_verdict

pytestmark = pytest.mark.asyncio

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def config(tmp_path: Path, **backup: Any) -> dict[str, Any]:
    """A failing primary and a backup approved in the config (``backup`` changes its section)."""
    return {
        "state": {"url": f"sqlite:///{tmp_path}/state.db"},
        "providers": {
            "primary": fake(model="m-1", faults=[{"kind": "http", "status": 503}]),
            "backup": {**fake("from backup", model="m-2"), **backup},
        },
        "models": {"chat": {"providers": ["primary", "backup"]}},
        "retry": {"attempts": 1},
        "cache": {"enabled": False},
    }


async def test_blocked_fallback_is_skipped_even_when_all_else_is_down(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """With the primary down and the only fallback blocked, the caller gets an honest 503: the
    block verdict wins over the config's approval (``fake`` approves every provider)."""
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


def _unvetted(tmp_path: Path) -> dict[str, Any]:
    """The config with a backup the config does not approve: its verdict decides."""
    data = config(tmp_path)
    data["providers"]["backup"] = unvetted(data["providers"]["backup"])
    return data


async def test_a_fallback_without_a_verdict_is_never_used(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """No verdict and no approval: the primary (itself unjudged) is tried, and its error is the
    caller's; the header shows the fallback skipped and the fallback is never called."""
    data = _unvetted(tmp_path)
    data["providers"]["primary"] = unvetted(data["providers"]["primary"])
    async with gateway_client(data) as (client, app):
        assert app.runtime.approved_fallbacks() == frozenset()
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503
        assert (
            response.headers["x-tidegate-tried"]
            == "primary=overloaded, backup=skipped:not_approved"
        )
        assert len(app.runtime.providers["primary"].attempts) == 1
        assert app.runtime.providers["backup"].attempts == []


@pytest.mark.parametrize("verdict", [EvalVerdict.GO, EvalVerdict.REVIEW])
async def test_a_go_or_review_verdict_makes_a_fallback(
    gateway_client: AppFactory, tmp_path: Path, verdict: EvalVerdict
) -> None:
    """The evidence alone approves it: no approved_fallback in the config."""
    record_verdict(f"sqlite:///{tmp_path}/state.db", "backup", verdict, {})
    async with gateway_client(_unvetted(tmp_path)) as (client, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        assert response.headers["x-tidegate-served-by"] == "backup"
        assert response.headers["x-tidegate-tried"] == "primary=overloaded, backup=ok"


async def test_a_verdict_recorded_while_running_takes_effect(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """The verdicts are reloaded: a go recorded after start-up approves the fallback."""
    from tidegate.gateway.runtime import refresh_verdicts

    async with gateway_client(_unvetted(tmp_path)) as (_, app):
        assert "backup" not in app.runtime.approved_fallbacks()
        record_verdict(f"sqlite:///{tmp_path}/state.db", "backup", EvalVerdict.GO, {})
        refresh_verdicts(app.runtime)
        assert "backup" in app.runtime.approved_fallbacks()


async def test_approved_fallback_false_is_never_even_with_a_go_verdict(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    record_verdict(f"sqlite:///{tmp_path}/state.db", "backup", EvalVerdict.GO, {})
    async with gateway_client(config(tmp_path, approved_fallback=False)) as (client, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503
        assert response.headers["x-tidegate-tried"].endswith("backup=skipped:not_approved")


async def test_an_override_is_used_without_a_verdict(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """approved_fallback: true (as ``fake`` sets it) serves without any verdict."""
    async with gateway_client(config(tmp_path)) as (client, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.headers["x-tidegate-served-by"] == "backup"


async def test_each_override_is_logged_at_start_up_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One fallback_override line per provider the config approves, naming it and the reason."""
    import structlog

    from tidegate.gateway import approval
    from tidegate.gateway.config import Config

    data = config(tmp_path, approved_fallback_reason="same model, second account")
    data["providers"]["other"] = unvetted(fake(model="m-3"))
    with capture_logs() as logs:
        # A fresh logger: the module's may be bound already (cached on first use elsewhere).
        monkeypatch.setattr(approval, "log", structlog.get_logger("tidegate"))
        approval.log_fallback_overrides(Config.model_validate(data).providers)
    overrides = [(e["provider"], e["reason"]) for e in logs if e["event"] == "fallback_override"]
    assert overrides == [("primary", "none given"), ("backup", "same model, second account")]
