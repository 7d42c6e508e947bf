"""``tidegate admin``: the CLI against a real gateway on loopback (and a stub for rollouts)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from tests.gateway.admin_harness import admin_auth, prompt_flag
from tests.gateway.harness import fake, running_gateway
from tidegate.ops.admin_client import (
    ADMIN_KEY_FILE_ENV,
    ADMIN_URL_ENV,
    AdminClient,
    admin_app,
    parse_value,
    read_admin_key,
)

runner = CliRunner()

ADMIN = "tg-admin-key-for-the-cli"


def _config(tmp_path: Path) -> dict[str, Any]:
    return {
        "auth": admin_auth(tmp_path, ADMIN),
        "providers": {"p": fake("hi", model="m-1")},
        "models": {"chat": {"providers": ["p"]}},
        "flags": [prompt_flag()],
    }


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "admin-key"
    path.write_text(ADMIN + "\n", encoding="utf-8")
    return path


@pytest.fixture
def gateway(tmp_path: Path, key_file: Path) -> Iterator[list[str]]:
    """A running gateway with an admin key; yields the CLI's leading arguments for it."""
    with running_gateway(tmp_path, _config(tmp_path)) as (base, _):
        yield ["--url", base, "--key-file", str(key_file)]


def admin(*args: str, env: dict[str, str] | None = None) -> Result:
    return runner.invoke(admin_app, list(args), env=env)


