"""Throughput and added latency of the tidegate gateway against a minimal pass-through proxy.

Run with ``make bench`` or ``.venv/bin/python benchmarks/gateway.py``. Everything listens on
loopback only and every process this script starts is stopped when it ends, on Ctrl-C too.

Four servers answer the same request, ``POST /v1/chat/completions``:

* the **upstream**: a fixed ``chat.completion`` answer. nginx when it is installed (a ``return
  200`` location: the fastest answer this machine can give), otherwise a raw asyncio protocol on
  uvloop with the httptools parser;
* the **pass-through**: the smallest proxy the same stack can make (a raw ASGI app on uvicorn with
  uvloop and httptools, one shared aiohttp session) that forwards the body and returns the answer;
* **tidegate** (``tidegate serve``) with its default pipeline on: API-key auth, per-user and
  per-tenant rate limits, daily budgets, admission, the breaker, metrics and the spend ledger,
  with SQLite state. The limits are set high so nothing is refused, and the response cache is off
  so every request goes upstream;
* **tidegate without the ledger**: the same, with ``ledger.enabled: false`` and a SQLite file of
  its own. The two tidegates' req/s in the same alternating rounds say what the spend ledger
  costs the request path (unless ``--no-ledger-check``).

The load generator is wrk (with a Lua script for the body and the key) when it is installed,
otherwise an aiohttp client in its own process. After a warm-up it measures req/s at 32
connections, then latency percentiles at one connection, in short rounds that alternate the two
proxies, so that background load on a shared machine falls on both alike. It also reads each
proxy's CPU time from ``/proc``: CPU microseconds per request is the steadiest number on a busy
machine. The targets are printed with MET or MISSED; the exit status is 0 either way (a
benchmark, not a test), unless the run itself failed (a server did not start, or requests failed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime as dt
import hashlib
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, cast

import aiohttp
import yaml
from rich.console import Console
from rich.table import Table

from tidegate.clock import SystemClock

__all__ = ["main"]

HOST = "127.0.0.1"
ROUTE = "/v1/chat/completions"
ALIAS = "bench"
UPSTREAM_MODEL = "bench-model-2026-01"
#: The fixed answer of the upstream: a complete, small ``chat.completion``.
UPSTREAM_ANSWER = (
    '{"id":"chatcmpl-bench","object":"chat.completion","created":1767225600,'
    f'"model":"{UPSTREAM_MODEL}","choices":[{{"index":0,"message":{{"role":"assistant",'
    '"content":"Hello from the benchmark upstream."},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":9,"completion_tokens":7,"total_tokens":16}}'
)
REQUEST_BODY = json.dumps(
    {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
    },
    separators=(",", ":"),
)
#: The targets for this machine (issue 3): a ratio of req/s, and added p50 in milliseconds.
TARGET_RPS_RATIO = 0.50
TARGET_ADDED_P50_MS = 0.6
#: The most of tidegate's req/s the spend ledger may cost (issue 18).
TARGET_LEDGER_COST = 0.05
#: The targets' names in the table.
PASS_THROUGH, TIDEGATE, NO_LEDGER = "pass-through", "tidegate", "tidegate, no ledger"
#: A limit nothing in a two-minute run reaches.
UNLIMITED = 1_000_000_000

CLOCK = SystemClock()


# --------------------------------------------------------------------------- process handling


def _parent_death_signal() -> None:
    """In the child, before exec: be sent SIGTERM if this script dies without cleaning up."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


class Processes:
    """The servers this run started; :meth:`stop_all` ends each one by its own pid."""

    def __init__(self) -> None:
        self._started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self, name: str, argv: Sequence[str], *, log: Path, cwd: Path
    ) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                # Its own session, so Ctrl-C reaches only this script, which then stops it.
                start_new_session=True,
                preexec_fn=_parent_death_signal if sys.platform == "linux" else None,
            )
        self._started.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self._started:
            if proc.poll() is not None:
                raise BenchError(f"{name} exited early with status {proc.returncode}")

    def stop_all(self) -> None:
        for _, proc in reversed(self._started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self._started):
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._started.clear()


