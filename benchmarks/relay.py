"""Stream relay: tidegate's CPU per relayed chunk against a minimal relay's, in the same run.

Run with ``make bench`` or ``.venv/bin/python benchmarks/relay.py`` (about 40 s). Everything
listens on loopback only, and every process this script starts is stopped by its pid when it
ends, on Ctrl-C too.

Three servers and a client, each its own process:

* the **upstream**: ``tidegate fake-upstream`` streaming OpenAI ``chat.completion.chunk`` events,
  ``--chunks`` content chunks a stream (and the role, finish and usage chunks), one every
  ``1 / --pace`` seconds, so that each chunk reaches a relay on its own, as a model's tokens do;
* the **minimal relay**: a raw ASGI app on uvicorn with the server flags tidegate runs with
  (uvloop, httptools) that forwards the POST through one shared ``aiohttp.ClientSession`` and
  sends on every piece of the upstream's body as it arrives, parsing nothing;
* **tidegate** (``tidegate serve``) with the configuration of ``benchmarks/gateway.py`` (keys-file
  auth, rate limits, budgets, SQLite state, the ledger, the request log), relaying the stream;
* the **client**: a raw asyncio protocol on uvloop, ``--concurrency`` keep-alive connections each
  running streams one after another, ``--streams`` in all, counting the ``data:`` events of each.

Rounds alternate the two relays, so that background load falls on both alike. Each relay's CPU
time (user + system, from ``/proc``) over its rounds, divided by the chunks its client received,
is its CPU per chunk; the target is tidegate at most 1.3x the minimal relay's. The exit status is
0 whether or not it is met, 1 only when the run itself failed.
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
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import yaml
from rich.console import Console
from rich.table import Table

import gateway as gw  # the process handling, config and key of benchmarks/gateway.py

__all__ = ["Totals", "main", "verdict"]

#: The target (issue 20): tidegate's CPU per chunk against the minimal relay's.
TARGET_RATIO = 1.3


# --------------------------------------------------------------------------- the minimal relay


class MinimalRelay(gw.PassThrough):
    """The baseline: ``gateway.py``'s pass-through (its session and lifespan), sending the
    upstream's body on as it comes. Nothing else."""

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)  # the lifespan, as the pass-through's
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
            content_type = response.headers.get("content-type", "application/json").encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": [(b"content-type", content_type)],
                }
            )
            async for data in response.content.iter_any():
                await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def serve_minimal(port: int, upstream_url: str) -> None:
    import uvicorn

    uvicorn.run(
        MinimalRelay(upstream_url),
        host=gw.HOST,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,
    )


# --------------------------------------------------------------------------- the client


class _Conn(asyncio.Protocol):
    """One keep-alive connection: a streamed request out, its chunked answer read to its end."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parts: list[bytes] = []
        self.tail = b""
        self.done: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(b"".join(self.parts))

    def data_received(self, data: bytes) -> None:
        self.parts.append(data)
        self.tail = (self.tail + data)[-7:]
        # The last chunk of a chunked body (it may come in a read of its own); an event's own
        # bytes never end this way.
        if self.tail == b"\r\n0\r\n\r\n" and self.done is not None and not self.done.done():
            self.done.set_result(b"".join(self.parts))
            self.parts, self.tail = [], b""


def _events(answer: bytes) -> tuple[int, bool]:
    """The ``data:`` events of an answer, and whether it was a complete 200 stream."""
    head, _, body = answer.partition(b"\r\n\r\n")
    ok = head.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in body
    return body.count(b"data: {"), ok


async def _streams(port: int, request: bytes, streams: int, concurrency: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    left, chunks, failed = streams, 0, 0

    async def client() -> None:
        nonlocal left, chunks, failed
        _, conn = await loop.create_connection(_Conn, gw.HOST, port)
        while left > 0:
            left -= 1
            conn.done = loop.create_future()
            assert conn.transport is not None
            conn.transport.write(request)
            count, ok = _events(await conn.done)
            chunks += count
            failed += not ok
            if conn.transport.is_closing():
                _, conn = await loop.create_connection(_Conn, gw.HOST, port)
        assert conn.transport is not None
        conn.transport.close()

    started = gw.CLOCK.now()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {
        "seconds": gw.CLOCK.now() - started,
        "streams": streams,
        "chunks": chunks,
        "failed": failed,
    }


def request_bytes(key: str) -> bytes:
    body = json.dumps(
        {
            "model": gw.ALIAS,
            "messages": [{"role": "user", "content": "Say hello."}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        separators=(",", ":"),
    ).encode()
    head = (
        f"POST {gw.ROUTE} HTTP/1.1\r\nHost: {gw.HOST}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def run_client(args: argparse.Namespace) -> None:
    import uvloop

    request = request_bytes(args.key)
    result = uvloop.run(_streams(args.port, request, args.streams, args.concurrency))
    print("RELAY-RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- the run


@dataclass(slots=True)
class Totals:
    """One relay's rounds added up: the streams and chunks its client received, its CPU time."""

    streams: int = 0
    chunks: int = 0
    cpu_s: float = 0.0
    seconds: float = 0.0

    @property
    def cpu_us_per_chunk(self) -> float:
        return self.cpu_s / self.chunks * 1e6 if self.chunks else 0.0


def verdict(minimal: Totals, tidegate: Totals) -> tuple[bool, str]:
    """MET or MISSED for tidegate's CPU per chunk against the minimal relay's."""
    ratio = tidegate.cpu_us_per_chunk / minimal.cpu_us_per_chunk if minimal.chunks else 0.0
    line = (
        f"tidegate's CPU per chunk: {ratio:.2f}x the minimal relay's (target <= {TARGET_RATIO:g}x)"
    )
    return 0 < ratio <= TARGET_RATIO, line