def as_json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def stub(status: int, body: Any) -> Iterator[str]:
    """A server that answers every request with ``status`` and ``body`` (JSON unless bytes)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# --------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("text", "value"),
    [("true", True), ("3", 3), ("0.5", 0.5), ("v2", "v2"), ('"3"', "3"), ("", "")],
)
def test_values_are_read_as_yaml_scalars(text: str, value: object) -> None:
    """A flag value is a YAML scalar: booleans, numbers and strings, quoting forces a string."""
    parsed = parse_value(text)
    assert parsed == value
    assert type(parsed) is type(value)


@pytest.mark.parametrize("text", ["[1, 2]", "{a: 1}", "null"])
def test_values_that_are_not_scalars_are_refused(text: str) -> None:
    """Lists, mappings and null are not flag values."""
    with pytest.raises(ValueError, match="VALUE must be"):
        parse_value(text)


def test_the_key_file_holds_exactly_one_key(tmp_path: Path) -> None:
    """The key is read without its newline; an empty, missing or multi-word file is refused."""
    path = tmp_path / "key"
    path.write_text("  abc \n", encoding="utf-8")
    assert read_admin_key(path) == "abc"
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        read_admin_key(path)
    path.write_text("abc def", encoding="utf-8")
    with pytest.raises(ValueError, match="one key"):
        read_admin_key(path)
    with pytest.raises(ValueError, match="cannot read"):
        read_admin_key(tmp_path / "missing")


def test_the_client_refuses_a_url_that_is_not_http() -> None:
    """Only http(s) base URLs are accepted, before any request."""
    with pytest.raises(ValueError, match="url"):
        AdminClient("ftp://host", "k")
    with pytest.raises(ValueError, match="decision"):
        AdminClient("http://host", "k").decide("a", "maybe", who="x")


# --------------------------------------------------------------------------- usage errors


def test_without_url_or_key_file_the_command_exits_2(key_file: Path) -> None:
    """Both the URL and the key file are needed; the message names the option and the variable."""
    no_url = admin("--key-file", str(key_file), "breakers", env={ADMIN_URL_ENV: ""})
    assert no_url.exit_code == 2
    assert ADMIN_URL_ENV in no_url.output
    no_key = admin("--url", "http://127.0.0.1:1", "breakers", env={ADMIN_KEY_FILE_ENV: ""})
    assert no_key.exit_code == 2
    assert ADMIN_KEY_FILE_ENV in no_key.output


def test_an_unreachable_gateway_exits_2(key_file: Path) -> None:
    """Nothing listening is a connection error: exit 2, saying which URL."""
    url = f"http://127.0.0.1:{_free_port()}"
    result = admin("--url", url, "--key-file", str(key_file), "breakers")
    assert result.exit_code == 2
    assert f"cannot reach {url}" in result.output


def test_a_value_that_is_not_a_scalar_exits_2_before_any_request(key_file: Path) -> None:
    """flags set refuses a list value itself (nothing listens at the URL)."""
    url = f"http://127.0.0.1:{_free_port()}"
    result = admin(
        "--url",
        url,
        "--key-file",
        str(key_file),
        "flags",
        "set",
        "x",
        "[1, 2]",
        "--who",
        "a",
        "--why",
        "b",
    )
    assert result.exit_code == 2
    assert "VALUE must be" in result.output
    assert "cannot reach" not in result.output


def test_set_needs_who_and_why(key_file: Path) -> None:
    """--who and --why are required options: a usage error without them."""
    result = admin(
        "--url", "http://127.0.0.1:1", "--key-file", str(key_file), "flags", "set", "x", "1"
    )
    assert result.exit_code == 2
    assert "--who" in result.output


# --------------------------------------------------------------------------- a live gateway


@pytest.mark.slow
def test_flags_get_lists_every_flag_as_a_table_or_json(gateway: list[str]) -> None:
    """flags get shows the built-in kill switch and the configured flags with their defaults."""
    table = admin(*gateway, "flags", "get")
    assert table.exit_code == 0, table.output
    assert "prompt.version" in table.stdout
    assert "answer.mode" in table.stdout
    flags = as_json(admin(*gateway, "flags", "get", "--json"))
    assert flags["prompt.version"]["value"] == "v1"
    assert flags["prompt.version"]["default"] == "v1"
    one = as_json(admin(*gateway, "--json", "flags", "get", "prompt.version"))
    assert list(one) == ["prompt.version"]


@pytest.mark.slow
def test_flags_get_of_an_unknown_flag_exits_1(gateway: list[str]) -> None:
    """Asking for a flag the gateway does not define exits 1 and lists the flags it has."""
    result = admin(*gateway, "flags", "get", "nope")
    assert result.exit_code == 1
    assert "no flag named 'nope'" in result.output
    assert "prompt.version" in result.output


@pytest.mark.slow
def test_flags_set_changes_the_flag_and_records_who_and_why(gateway: list[str]) -> None:
    """A set is visible at once and lands in the audit history with who and why."""
    changed = admin(
        *gateway, "flags", "set", "prompt.version", "v2", "--who", "dev", "--why", "ship"
    )
    assert changed.exit_code == 0, changed.output
    assert changed.stdout.startswith("prompt.version: ")
    assert "-> v2 (by dev: ship)" in changed.stdout
    assert as_json(admin(*gateway, "flags", "get", "--json"))["prompt.version"]["value"] == "v2"
    audit = as_json(admin(*gateway, "audit", "--flag", "prompt.version", "--json"))
    assert [(a["flag"], a["new"], a["who"], a["why"]) for a in audit] == [
        ("prompt.version", "v2", "dev", "ship")
    ]


@pytest.mark.slow
def test_a_value_the_gateway_refuses_exits_1_with_its_code(gateway: list[str]) -> None:
    """The server's 400 is printed with its status, code and message; the exit code is 1."""
    result = admin(*gateway, "flags", "set", "prompt.version", "v9", "--who", "a", "--why", "b")
    assert result.exit_code == 1
    assert "HTTP 400 invalid_request" in result.output
    assert "v9" in result.output


@pytest.mark.slow
def test_a_wrong_admin_key_is_refused_with_401(gateway: list[str], tmp_path: Path) -> None:
    """An unknown admin key is the gateway's refusal: exit 1, invalid_api_key."""
    wrong = tmp_path / "wrong-key"
    wrong.write_text("not-the-admin-key", encoding="utf-8")
    result = admin("--url", gateway[1], "--key-file", str(wrong), "breakers")
    assert result.exit_code == 1
    assert "HTTP 401 invalid_api_key" in result.output


