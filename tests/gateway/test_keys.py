"""Virtual keys: ``/admin/keys`` creates, changes, rotates and revokes keys in the store; each
works (or is refused with its own code) at once on the replica that wrote it, and on the others
after their next check of the store; its own rate limit and budget are honoured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.admin_harness import admin_auth
from tests.gateway.harness import in_process_gateway
from tidegate.clock import ManualClock
from tidegate.gateway.auth import hash_key
from tidegate.gateway.keys import KEY_CHECK_S, sync_keys
from tidegate.gateway.runtime import Runtime
from tidegate.state.base import KeyAudit, KeyRecord

pytestmark = pytest.mark.asyncio

ADMIN = "tg-admin-key"
OPS = {"Authorization": f"Bearer {ADMIN}"}
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def answer(request: Any, attempt: int) -> dict[str, Any]:
    return {"text": "hi", "prompt_tokens": 3, "completion_tokens": 2}


def config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "auth": admin_auth(tmp_path, ADMIN),
        "providers": {"p": {"type": "fake", "model": "m-1"}},
        "models": {"chat": {"providers": ["p"]}, "other": {"providers": ["p"]}},
        **extra,
    }


async def chat(client: httpx.AsyncClient, key: str, model: str = "chat") -> httpx.Response:
    return await client.post(
        "/v1/chat/completions",
        json={**CHAT, "model": model},
        headers={"Authorization": f"Bearer {key}"},
    )


async def create(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    made = await client.post(
        "/admin/keys", json={"tenant": "shop", "user": "u9", **body}, headers=OPS
    )
    assert made.status_code == 201, made.text
    found: dict[str, Any] = made.json()
    return found


async def test_a_created_key_works_and_is_shown_once_without_its_digest(tmp_path: Path) -> None:
    async with in_process_gateway(tmp_path, config(tmp_path), {"p": answer}) as (client, rt):
        made = await create(client, id="svc", priority="critical", metadata={"team": "pay"})
        secret = made["key"]
        assert secret.startswith("tg-")
        assert len(secret) > 40
        assert "sha256" not in made
        assert made["sha256_prefix"] == hash_key(secret)[:12]
        assert (made["state"], made["created_by"], made["priority"]) == (
            "active",
            "oncall",
            "critical",
        )
        assert (await chat(client, secret)).status_code == 200
        shown = (await client.get("/admin/keys/svc", headers=OPS)).json()
        assert "key" not in shown
        assert shown["metadata"] == {"team": "pay"}
        listed = (await client.get("/admin/keys", headers=OPS)).json()["keys"]
        assert {(k["id"], k["source"]) for k in listed} >= {("svc", "store"), ("test", "file")}
        assert all("sha256" not in k for k in listed)
        stored = await rt.stores.keys.get("svc")
        assert stored is not None
        assert stored.sha256 == hash_key(secret)
        assert secret not in repr(await rt.stores.keys.all())


async def test_revoked_and_expired_keys_get_their_own_401(tmp_path: Path) -> None:
    async with in_process_gateway(tmp_path, config(tmp_path), {"p": answer}) as (client, rt):
        clock = rt.clock
        assert isinstance(clock, ManualClock)
        revoked = await create(client, id="gone")
        expiring = await create(client, id="brief", expires_in_s=60)
        done = await client.post("/admin/keys/gone/revoke", json={"why": "leaked"}, headers=OPS)
        assert done.status_code == 200
        assert done.json()["state"] == "revoked"
        refused = await chat(client, revoked["key"])
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "key_revoked"
        assert (await chat(client, expiring["key"])).status_code == 200
        clock.advance(61)
        lapsed = await chat(client, expiring["key"])
        assert lapsed.status_code == 401
        assert lapsed.json()["error"]["code"] == "key_expired"
        unknown = await chat(client, "tg-never-issued")
        assert unknown.json()["error"]["code"] == "invalid_api_key"
        audit = (await client.get("/admin/keys/gone/audit", headers=OPS)).json()
        assert [(a["action"], a["who"], a["why"]) for a in audit] == [
            ("revoke", "oncall", "leaked"),
            ("create", "oncall", ""),
        ]
        assert "revoked_at" in audit[0]["detail"]
        assert audit[0]["at"] >= 1_000_000.0


async def test_rotation_keeps_the_old_secret_for_its_grace_only(tmp_path: Path) -> None:
    async with in_process_gateway(tmp_path, config(tmp_path), {"p": answer}) as (client, rt):
        assert isinstance(rt.clock, ManualClock)
        old = (await create(client, id="svc"))["key"]
        rotated = await client.post("/admin/keys/svc/rotate", json={"grace_s": 30}, headers=OPS)
        assert rotated.status_code == 200, rotated.text
        new = rotated.json()["key"]
        assert new != old
        assert (await chat(client, old)).status_code == 200
        assert (await chat(client, new)).status_code == 200
        rt.clock.advance(31)
        stale = await chat(client, old)
        assert stale.status_code == 401
        assert stale.json()["error"]["code"] == "key_expired"
        assert (await chat(client, new)).status_code == 200
        audit = (await client.get("/admin/keys/svc/audit", headers=OPS)).json()
        assert audit[0]["action"] == "rotate"
        assert audit[0]["detail"]["sha256"] == "changed"


async def test_a_keys_own_rate_limit_and_budget_are_honoured(tmp_path: Path) -> None:
    async with in_process_gateway(tmp_path, config(tmp_path), {"p": answer}) as (client, _):
        limited = (await create(client, rate_limit={"rate_per_s": 0.001, "burst": 2}))["key"]
        assert [(await chat(client, limited)).status_code for _ in range(2)] == [200, 200]
        third = await chat(client, limited)
        assert third.status_code == 429
        assert third.json()["error"]["code"] == "rate_limited"
        assert "per-key" in third.json()["error"]["message"]
        budgeted = (await create(client, user="u8", budget={"calls": 1}))["key"]
        assert (await chat(client, budgeted)).status_code == 200
        spent = await chat(client, budgeted)
        assert spent.status_code == 429
        assert spent.json()["error"]["code"] == "budget_exceeded"


async def test_patch_changes_models_and_bad_bodies_are_400(tmp_path: Path) -> None:
    async with in_process_gateway(tmp_path, config(tmp_path), {"p": answer}) as (client, _):
        secret = (await create(client, id="svc"))["key"]
        assert (await chat(client, secret, "other")).status_code == 200
        changed = await client.patch(
            "/admin/keys/svc", json={"models": ["chat"], "why": "least privilege"}, headers=OPS
        )
        assert changed.status_code == 200
        assert changed.json()["models"] == ["chat"]
        assert (await chat(client, secret, "other")).status_code == 403
        for bad in (
            {"tenant": "t"},
            {"tenant": "t", "user": "u", "priority": "vip"},
            {"tenant": "t", "user": "u", "budget": {}},
            {"tenant": "t", "user": "u", "x": 1},
        ):
            refused = await client.post("/admin/keys", json=bad, headers=OPS)
            assert refused.status_code == 400, bad
        again = await client.post(
            "/admin/keys", json={"id": "svc", "tenant": "t", "user": "u"}, headers=OPS
        )
        assert again.status_code == 400
        clash = await client.post(
            "/admin/keys", json={"id": "test", "tenant": "t", "user": "u"}, headers=OPS
        )
        assert clash.status_code == 400  # the keys file's id
        assert (await client.get("/admin/keys/nobody", headers=OPS)).status_code == 404
        assert (await client.get("/admin/keys")).status_code == 401


async def test_another_replicas_change_arrives_within_the_check_interval(tmp_path: Path) -> None:
    """A key written to the store by someone else is picked up by the next check (or at once on
    a notice), never by a request: identifying stays a dict lookup."""
    async with in_process_gateway(tmp_path, config(tmp_path), {"p": answer}) as (client, rt):
        assert isinstance(rt.clock, ManualClock)
        await sync_keys(rt, changed=True)
        secret = "tg-written-elsewhere"
        record = KeyRecord(id="far", sha256=hash_key(secret), tenant="shop", user="far")
        await rt.stores.keys.put(
            record, expected_revision=0, audit=KeyAudit("far", "create", "other", "", 0.0, {})
        )
        assert (await chat(client, secret)).status_code == 401
        await sync_keys(rt)  # checked less than a second ago: nothing asked
        assert (await chat(client, secret)).status_code == 401
        rt.clock.advance(KEY_CHECK_S)
        await sync_keys(rt)
        assert (await chat(client, secret)).status_code == 200
        await sync_keys(rt, changed=True)  # a notice, nothing new: the same ring
        ring = rt.keys
        await sync_keys(rt, changed=True)
        assert rt.keys is ring


async def test_sighup_reload_keeps_the_store_keys(tmp_path: Path) -> None:
    from tidegate.gateway.app import Gateway

    async with in_process_gateway(tmp_path, config(tmp_path), {"p": answer}) as (client, rt):
        secret = (await create(client))["key"]
        gateway = Gateway(rt.config, rt.config_path, runtime=rt)
        gateway.reload_keys()
        assert (await chat(client, secret)).status_code == 200


def _runtime_type_check(rt: Runtime) -> None:  # the runtime is what the keys module holds
    from tidegate.gateway.keys import KeyHolder

    holder: KeyHolder = rt
    assert holder is rt
