"""Overload: tidegate at 10x and 100x its capacity, and what a refusal costs it.

Run with ``make bench`` or ``.venv/bin/python benchmarks/overload.py`` (about two minutes).
Everything listens on loopback only, and every process this script starts is stopped by its pid
when it ends, on Ctrl-C too.

The scenario of the surge runbook: ``tidegate serve`` (one process, the pipeline of
``gateway.py``: keys, rate limits and budgets that refuse nothing, SQLite state) with admission of
8 slots and 8 waiting places, in front of ``tidegate fake-upstream`` answering each request after
0.2 s. Its capacity is measured first (a closed loop of 16 connections: every slot busy and the
queue full, nothing refused), then it is offered 10x and 100x that rate by a closed-loop client
(each connection has at most one request out, and sends the next at its own pace or as soon as
the answer is back if that is later). The client is a raw asyncio protocol on uvloop in its own
process, a few microseconds a request, so that it takes little of the machine from the server.

Printed for each load: the share shed, the refusals' p50 and p99 (from the client), served
throughput against the measured capacity, and the CPU time per refusal, three ways:

- *est.*: the mixed load's CPU time less what its served requests cost at capacity, over the
  refusals (it carries the served requests' variance from one run to the next);
- *refusals only*: the same rate again with admission held full by 16 requests on a route whose
  answers take 600 s (so nothing is served and every request is refused), less the server's idle
  CPU measured meanwhile: the figure the target is checked on, at each load;
- *minimal server*: the same rates against a raw protocol that answers every request with a fixed
  503 (the floor the sockets and the event loop cost, whatever answers).

Then RSS before and after, and the pass-through of ``gateway.py`` in front of the same upstream
for scale (CPU per proxied request). Each target is a MET or MISSED line; the exit status is 0
either way, 1 only when the run itself failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import yaml
from rich.console import Console
from rich.table import Table

import gateway as gw  # the process handling, config and key of benchmarks/gateway.py

__all__ = ["LoadResult", "main", "summarise"]

#: The fake upstream's time per answer, and the admission under test.
UPSTREAM_S = 0.2
SLOTS = 8
QUEUE = 8
#: The targets (issue 20).
TARGET_REFUSAL_P99_MS = 5.0
TARGET_SERVED_SHARE = 0.95
TARGET_CPU_US = 50.0
TARGET_RSS_MIB = 10.0
#: Closed-loop connections for the pass-through's reference figure.
PASSTHROUGH_CONNECTIONS = 64
#: The route whose answers take HELD_S: its requests hold every slot and waiting place while
#: refusals alone are measured.
HELD_ALIAS = "held"
HELD_MODEL = "held-model"
HELD_S = 600.0
#: Seconds of idle CPU measured with admission held full (subtracted from the refusal loads).
IDLE_S = 3.0
#: The loads: name, factor of the measured capacity, closed-loop connections.
LOADS = (("10x", 10, 50), ("100x", 100, 200))


# --------------------------------------------------------------------------- the client


class _Conn(asyncio.Protocol):
    """One keep-alive connection: a request out, its answer parsed just enough (status line and
    Content-Length), then the next."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.done: asyncio.Future[int] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            self.done.set_result(0)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.done is None or self.done.done():
            return
        head = self.buffer[:end].lower()
        at = head.find(b"content-length:")
        length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
        if len(self.buffer) < end + 4 + length:
            return
        self.buffer = self.buffer[end + 4 + length :]
        self.done.set_result(int(head[9:12]))


def percentile(values: Sequence[float], q: float) -> float:
    return gw.percentile(sorted(values), q)