def _script(workdir: Path, args: argparse.Namespace) -> Path:
    behaviour = {"tokens": args.chunks, "tokens_per_second": args.pace}
    script = {"seed": 1, "models": {"*": behaviour}}
    path = workdir / "upstream.yaml"
    path.write_text(yaml.safe_dump(script), encoding="utf-8")
    return path


def _round(args: argparse.Namespace, port: int, key: str, pid: int, streams: int) -> Totals:
    argv = [sys.executable, __file__, "_client", "--port", str(port), "--key", key]
    argv += ["--streams", str(streams), "--concurrency", str(args.concurrency)]
    before = gw.cpu_seconds(pid) or 0.0
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    after = gw.cpu_seconds(pid) or 0.0
    for line in done.stdout.splitlines():
        if line.startswith("RELAY-RESULT "):
            data = json.loads(line.removeprefix("RELAY-RESULT "))
            if data["failed"]:
                raise gw.BenchError(f"{data['failed']} of {data['streams']} streams failed")
            return Totals(data["streams"], data["chunks"], after - before, data["seconds"])
    raise gw.BenchError(f"the client printed no result: {(done.stdout + done.stderr)[-800:]}")


def _start(workdir: Path, args: argparse.Namespace, processes: gw.Processes) -> dict[str, Any]:
    """The upstream and both relays, answering; their ports, pids and the key."""
    upstream_port, minimal_port, port = gw.free_port(), gw.free_port(), gw.free_port()
    tidegate = Path(sys.executable).parent / "tidegate"
    upstream = [str(tidegate), "fake-upstream", "--script", str(_script(workdir, args))]
    upstream += ["--port", str(upstream_port)]
    processes.start("fake upstream", upstream, log=workdir / "upstream.log", cwd=workdir)
    upstream_url = f"http://{gw.HOST}:{upstream_port}{gw.ROUTE}"
    minimal_argv = [sys.executable, __file__, "_minimal", "--port", str(minimal_port)]
    minimal_argv += ["--upstream-url", upstream_url]
    minimal = processes.start(
        "minimal relay", minimal_argv, log=workdir / "minimal.log", cwd=workdir
    )
    key = gw.write_keys(workdir)
    argv = gw.tidegate_argv(gw.tidegate_config(workdir, upstream_port), port)
    server = processes.start("tidegate", argv, log=workdir / "tidegate.log", cwd=workdir)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    for name, at in (("minimal relay", minimal_port), ("tidegate", port)):
        url = f"http://{gw.HOST}:{at}{gw.ROUTE}"
        gw.wait_until_answers(name, url, processes, body=gw.REQUEST_BODY, headers=headers)
    return {
        "key": key,
        "relays": {"minimal relay": (minimal_port, minimal.pid), "tidegate": (port, server.pid)},
    }


def bench(args: argparse.Namespace) -> int:
    console = Console(highlight=False, width=max(Console().width, 100))
    workdir = Path(tempfile.mkdtemp(prefix="tidegate-relay-"))
    processes = gw.Processes()
    totals = {"minimal relay": Totals(), "tidegate": Totals()}
    try:
        started = _start(workdir, args, processes)
        key, relays = started["key"], started["relays"]
        console.print(
            f"upstream: {args.chunks} chunks a stream at {args.pace:g} a second; "
            f"{args.concurrency} streams at a time, {args.streams} a round, {args.rounds} rounds"
        )
        for port, pid in relays.values():  # warm-up
            _round(args, port, key, pid, args.concurrency)
        for _ in range(args.rounds):
            for name, (port, pid) in relays.items():
                run = _round(args, port, key, pid, args.streams)
                total = totals[name]
                total.streams += run.streams
                total.chunks += run.chunks
                total.cpu_s += run.cpu_s
                total.seconds += run.seconds
        processes.check_alive()
    finally:
        processes.stop_all()
        if args.keep:
            console.print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report(console, totals)
    return 0


def report(console: Console, totals: dict[str, Totals]) -> None:
    table = Table(title="stream relay: tidegate against a minimal relay, same upstream, same run")
    for column in ("relay", "streams", "chunks", "chunks/s", "CPU µs/chunk"):
        table.add_column(column, justify="left" if column == "relay" else "right")
    for name, total in totals.items():
        rate = total.chunks / total.seconds if total.seconds else 0.0
        table.add_row(
            name,
            f"{total.streams:,}",
            f"{total.chunks:,}",
            f"{rate:,.0f}",
            f"{total.cpu_us_per_chunk:.1f}",
        )
    minimal, tidegate = totals["minimal relay"], totals["tidegate"]
    met, line = verdict(minimal, tidegate)
    ratio = tidegate.cpu_us_per_chunk / minimal.cpu_us_per_chunk if minimal.chunks else 0.0
    table.add_row("tidegate vs minimal", "", "", "", f"{ratio:.2f}x")
    console.print(table)
    console.print(f"{'MET   ' if met else 'MISSED'} {line}")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "role", nargs="?", default="bench", choices=["bench", "_client", "_minimal"]
    )
    parser.add_argument("--chunks", type=int, default=200, help="content chunks a stream")
    parser.add_argument("--pace", type=float, default=200.0, help="chunks a second a stream")
    parser.add_argument("--concurrency", type=int, default=16, help="streams at a time")
    parser.add_argument("--streams", type=int, default=48, help="streams a round and relay")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key", default="")
    parser.add_argument("--upstream-url", default="")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.role == "_client":
        run_client(args)
        return 0
    if args.role == "_minimal":
        serve_minimal(args.port, args.upstream_url)
        return 0
    signal.signal(signal.SIGTERM, gw._on_sigterm)
    try:
        return bench(args)
    except gw.BenchError as exc:
        print(f"relay benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: every server this run started has been stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
