"""The admin listener (``server.admin_port``): the admin API, the console and /metrics on their
own port; the public port answers 404 for them. In-process (ASGI) and over real sockets."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.gateway.admin_harness import two_sockets
from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake, write_config
from tidegate.errors import ConfigError
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config

ADMIN = "tg-admin-key"
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
BEARER = {"Authorization": f"Bearer {ADMIN}"}


def config(tmp_path: Path, **server: Any) -> dict[str, Any]:
    digest = hashlib.sha256(ADMIN.encode()).hexdigest()
    (tmp_path / "admin.yaml").write_text(
        yaml.safe_dump({"keys": [{"id": "oncall", "sha256": digest}]})
    )
    return {
        "server": {"admin_port": 0, **server},
        "auth": {"keys_file": "keys.yaml", "admin_keys_file": "admin.yaml"},
        "providers": {"p": fake("hi", model="m-1")},
        "models": {"chat": {"providers": ["p"]}},
    }


def admin_client(app: Gateway) -> httpx.AsyncClient:
    assert app.admin is not None
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app.admin), base_url="http://admin")


@pytest.mark.asyncio
async def test_the_public_port_answers_404_for_what_the_admin_listener_serves(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """With an admin port, /admin/*, /v1/actions, /console and /metrics are 404 on the public
    app; the model API is unchanged."""
    async with gateway_client(config(tmp_path)) as (client, _):
        for path in ("/admin/flags", "/v1/actions/x", "/console", "/metrics"):
            answer = await client.get(path, headers=BEARER)
            assert answer.status_code == 404, path
            assert answer.json()["error"]["code"] == "not_found"
        assert (await client.post("/admin/kill-switch", headers=BEARER)).status_code == 404
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await client.get("/healthz")).status_code == 200


@pytest.mark.asyncio
async def test_the_admin_listener_serves_the_admin_api_and_metrics_only(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """The admin app answers the admin API (with an admin key), /metrics and /healthz, and 404
    for the model API."""
    async with gateway_client(config(tmp_path)) as (client, app):
        await client.post("/v1/chat/completions", json=CHAT)
        async with admin_client(app) as admin:
            assert (await admin.get("/admin/breakers")).status_code == 401
            breakers = await admin.get("/admin/breakers", headers=BEARER)
            assert breakers.json()["p"]["state"] == "closed"
            metrics = await admin.get("/metrics")
            assert 'route="chat"' in metrics.text
            assert (await admin.get("/healthz")).status_code == 200
            assert (await admin.post("/v1/chat/completions", json=CHAT)).status_code == 404
            assert (await admin.post("/metrics")).status_code == 405
            assert (await admin.get("/")).headers["location"] == "/console"


@pytest.mark.asyncio
async def test_admin_metrics_off_keeps_metrics_on_the_public_port(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    async with gateway_client(config(tmp_path, admin_metrics=False)) as (client, app):
        assert (await client.get("/metrics")).status_code == 200
        async with admin_client(app) as admin:
            assert (await admin.get("/metrics")).status_code == 404


@pytest.mark.asyncio
async def test_the_console_signs_in_with_a_cookie_and_flips_the_kill_switch(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """Without a key the console is the sign-in form; a wrong key is 401; the right one sets an
    HttpOnly SameSite=Strict cookie that the admin API then accepts (audited under its id)."""
    async with gateway_client(config(tmp_path)) as (client, app), admin_client(app) as admin:
        page = await admin.get("/console")
        assert page.status_code == 200
        assert 'name="key"' in page.text
        assert (await admin.get("/console/stats.json")).status_code == 401
        wrong = await admin.post("/console/login", data={"key": "nope"})
        assert wrong.status_code == 401
        signed = await admin.post("/console/login", data={"key": ADMIN})
        assert signed.status_code == 303
        cookie = signed.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        page = await admin.get("/console")
        assert 'data-operator="oncall"' in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        switched = await admin.post(
            "/admin/kill-switch", json={"mode": "unavailable", "who": "oncall", "why": "test"}
        )
        assert switched.status_code == 200
        stats = (await admin.get("/console/stats.json")).json()
        assert stats["answer_mode"] == "unavailable"
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 503
        script = await admin.get("/console/static/console.js")
        assert script.headers["content-type"].startswith("text/javascript")
        assert (await admin.get("/console/static/nope.js")).status_code == 404
        out = await admin.post("/console/logout")
        assert "Max-Age=0" in out.headers["set-cookie"]


def test_the_admin_port_must_differ_from_the_public_one(tmp_path: Path) -> None:
    path = write_config(
        tmp_path, {**config(tmp_path), "server": {"port": 9000, "admin_port": 9000}}
    )
    with pytest.raises(ConfigError, match="admin_port must differ"):
        load_config(path, env={})


def test_one_server_on_two_sockets_routes_by_the_port_a_connection_came_to(
    tmp_path: Path,
) -> None:
    """Over real sockets: the admin port serves the admin API and the console, the public port
    answers 404 for them and serves the model API (kept-alive connections stay where they are)."""
    with two_sockets(tmp_path, config(tmp_path)) as (public, admin, _):
        with httpx.Client(base_url=public, headers=BEARER) as client:
            assert client.get("/admin/flags").status_code == 404
            assert client.get("/metrics").status_code == 404
            assert client.get("/console").status_code == 404
        with httpx.Client(base_url=admin, headers=BEARER) as client:
            assert client.get("/admin/flags").status_code == 200
            assert client.get("/metrics").status_code == 200
            assert client.get("/console").status_code == 200
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 404