class BenchError(Exception):
    """The benchmark could not run (as opposed to a target being missed)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def http(
    url: str, *, body: str | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(
        url,
        data=None if body is None else body.encode(),
        headers=headers or {},
        method="GET" if body is None else "POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            headers = {k.lower(): v for k, v in response.headers.items()}
            return response.status, headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def wait_until_answers(
    name: str, url: str, processes: Processes, *, body: str, headers: dict[str, str]
) -> dict[str, str]:
    """Poll ``url`` until it answers 200 (at most 20 s); returns the response headers."""
    give_up = CLOCK.now() + 20.0
    last = "no answer"
    while CLOCK.now() < give_up:
        processes.check_alive()
        try:
            status, response_headers, payload = http(url, body=body, headers=headers)
        except OSError as exc:
            last = str(exc)
        else:
            if status == 200 and json.loads(payload).get("object") == "chat.completion":
                return response_headers
            last = f"HTTP {status}: {payload[:300]!r}"
        CLOCK.sleep(0.1)
    raise BenchError(f"{name} did not answer {url} within 20 s ({last})")


# --------------------------------------------------------------------------- the upstream


def nginx_config(workdir: Path, port: int) -> str:
    temp = "\n".join(
        f"    {kind}_temp_path {workdir / ('nginx-' + kind)};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""
daemon off;
master_process on;
worker_processes 1;
pid {workdir / "nginx.pid"};
error_log {workdir / "nginx-error.log"} warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
{temp}
    keepalive_requests 100000000;
    keepalive_timeout 75s;
    server {{
        listen {HOST}:{port};
        location = {ROUTE} {{
            default_type application/json;
            return 200 '{UPSTREAM_ANSWER}';
        }}
        location / {{ return 404; }}
    }}
}}
"""


def find_nginx() -> str | None:
    found = shutil.which("nginx")
    if found is None:
        # Debian installs it under sbin, which is not on every user's PATH.
        found = next(
            (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).is_file()), None
        )
    return found


def start_upstream(processes: Processes, workdir: Path, port: int, choice: str) -> str:
    """Start the upstream (``choice``: auto, nginx or python); returns a description of it."""
    nginx = find_nginx() if choice != "python" else None
    if choice == "nginx" and nginx is None:
        raise BenchError("--upstream nginx: nginx is not installed (apt-get install nginx)")
    log = workdir / "upstream.log"
    if nginx is not None:
        conf = workdir / "nginx.conf"
        conf.write_text(nginx_config(workdir, port), encoding="utf-8")
        argv = [nginx, "-p", str(workdir), "-e", str(workdir / "nginx-error.log"), "-c", str(conf)]
        processes.start("nginx upstream", argv, log=log, cwd=workdir)
        return "nginx, 1 worker, `return 200` of a fixed chat.completion"
    argv = [sys.executable, __file__, "_upstream", "--port", str(port)]
    processes.start("python upstream", argv, log=log, cwd=workdir)
    why = "" if choice == "python" else " (nginx not found)"
    return f"raw asyncio protocol on uvloop + httptools, fixed chat.completion{why}"


