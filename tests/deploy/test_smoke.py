"""scripts/smoke.py against real gateways on loopback, directly and through the compose nginx."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import NGINX_CONF, ROOT
from tests.gateway.harness import KEY, fake, running_gateway
from tidegate.gateway.app import Gateway

pytestmark = pytest.mark.slow

SMOKE = ROOT / "scripts" / "smoke.py"
CONFIG: dict[str, Any] = {
    "providers": {"main": fake("The tide comes in twice a day.", model="m-2026-01")},
    "models": {"chat": {"providers": ["main"]}},
}


def smoke(base: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SMOKE), base, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def lines(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """Each check's name -> 'ok' or 'FAIL'."""
    found = {}
    for line in result.stdout.splitlines():
        status, _, rest = line.partition("  ")
        if status.strip() in ("ok", "FAIL"):
            found[rest.strip().split("  ")[0].strip()] = status.strip()
    return found


def test_a_healthy_gateway_passes_every_check(tmp_path: Path) -> None:
    """Ready, a streamed answer to [DONE], the request id back, metrics, version: exit 0."""
    with running_gateway(tmp_path, CONFIG) as (base, _):
        result = smoke(base, "--key", KEY, "--model", "chat")
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines(result) == {
        "readiness": "ok",
        "stream": "ok",
        "request id": "ok",
        "metrics": "ok",
        "version": "ok",
    }
    assert "smoke: 5 of 5 checks passed" in result.stdout


def test_a_refused_key_fails_the_stream_check(tmp_path: Path) -> None:
    """An unknown key gets 401: the stream check fails, the script exits 1."""
    with running_gateway(tmp_path, CONFIG) as (base, _):
        result = smoke(base, "--key", "tg-wrong", "--model", "chat")
    assert result.returncode == 1
    assert lines(result)["stream"] == "FAIL"
    assert "HTTP 401" in result.stdout
    assert lines(result)["readiness"] == "ok"


def test_a_stream_cut_before_done_fails(tmp_path: Path) -> None:
    """A stream that ends without data: [DONE] is not an answer: exit 1."""
    cut = {
        "providers": {
            "main": fake(
                "one two three four five six",
                model="m-1",
                faults=[{"kind": "cut_after", "tokens": 2}],
            )
        },
        "models": {"chat": {"providers": ["main"]}},
        "retry": {"attempts": 1},
    }
    with running_gateway(tmp_path, cut) as (base, _):
        result = smoke(base, "--key", KEY, "--model", "chat")
    assert result.returncode == 1
    assert lines(result)["stream"] == "FAIL"


def test_nothing_listening_fails_every_check() -> None:
    """With nothing listening at the URL every check fails, and the script exits 1."""
    with _free_port() as port:
        pass
    result = smoke(f"http://127.0.0.1:{port}", "--key", KEY, "--model", "chat", "--timeout", "2")
    assert result.returncode == 1
    assert set(lines(result).values()) == {"FAIL"}
    assert "smoke: 0 of 5 checks passed" in result.stdout


def test_bad_arguments_exit_2() -> None:
    """A URL that is not http(s) is refused before any request."""
    result = smoke("ftp://example.invalid", "--key", KEY, "--model", "chat")
    assert result.returncode == 2
    assert "expected an http:// or https:// URL" in result.stderr


@contextlib.contextmanager
def _free_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


@contextlib.contextmanager
def running_nginx(tmp_path: Path, upstreams: list[str]) -> Iterator[str]:
    """deploy/nginx.conf with loopback addresses for the two replicas; yields its base URL."""
    with _free_port() as port:
        pass
    text = NGINX_CONF.read_text(encoding="utf-8")
    for name, address in zip(("gateway-1:8080", "gateway-2:8080"), upstreams, strict=True):
        assert name in text
        text = text.replace(name, address)
    text = text.replace("listen 8080;", f"listen 127.0.0.1:{port};")
    text = text.replace("pid /tmp/nginx.pid;", f"pid {tmp_path}/nginx.pid;")
    conf = tmp_path / "nginx.conf"
    conf.write_text(text, encoding="utf-8")
    (tmp_path / "logs").mkdir()
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    process = subprocess.Popen(
        [nginx, "-p", str(tmp_path), "-c", str(conf), "-e", "stderr", "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        pause = threading.Event()
        for _ in range(200):
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            try:
                with urllib.request.urlopen(f"{base}/nginx-health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pause.wait(0.05)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()


@pytest.mark.skipif(
    shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
    reason="nginx is not installed (Debian package nginx)",
)
def test_smoke_passes_through_the_compose_nginx_to_two_replicas(tmp_path: Path) -> None:
    """Through deploy/nginx.conf a stream reaches [DONE], the caller's request id survives, one
    is made when there is none, and both replicas serve."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "nginx").mkdir()
    with (
        running_gateway(tmp_path / "a", CONFIG) as (first, app_a),
        running_gateway(tmp_path / "b", CONFIG) as (second, app_b),
        running_nginx(tmp_path / "nginx", [first[7:], second[7:]]) as base,
    ):
        result = smoke(base, "--key", KEY, "--model", "chat")
        assert result.returncode == 0, result.stdout + result.stderr
        request = urllib.request.Request(
            f"{base}/v1/chat/completions",
            data=json.dumps(
                {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
            assert re.fullmatch(r"[0-9a-f]{32}", response.headers["X-Request-ID"])
        for _ in range(3):
            assert smoke(base, "--key", KEY, "--model", "chat").returncode == 0
        # nginx takes turns over every request it passes on, so the chat requests of the smoke
        # runs alone can all land on one replica (when the other requests fall between them).
        # Consecutive chat requests with nothing in between alternate.
        for _ in range(4):
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.status == 200
        served = [_answered(app) for app in (app_a, app_b)]
        assert all(count > 0 for count in served), served


def _answered(app: Gateway) -> float:
    """Chat requests this replica answered, from its own metrics registry."""
    assert app.runtime is not None
    return sum(
        sample.value
        for metric in app.runtime.metrics.requests.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )
