"""Python bytecodes per request of tidegate's own path, by module and by function.

Run with ``.venv/bin/python benchmarks/opcodes.py`` (``--top N`` functions, ``--requests N``).
tidegate's ASGI app runs in this process with the pipeline of ``gateway.py`` (keys-file auth,
user and tenant rate limits, budgets, admission, the breaker, metrics and the JSON request log;
SQLite state; no cache), but its provider is a stand-in that returns a fixed answer at once, and
requests go straight into the app, 32 at a time: no socket, no HTTP parser, no upstream client.
What is left is tidegate's own work on a request, the part ``gateway.py`` and
``instructions.py`` see as the difference between tidegate and the pass-through.

After a warm-up, ``sys.settrace`` counts every bytecode the measured requests execute
(``f_trace_opcodes``). The count does not depend on what else the machine is doing, and it says
where the interpreter's work goes, module by module and function by function. It leaves out
the work done inside C functions (orjson, SQLite, hashing, the dictionary operation behind one
bytecode), which ``instructions.py`` counts. Tracing makes a request about thirty times
slower, so the two things tidegate decides by elapsed time are stretched by that factor (the
lease window and the disconnect watcher's delay), as ``instructions.py`` does under callgrind.
CPU microseconds per request, measured without tracing, are printed too (this machine, now).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import orjson
import uvloop
from rich.console import Console
from rich.table import Table

import gateway as gw  # the pipeline and the key of benchmarks/gateway.py (run from this folder)
import tidegate.gateway.app as gateway_app
import tidegate.gateway.watch as gateway_watch
from tidegate.gateway.config import load_config
from tidegate.gateway.protocol import STATE_KEY, ConnectionLimits, GuardedHttpToolsProtocol
from tidegate.providers.base import JSONObject

#: How much slower a request runs while traced (time-based settings are stretched by it).
SLOWDOWN = 30
CONNECTIONS = 32
BODY = gw.REQUEST_BODY.encode()
OpcodeKey = tuple[str, int, str]


class FixedAnswer:
    """The provider: the benchmark upstream's answer, in the next round of the event loop."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def complete(self, body: JSONObject, *, timeout: float) -> JSONObject:  # noqa: ASYNC109
        # One round of the loop, as a network answer takes at least: the 32 requests in flight
        # then overlap (in admission, leases and the rest) as a real upstream's do.
        loop = asyncio.get_running_loop()
        answered = loop.create_future()
        loop.call_soon(answered.set_result, None)
        await answered
        answer: JSONObject = orjson.loads(gw.UPSTREAM_ANSWER)  # parsed, as a provider does
        return answer

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the benchmark sends non-streaming requests")

    async def embed(self, body: JSONObject, *, timeout: float) -> JSONObject:  # noqa: ASYNC109
        raise NotImplementedError("the benchmark sends chat requests")

    async def aclose(self) -> None:
        return None


async def _request(app: gateway_app.Gateway, headers: list[tuple[bytes, bytes]]) -> int:
    """One chat completion through the app; returns its status."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": gw.ROUTE,
        "raw_path": gw.ROUTE.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8080),
    }
    delivered = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.get_running_loop().create_future()  # the client never goes away
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def _drive(app: gateway_app.Gateway, headers: list[tuple[bytes, bytes]], n: int) -> int:
    """``n`` requests, CONNECTIONS at a time; returns how many did not answer 200."""
    left, failed = n, 0

    async def worker() -> None:
        nonlocal left, failed
        while left > 0:
            left -= 1
            failed += await _request(app, headers) != 200

    await asyncio.gather(*(worker() for _ in range(CONNECTIONS)))
    return failed


async def measure(
    config_path: Path, key: str, *, warmup: int, requests: int, slowdown: int
) -> tuple[collections.Counter[OpcodeKey], float]:
    """Bytecodes of ``requests`` traced requests, and CPU microseconds per untraced request."""
    config = load_config(config_path)
    providers: dict[str, Any] = {name: FixedAnswer(name) for name in config.providers}
    app = gateway_app.Gateway(config, config_path, providers=providers)
    await app.startup()
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"authorization", f"Bearer {key}".encode()),
        (b"content-length", str(len(BODY)).encode()),
    ]
    try:
        failed = await _drive(app, headers, warmup)
        started = time.process_time()
        failed += await _drive(app, headers, requests)
        cpu_us = (time.process_time() - started) * 1e6 / requests
        counts: collections.Counter[OpcodeKey] = collections.Counter()

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                code = frame.f_code
                counts[(code.co_filename, code.co_firstlineno, code.co_qualname)] += 1
            return local

        def start(frame: FrameType, event: str, arg: Any) -> Any:
            frame.f_trace_opcodes = True
            return local

        # The watcher's delay, stretched as the requests are (its timer is read at each add).
        app._watches.after_s = gateway_watch.WATCH_AFTER_S * slowdown
        sys.settrace(start)
        try:
            failed += await _drive(app, headers, requests)
        finally:
            sys.settrace(None)
    finally:
        await app.shutdown()
    if failed:
        raise gw.BenchError(f"{failed} requests did not answer 200")
    return counts, cpu_us


class _Discard(asyncio.Transport):
    """A connection's transport that keeps nothing but how many 503s were written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def write(self, data: Any) -> None:
        self.refused += bytes(data).startswith(b"HTTP/1.1 503")

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        return None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 8080) if name in ("sockname", "peername") else default