async def _closed_loop(
    port: int, request: bytes, connections: int, rate: float, seconds: float
) -> dict[str, Any]:
    """``connections`` closed-loop clients, each sending at ``rate / connections`` a second at
    most; what came back, by status, with every latency."""
    loop = asyncio.get_running_loop()
    interval = connections / rate
    served: list[float] = []
    refused: list[float] = []
    statuses: dict[int, int] = {}
    started = loop.time()
    stop = started + seconds

    async def connect() -> _Conn:
        _, conn = await loop.create_connection(_Conn, gw.HOST, port)
        return conn

    async def client(index: int) -> None:
        conn = await connect()
        due = started + interval * index / connections
        while True:
            now = loop.time()
            if due > now:
                await gw.CLOCK.asleep(due - now)
            if loop.time() >= stop:
                break
            if conn.closed:
                conn = await connect()
            sent = gw.CLOCK.now()  # the loop's own clock counts whole milliseconds on uvloop
            conn.done = loop.create_future()
            assert conn.transport is not None
            conn.transport.write(request)
            status = await conn.done
            took = gw.CLOCK.now() - sent
            statuses[status] = statuses.get(status, 0) + 1
            (served if status == 200 else refused).append(took)
            due = max(due + interval, loop.time())
        if conn.transport is not None:
            conn.transport.close()

    cpu = time.process_time()
    await asyncio.gather(*(client(i) for i in range(connections)))
    return {
        "client_cpu_s": time.process_time() - cpu,
        "seconds": loop.time() - started,
        "statuses": {str(k): v for k, v in statuses.items()},
        "served": len(served),
        "refused": len(refused),
        "refused_p50_ms": percentile(refused, 50) * 1000,
        "refused_p99_ms": percentile(refused, 99) * 1000,
        "served_p50_ms": percentile(served, 50) * 1000,
    }


def _body_for(model: str) -> str:
    """gateway.py's request body, naming the upstream's own model (for the pass-through)."""
    return json.dumps({**json.loads(gw.REQUEST_BODY), "model": model})


