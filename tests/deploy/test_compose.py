"""docker-compose.yml and its nginx: validated by docker-compose itself, then read."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.deploy.conftest import (
    COMPOSE_CONFIG,
    COMPOSE_FILE,
    DEPLOY,
    NGINX_CONF,
    ROOT,
    SECRET_NAME,
    load_with_secrets,
    nginx_directive,
    seconds,
)
from tidegate.ops.cli import check_app
from tidegate.providers.script import load_script

#: The API key of the local stack, as docs/deploy.md gives it.
LOCAL_KEY = "tg-compose-local-key-not-a-secret"
GATEWAYS = ("gateway-1", "gateway-2")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    return data


def test_docker_compose_validates_the_file() -> None:
    """`docker-compose config -q` (no engine needed) accepts the file."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (Debian package docker-compose)")
    result = subprocess.run(
        [binary, "--file", str(COMPOSE_FILE), "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_two_gateway_replicas_sit_behind_nginx(compose: dict[str, Any]) -> None:
    """Two gateway services from one image; nginx's upstream names both on the config's port."""
    services = compose["services"]
    assert set(GATEWAYS) <= set(services)
    assert {services[g]["image"] for g in GATEWAYS} == {"tidegate:local"}
    port = yaml.safe_load(COMPOSE_CONFIG.read_text(encoding="utf-8"))["server"]["port"]
    servers = [args.split(" ")[0] for args in nginx_directive("server")]
    assert sorted(servers) == [f"{g}:{port}" for g in GATEWAYS]
    assert set(GATEWAYS) <= set(services["nginx"]["depends_on"])
    assert {"postgres", "redis"} <= set(services)


def test_stop_grace_period_outlasts_the_drain(compose: dict[str, Any], tmp_path: Path) -> None:
    """Each gateway's stop_grace_period is longer than server.drain_seconds; SIGTERM stops it."""
    config = load_with_secrets(COMPOSE_CONFIG, tmp_path)
    for name in GATEWAYS:
        service = compose["services"][name]
        assert seconds(service["stop_grace_period"]) > config.server.drain_seconds, name
        assert service["stop_signal"] == "SIGTERM"
        assert "exec tidegate serve" in " ".join(service["command"]), "tidegate must be PID 1"
    nginx = compose["services"]["nginx"]
    assert seconds(nginx["stop_grace_period"]) > config.server.drain_seconds


def test_every_service_has_a_healthcheck(compose: dict[str, Any]) -> None:
    """Compose knows when each service is ready; gateways report readiness, not just liveness."""
    for name, service in compose["services"].items():
        assert "healthcheck" in service, name
        assert service["healthcheck"]["test"][0] == "CMD", name
    for name in GATEWAYS:
        assert "/readyz" in compose["services"][name]["healthcheck"]["test"][-1]


def test_config_and_secrets_are_mounted_as_files(compose: dict[str, Any]) -> None:
    """The gateway config is a read-only mount, secrets are compose secrets, no env holds one."""
    for name in GATEWAYS:
        service = compose["services"][name]
        assert "./deploy/compose/tidegate.yaml:/etc/tidegate/tidegate.yaml:ro" in service["volumes"]
        assert set(service["secrets"]) == {
            "tidegate_keys",
            "tidegate_admin_keys",
            "tidegate_pgpass",
        }
    for name, service in compose["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if SECRET_NAME.search(key):
                assert key.endswith("_FILE"), name
                assert str(value).startswith("/run/secrets/"), name
    for name, secret in compose["secrets"].items():
        assert (ROOT / secret["file"]).is_file(), name


def test_the_gateway_config_reads_the_mounted_secrets(compose: dict[str, Any]) -> None:
    """The config's key file and password file are where compose mounts and copies them."""
    raw = yaml.safe_load(COMPOSE_CONFIG.read_text(encoding="utf-8"))
    assert raw["auth"]["keys_file"] == "/run/secrets/tidegate_keys"
    passfile = raw["state"]["url"].split("passfile=", 1)[1]
    command = " ".join(compose["services"]["gateway-1"]["command"])
    assert f"install -m 0600 /run/secrets/tidegate_pgpass {passfile}" in command
    assert passfile.startswith("/tmp/")
    assert "/tmp" in compose["services"]["gateway-1"]["tmpfs"]


def test_the_database_password_files_agree() -> None:
    """The password Postgres is created with is the one in the gateway's libpq password file."""
    password = (DEPLOY / "compose/secrets/postgres-password").read_text(encoding="utf-8").strip()
    entries = [
        line
        for line in (DEPLOY / "compose/secrets/pgpass").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    ]
    assert entries == [f"postgres:5432:tidegate:tidegate:{password}"]


def test_the_documented_local_key_is_the_one_the_stack_accepts() -> None:
    """keys.yaml holds the digest of the key docs/deploy.md tells people to use."""
    keys = yaml.safe_load((DEPLOY / "compose/keys.yaml").read_text(encoding="utf-8"))["keys"]
    assert [k["sha256"] for k in keys] == [hashlib.sha256(LOCAL_KEY.encode()).hexdigest()]
    assert LOCAL_KEY in (ROOT / "docs/deploy.md").read_text(encoding="utf-8")


def test_the_fake_upstream_answers_every_model_the_config_routes_to() -> None:
    """The fake upstream's script is valid and names each provider model of the gateway config."""
    script = load_script(DEPLOY / "compose/fake-upstream.yaml")
    raw = yaml.safe_load(COMPOSE_CONFIG.read_text(encoding="utf-8"))
    for provider in raw["providers"].values():
        assert provider["model"] in script.models
        assert provider["base_url"] == "http://fake-upstream:9100/v1"


def test_images_are_pinned_to_exact_versions(compose: dict[str, Any]) -> None:
    """Third-party images name an exact release (PostgreSQL's are major.minor); ours is built."""
    for name, service in compose["services"].items():
        image = service["image"]
        if image == "tidegate:local":
            assert service["build"]["context"] == ".", name
            continue
        assert re.search(r":\d+\.\d+(\.\d+)?-", image), f"{name}: {image}"


def test_nginx_passes_streams_through_and_keeps_the_request_id() -> None:
    """No buffering of server-sent events; the caller's X-Request-ID reaches the gateway."""
    assert nginx_directive("proxy_buffering") == ["off"]
    headers = nginx_directive("proxy_set_header")
    assert "X-Request-ID $tidegate_request_id" in headers
    assert nginx_directive("proxy_next_upstream") == ["error"], "never resend a sent request"


def test_nginx_waits_longer_than_the_gateway(tmp_path: Path) -> None:
    """proxy_read_timeout outlasts the gateway's request deadline, so the gateway answers first."""
    config = load_with_secrets(COMPOSE_CONFIG, tmp_path)
    (read,) = nginx_directive("proxy_read_timeout")
    assert seconds(read) > config.server.request_timeout_s


#: The admin key of the local stack, as docs/deploy.md gives it.
LOCAL_ADMIN_KEY = "tg-compose-local-admin-key-not-a-secret"


def test_the_admin_port_is_published_on_the_host_loopback_only(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """The gateways have an admin listener and an admin key from a compose secret; only
    gateway-1's admin port is published, on 127.0.0.1; nothing else of a gateway is."""
    config = load_with_secrets(COMPOSE_CONFIG, tmp_path)
    raw = yaml.safe_load(COMPOSE_CONFIG.read_text(encoding="utf-8"))
    assert config.server.admin_port is not None
    assert config.server.admin_port != config.server.port
    assert raw["auth"]["admin_keys_file"] == "/run/secrets/tidegate_admin_keys"
    assert compose["services"]["gateway-1"]["ports"] == [
        f"127.0.0.1:9090:{config.server.admin_port}"
    ]
    assert "ports" not in compose["services"]["gateway-2"]
    for name, service in compose["services"].items():
        for published in service.get("ports", []):
            assert str(published).startswith("127.0.0.1:"), name
    keys = yaml.safe_load((DEPLOY / "compose/admin-keys.yaml").read_text(encoding="utf-8"))["keys"]
    assert [k["sha256"] for k in keys] == [hashlib.sha256(LOCAL_ADMIN_KEY.encode()).hexdigest()]
    assert LOCAL_ADMIN_KEY in (ROOT / "docs/deploy.md").read_text(encoding="utf-8")


def test_nginx_refuses_the_admin_paths_at_the_public_entrance() -> None:
    """/admin/*, /console and /v1/actions are answered 404 by nginx itself; no server of nginx
    proxies to a gateway's admin port."""
    text = NGINX_CONF.read_text(encoding="utf-8")
    assert "location ~ ^/(admin|console|v1/actions)(/|$) {\n            return 404;" in text
    assert ":9090" not in text


def test_the_timeout_check_passes_on_the_compose_stack() -> None:
    """`tidegate check timeouts` finds nothing wrong with the compose file and its gateway config."""
    result = CliRunner().invoke(
        check_app, ["timeouts", "--config", str(COMPOSE_CONFIG), "--compose", str(COMPOSE_FILE)]
    )
    assert result.exit_code == 0, result.output
    assert "WARNING" not in result.output
