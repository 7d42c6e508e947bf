"""The gateway on two loopback sockets, public and admin, served by one uvicorn server in a
thread, as ``tidegate serve`` runs it with ``server.admin_port``."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn
import yaml

from tests.gateway.harness import serving, write_config
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config
from tidegate.gateway.protocol import GuardedHttpToolsProtocol


def admin_auth(tmp_path: Path, key: str) -> dict[str, str]:
    """Write ``admin.yaml`` holding the digest of the admin key ``key`` (its name: oncall); the
    config's ``auth`` section that reads it."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    (tmp_path / "admin.yaml").write_text(
        yaml.safe_dump({"keys": [{"id": "oncall", "sha256": digest}]}), encoding="utf-8"
    )
    return {"keys_file": "keys.yaml", "admin_keys_file": "admin.yaml"}


def prompt_flag() -> dict[str, Any]:
    """The flag the admin tests read and change: the system prompt template in use."""
    return {
        "name": "prompt.version",
        "type": "str",
        "default": "v1",
        "description": "the system prompt template in use",
        "choices": ["v1", "v2"],
    }


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
            http=GuardedHttpToolsProtocol,
            loop="asyncio",
            lifespan="on",
            log_level="warning",
        )
    )
    with serving(server, sockets=[public, admin]):
        yield (
            f"http://127.0.0.1:{public.getsockname()[1]}",
            f"http://127.0.0.1:{admin_port}",
            app,
        )
