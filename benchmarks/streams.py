"""Streams per second relayed by tidegate: OpenAI's ``/v1/chat/completions`` against Anthropic's
``/v1/messages`` (the same stream, translated into Messages events), in the same run.

Run with ``.venv/bin/python benchmarks/streams.py`` (``--streams N``, ``--rounds N``). The
gateway's ASGI app runs in this process on uvloop, with keys-file auth and SQLite state; its
provider is the in-process fake streaming a fixed answer of ``--tokens`` chunks at once, and
streams go straight into the app, 32 at a time (no socket, no HTTP parser): what is measured is
the gateway's own work on a stream, which is where the translation is. Rounds alternate the two
paths, so that background load falls on both alike; the table gives the median of the rounds
and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson
import uvloop
import yaml
from rich.console import Console
from rich.table import Table

import gateway as gw  # the key file of benchmarks/gateway.py (run from this folder)
from tidegate.clock import SystemClock
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config
from tidegate.ops.readiness import asgi_request

CONNECTIONS = 32
CLOCK = SystemClock()
ASK = [{"role": "user", "content": "Say hello."}]
PATHS = {
    "/v1/chat/completions": {"model": "bench", "messages": ASK, "stream": True},
    "/v1/messages": {"model": "bench", "messages": ASK, "stream": True, "max_tokens": 64},
}


def _config(workdir: Path, tokens: int) -> Path:
    key = gw.write_keys(workdir)
    (workdir / "key.txt").write_text(key, encoding="utf-8")
    config = {
        "profile": "dev",
        "auth": {"keys_file": str(workdir / "keys.yaml")},
        "state": {"url": f"sqlite:///{workdir / 'state.db'}"},
        "logging": {"level": "warning"},
        "cache": {"enabled": False},
        "providers": {"fake": {"type": "fake", "model": "fake-1", "fake": {"tokens": tokens}}},
        "models": {"bench": {"providers": ["fake"]}},
    }
    path = workdir / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


async def _stream(app: Gateway, path: str, body: bytes, key: str) -> bool:
    """One stream through the app; whether it ended as a complete answer."""
    answer = await asgi_request(app, "POST", path, body, {"authorization": f"Bearer {key}"})
    return answer.body.endswith((b"data: [DONE]\n\n", b'"message_stop"}\n\n'))


async def _round(app: Gateway, path: str, key: str, streams: int) -> tuple[float, float]:
    """``streams`` streams on ``path``, CONNECTIONS at a time: streams/s and CPU µs a stream."""
    body = orjson.dumps(PATHS[path])
    left, failed = streams, 0

    async def worker() -> None:
        nonlocal left, failed
        while left > 0:
            left -= 1
            failed += not await _stream(app, path, body, key)

    wall, cpu = CLOCK.now(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(CONNECTIONS)))
    wall, cpu = CLOCK.now() - wall, time.process_time() - cpu
    if failed:
        raise SystemExit(f"{failed} streams on {path} did not end complete")
    return streams / wall, cpu * 1e6 / streams


async def _measure(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    with tempfile.TemporaryDirectory(prefix="tidegate-streams-") as folder:
        workdir = Path(folder)
        config_path = _config(workdir, args.tokens)
        key = (workdir / "key.txt").read_text(encoding="utf-8")
        app = Gateway(load_config(config_path), config_path)
        await app.startup()
        try:
            for path in PATHS:  # warm-up
                await _round(app, path, key, args.streams // 4)
            results: dict[str, list[tuple[float, float]]] = {path: [] for path in PATHS}
            for _ in range(args.rounds):
                for path in PATHS:
                    results[path].append(await _round(app, path, key, args.streams))
        finally:
            await app.shutdown()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000, help="streams per round and path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=20, help="content chunks per stream")
    args = parser.parse_args()
    results = uvloop.run(_measure(args))
    table = Table(title=f"streams of {args.tokens} chunks, {CONNECTIONS} at a time, in-process")
    for column in ("path", "streams/s", "(rounds)", "CPU µs/stream"):
        table.add_column(column, justify="left" if column == "path" else "right")
    medians = {}
    for path, rounds in results.items():
        rates = [rate for rate, _ in rounds]
        medians[path] = (statistics.median(rates), statistics.median(cpu for _, cpu in rounds))
        table.add_row(
            path,
            f"{medians[path][0]:,.0f}",
            f"{min(rates):,.0f}-{max(rates):,.0f}",
            f"{medians[path][1]:,.0f}",
        )
    openai, messages = medians["/v1/chat/completions"], medians["/v1/messages"]
    table.add_row(
        "messages vs chat", f"{messages[0] / openai[0]:.2f}x", "", f"{messages[1] / openai[1]:.2f}x"
    )
    Console(highlight=False).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
