"""Running the gateway under uvicorn (uvloop + httptools), with a graceful drain on SIGTERM."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from tidegate.gateway.app import Gateway
from tidegate.gateway.config import Config, load_config
from tidegate.gateway.logsink import configure_logging, flush_logs
from tidegate.gateway.protocol import GuardedHttpToolsProtocol
from tidegate.gateway.worker_metrics import METRICS_DIR_ENV

__all__ = ["app_from_env", "configure_logging", "flush_logs", "git_sha", "run"]

CONFIG_ENV = "TIDEGATE_CONFIG"
#: The admin port as bound, for the config of every process that serves (an override).
ADMIN_PORT_ENV = "TIDEGATE_SERVER__ADMIN_PORT"


def git_sha() -> str:
    """The baked-in sha (``TIDEGATE_GIT_SHA``, set by the image build), else the checkout's."""
    baked = os.environ.get("TIDEGATE_GIT_SHA")
    if baked:
        return baked
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=2,
            cwd=Path(__file__).parent,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def app_from_env() -> Gateway:
    """The app factory uvicorn's worker processes call (``--workers`` > 1)."""
    path = Path(os.environ[CONFIG_ENV])
    config = load_config(path)
    configure_logging(config)
    return Gateway(config, path, git_sha=git_sha(), tune_gc=True, reload_on_sighup=True)


def run(
    config_path: Path,
    *,
    host: str | None = None,
    port: int | None = None,
    workers: int | None = None,
) -> None:
    """Validate the config (refusing to start on any problem), then serve until SIGTERM/SIGINT.

    On SIGTERM uvicorn stops accepting and lets in-flight requests and streams finish for up to
    ``server.drain_seconds``. Just before that is up the gateway ends what is still running
    itself (a stream with its in-band ``stream_incomplete`` event, an answer not yet begun with
    503 ``shutting_down``), each with its log line; cancelled requests still settle their
    bookkeeping (shielded), and the lifespan shutdown closes stores and the upstream session.

    SIGHUP reloads ``auth.keys_file`` in each process that serves. With ``workers`` > 1 uvicorn's
    supervisor takes SIGHUP itself: it replaces the workers one at a time (each new one reads the
    whole config, and a worker that fails to start leaves the old one serving).
    """
    config = load_config(config_path)
    configure_logging(config)
    host = host or config.server.host
    port = config.server.port if port is None else port
    workers = workers or config.server.workers
    common = {
        "host": host,
        "port": port,
        "loop": "uvloop",
        # httptools with header limits and head and body timeouts (see gateway.protocol).
        "http": GuardedHttpToolsProtocol,
        "lifespan": "on",
        "access_log": False,
        "log_level": "warning",
        "timeout_graceful_shutdown": config.server.drain_seconds,
        "timeout_keep_alive": config.server.keep_alive_s,
        "server_header": False,
        # tidegate reads neither the client address nor the scheme: no X-Forwarded-* rewriting
        # of them on every request.
        "proxy_headers": False,
    }
    sockets = _bind_with_admin(config, host, port)
    if sockets:
        config = load_config(config_path)  # with the admin port as bound (see _bind_with_admin)
    _announce(config, config_path, host, port)
    if workers > 1:
        os.environ[CONFIG_ENV] = str(config_path.resolve())
        with _shared_metrics_folder():
            _serve(FACTORY, common, sockets, factory=True, workers=workers)
        return
    app = Gateway(config, config_path, git_sha=git_sha(), tune_gc=True, reload_on_sighup=True)
    _serve(app, common, sockets)


#: What uvicorn's worker processes import and call for their app.
FACTORY = "tidegate.gateway.server:app_from_env"


def _bind_with_admin(config: Config, host: str, port: int) -> list[socket.socket]:
    """With ``server.admin_port``: the public socket and the admin listener's, bound here (so
    every worker serves both), and the admin port as bound in ``TIDEGATE_SERVER__ADMIN_PORT``
    (so each worker's config names the port its connections arrive on, also for 0). Without
    it, nothing: uvicorn binds the one socket itself."""
    server = config.server
    if server.admin_port is None:
        return []
    public = uvicorn.Config(Gateway, host=host, port=port, log_level="warning").bind_socket()
    admin = uvicorn.Config(
        Gateway, host=server.admin_host, port=server.admin_port, log_level="warning"
    ).bind_socket()
    os.environ[ADMIN_PORT_ENV] = str(admin.getsockname()[1])
    return [public, admin]


def _serve(app: Any, common: dict[str, Any], sockets: list[socket.socket], **more: Any) -> None:
    """``uvicorn.run``, or its steps with the sockets bound here (one server on both)."""
    if not sockets:
        uvicorn.run(app, **common, **more)
        return
    config = uvicorn.Config(app, **common, **more)
    if config.workers > 1:
        Multiprocess(config, sockets=sockets).run()
        return
    server = uvicorn.Server(config)
    server.run(sockets=sockets)
    if not server.started:
        sys.exit(STARTUP_FAILURE)


@contextlib.contextmanager
def _shared_metrics_folder() -> Iterator[None]:
    """A private folder the workers share their metrics in (``gateway.worker_metrics``),
    removed when the supervisor exits."""
    folder = tempfile.mkdtemp(prefix="tidegate-metrics-")
    os.environ[METRICS_DIR_ENV] = folder
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _announce(config: Config, config_path: Path, host: str, port: int) -> None:
    base = f"http://{host}:{port}"
    print(
        f"tidegate listening on {base} (profile {config.profile.value}, state {config.state.url})"
    )
    if config.server.admin_port is not None:
        admin = f"http://{config.server.admin_host}:{config.server.admin_port}"
        print(f"admin listener on {admin} (the console at {admin}/console)")
    demo = config_path.parent / "demo-key.txt"
    if config.profile.value == "dev" and demo.is_file():
        key = demo.read_text(encoding="utf-8").strip()
        alias = sorted(config.models)[0]
        print(f"demo API key: {key}")
        print("try:")
        print(
            f"  curl -s {base}/v1/chat/completions -H 'Authorization: Bearer {key}' "
            f"-H 'Content-Type: application/json' "
            f'-d \'{{"model": "{alias}", "messages": [{{"role": "user", "content": "hello"}}]}}\''
        )
        print("or, with the openai SDK:")
        print("  from openai import OpenAI")
        print(f'  client = OpenAI(base_url="{base}/v1", api_key="{key}")')
        print(f'  reply = client.chat.completions.create(model="{alias}",')
        print('      messages=[{"role": "user", "content": "hello"}])')
        print("  print(reply.choices[0].message.content)")
    sys.stdout.flush()