class _UpstreamProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection answered with the fixed answer, request after request."""

    def __init__(self, response: bytes) -> None:
        import httptools

        self._response = response
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        import httptools

        assert self._transport is not None
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._transport.close()

    def on_message_complete(self) -> None:
        assert self._transport is not None
        self._transport.write(self._response)
        if not self._parser.should_keep_alive():
            self._transport.close()


def serve_upstream(port: int) -> None:
    """The fallback upstream (no nginx): as little Python per request as an answer can take."""
    import uvloop

    body = UPSTREAM_ANSWER.encode()
    response = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _UpstreamProtocol(response), HOST, port)
        async with server:
            await server.serve_forever()

    uvloop.run(run())


# --------------------------------------------------------------------------- the pass-through


class PassThrough:
    """The baseline: forward the body to the upstream, return its answer. Nothing else."""

    def __init__(self, upstream_url: str) -> None:
        self.url = upstream_url
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        assert self.session is not None, "a request arrived before the lifespan start-up"
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        async with self.session.post(
            self.url, data=b"".join(chunks), headers={"content-type": "application/json"}
        ) as response:
            payload = await response.read()
            status = response.status
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0),
                    timeout=aiohttp.ClientTimeout(total=None),
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def passthrough_argv(port: int, upstream_url: str) -> list[str]:
    return [
        sys.executable,
        __file__,
        "_passthrough",
        "--port",
        str(port),
        "--upstream-url",
        upstream_url,
    ]


def serve_passthrough(port: int, upstream_url: str) -> None:
    import uvicorn

    uvicorn.run(
        PassThrough(upstream_url),
        host=HOST,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,
    )


# --------------------------------------------------------------------------- tidegate


def tidegate_config(
    workdir: Path, upstream_port: int, *, slowdown: int = 1, ledger: bool = True
) -> Path:
    """The default pipeline, with limits nobody reaches here, SQLite state and no cache.

    ``slowdown``: how many times slower than usual the requests will run (under callgrind or a
    trace); the lease window and the spend ledger's flush interval are stretched by as much, so
    leases cover as many requests, and ledger batches hold as many rows, as usual. Without
    ``ledger`` the spend ledger is off, and the config and the SQLite file have names of their
    own (``tidegate-no-ledger.yaml``, ``state-no-ledger.db``), so both can run side by side.
    """

    def limit() -> dict[str, int]:
        return {"rate_per_s": UNLIMITED, "burst": UNLIMITED}

    suffix = "" if ledger else "-no-ledger"
    state: dict[str, Any] = {"url": f"sqlite:///{workdir / f'state{suffix}.db'}"}
    ledger_section: dict[str, Any] = {} if ledger else {"enabled": False}
    if slowdown != 1:
        state["leases"] = {"hold_s": 0.25 * slowdown}
        ledger_section["flush_s"] = 1.0 * slowdown
    config = {
        "profile": "dev",
        "server": {"host": HOST, "drain_seconds": 1, "request_timeout_s": 30},
        "auth": {"keys_file": "keys.yaml"},
        "state": state,
        "providers": {
            "upstream": {
                "type": "openai",
                "model": UPSTREAM_MODEL,
                "base_url": f"http://{HOST}:{upstream_port}/v1",
            }
        },
        "models": {ALIAS: {"providers": ["upstream"], "per_try_timeout_s": 10}},
        "rate_limits": {"per_user": limit(), "per_tenant": limit()},
        "budgets": {"calls": UNLIMITED, "tokens": UNLIMITED * 1000, "cost_usd": UNLIMITED},
        "prices": {UPSTREAM_MODEL: {"input_per_1k": 0.0005, "output_per_1k": 0.0015}},
        "cache": {"enabled": False},
        "logging": {"level": "info"},
        **({"ledger": ledger_section} if ledger_section else {}),
    }
    path = workdir / f"tidegate{suffix}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def write_keys(workdir: Path) -> str:
    key = "tg-bench-" + secrets.token_hex(16)
    keys = {
        "keys": [
            {
                "id": "bench",
                "sha256": hashlib.sha256(key.encode()).hexdigest(),
                "tenant": "bench",
                "user": "bench-user",
                "priority": "standard",
                "data_class": "internal",
                "models": [ALIAS],
            }
        ]
    }
    (workdir / "keys.yaml").write_text(yaml.safe_dump(keys), encoding="utf-8")
    return key


def tidegate_argv(config: Path, port: int) -> list[str]:
    script = Path(sys.executable).parent / "tidegate"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "tidegate.cli"]
    return [*command, "serve", "--config", str(config), "--port", str(port)]


# --------------------------------------------------------------------------- load generation


@dataclass(frozen=True, slots=True)
class Measurement:
    """One load run against one target."""

    requests: int
    seconds: float
    failures: int
    p50_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK-RESULT {{\\"requests\\": %d, \\"duration_us\\": %d, \\"failures\\": %d, " ..
    "\\"p50_us\\": %.1f, \\"p99_us\\": %.1f}}\\n",
    summary.requests, summary.duration,
    e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50.0), latency:percentile(99.0)))
end
"""


