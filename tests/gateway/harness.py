"""Start real servers on loopback for socket-level tests: the gateway (uvicorn) in a thread,
or ``tidegate serve`` in a process of its own (for signals, and for its memory)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml

from tidegate.clock import ManualClock
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config
from tidegate.gateway.runtime import Runtime, build_runtime, close_runtime
from tidegate.providers.fake import FakeProvider

KEY = "tg-test-key"
LOW_KEY = "tg-test-batch-key"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write_config(tmp_path: Path, config: dict[str, Any]) -> Path:
    """Write ``config`` (plus a keys file with two test keys) and return the config path."""
    keys = {
        "keys": [
            {
                "id": "test",
                "sha256": _digest(KEY),
                "tenant": "t1",
                "user": "u1",
                "priority": "standard",
                "data_class": "internal",
            },
            {
                "id": "batch",
                "sha256": _digest(LOW_KEY),
                "tenant": "t2",
                "user": "u2",
                "priority": "batch",
                "data_class": "internal",
            },
        ]
    }
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump(keys), encoding="utf-8")
    base: dict[str, Any] = {
        "profile": "dev",
        "auth": {"keys_file": "keys.yaml"},
        "state": {"url": "memory://"},
        "logging": {"level": "warning"},
    }
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump({**base, **config}), encoding="utf-8")
    return path


def fake(text: str = "hello there", **script: Any) -> dict[str, Any]:
    """A fake provider section answering ``text``, approved as an automatic fallback by the
    config (the tests' fallbacks have no eval verdict; :func:`unvetted` takes the approval off)."""
    return {
        "type": "fake",
        "model": script.pop("model", "fake-1"),
        "approved_fallback": True,
        "fake": {"text": text, **script},
    }


def unvetted(section: dict[str, Any]) -> dict[str, Any]:
    """A provider section without the config's fallback approval: its eval verdict decides."""
    return {k: v for k, v in section.items() if k != "approved_fallback"}


@contextmanager
def running_gateway(
    tmp_path: Path, config: dict[str, Any], **overrides: Any
) -> Iterator[tuple[str, Gateway]]:
    """A gateway on an ephemeral loopback port; yields its base URL and the app."""
    path = write_config(tmp_path, config)
    app = Gateway(load_config(path, env={}), path, **overrides)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            loop="asyncio",
            lifespan="on",
            log_level="warning",
            access_log=False,
        )
    )
    with serving(server):
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", app


@contextmanager
def serving(server: uvicorn.Server, **run: Any) -> Iterator[None]:
    """``server`` running in a thread (``run``: the arguments of its ``run``) until the block
    ends; it has started when the block begins."""
    thread = threading.Thread(target=server.run, kwargs=run, daemon=True)
    thread.start()
    pause = threading.Event()
    for _ in range(500):
        if server.started or not thread.is_alive():
            break
        pause.wait(0.01)
    assert server.started, "the gateway did not start"
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServedProcess:
    """A ``tidegate serve`` process; its stdout and stderr lines are collected as they come."""

    def __init__(self, process: subprocess.Popen[bytes], base: str, port: int) -> None:
        self.process = process
        self.base = base
        self.port = port
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._readers = [
            threading.Thread(target=self._read, args=(stream,), daemon=True)
            for stream in (process.stdout, process.stderr)
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: Any) -> None:
        for raw in iter(stream.readline, b""):
            with self._lock:
                self._lines.append(raw.decode("utf-8", "replace"))

    def output(self) -> str:
        """Everything the process wrote so far, stdout and stderr interleaved by line."""
        with self._lock:
            return "".join(self._lines)

    def wait_for(self, text: str, timeout: float = 5.0) -> str:
        """The output once ``text`` is in it (an AssertionError after ``timeout`` seconds)."""
        pause = threading.Event()
        for _ in range(int(timeout / 0.02)):
            out = self.output()
            if text in out:
                return out
            pause.wait(0.02)
        raise AssertionError(f"{text!r} not in the output:\n{self.output()}")

    def rss_kib(self) -> int:
        """The process's resident memory (Linux: ``VmRSS`` in /proc)."""
        with open(f"/proc/{self.process.pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise AssertionError("no VmRSS in /proc/<pid>/status")

    def finish(self, timeout: float = 10.0) -> str:
        """Wait for the process to exit (killing its process group after ``timeout``: worker
        processes too); all its output."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        for reader, stream in zip(
            self._readers, (self.process.stdout, self.process.stderr), strict=True
        ):
            # Closing a pipe a reader still blocks on would wait for that reader for ever.
            if stream is not None and not reader.is_alive():
                stream.close()
        return self.output()


@contextmanager
def serving_process(tmp_path: Path, config: dict[str, Any]) -> Iterator[ServedProcess]:
    """``tidegate serve`` on a free loopback port with ``config`` (its ``server.port`` is set
    here), once ``/healthz`` answers; killed on the way out if it is still running."""
    port = free_port()
    config = {**config, "server": {**config.get("server", {}), "port": port}}
    path = write_config(tmp_path, config)
    process = subprocess.Popen(
        [sys.executable, "-m", "tidegate.cli", "serve", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, with the workers it starts
    )
    served = ServedProcess(process, f"http://127.0.0.1:{port}", port)
    try:
        pause = threading.Event()
        for _ in range(400):
            assert process.poll() is None, served.finish()
            try:
                if httpx.get(f"{served.base}/healthz", timeout=0.2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            pause.wait(0.05)
        else:
            raise AssertionError(f"the gateway did not start:\n{served.output()}")
        yield served
    finally:
        if process.poll() is None:
            process.terminate()  # uvicorn's supervisor stops its workers on SIGTERM
        served.finish()


@asynccontextmanager
async def in_process_gateway(
    tmp_path: Path, config: dict[str, Any], handlers: Mapping[str, Callable[[Any, int], Any]]
) -> AsyncIterator[tuple[httpx.AsyncClient, Runtime]]:
    """The gateway app in this task (no socket) on a manual clock, each provider a
    :class:`FakeProvider` answering with its handler, and a client sending the test key."""
    clock = ManualClock(0.0, wall_start=1_000_000.0)
    path = write_config(tmp_path, config)
    providers: dict[str, Any] = {
        name: FakeProvider(name, handler, sleep=clock.asleep, clock=clock)
        for name, handler in handlers.items()
    }
    loaded = load_config(path, env={})
    rt = await build_runtime(
        loaded, path, clock=clock, sleep=clock.asleep, rng=random.Random(1), providers=providers
    )
    transport = httpx.ASGITransport(app=Gateway(loaded, path, runtime=rt))
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://gw", headers={"Authorization": f"Bearer {KEY}"}
        ) as client:
            yield client, rt
    finally:
        await close_runtime(rt)


class RecordingTransport(asyncio.Transport):
    """Collects what a protocol writes and whether it closed; nothing goes on a wire."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 8080) if name in ("sockname", "peername") else default

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None
