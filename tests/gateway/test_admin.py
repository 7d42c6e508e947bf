"""The admin API: flags with an audit trail, the kill switch, breakers, queues, pending actions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.admin_harness import admin_auth, prompt_flag
from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake

pytestmark = pytest.mark.asyncio

ADMIN = "tg-admin-key"
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "auth": admin_auth(tmp_path, ADMIN),
        "providers": {"p": fake("hi", model="m-1")},
        "models": {"chat": {"providers": ["p"]}},
        "flags": [prompt_flag()],
        **extra,
    }


def admin(client: httpx.AsyncClient) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


async def test_kill_switch_round_trip_with_audit(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """Switching answering off refuses requests with 503; the audit says who, why and when."""
    async with gateway_client(config(tmp_path)) as (client, _):
        off = await client.post(
            "/admin/kill-switch",
            json={"mode": "unavailable", "who": "oncall", "why": "provider incident"},
            headers=admin(client),
        )
        assert off.status_code == 200
        assert (off.json()["old"], off.json()["new"]) == (None, "unavailable")
        refused = await client.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "unavailable"
        await client.post(
            "/admin/kill-switch",
            json={"mode": "full", "who": "oncall", "why": "fixed"},
            headers=admin(client),
        )
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        audit = (await client.get("/admin/audit?flag=answer.mode", headers=admin(client))).json()
        assert [(a["new"], a["who"], a["why"]) for a in audit] == [
            ("full", "oncall", "fixed"),
            ("unavailable", "oncall", "provider incident"),
        ]
        assert all(a["at"] > 1_600_000_000 for a in audit)


async def test_flags_are_typed_and_need_who_and_why(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """A value outside the flag's spec or a change without who/why is a 400; a good one sticks."""
    async with gateway_client(config(tmp_path)) as (client, app):
        bad = await client.put(
            "/admin/flags/prompt.version",
            json={"value": "v9", "who": "a", "why": "b"},
            headers=admin(client),
        )
        assert bad.status_code == 400
        anonymous = await client.put(
            "/admin/flags/prompt.version", json={"value": "v2"}, headers=admin(client)
        )
        assert anonymous.status_code == 400
        good = await client.put(
            "/admin/flags/prompt.version",
            json={"value": "v2", "who": "dev", "why": "ship"},
            headers=admin(client),
        )
        assert good.status_code == 200
        flags = (await client.get("/admin/flags", headers=admin(client))).json()
        assert flags["prompt.version"]["value"] == "v2"
        assert app.runtime.flags.get("prompt.version") == "v2"
        unknown = await client.put(
            "/admin/flags/nope", json={"value": 1, "who": "a", "why": "b"}, headers=admin(client)
        )
        assert unknown.status_code == 404


async def test_admin_needs_an_admin_key(gateway_client: AppFactory, tmp_path: Path) -> None:
    """An API key is not an admin key; without an admin keys file the API does not exist."""
    async with gateway_client(config(tmp_path)) as (client, _):
        assert (await client.get("/admin/flags")).status_code == 401
    plain = {"providers": {"p": fake("hi")}, "models": {"chat": {"providers": ["p"]}}}
    async with gateway_client(plain) as (client, _):
        assert (await client.get("/admin/flags", headers=admin(client))).status_code == 404


async def test_breakers_and_queues_are_visible(gateway_client: AppFactory, tmp_path: Path) -> None:
    """Operators can read each breaker and the admission queues."""
    async with gateway_client(config(tmp_path)) as (client, _):
        breakers = (await client.get("/admin/breakers", headers=admin(client))).json()
        assert breakers["p"]["state"] == "closed"
        await client.post("/v1/chat/completions", json=CHAT)
        queues = (await client.get("/admin/admission", headers=admin(client))).json()
        assert queues["in_flight"] == 0
        assert queues["depth"] == {"critical": 0, "standard": 0, "batch": 0}
        assert queues["finished"]["standard"] == 1


async def test_pending_action_is_decided_exactly_once(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """Propose, approve once; a second decision is 409; an unknown id is 404."""
    async with gateway_client(config(tmp_path)) as (client, _):
        proposed = await client.post(
            "/v1/actions",
            json={"kind": "refund", "payload": {"order": 1042}, "ttl_s": 60, "who": "agent"},
            headers=admin(client),
        )
        assert proposed.status_code == 201
        action_id = proposed.json()["id"]
        approved = await client.post(
            f"/v1/actions/{action_id}/approve", json={"who": "alice"}, headers=admin(client)
        )
        assert approved.json()["status"] == "approved"
        again = await client.post(
            f"/v1/actions/{action_id}/reject", json={"who": "bob"}, headers=admin(client)
        )
        assert again.status_code == 409
        assert again.json()["error"]["code"] == "already_decided"
        seen = (await client.get(f"/v1/actions/{action_id}", headers=admin(client))).json()
        assert (seen["status"], seen["decided_by"]) == ("approved", "alice")
        assert (await client.get("/v1/actions/nope", headers=admin(client))).status_code == 404