class LoadGenerator:
    """wrk when installed, else an aiohttp client in a subprocess; both print one result."""

    def __init__(self, workdir: Path, key: str, choice: str) -> None:
        self.choice = choice
        self.wrk = shutil.which("wrk") if choice != "python" else None
        if choice == "wrk" and self.wrk is None:
            raise BenchError("--load wrk: wrk is not installed (apt-get install wrk)")
        self.key = key
        self.script = workdir / "post.lua"
        self.script.write_text(
            WRK_SCRIPT.format(body=json.dumps(REQUEST_BODY), key=key), encoding="utf-8"
        )
        self.body_file = workdir / "body.json"
        self.body_file.write_text(REQUEST_BODY, encoding="utf-8")

    def describe(self) -> str:
        if self.wrk is not None:
            return "wrk, 1 thread, Lua script for the POST body and key"
        why = "" if self.choice == "python" else " (wrk not found)"
        return f"aiohttp client in a subprocess{why}"

    def run(self, url: str, *, connections: int, seconds: float) -> Measurement:
        if self.wrk is not None:
            argv = [
                self.wrk,
                "-t1",
                f"-c{connections}",
                f"-d{max(1, round(seconds))}s",
                "--timeout",
                "5s",
                "-s",
                str(self.script),
                url,
            ]
        else:
            argv = [
                sys.executable,
                __file__,
                "_load",
                "--url",
                url,
                "--connections",
                str(connections),
                "--seconds",
                str(seconds),
                "--body-file",
                str(self.body_file),
                "--key",
                self.key,
            ]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=seconds + 60, check=False
        )
        for line in done.stdout.splitlines():
            if line.startswith("WRK-RESULT "):
                data = json.loads(line.removeprefix("WRK-RESULT "))
                return Measurement(
                    requests=int(data["requests"]),
                    seconds=data["duration_us"] / 1e6,
                    failures=int(data["failures"]),
                    p50_ms=data["p50_us"] / 1000.0,
                    p99_ms=data["p99_us"] / 1000.0,
                )
        raise BenchError(
            f"the load generator printed no result (exit {done.returncode}): "
            f"{(done.stdout + done.stderr)[-800:]}"
        )


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return 0.0
    rank = max(1, min(len(sorted_values), round(q / 100.0 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def run_load(url: str, connections: int, seconds: float, body: bytes, key: str) -> None:
    """The fallback load generator (no wrk): closed loop, one connection per worker."""
    import uvloop

    async def run() -> None:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        latencies: list[float] = []
        failures = 0
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections)
        ) as session:
            started = CLOCK.now()
            stop_at = started + seconds

            async def worker() -> None:
                nonlocal failures
                while CLOCK.now() < stop_at:
                    sent = CLOCK.now()
                    try:
                        async with session.post(url, data=body, headers=headers) as response:
                            await response.read()
                            ok = response.status == 200
                    except aiohttp.ClientError:
                        ok = False
                    latencies.append(CLOCK.now() - sent)
                    failures += 0 if ok else 1

            await asyncio.gather(*(worker() for _ in range(connections)))
            elapsed = CLOCK.now() - started
        latencies.sort()
        result = {
            "requests": len(latencies),
            "duration_us": elapsed * 1e6,
            "failures": failures,
            "p50_us": percentile(latencies, 50) * 1e6,
            "p99_us": percentile(latencies, 99) * 1e6,
        }
        print("WRK-RESULT " + json.dumps(result), flush=True)

    uvloop.run(run())


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    url: str
    pid: int


@dataclass(frozen=True, slots=True)
class Round:
    """One load run and the CPU time the target process spent during it."""

    load: Measurement
    cpu_s: float | None


@dataclass(frozen=True, slots=True)
class Summary:
    """A target's rounds, combined."""

    rps: float
    rps_low: float
    rps_high: float
    cpu_us_per_request: float | None
    p50_ms: float
    p99_ms: float
    failures: int

    @classmethod
    def of(cls, loaded: Sequence[Round], single: Sequence[Round]) -> Summary:
        requests = sum(r.load.requests for r in loaded)
        seconds = sum(r.load.seconds for r in loaded)
        cpu = [r.cpu_s for r in loaded]
        cpu_total = None if any(c is None for c in cpu) else sum(c or 0.0 for c in cpu)
        return cls(
            rps=requests / seconds if seconds > 0 else 0.0,
            rps_low=min(r.load.rps for r in loaded),
            rps_high=max(r.load.rps for r in loaded),
            cpu_us_per_request=(
                None if cpu_total is None or requests == 0 else cpu_total / requests * 1e6
            ),
            p50_ms=statistics.median(r.load.p50_ms for r in single),
            p99_ms=statistics.median(r.load.p99_ms for r in single),
            failures=sum(r.load.failures for r in (*loaded, *single)),
        )


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux ``/proc``), or None where unavailable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    # After the command name: state is field 3, utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(load: LoadGenerator, target: Target, *, connections: int, seconds: int) -> Round:
    before = cpu_seconds(target.pid)
    result = load.run(target.url, connections=connections, seconds=seconds)
    after = cpu_seconds(target.pid)
    cpu = None if before is None or after is None else after - before
    return Round(result, cpu)


