"""Graceful shutdown of a real `tidegate serve` process on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import KEY, fake, write_config

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(base: str, process: subprocess.Popen[bytes]) -> None:
    pause = threading.Event()
    for _ in range(300):
        assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
        try:
            if httpx.get(f"{base}/healthz", timeout=0.2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        pause.wait(0.05)
    raise AssertionError("the gateway did not start")


def test_sigterm_lets_in_flight_requests_finish(tmp_path: Path) -> None:
    """A request in flight when SIGTERM arrives still gets its answer; then the process exits.

    uvicorn re-raises the captured signal once it has drained, so the exit status is that of
    SIGTERM (143 in a shell), as a supervisor expects.
    """
    port = _free_port()
    config = {
        "server": {"port": port, "drain_seconds": 5},
        "providers": {"slow": fake("finished", model="m-1", latency=1.0)},
        "models": {"chat": {"providers": ["slow"]}},
    }
    path = write_config(tmp_path, config)
    process = subprocess.Popen(
        [sys.executable, "-m", "tidegate.cli", "serve", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, process)
        result: dict[str, httpx.Response] = {}

        def call() -> None:
            result["answer"] = httpx.post(
                f"{base}/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=10,
            )

        caller = threading.Thread(target=call)
        caller.start()
        threading.Event().wait(0.4)  # the request is now waiting on the slow provider
        process.send_signal(signal.SIGTERM)
        caller.join(timeout=10)
        assert result["answer"].status_code == 200
        assert result["answer"].json()["choices"][0]["message"]["content"] == "finished"
        assert process.wait(timeout=10) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
