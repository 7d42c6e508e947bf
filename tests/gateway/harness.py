"""Start real servers on loopback for socket-level tests: the gateway (uvicorn) in a thread."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn
import yaml

from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config

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
    """A fake provider section answering ``text``."""
    return {
        "type": "fake",
        "model": script.pop("model", "fake-1"),
        "fake": {"text": text, **script},
    }


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
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    pause = threading.Event()
    for _ in range(500):
        if server.started or not thread.is_alive():
            break
        pause.wait(0.01)
    assert server.started, "the gateway did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=10)