def run_client(args: argparse.Namespace) -> None:
    import uvloop

    body = (gw.REQUEST_BODY if not args.model else _body_for(args.model)).encode()
    request = (
        f"POST {gw.ROUTE} HTTP/1.1\r\nHost: {gw.HOST}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {args.key}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    result = uvloop.run(_closed_loop(args.port, request, args.connections, args.rate, args.seconds))
    print("LOAD-RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True, slots=True)
class LoadResult:
    """One load against the server: what the client saw and the server's CPU time meanwhile."""

    seconds: float
    served: int
    refused: int
    refused_p50_ms: float
    refused_p99_ms: float
    cpu_s: float

    @property
    def served_rps(self) -> float:
        return self.served / self.seconds

    @property
    def offered_rps(self) -> float:
        return (self.served + self.refused) / self.seconds

    @property
    def shed_share(self) -> float:
        total = self.served + self.refused
        return self.refused / total if total else 0.0

    def cpu_us_per_refusal(self, cpu_per_served_s: float) -> float:
        """The run's CPU time less what its served requests cost at capacity, per refusal."""
        if not self.refused:
            return 0.0
        return max(0.0, self.cpu_s - self.served * cpu_per_served_s) / self.refused * 1e6


@dataclass(frozen=True, slots=True)
class RefusalCost:
    """CPU per refusal at one load, measured with nothing served meanwhile (admission held full
    by requests that answer late): tidegate's, less its idle CPU, and a minimal server's that
    answers every request with a fixed 503 (the floor: the sockets and the loop, no HTTP
    framework)."""

    tidegate: LoadResult
    tidegate_idle_cpu_per_s: float
    floor: LoadResult

    @property
    def tidegate_us(self) -> float:
        run = self.tidegate
        busy = max(0.0, run.cpu_s - self.tidegate_idle_cpu_per_s * run.seconds)
        return busy / run.refused * 1e6 if run.refused else 0.0

    @property
    def floor_us(self) -> float:
        run = self.floor
        return run.cpu_s / run.refused * 1e6 if run.refused else 0.0


def summarise(
    capacity: LoadResult,
    loads: dict[str, LoadResult],
    costs: dict[str, RefusalCost],
    rss_growth_mib: float,
) -> list[tuple[bool, str]]:
    """The MET/MISSED verdicts: ``(met, line)`` each."""
    top = loads["100x"]
    share = top.served_rps / capacity.served_rps if capacity.served_rps else 0.0
    verdicts = [
        (
            top.refused_p99_ms <= TARGET_REFUSAL_P99_MS,
            f"refusal p99 at 100x: {top.refused_p99_ms:.2f} ms "
            f"(target <= {TARGET_REFUSAL_P99_MS:g} ms)",
        ),
        (
            share >= TARGET_SERVED_SHARE,
            f"served throughput at 100x: {share:.1%} of capacity "
            f"(target >= {TARGET_SERVED_SHARE:.0%})",
        ),
    ]
    for name, cost in costs.items():
        verdicts.append(
            (
                cost.tidegate_us <= TARGET_CPU_US,
                f"CPU per refusal at {name}: {cost.tidegate_us:.1f} µs "
                f"(target <= {TARGET_CPU_US:g} µs; a minimal server's: {cost.floor_us:.1f} µs)",
            )
        )
    verdicts.append(
        (
            rss_growth_mib < TARGET_RSS_MIB,
            f"RSS growth: {rss_growth_mib:+.1f} MiB (target < {TARGET_RSS_MIB:g} MiB)",
        )
    )
    return verdicts


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _script(workdir: Path) -> Path:
    script = {
        "seed": 1,
        "models": {
            gw.UPSTREAM_MODEL: {
                "latency": UPSTREAM_S,
                "ttft": 0.0,
                "tokens_per_second": 100_000,
                "text": "Hello from the overload upstream.",
            },
            HELD_MODEL: {"latency": HELD_S, "text": "late"},
        },
    }
    path = workdir / "upstream.yaml"
    path.write_text(yaml.safe_dump(script), encoding="utf-8")
    return path


def _write_keys(workdir: Path) -> str:
    """gateway.py's key, allowed the held route too."""
    key = gw.write_keys(workdir)
    path = workdir / "keys.yaml"
    keys = yaml.safe_load(path.read_text(encoding="utf-8"))
    keys["keys"][0]["models"].append(HELD_ALIAS)
    path.write_text(yaml.safe_dump(keys), encoding="utf-8")
    return key


def _config(workdir: Path, upstream_port: int) -> Path:
    path = gw.tidegate_config(workdir, upstream_port)
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    config["admission"] = {"slots": SLOTS, "queue_cap": QUEUE}
    # A second route, to the model that answers after HELD_S, with timeouts that outlast it.
    config["server"]["request_timeout_s"] = 2 * HELD_S
    config["providers"]["held"] = {**config["providers"]["upstream"], "model": HELD_MODEL}
    config["models"][HELD_ALIAS] = {"providers": ["held"], "per_try_timeout_s": 2 * HELD_S}
    config["prices"][HELD_MODEL] = config["prices"][gw.UPSTREAM_MODEL]
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _load(
    args: argparse.Namespace,
    port: int,
    key: str,
    pid: int,
    connections: int,
    rate: float,
    *,
    model: str = "",
    seconds: float | None = None,
) -> LoadResult:
    argv = [sys.executable, __file__, "_client", "--port", str(port), "--key", key]
    argv += ["--model", model] if model else []
    argv += ["--connections", str(connections), "--rate", str(rate)]
    argv += ["--seconds", str(args.seconds if seconds is None else seconds)]
    before = gw.cpu_seconds(pid) or 0.0
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=args.seconds + 60, check=False
    )
    after = gw.cpu_seconds(pid) or 0.0
    for line in done.stdout.splitlines():
        if line.startswith("LOAD-RESULT "):
            data = json.loads(line.removeprefix("LOAD-RESULT "))
            print("  client:", data["statuses"], f"client CPU {data['client_cpu_s']:.2f} s")
            return LoadResult(
                seconds=data["seconds"],
                served=data["served"],
                refused=data["refused"],
                refused_p50_ms=data["refused_p50_ms"],
                refused_p99_ms=data["refused_p99_ms"],
                cpu_s=after - before,
            )
    raise gw.BenchError(f"the client printed no result: {(done.stdout + done.stderr)[-800:]}")


def bench(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 110))
    workdir = Path(tempfile.mkdtemp(prefix="tidegate-overload-"))
    processes = gw.Processes()
    try:
        upstream_port, port = gw.free_port(), gw.free_port()
        tidegate = Path(sys.executable).parent / "tidegate"
        upstream = [str(tidegate), "fake-upstream", "--script", str(_script(workdir))]
        upstream += ["--port", str(upstream_port)]
        processes.start("fake upstream", upstream, log=workdir / "upstream.log", cwd=workdir)
        key = _write_keys(workdir)
        argv = gw.tidegate_argv(_config(workdir, upstream_port), port)
        server = processes.start("tidegate", argv, log=workdir / "tidegate.log", cwd=workdir)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        url = f"http://{gw.HOST}:{port}{gw.ROUTE}"
        gw.wait_until_answers("tidegate", url, processes, body=gw.REQUEST_BODY, headers=headers)
        console.print(
            f"tidegate: admission {SLOTS} slots + {QUEUE} waiting, upstream "
            f"{UPSTREAM_S:g} s an answer; {args.seconds:g} s a load"
        )
        rss_before = rss_mib(server.pid)
        capacity = _load(args, port, key, server.pid, SLOTS + QUEUE, 1e6)
        loads: dict[str, LoadResult] = {}
        for name, factor, connections in LOADS:
            rate = factor * capacity.served_rps
            loads[name] = _load(args, port, key, server.pid, connections, rate)
        rss_after = rss_mib(server.pid)
        processes.check_alive()
        costs = _refusal_costs(args, processes, workdir, (port, server.pid, key), capacity)
        passthrough = _passthrough(args, processes, workdir, upstream_port, key)
    finally:
        processes.stop_all()
        if args.keep:
            console.print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report(console, capacity, loads, costs)
    per_request = passthrough.cpu_s / passthrough.served * 1e6 if passthrough.served else 0.0
    console.print(
        f"RSS before {rss_before:.1f} MiB, after {rss_after:.1f} MiB; pass-through (same "
        f"upstream, {PASSTHROUGH_CONNECTIONS} connections, same run): "
        f"{passthrough.served_rps:,.0f} req/s, {per_request:,.0f} µs of CPU per proxied request"
    )
    for met, line in summarise(capacity, loads, costs, rss_after - rss_before):
        console.print(f"{'MET   ' if met else 'MISSED'} {line}")
    return 0


