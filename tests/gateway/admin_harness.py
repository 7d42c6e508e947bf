"""The gateway on two loopback sockets, public and admin, served by one uvicorn server in a
thread, as ``tidegate serve`` runs it with ``server.admin_port``."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn

from tests.gateway.harness import write_config
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config
from tidegate.gateway.protocol import GuardedHttpToolsProtocol


def _bound() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def two_sockets(tmp_path: Path, raw: dict[str, Any]) -> Iterator[tuple[str, str, Gateway]]:
    """One uvicorn server on a public and an admin socket, as ``tidegate serve`` runs it."""
    public, admin = _bound(), _bound()
    admin_port = admin.getsockname()[1]
    raw = {**raw, "server": {**raw.get("server", {}), "admin_port": admin_port}}
    path = write_config(tmp_path, raw)
    app = Gateway(load_config(path, env={}), path)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            http=GuardedHttpToolsProtocol,  # type: ignore[arg-type]
            loop="asyncio",
            lifespan="on",
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [public, admin]}, daemon=True)
    thread.start()
    pause = threading.Event()
    for _ in range(500):
        if server.started or not thread.is_alive():
            break
        pause.wait(0.01)
    assert server.started, "the gateway did not start"
    try:
        yield (
            f"http://127.0.0.1:{public.getsockname()[1]}",
            f"http://127.0.0.1:{admin_port}",
            app,
        )
    finally:
        server.should_exit = True
        thread.join(timeout=10)
