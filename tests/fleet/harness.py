"""A fleet on loopback: N ``tidegate serve`` processes behind nginx, sharing Redis and Postgres.

Every piece is a real process (or, for the TCP proxy, a real socket): the gateways are started
with ``python -m tidegate.cli serve``, the upstream with ``tidegate fake-upstream``, the load
balancer is nginx with a round-robin upstream. Each process runs in a session of its own, so
stopping it (or killing it with SIGKILL) reaches its whole process group.

nginx adds an ``X-Fleet-Upstream`` header (``$upstream_addr``) to every answer, so a test can see
which replica served a request; :func:`served_by` reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import psycopg
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from tidegate.clock import SystemClock

__all__ = [
    "ADMIN_KEY",
    "CLOCK",
    "MODEL",
    "Fleet",
    "ProcessFailed",
    "Replica",
    "SharedState",
    "TcpProxy",
    "UpstreamServer",
    "base_config",
    "chat",
    "find_nginx",
    "free_port",
    "metric",
    "running_fleet",
    "schema_migrations",
    "served_by",
    "shared_state",
    "with_query",
]

T = TypeVar("T")

CLOCK = SystemClock()
PYTHON = sys.executable
#: The model alias every fleet routes (to the fake upstream's wildcard model).
MODEL = "chat"
#: The operator key of every fleet's admin API.
ADMIN_KEY = "tg-fleet-admin-" + secrets.token_hex(8)
TENANT = "fleet"
#: How many caller keys (one user each) a fleet knows; tests take fresh ones with ``new_user``.
USERS = 120
START_TIMEOUT_S = 30.0
DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "postgresql": 5432, "postgres": 5432}


class ProcessFailed(RuntimeError):
    """A fleet process did not start, or died; the message ends with the tail of its log."""


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_nginx() -> str | None:
    """The nginx binary, or None when it is not installed."""
    found = shutil.which("nginx")
    if found is not None:
        return found
    return "/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else None


def with_query(url: str, **params: str) -> str:
    """``url`` with ``params`` added to its query string."""
    parts = urlsplit(url)
    query = [*parse_qsl(parts.query), *params.items()]
    return urlunsplit(parts._replace(query=urlencode(query)))


def chat(text: str, **extra: Any) -> dict[str, Any]:
    """A chat completion request body asking ``text`` of the fleet's model."""
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def served_by(response: httpx.Response) -> int:
    """The port of the replica that answered (the last address nginx tried)."""
    addresses = response.headers.get("x-fleet-upstream", "")
    last = addresses.split(",")[-1].strip()
    if not last:
        raise AssertionError(f"no X-Fleet-Upstream header on a {response.status_code} answer")
    return int(last.rsplit(":", 1)[1])


