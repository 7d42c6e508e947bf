"""What `make run` starts passes the operator's smoke test and a short load test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tidegate.dev.yaml"
KEY = (ROOT / "examples" / "demo-key.txt").read_text(encoding="utf-8").strip()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def make_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tidegate serve` on the dev example (as `make run` starts it), on a free port."""
    port = _free_port()
    state = tmp_path_factory.mktemp("state") / "state.db"
    env = {**os.environ, "TIDEGATE_STATE__URL": f"sqlite:///{state}"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tidegate.cli",
            "serve",
            "--config",
            str(CONFIG),
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    pause = threading.Event()
    try:
        for _ in range(200):
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert server.poll() is None, "the gateway exited at start-up"
            pause.wait(0.05)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=15)


def test_smoke_script_passes_against_make_run(make_run: str) -> None:
    """scripts/smoke.py (standard library only) exits 0: ready, streamed, request id, metrics."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "smoke.py"),
            make_run,
            "--key",
            KEY,
            "--model",
            "chat-default",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_loadtest_passes_against_make_run(make_run: str) -> None:
    """A short open-loop run at 20 req/s: answered, and the in-flight gauge returns to 0."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tidegate.cli",
            "loadtest",
            make_run,
            "--rate",
            "20",
            "--duration",
            "2",
            "--key",
            KEY,
            "--model",
            "chat-default",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "p95" in result.stdout