def _refusal_costs(
    args: argparse.Namespace,
    processes: gw.Processes,
    workdir: Path,
    target: tuple[int, int, str],
    capacity: LoadResult,
) -> dict[str, RefusalCost]:
    """Each load's rate again with admission held full (nothing is served, so all the CPU but
    the idle is the refusals'), then the same against the minimal server."""
    port, pid, key = target
    held = _hold(port, key, SLOTS + QUEUE)
    try:
        probe = _load(args, port, key, pid, 1, 1e6, seconds=0.5)
        if probe.served:
            raise gw.BenchError("admission was not held full: a request was served")
        before = gw.cpu_seconds(pid) or 0.0
        gw.CLOCK.sleep(IDLE_S)
        idle = ((gw.cpu_seconds(pid) or 0.0) - before) / IDLE_S
        refused = {
            name: _load(args, port, key, pid, connections, factor * capacity.served_rps)
            for name, factor, connections in LOADS
        }
    finally:
        for sock in held:
            sock.close()
    floor_port = gw.free_port()
    floor_argv = [sys.executable, __file__, "_floor", "--port", str(floor_port)]
    floor = processes.start("floor", floor_argv, log=workdir / "floor.log", cwd=workdir)
    _wait_for_port(floor_port, processes)
    costs = {}
    for name, factor, connections in LOADS:
        at_floor = _load(
            args, floor_port, key, floor.pid, connections, factor * capacity.served_rps
        )
        if refused[name].served or at_floor.served:
            raise gw.BenchError(f"a request was served during the refusals-only {name} load")
        costs[name] = RefusalCost(refused[name], idle, at_floor)
    return costs


def _passthrough(
    args: argparse.Namespace, processes: gw.Processes, workdir: Path, upstream_port: int, key: str
) -> LoadResult:
    """The minimal proxy of ``gateway.py`` in front of the same upstream, at a closed loop: what
    a whole proxied request costs, for scale beside a refusal."""
    port = gw.free_port()
    upstream_url = f"http://{gw.HOST}:{upstream_port}{gw.ROUTE}"
    argv = gw.passthrough_argv(port, upstream_url)
    server = processes.start("pass-through", argv, log=workdir / "passthrough.log", cwd=workdir)
    url = f"http://{gw.HOST}:{port}{gw.ROUTE}"
    headers = {"Content-Type": "application/json"}
    body = _body_for(gw.UPSTREAM_MODEL)
    gw.wait_until_answers("pass-through", url, processes, body=body, headers=headers)
    connections = PASSTHROUGH_CONNECTIONS
    return _load(args, port, key, server.pid, connections, 1e6, model=gw.UPSTREAM_MODEL)


