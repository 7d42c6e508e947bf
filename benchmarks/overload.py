"""Overload: tidegate at 10x and 100x its capacity, and what a refusal costs it.

Run with ``make bench`` or ``.venv/bin/python benchmarks/overload.py`` (about a minute).
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
throughput against the measured capacity, and the server's CPU time per refusal (its CPU time in
the run, less what the served requests cost at capacity, over the refusals); then its RSS before
and after. Each target is a MET or MISSED line; the exit status is 0 either way, 1 only when the
run itself failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
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


def run_client(args: argparse.Namespace) -> None:
    import uvloop

    body = gw.REQUEST_BODY.encode()
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


def summarise(
    capacity: LoadResult, loads: dict[str, LoadResult], rss_growth_mib: float
) -> list[tuple[bool, str]]:
    """The MET/MISSED verdicts, worst load last: ``(met, line)`` each."""
    per_served = capacity.cpu_s / capacity.served if capacity.served else 0.0
    top = loads["100x"]
    cpu = max(run.cpu_us_per_refusal(per_served) for run in loads.values())
    share = top.served_rps / capacity.served_rps if capacity.served_rps else 0.0
    return [
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
        (
            cpu <= TARGET_CPU_US,
            f"CPU per refusal: {cpu:.1f} µs, the worse load (target <= {TARGET_CPU_US:g} µs)",
        ),
        (
            rss_growth_mib < TARGET_RSS_MIB,
            f"RSS growth: {rss_growth_mib:+.1f} MiB (target < {TARGET_RSS_MIB:g} MiB)",
        ),
    ]


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
            }
        },
    }
    path = workdir / "upstream.yaml"
    path.write_text(yaml.safe_dump(script), encoding="utf-8")
    return path


def _config(workdir: Path, upstream_port: int) -> Path:
    path = gw.tidegate_config(workdir, upstream_port)
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    config["admission"] = {"slots": SLOTS, "queue_cap": QUEUE}
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _load(
    args: argparse.Namespace, port: int, key: str, pid: int, connections: int, rate: float
) -> LoadResult:
    argv = [sys.executable, __file__, "_client", "--port", str(port), "--key", key]
    argv += ["--connections", str(connections), "--rate", str(rate)]
    argv += ["--seconds", str(args.seconds)]
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
        key = gw.write_keys(workdir)
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
        for name, factor, connections in (("10x", 10, 50), ("100x", 100, 200)):
            rate = factor * capacity.served_rps
            loads[name] = _load(args, port, key, server.pid, connections, rate)
        rss_after = rss_mib(server.pid)
        processes.check_alive()
    finally:
        processes.stop_all()
        if args.keep:
            console.print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report(console, capacity, loads, rss_before, rss_after)
    return 0


def report(
    console: Console,
    capacity: LoadResult,
    loads: dict[str, LoadResult],
    rss_before: float,
    rss_after: float,
) -> None:
    per_served = capacity.cpu_s / capacity.served if capacity.served else 0.0
    table = Table(title="tidegate under overload: admission 8 + 8, upstream 0.2 s, one process")
    for column in ("load", "offered req/s", "shed", "refusal p50 ms", "refusal p99 ms"):
        table.add_column(column, justify="right")
    table.add_column("served req/s", justify="right")
    table.add_column("vs capacity", justify="right")
    table.add_column("CPU µs/refusal", justify="right")
    table.add_row(
        "capacity", f"{capacity.offered_rps:,.0f}", f"{capacity.shed_share:.1%}", "", "",
        f"{capacity.served_rps:.1f}", "1.00x", "",
    )  # fmt: skip
    for name, run in loads.items():
        table.add_row(
            name,
            f"{run.offered_rps:,.0f}",
            f"{run.shed_share:.1%}",
            f"{run.refused_p50_ms:.2f}",
            f"{run.refused_p99_ms:.2f}",
            f"{run.served_rps:.1f}",
            f"{run.served_rps / capacity.served_rps:.2f}x" if capacity.served_rps else "-",
            f"{run.cpu_us_per_refusal(per_served):.1f}",
        )
    console.print(table)
    console.print(
        f"RSS before {rss_before:.1f} MiB, after {rss_after:.1f} MiB; "
        f"CPU per served request at capacity {per_served * 1e6:,.0f} µs"
    )
    for met, line in summarise(capacity, loads, rss_after - rss_before):
        console.print(f"{'MET   ' if met else 'MISSED'} {line}")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="bench", choices=["bench", "_client"])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each load")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key", default="")
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--rate", type=float, default=1.0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.role == "_client":
        run_client(args)
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
