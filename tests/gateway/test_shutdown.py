"""Graceful shutdown of a real `tidegate serve` process on SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import KEY, fake, serving_process, write_config

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


def _dechunk(raw: bytes) -> tuple[bytes, bool]:
    """A chunked body's content, and whether it ended with the last (zero) chunk."""
    body = b""
    while raw:
        size_line, _, raw = raw.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body, raw == b"\r\n"
        body, raw = body + raw[:size], raw[size + 2 :]
    return body, False


def _read_until_closed(conn: socket.socket) -> bytes:
    out = b""
    while chunk := conn.recv(65536):
        out += chunk
    return out


def test_what_outlives_the_drain_is_ended_honestly(tmp_path: Path) -> None:
    """At the drain's end a stream gets its stream_incomplete event and a proper end, an answer
    not yet begun gets 503 shutting_down, each has its log line, and nothing prints a traceback."""
    config = {
        "server": {"drain_seconds": 0.5},
        "logging": {"level": "info"},
        "providers": {
            "slow_stream": fake(" ".join(f"w{i}" for i in range(40)), tokens_per_second=4),
            "slow_answer": fake("late", latency=10.0),
        },
        "models": {
            "chat": {"providers": ["slow_stream"]},
            "slow": {"providers": ["slow_answer"]},
        },
    }
    with serving_process(tmp_path, config) as served:
        conns = []
        for model, stream in (("chat", True), ("slow", False)):
            body = json.dumps(
                {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
            ).encode()
            conn = socket.create_connection(("127.0.0.1", served.port), timeout=10)
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            conns.append(conn)
        first = conns[0].recv(65536)  # the stream's head and first chunk: it is under way
        assert first.startswith(b"HTTP/1.1 200"), first
        served.process.send_signal(signal.SIGTERM)
        streamed = first + _read_until_closed(conns[0])
        answered = _read_until_closed(conns[1])
        for conn in conns:
            conn.close()
        assert served.process.wait(timeout=10) in (0, -signal.SIGTERM)
        output = served.finish()

    head, _, chunked = streamed.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head
    events, ended = _dechunk(chunked)
    assert ended, streamed[-200:]
    last = events.strip().split(b"\n\n")[-1]
    assert last.startswith(b"data: ")
    assert json.loads(last[6:])["error"]["code"] == "stream_incomplete"
    assert b"[DONE]" not in events

    assert answered.startswith(b"HTTP/1.1 503"), answered
    assert json.loads(answered.partition(b"\r\n\r\n")[2])["error"]["code"] == "shutting_down"

    requests = [json.loads(line) for line in output.splitlines() if '"event":"request"' in line]
    assert sorted(r["outcome"] for r in requests) == ["shutting_down", "stream_incomplete"]
    assert "Traceback" not in output
    assert "Exception in ASGI application" not in output