def measure(
    console: Console, targets: list[Target], load: LoadGenerator, args: argparse.Namespace
) -> dict[str, Summary]:
    """Warm up, then alternate the targets round by round so background load hits both alike."""
    loaded: dict[str, list[Round]] = {t.name: [] for t in targets}
    single: dict[str, list[Round]] = {t.name: [] for t in targets}
    for target in targets:
        console.print(
            f"  warm-up: {target.name}, {args.warmup} s at {args.connections} connections"
        )
        load.run(target.url, connections=args.connections, seconds=args.warmup)
    console.print(
        f"  {args.rounds} rounds of {args.round_seconds} s at {args.connections} connections, "
        f"then {args.single_rounds} rounds of {args.round_seconds} s at 1 connection, "
        "alternating the targets"
    )
    for _ in range(args.rounds):
        for target in targets:
            loaded[target.name].append(
                measured(load, target, connections=args.connections, seconds=args.round_seconds)
            )
    for _ in range(args.single_rounds):
        for target in targets:
            single[target.name].append(
                measured(load, target, connections=1, seconds=args.round_seconds)
            )
    return {t.name: Summary.of(loaded[t.name], single[t.name]) for t in targets}


def report(console: Console, results: dict[str, Summary], connections: int) -> bool:
    """Print the table and the verdicts; returns False when some request failed."""
    base, gate = results[PASS_THROUGH], results[TIDEGATE]
    ratio = gate.rps / base.rps
    added_p50 = gate.p50_ms - base.p50_ms
    added_p99 = gate.p99_ms - base.p99_ms

    table = Table(title="tidegate against a minimal pass-through: same upstream, same run")
    table.add_column("target")
    table.add_column(f"req/s @{connections}", justify="right")
    table.add_column("(rounds)", justify="right")
    table.add_column("CPU µs/req", justify="right")
    table.add_column("p50 @1 ms", justify="right")
    table.add_column("p99 @1 ms", justify="right")
    table.add_column("failed", justify="right")
    for name, row in results.items():
        cpu = row.cpu_us_per_request
        table.add_row(
            name,
            f"{row.rps:,.0f}",
            f"{row.rps_low:,.0f}-{row.rps_high:,.0f}",
            "-" if cpu is None else f"{cpu:,.0f}",
            f"{row.p50_ms:.3f}",
            f"{row.p99_ms:.3f}",
            str(row.failures),
        )
    cpu_ratio = (
        "-"
        if gate.cpu_us_per_request is None or base.cpu_us_per_request is None
        else f"{gate.cpu_us_per_request / base.cpu_us_per_request:.2f}x"
    )
    table.add_row(
        "tidegate vs pass-through",
        f"{ratio:.2f}x",
        "",
        cpu_ratio,
        f"{added_p50:+.3f}",
        f"{added_p99:+.3f}",
        "",
    )
    console.print(table)

    verdicts = [
        (
            f"req/s at {connections} connections: {ratio:.0%} of the pass-through",
            f">= {TARGET_RPS_RATIO:.0%}",
            ratio >= TARGET_RPS_RATIO,
        ),
        (
            f"added p50 at 1 connection: {added_p50:.3f} ms",
            f"<= {TARGET_ADDED_P50_MS} ms",
            added_p50 <= TARGET_ADDED_P50_MS,
        ),
    ]
    unledgered = results.get(NO_LEDGER)
    if unledgered is not None:
        verdicts.append(ledger_verdict(gate, unledgered))
    for text, target, met in verdicts:
        mark = "[bold green]MET[/]   " if met else "[bold red]MISSED[/]"
        console.print(f"{mark} {text} (target {target})")
    failed = sum(row.failures for row in results.values())
    if failed:
        console.print(f"[bold red]{failed} requests failed: the numbers above are not valid[/]")
    return failed == 0