@pytest.mark.slow
def test_the_environment_names_the_gateway_and_the_key_file(gateway: list[str]) -> None:
    """TIDEGATE_ADMIN_URL and TIDEGATE_ADMIN_KEY_FILE stand in for --url and --key-file."""
    env = {ADMIN_URL_ENV: gateway[1], ADMIN_KEY_FILE_ENV: gateway[3]}
    assert "p" in as_json(admin("breakers", "--json", env=env))


@pytest.mark.slow
def test_kill_switch_on_off_and_degraded_set_answer_mode(gateway: list[str]) -> None:
    """on is unavailable, degraded is degraded, off is full; each change is audited in order."""
    for state in ("on", "degraded", "off"):
        result = admin(*gateway, "kill-switch", state, "--who", "oncall", "--why", f"drill {state}")
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"kill switch {state}: answer.mode: ")
    audit = as_json(admin(*gateway, "audit", "--flag", "answer.mode", "--json"))
    assert [(a["new"], a["why"]) for a in audit] == [
        ("full", "drill off"),
        ("degraded", "drill degraded"),
        ("unavailable", "drill on"),
    ]
    limited = as_json(admin(*gateway, "audit", "--limit", "1", "--json"))
    assert len(limited) == 1
    table = admin(*gateway, "audit")
    assert table.exit_code == 0
    assert "drill on" in table.stdout
    assert "UTC" in table.stdout


@pytest.mark.slow
def test_kill_switch_refuses_a_state_it_does_not_know(gateway: list[str]) -> None:
    """Only on, off and degraded are states: anything else is a usage error."""
    result = admin(*gateway, "kill-switch", "maybe", "--who", "a", "--why", "b")
    assert result.exit_code == 2


@pytest.mark.slow
def test_breakers_and_queues_show_the_gateway_state(gateway: list[str]) -> None:
    """breakers lists each provider's state; queues lists each priority class."""
    breakers = admin(*gateway, "breakers")
    assert breakers.exit_code == 0, breakers.output
    assert "closed" in breakers.stdout
    assert as_json(admin(*gateway, "breakers", "--json"))["p"]["state"] == "closed"
    queues = admin(*gateway, "queues")
    assert queues.exit_code == 0, queues.output
    for klass in ("critical", "standard", "batch"):
        assert klass in queues.stdout
    assert "in flight 0" in queues.stdout
    assert as_json(admin(*gateway, "queues", "--json"))["in_flight"] == 0


@pytest.mark.slow
def test_an_action_is_proposed_then_decided_exactly_once(gateway: list[str]) -> None:
    """propose, approve; a second decision is refused with already_decided; get shows who."""
    propose = ["actions", "propose", "refund", "--payload", '{"order": 1042}', "--ttl", "60"]
    proposed = as_json(admin(*gateway, *propose, "--who", "agent", "--json"))
    assert (proposed["status"], proposed["payload"]) == ("pending", {"order": 1042})
    action_id = proposed["id"]
    approved = admin(*gateway, "actions", "approve", action_id, "--who", "alice")
    assert approved.exit_code == 0, approved.output
    assert "approved" in approved.stdout
    again = admin(*gateway, "actions", "reject", action_id, "--who", "bob")
    assert again.exit_code == 1
    assert "HTTP 409 already_decided" in again.output
    seen = as_json(admin(*gateway, "actions", "get", action_id, "--json"))
    assert (seen["status"], seen["decided_by"]) == ("approved", "alice")
    missing = admin(*gateway, "actions", "get", "no-such-action")
    assert missing.exit_code == 1
    assert "HTTP 404" in missing.output


@pytest.mark.slow
def test_a_payload_that_is_not_an_object_exits_2(gateway: list[str]) -> None:
    """--payload must be a JSON object."""
    result = admin(*gateway, "actions", "propose", "refund", "--payload", "[1]", "--who", "a")
    assert result.exit_code == 2
    assert "JSON object" in result.output


# --------------------------------------------------------------------------- rollouts


@pytest.mark.slow
def test_rollout_status_says_plainly_when_the_gateway_has_none(key_file: Path) -> None:
    """A 404 from /admin/rollouts is printed with its code and message, as no rollout status."""
    refusal = {"error": {"code": "not_found", "message": "no admin route GET /admin/rollouts"}}
    with stub(404, refusal) as url:
        result = admin("--url", url, "--key-file", str(key_file), "rollout", "status")
    assert result.exit_code == 1
    assert f"the gateway at {url} has no rollout status" in result.output
    assert "HTTP 404 not_found: no admin route GET /admin/rollouts" in result.output


@pytest.mark.slow
def test_rollout_status_shows_each_rollout_as_a_row(key_file: Path) -> None:
    """Each canary is one row: its state and its share as a percentage."""
    rollouts = {"chat": {"share": 0.25, "state": "running"}}
    with stub(200, rollouts) as url:
        table = admin("--url", url, "--key-file", str(key_file), "rollout", "status")
        raw = admin("--url", url, "--key-file", str(key_file), "rollout", "status", "--json")
    assert table.exit_code == 0, table.output
    assert "running" in table.stdout
    assert "25%" in table.stdout
    assert as_json(raw) == rollouts


@pytest.mark.slow
def test_a_foreign_error_page_keeps_its_http_status(key_file: Path) -> None:
    """An error answer without the gateway's error body exits 1 with the HTTP status as code."""
    with stub(502, b"<html>bad gateway</html>") as url:
        result = admin("--url", url, "--key-file", str(key_file), "breakers")
    assert result.exit_code == 1
    assert "HTTP 502 http_502: <html>bad gateway</html>" in result.output


@pytest.mark.slow
def test_a_success_that_is_not_json_exits_2(key_file: Path) -> None:
    """A 200 whose body is not JSON is not the admin API answering: exit 2."""
    with stub(200, b"<html>a login page</html>") as url:
        result = admin("--url", url, "--key-file", str(key_file), "breakers")
    assert result.exit_code == 2
    assert "the answer is not JSON" in result.output


@pytest.mark.slow
def test_a_canary_is_started_paused_resumed_judged_and_aborted(
    tmp_path: Path, key_file: Path
) -> None:
    """Each operator action moves the canary's state; every share change is in the audit."""
    config = _config(tmp_path)
    config["providers"]["q"] = fake("hello from the candidate", model="m-2")
    config["models"]["chat"]["canary"] = {
        "salt": "chat-v2",
        "candidate": {"providers": ["q"], "prompt_version": "v2"},
        "schedule": [0.1, 0.5, 1.0],
        "evaluate_every_s": 3600,
    }
    with running_gateway(tmp_path, config) as (base, _):
        cli = ["--url", base, "--key-file", str(key_file)]
        idle = as_json(admin(*cli, "rollout", "status", "--json"))
        assert (idle["chat"]["state"], idle["chat"]["schedule"]) == ("idle", [0.1, 0.5, 1.0])
        steps = []
        for action in ("start", "pause", "resume"):
            result = admin(*cli, "rollout", action, "chat", "--who", "dana", "--why", action)
            assert result.exit_code == 0, result.output
            steps.append(as_json(admin(*cli, "rollout", "status", "chat", "--json"))["chat"])
        assert [(s["state"], s["share"]) for s in steps] == [
            ("running", 0.1),
            ("paused", 0.1),
            ("running", 0.1),
        ]
        judged = admin(*cli, "rollout", "evaluate", "chat", "--who", "dana", "--why", "now")
        assert judged.exit_code == 0, judged.output
        assert judged.stdout.startswith("chat: hold; state running, share 10%")
        aborted = admin(*cli, "rollout", "abort", "chat", "--who", "dana", "--why", "stop")
        assert aborted.exit_code == 0, aborted.output
        assert "aborted" in aborted.stdout
        assert "0%" in aborted.stdout
        shares = as_json(admin(*cli, "audit", "--flag", "rollout.chat.share", "--json"))
        assert [(a["new"], a["who"]) for a in shares] == [(0.0, "dana"), (0.1, "dana")]
        unknown = admin(*cli, "rollout", "status", "nope")
        assert unknown.exit_code == 1
        assert "HTTP 404 not_found" in unknown.output