def metric(exposition: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _environment() -> dict[str, str]:
    # TIDEGATE_* variables would override the fleet's config files: leave them all out.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE_")}
    env["TIDEGATE_GIT_SHA"] = "fleet-test"
    return env


class _Process:
    """One child process in a session of its own, logging to a file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, cwd: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                env=_environment(),
                start_new_session=True,
            )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_alive(self) -> None:
        if not self.running:
            code = None if self.process is None else self.process.returncode
            raise ProcessFailed(
                f"{self.name} is not running (exit status {code}); its log ends:\n"
                + _log_tail(self.log_path)
            )

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process group (the process and anything it started)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)

    def kill(self) -> None:
        """SIGKILL the process group and reap it: no drain, no shutdown hooks."""
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=10)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group; SIGKILL it if it is still there after ``grace_s``."""
        if self.process is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()


def _wait_until_answers(process: _Process, url: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll ``url`` until it answers 200; fail with the process's log if it dies or times out."""
    deadline = CLOCK.now() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=1.0) as client:
        while CLOCK.now() < deadline:
            process.check_alive()
            try:
                response = client.get(url)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {response.text[:300]}"
            CLOCK.sleep(0.05)
    raise ProcessFailed(
        f"{process.name} did not answer 200 at {url} within {timeout_s:g} s ({last});"
        f" its log ends:\n{_log_tail(process.log_path)}"
    )


class UpstreamServer:
    """``tidegate fake-upstream`` as a subprocess; its ``/_fake`` routes drive and inspect it."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        script = workdir / "upstream.yaml"
        script.write_text(yaml.safe_dump(self.script()), encoding="utf-8")
        self._process = _Process(
            "fake upstream",
            [
                *(PYTHON, "-m", "tidegate.cli", "fake-upstream"),
                *("--script", str(script), "--port", str(self.port)),
            ],
            workdir / "upstream.log",
            workdir,
        )

    @staticmethod
    def script(latency: float = 0.0, text: str = "the tide turns") -> dict[str, Any]:
        """A script in which every model answers ``text`` after ``latency`` seconds."""
        return {"models": {"*": {"text": text, "latency": latency}}}

    def start(self) -> None:
        self._process.start()
        _wait_until_answers(self._process, f"{self.url}/v1/models")

    def stop(self) -> None:
        self._process.stop()

    def reset(self, script: dict[str, Any] | None = None) -> None:
        """Forget every attempt and restart the counters, with ``script`` (default: instant)."""
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            client.post("/_fake/reset").raise_for_status()
            client.post("/_fake/script", json=script or self.script()).raise_for_status()

    def attempts(self, containing: str = "") -> list[dict[str, Any]]:
        """The upstream calls seen since the last reset whose messages contain ``containing``."""
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            response = client.get("/_fake/attempts")
        response.raise_for_status()
        found: list[dict[str, Any]] = response.json()["attempts"]
        return [
            attempt
            for attempt in found
            if any(containing in str(m.get("content", "")) for m in attempt["messages"] or ())
        ]


@dataclass(frozen=True)
class SharedState:
    """A Redis key prefix and a Postgres schema that belong to one fleet only."""

    redis_url: str
    postgres_url: str
    prefix: str
    schema: str

    @property
    def fast_url(self) -> str:
        return with_query(self.redis_url, prefix=self.prefix)

    @property
    def durable_url(self) -> str:
        return with_query(self.postgres_url, schema=self.schema)


@contextlib.contextmanager
def shared_state(redis_url: str, postgres_url: str) -> Iterator[SharedState]:
    """A fresh prefix and schema; the keys are deleted and the schema dropped afterwards."""
    run = secrets.token_hex(5)
    state = SharedState(redis_url, postgres_url, f"fleet-{run}:", f"fleet_{run}")
    try:
        yield state
    finally:
        client = redis.Redis.from_url(redis_url)
        try:
            keys = list(client.scan_iter(match=f"{state.prefix}*", count=500))
            if keys:
                client.delete(*keys)
        finally:
            client.close()
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(state.schema))
            )


def schema_migrations(postgres_url: str, schema: str) -> list[tuple[Any, ...]]:
    """Every row of the schema's ``schema_migrations``: version, name, applied_at."""
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("SELECT version, name, applied_at FROM {}.schema_migrations ORDER BY 1").format(
                sql.Identifier(schema)
            )
        ).fetchall()
    return [tuple(row) for row in rows]