def ledger_verdict(gate: Summary, unledgered: Summary) -> tuple[str, str, bool]:
    """What the spend ledger costs: the share of req/s tidegate loses to it (the same run's
    rounds, alternated), with the CPU per request it adds beside it."""
    cost = 1.0 - gate.rps / unledgered.rps if unledgered.rps > 0 else 0.0
    cpu = ""
    if gate.cpu_us_per_request is not None and unledgered.cpu_us_per_request is not None:
        cpu = f", {gate.cpu_us_per_request - unledgered.cpu_us_per_request:+.0f} CPU µs a request"
    return (
        f"spend ledger: {cost:.1%} of tidegate's req/s{cpu}",
        f"<= {TARGET_LEDGER_COST:.0%}",
        cost <= TARGET_LEDGER_COST,
    )


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.release()}"


def load_average() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


@contextlib.contextmanager
def servers(
    console: Console, args: argparse.Namespace, *, ledger_target: bool = False
) -> Iterator[tuple[list[Target], LoadGenerator, str]]:
    """Start the upstream, the pass-through and tidegate (and, with ``ledger_target``, tidegate
    without the spend ledger); stop them all on the way out."""
    workdir = Path(tempfile.mkdtemp(prefix="tidegate-bench-"))
    processes = Processes()
    try:
        upstream_port, pass_port = free_port(), free_port()
        upstream_desc = start_upstream(processes, workdir, upstream_port, args.upstream)
        upstream_url = f"http://{HOST}:{upstream_port}{ROUTE}"
        json_headers = {"Content-Type": "application/json"}
        wait_until_answers(
            "the upstream", upstream_url, processes, body=REQUEST_BODY, headers=json_headers
        )
        passthrough = processes.start(
            "the pass-through",
            passthrough_argv(pass_port, upstream_url),
            log=workdir / "passthrough.log",
            cwd=workdir,
        )
        key = write_keys(workdir)
        targets = [Target(PASS_THROUGH, f"http://{HOST}:{pass_port}{ROUTE}", passthrough.pid)]
        gates = [(TIDEGATE, True), (NO_LEDGER, False)] if ledger_target else [(TIDEGATE, True)]
        for name, ledger in gates:
            port = free_port()
            config = tidegate_config(workdir, upstream_port, ledger=ledger)
            log = workdir / f"{config.stem}.log"
            gate = processes.start(name, tidegate_argv(config, port), log=log, cwd=workdir)
            targets.append(Target(name, f"http://{HOST}:{port}{ROUTE}", gate.pid))
        auth = {**json_headers, "Authorization": f"Bearer {key}"}
        for target in targets:
            headers = wait_until_answers(
                target.name, target.url, processes, body=REQUEST_BODY, headers=auth
            )
            served = headers.get("x-tidegate-served-by")
            if target.name != PASS_THROUGH and served != "upstream":
                raise BenchError(f"{target.name} answered without serving upstream: {headers}")
        yield targets, LoadGenerator(workdir, key, args.load), upstream_desc
        processes.check_alive()
    except BenchError:
        log = workdir / "tidegate.log"
        if log.is_file():
            tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
            console.print("[dim]last lines of the tidegate log:[/]")
            for line in tail:
                console.print(line, markup=False)
        raise
    finally:
        clean_up(processes, workdir, keep=args.keep, console=console)