def _hold(port: int, key: str, count: int) -> list[socket.socket]:
    """``count`` connections, each with a request on the route that answers after HELD_S: they
    take every slot and waiting place (left unread; closed when the caller is done)."""
    body = json.dumps({**json.loads(gw.REQUEST_BODY), "model": HELD_ALIAS}).encode()
    request = (
        f"POST {gw.ROUTE} HTTP/1.1\r\nHost: {gw.HOST}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    held = []
    for _ in range(count):
        sock = socket.create_connection((gw.HOST, port), timeout=5.0)
        sock.sendall(request)
        held.append(sock)
    gw.CLOCK.sleep(1.0)  # each is admitted (a slot, or a waiting place) once the app reads it
    return held


def _wait_for_port(port: int, processes: gw.Processes) -> None:
    give_up = gw.CLOCK.now() + 20.0
    while gw.CLOCK.now() < give_up:
        processes.check_alive()
        try:
            socket.create_connection((gw.HOST, port), timeout=1.0).close()
            return
        except OSError:
            gw.CLOCK.sleep(0.05)
    raise gw.BenchError(f"nothing listens on port {port} after 20 s")


#: What the minimal server answers every request with.
FLOOR_BODY = b'{"error":{"type":"overloaded_error","code":"queue_full","retryable":true}}'
FLOOR_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    + b"content-length: %d\r\n\r\n" % len(FLOOR_BODY)
    + FLOOR_BODY
)


def serve_floor(port: int) -> None:
    """The floor: a raw protocol on uvloop with the httptools parser that answers every request
    with FLOOR_ANSWER, the least a process can do per refusal over the same sockets."""
    import uvloop

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: gw._UpstreamProtocol(FLOOR_ANSWER), gw.HOST, port)
        async with server:
            await server.serve_forever()

    uvloop.run(run())


def report(
    console: Console,
    capacity: LoadResult,
    loads: dict[str, LoadResult],
    costs: dict[str, RefusalCost],
) -> None:
    per_served = capacity.cpu_s / capacity.served if capacity.served else 0.0
    table = Table(title="tidegate under overload: admission 8 + 8, upstream 0.2 s, one process")
    for column in ("load", "offered req/s", "shed", "refusal p50 ms", "refusal p99 ms"):
        table.add_column(column, justify="right")
    table.add_column("served req/s", justify="right")
    table.add_column("vs capacity", justify="right")
    table.add_column("CPU µs/refusal (est.)", justify="right")
    table.add_column("refusals only", justify="right")
    table.add_column("minimal server", justify="right")
    table.add_row(
        "capacity", f"{capacity.offered_rps:,.0f}", f"{capacity.shed_share:.1%}", "", "",
        f"{capacity.served_rps:.1f}", "1.00x", "", "", "",
    )  # fmt: skip
    for name, run in loads.items():
        cost = costs[name]
        table.add_row(
            name,
            f"{run.offered_rps:,.0f}",
            f"{run.shed_share:.1%}",
            f"{run.refused_p50_ms:.2f}",
            f"{run.refused_p99_ms:.2f}",
            f"{run.served_rps:.1f}",
            f"{run.served_rps / capacity.served_rps:.2f}x" if capacity.served_rps else "-",
            f"{run.cpu_us_per_refusal(per_served):.1f}",
            f"{cost.tidegate_us:.1f}",
            f"{cost.floor_us:.1f}",
        )
    console.print(table)
    console.print(
        f"CPU per served request at capacity {per_served * 1e6:,.0f} µs. CPU µs a refusal: "
        "(est.) is the mixed load's CPU less its served requests at the capacity run's cost; "
        "refusals only is the same rate with admission held full (nothing served) less the "
        "idle CPU; the minimal server answers every request with a fixed 503 (the floor)."
    )


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="bench", choices=["bench", "_client", "_floor"])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each load")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key", default="")
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--model", default="", help="the body's model (default: gateway.py's)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.role == "_client":
        run_client(args)
        return 0
    if args.role == "_floor":
        serve_floor(args.port)
        return 0
    signal.signal(signal.SIGTERM, gw._on_sigterm)
    try:
        return bench(args)
    except gw.BenchError as exc:
        print(f"overload benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: every server this run started has been stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