class TcpProxy:
    """A loopback TCP proxy in front of a real service, whose link a test can cut or stall.

    It runs its own event loop in a thread, so the test's loop and the gateways are unaffected.
    ``stop()`` is the service going away (listener closed, every connection reset: new ones are
    refused); ``stall()`` is a service that accepts and never answers (bytes are held, not
    forwarded); ``restore()`` undoes either. The shared service itself is never touched.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"proxy-{target_port}", daemon=True
        )
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    @classmethod
    def to(cls, url: str) -> TcpProxy:
        """A proxy to the host and port ``url`` names."""
        parts = urlsplit(url)
        assert parts.hostname is not None, url
        return cls(parts.hostname, parts.port or DEFAULT_PORTS[parts.scheme])

    def url_through(self, url: str) -> str:
        """``url`` with its host and port replaced by this proxy's."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@" if userinfo else ""
        return urlunsplit(parts._replace(netloc=f"{netloc}127.0.0.1:{self.port}"))

    def _call(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=10)

    def start(self) -> None:
        self._thread.start()
        self._call(self._restore())

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
            self._writers.add(upstream_writer)
            await asyncio.gather(
                self._pump(reader, upstream_writer), self._pump(upstream_reader, writer)
            )
        except OSError:
            pass  # the service refused: so does the proxy, by closing
        finally:
            for end in (writer, upstream_writer):
                if end is not None:
                    end.transport.abort()
                    self._writers.discard(end)
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            # One side ended: so does the other (Redis and Postgres never half-close).
            writer.transport.abort()
            self._writers.discard(writer)

    def stall(self) -> None:
        """Keep accepting and reading, forward nothing: every call hangs until its timeout."""
        self._call(self._stall())

    async def _stall(self) -> None:
        self._flowing.clear()

    def stop(self) -> None:
        """Stop listening and reset every connection: the service is gone."""
        self._call(self._stop())

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def restore(self) -> None:
        """Forward again, listening on the same port if ``stop()`` closed it."""
        self._call(self._restore())

    async def _restore(self) -> None:
        if self._server is None:
            await self._listen()
        self._flowing.set()

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._stop())
        self._call(self._cancel_all())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> TcpProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def base_config(*, durable: str, fast: str | None, upstream: str) -> dict[str, Any]:
    """What every fleet's replicas share; a fleet replaces whole sections of it as it needs."""
    state: dict[str, Any] = {"url": durable, "timeout_s": 0.5}
    if fast is not None:
        state["fast_url"] = fast
    return {
        "profile": "dev",
        "server": {"request_timeout_s": 5.0, "drain_seconds": 1.0},
        "auth": {"keys_file": "keys.yaml", "admin_keys_file": "admin-keys.yaml"},
        "state": state,
        "providers": {
            "upstream": {"type": "openai", "model": "fleet-model", "base_url": f"{upstream}/v1"}
        },
        "models": {MODEL: {"providers": ["upstream"], "per_try_timeout_s": 5.0}},
        # One attempt per request: the upstream's attempt log then counts requests exactly.
        "retry": {"attempts": 1},
        "idempotency": {"wait_s": 1.0},
        "logging": {"level": "warning"},
    }


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Replica:
    """One gateway process of the fleet, on a fixed loopback port (kept across restarts)."""

    index: int
    port: int
    process: _Process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process.start()

    def wait_ready(self) -> None:
        _wait_until_answers(self.process, f"{self.url}/readyz")