def clean_up(processes: Processes, workdir: Path, *, keep: bool, console: Console) -> None:
    """Stop every process started, then remove the work folder (or say where it was kept)."""
    processes.stop_all()
    if keep:
        console.print(f"kept {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def bench(args: argparse.Namespace) -> int:
    console = Console(highlight=False, width=max(100, shutil.get_terminal_size().columns))
    console.print(
        f"[bold]tidegate gateway benchmark[/], {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"
    )
    console.print(f"machine: {machine()}; Python {platform.python_version()}")
    console.print(f"load average before: {load_average()}")
    overrides = sorted(k for k in os.environ if k.startswith("TIDEGATE_"))
    try:
        with servers(console, args, ledger_target=args.ledger_check) as (targets, load, upstream):
            console.print(f"upstream: {upstream}")
            console.print(f"load generator: {load.describe()}")
            console.print(
                "tidegate: 1 process; keys-file auth, user and tenant rate limits, budgets,\n"
                "  admission, breaker, metrics, one JSON log line a request, the spend ledger;\n"
                "  SQLite state; no cache"
                + (
                    "\ntidegate, no ledger: the same with ledger.enabled false"
                    if args.ledger_check
                    else ""
                )
            )
            if overrides:
                console.print(
                    f"[bold yellow]environment overrides in effect:[/] {' '.join(overrides)}"
                )
            results = measure(console, targets, load, args)
    except BenchError as error:
        console.print(f"[bold red]benchmark failed:[/] {error}")
        return 1
    console.print(f"load average after: {load_average()}")
    return 0 if report(console, results, args.connections) else 1


# --------------------------------------------------------------------------- entry points


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="tidegate against a minimal pass-through proxy", allow_abbrev=False
    )
    parser.add_argument(
        "--connections", type=int, default=32, help="connections of the loaded runs"
    )
    parser.add_argument("--warmup", type=int, default=2, help="seconds of warm-up per target")
    parser.add_argument("--rounds", type=int, default=5, help="loaded rounds per target")
    parser.add_argument(
        "--single-rounds", type=int, default=4, help="1-connection rounds per target"
    )
    parser.add_argument("--round-seconds", type=int, default=2, help="seconds of one round")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and its logs")
    parser.add_argument(
        "--no-ledger-check",
        dest="ledger_check",
        action="store_false",
        help="leave out the tidegate without the spend ledger (and the ledger's verdict)",
    )
    parser.add_argument(
        "--upstream", choices=("auto", "nginx", "python"), default="auto", help="the fast upstream"
    )
    parser.add_argument(
        "--load", choices=("auto", "wrk", "python"), default="auto", help="the load generator"
    )
    roles = parser.add_subparsers(dest="role", help="internal: the processes this script starts")
    upstream = roles.add_parser("_upstream")
    upstream.add_argument("--port", type=int, required=True)
    passthrough = roles.add_parser("_passthrough")
    passthrough.add_argument("--port", type=int, required=True)
    passthrough.add_argument("--upstream-url", required=True)
    load = roles.add_parser("_load")
    load.add_argument("--url", required=True)
    load.add_argument("--connections", type=int, required=True)
    load.add_argument("--seconds", type=float, required=True)
    load.add_argument("--body-file", type=Path, required=True)
    load.add_argument("--key", required=True)
    args = parser.parse_args(argv)
    if args.role is None and min(args.rounds, args.single_rounds, args.round_seconds) < 1:
        parser.error("--rounds, --single-rounds and --round-seconds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.role == "_upstream":
        serve_upstream(args.port)
        return 0
    if args.role == "_passthrough":
        serve_passthrough(args.port, args.upstream_url)
        return 0
    if args.role == "_load":
        run_load(args.url, args.connections, args.seconds, args.body_file.read_bytes(), args.key)
        return 0
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return bench(args)
    except KeyboardInterrupt:
        print("\ninterrupted: every server this run started has been stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