async def measure_door(
    config_path: Path, key: str, *, warmup: int, requests: int
) -> tuple[collections.Counter[OpcodeKey], float]:
    """Bytecodes of ``requests`` model requests refused at the door (the key's class held full
    in admission, as ``overload.py``'s refusals-only loads hold it), fed to the guarded protocol
    of one kept-alive connection; and CPU microseconds per untraced refusal. No socket: what is
    counted is the parser's callbacks and tidegate's decision, answer and counting."""
    import uvicorn

    config = load_config(config_path)
    providers: dict[str, Any] = {name: FixedAnswer(name) for name in config.providers}
    app = gateway_app.Gateway(config, config_path, providers=providers)
    await app.startup()
    try:
        assert app.runtime is not None
        controller = app.runtime.admission.controller
        held = 0
        while controller.saturated("standard") is None:  # the benchmark key's class
            controller.offer(
                request_id=f"held-{held}", klass="standard", tenant="held", deadline_at=None
            )
            held += 1
        limits = ConnectionLimits.from_config(config.server, None, app.door())
        server = uvicorn.Config(app=app, lifespan="off")
        server.load()
        protocol = GuardedHttpToolsProtocol(
            server, uvicorn.server.ServerState(), {STATE_KEY: limits}
        )
        transport = _Discard()
        protocol.connection_made(transport)
        request = (
            f"POST {gw.ROUTE} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {len(BODY)}\r\n\r\n"
        ).encode() + BODY
        for _ in range(warmup):
            protocol.data_received(request)
        started = time.process_time()
        for _ in range(requests):
            protocol.data_received(request)
        cpu_us = (time.process_time() - started) * 1e6 / requests
        counts: collections.Counter[OpcodeKey] = collections.Counter()

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                code = frame.f_code
                counts[(code.co_filename, code.co_firstlineno, code.co_qualname)] += 1
            return local

        def start(frame: FrameType, event: str, arg: Any) -> Any:
            frame.f_trace_opcodes = True
            return local

        sys.settrace(start)
        try:
            for _ in range(requests):
                protocol.data_received(request)
        finally:
            sys.settrace(None)
        protocol.connection_lost(None)
    finally:
        await app.shutdown()
    if transport.refused != warmup + 2 * requests:
        raise gw.BenchError(f"{transport.refused} of {warmup + 2 * requests} were refused")
    return counts, cpu_us


def _where(filename: str) -> str:
    for marker in ("/src/", "/site-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    if filename.startswith("<"):
        return filename  # generated code: dataclass __init__ and friends
    return "python/" + Path(filename).name


def report(
    console: Console,
    counts: collections.Counter[OpcodeKey],
    requests: int,
    cpu_us: float,
    top: int,
    *,
    what: str = "request",
) -> None:
    driver = str(Path(__file__).resolve())
    counts = collections.Counter(
        {key: n for key, n in counts.items() if str(Path(key[0]).resolve()) != driver}
    )  # this script's own request driver is not tidegate's work
    total = sum(counts.values())
    modules: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    for (filename, line, name), n in counts.items():
        where = _where(filename)
        modules[where] += n
        functions[f"{where}:{line} {name}" if line else f"{where} {name}"] += n
    path = "tidegate's own path" if what == "request" else "a refusal at the door"
    console.print(
        f"{path}: {total / requests:,.0f} bytecodes per {what}; "
        f"{cpu_us:,.1f} CPU µs per {what} untraced (this machine, now)"
    )
    for title, rows in (("module", modules), ("function", functions)):
        table = Table(title=f"bytecodes per {what} by {title}")
        table.add_column(title)
        table.add_column(f"per {what}", justify="right")
        table.add_column("share", justify="right")
        for name, n in rows.most_common(top if title == "function" else len(rows)):
            if title == "module" and n / total < 0.002:
                continue
            table.add_row(name, f"{n / requests:,.0f}", f"{100 * n / total:.1f}%")
        console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2000, help="requests before measuring")
    parser.add_argument("--requests", type=int, default=1000, help="requests measured")
    parser.add_argument("--top", type=int, default=40, help="functions listed")
    parser.add_argument(
        "--door",
        action="store_true",
        help="count a model request refused at the door (admission full) instead",
    )
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 110))
    workdir = Path(tempfile.mkdtemp(prefix="tidegate-opcodes-"))
    # The request log lines (part of the measured work) go nowhere; left open until exit, when
    # the log sink flushes what it still holds.
    nowhere = io.TextIOWrapper(open(os.devnull, "wb"))  # noqa: SIM115
    try:
        key = gw.write_keys(workdir)
        config_path = gw.tidegate_config(workdir, upstream_port=9, slowdown=SLOWDOWN)  # port unused
        with contextlib.redirect_stdout(nowhere):
            if args.door:
                run = measure_door(config_path, key, warmup=args.warmup, requests=args.requests)
            else:
                run = measure(
                    config_path,
                    key,
                    warmup=args.warmup,
                    requests=args.requests,
                    slowdown=SLOWDOWN,
                )
            counts, cpu_us = uvloop.run(run)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(
        console, counts, args.requests, cpu_us, args.top, what="refusal" if args.door else "request"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