@dataclass
class Fleet:
    """N replicas behind nginx; ``url`` is nginx, ``replicas[i].url`` a replica directly."""

    workdir: Path
    config: dict[str, Any]
    nginx_binary: str
    size: int = 3
    replicas: list[Replica] = field(default_factory=list)
    port: int = 0
    _keys: list[str] = field(default_factory=list)
    _nginx: _Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def new_user(self) -> str:
        """The API key of a user no earlier test has used (its own rate-limit bucket)."""
        if not self._keys:
            raise AssertionError(f"the fleet's {USERS} caller keys are used up: raise USERS")
        return self._keys.pop(0)

    def user_index(self, key: str) -> int:
        """The number of the caller a key from :meth:`new_user` belongs to (``user-NNN``)."""
        return int(key.rsplit("-", 1)[1])

    def replica_index(self, port: int) -> int:
        """The index of the replica listening on ``port``."""
        for replica in self.replicas:
            if replica.port == port:
                return replica.index
        raise AssertionError(f"no replica listens on port {port}")

    def _write_files(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        run = secrets.token_hex(4)
        self._keys = [f"tg-fleet-{run}-{i:03d}" for i in range(USERS)]
        keys = [
            {
                "id": f"caller-{i:03d}",
                "sha256": _digest(key),
                "tenant": TENANT,
                "user": f"user-{i:03d}",
                "priority": "standard",
            }
            for i, key in enumerate(self._keys)
        ]
        (self.workdir / "keys.yaml").write_text(yaml.safe_dump({"keys": keys}), encoding="utf-8")
        admin = {"keys": [{"id": "fleet-operator", "sha256": _digest(ADMIN_KEY)}]}
        (self.workdir / "admin-keys.yaml").write_text(yaml.safe_dump(admin), encoding="utf-8")
        path = self.workdir / "tidegate.yaml"
        path.write_text(yaml.safe_dump(self.config, sort_keys=False), encoding="utf-8")
        return path

    def start(self) -> None:
        config_path = self._write_files()
        for index in range(self.size):
            port = free_port()
            argv = [PYTHON, "-m", "tidegate.cli", "serve", "--config", str(config_path)]
            process = _Process(
                f"replica {index} (port {port})",
                [*argv, "--port", str(port)],
                self.workdir / f"replica-{index}.log",
                self.workdir,
            )
            self.replicas.append(Replica(index, port, process))
        # Started together on purpose: their migrations meet at the advisory lock.
        for replica in self.replicas:
            replica.start()
        for replica in self.replicas:
            replica.wait_ready()
        self._start_nginx()

    def _start_nginx(self) -> None:
        root = self.workdir / "nginx"
        (root / "temp").mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        conf = root / "nginx.conf"
        conf.write_text(self._nginx_conf(root), encoding="utf-8")
        self._nginx = _Process(
            "nginx",
            [self.nginx_binary, "-p", str(root), "-c", str(conf), "-e", str(root / "error.log")],
            root / "stdout.log",
            root,
        )
        self._nginx.start()
        _wait_until_answers(self._nginx, f"{self.url}/fleet-health")

    def _nginx_conf(self, root: Path) -> str:
        servers = "\n".join(
            f"        server 127.0.0.1:{r.port} max_fails=1 fail_timeout=1s;" for r in self.replicas
        )
        temp = root / "temp"
        # As root, nginx would hand its worker to "nobody", who cannot use these paths.
        user = "user root;\n" if os.geteuid() == 0 else ""
        return f"""{user}daemon off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;

events {{
    worker_connections 4096;
}}

http {{
    access_log {root}/access.log;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;

    upstream tidegate {{
{servers}
    }}

    server {{
        listen 127.0.0.1:{self.port};

        location = /fleet-health {{
            return 200 "ok\\n";
        }}

        location / {{
            proxy_pass http://tidegate;
            proxy_http_version 1.1;
            proxy_buffering off;
            proxy_connect_timeout 1s;
            proxy_read_timeout 30s;
            # A replica that refuses the connection (killed, restarting) is skipped: the request
            # goes to the next one. A request a replica already received is never sent twice.
            proxy_next_upstream error timeout;
            proxy_next_upstream_tries 3;
            add_header X-Fleet-Upstream $upstream_addr always;
        }}
    }}
}}
"""

    def kill(self, index: int) -> None:
        """SIGKILL replica ``index``: no drain, no shutdown, its connections reset."""
        self.replicas[index].process.kill()

    def restart(self, index: int) -> None:
        """Start replica ``index`` again on its port, with the same config; wait until ready."""
        replica = self.replicas[index]
        replica.process.stop()
        replica.start()
        replica.wait_ready()

    def close(self) -> None:
        if self._nginx is not None:
            self._nginx.stop()
        for replica in self.replicas:
            replica.process.stop()

    def logs(self) -> str:
        """The tail of every replica's log, for a failure message."""
        return "\n".join(
            f"--- replica {r.index}\n{_log_tail(r.process.log_path, 15)}" for r in self.replicas
        )


@contextlib.contextmanager
def running_fleet(
    workdir: Path, config: dict[str, Any], *, nginx: str, size: int = 3
) -> Iterator[Fleet]:
    """A started fleet, stopped (every process group) when the block ends, however it ends."""
    fleet = Fleet(workdir, config, nginx, size)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.close()
