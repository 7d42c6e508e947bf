"""The gateway's own request log line replays with its class and deadline (a gateway test: the
gateway does not run on the compiled lab build, which `make accel-test` runs tests/lab against).

The gateway (in process, no sockets) answers three callers: one of the standard class with its
own deadline header, one of the batch class with the configured deadline, one without a key.
Their log lines, in a raw log between a start-up banner and uvicorn's text lines, read back as
a trace with the same classes and deadlines, and replay through the same config file.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.harness import KEY, LOW_KEY, fake, write_config
from tidegate.clock import ManualClock
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config
from tidegate.lab.replay import load_replay_config, replay_log
from tidegate.lab.workload import load_trace

CONFIG: dict[str, Any] = {
    "server": {"request_timeout_s": 30},
    "providers": {"p": fake()},
    "models": {"chat": {"providers": ["p"]}},
}
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


async def _never(seconds: float) -> None:
    """The gateway's sleep: nothing here waits out a timer (the fake answers at once)."""
    await asyncio.Event().wait()


async def _logged(path: Path) -> list[dict[str, Any]]:
    """The request log lines the gateway writes for the three callers, on a manual clock (the
    deadline counts from the request's start, so a real clock's microseconds would show)."""
    clock = ManualClock(0.0, wall_start=1_800_000_000.0)
    app = Gateway(load_config(path, env={}), path, clock=clock, sleep=_never)
    lines: list[dict[str, Any]] = []
    await app.startup()
    app._log_request = lines.append
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            asked = [
                {"Authorization": f"Bearer {KEY}", "X-Tidegate-Deadline-Ms": "2500"},
                {"Authorization": f"Bearer {LOW_KEY}"},
                {},
            ]
            for headers in asked:
                await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    finally:
        await app.shutdown()
    return lines


@pytest.mark.asyncio
async def test_the_log_line_carries_the_class_and_the_deadline(tmp_path: Path) -> None:
    """``priority`` is the caller's class and ``deadline_ms`` its deadline (the header's, or
    ``server.request_timeout_s``); both are null for a caller refused before either is known."""
    lines = await _logged(write_config(tmp_path, CONFIG))
    seen = [(line["priority"], line["deadline_ms"], line["status"]) for line in lines]
    assert seen == [("standard", 2500, 200), ("batch", 30_000, 200), (None, None, 401)]


@pytest.mark.asyncio
async def test_a_raw_gateway_log_replays_with_its_classes_and_deadlines(tmp_path: Path) -> None:
    """The raw log (banner and uvicorn's lines skipped and counted) reads back with each
    request's class and deadline, and replays through the gateway's own config file."""
    path = write_config(tmp_path, CONFIG)
    lines = await _logged(path)
    log = tmp_path / "gateway.log"
    stamps = ("2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z", "2026-01-01T00:00:03Z")
    text = ["tidegate listening on http://127.0.0.1:8080 (profile dev, state memory://)"]
    text.append("INFO:     Uvicorn running on http://127.0.0.1:8080 (Press CTRL+C to quit)")
    text += [
        json.dumps({"event": "request", "timestamp": stamp, **line})
        for stamp, line in zip(stamps, lines, strict=True)
    ]
    text.append("INFO:     Shutting down")
    log.write_text("\n".join(text) + "\n", encoding="utf-8")
    trace = load_trace(log)
    assert trace.skipped == 3
    assert [(r.klass, r.deadline, r.tenant) for r in trace.records] == [
        ("standard", 2.5, "t1"),
        ("batch", 30.0, "t2"),
        ("standard", None, "default"),
    ]
    result = replay_log(trace, load_replay_config(path))
    assert result.skipped == 3
    assert result.by_class == {"batch": {"ok": 1}, "standard": {"ok": 2}}
