"""The fake upstream on a real socket, in a thread of its own, for socket-level gateway tests.

The gateway under test runs in one thread (see :mod:`tests.gateway.harness`) and the fake upstream
in another, each with its own event loop, so neither can hide a blocking call in the other. The
test itself stays synchronous: it reads the upstream's attempt log and changes its script over
HTTP, exactly as an operator would against ``tidegate fake-upstream``.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from tidegate.clock import SystemClock
from tidegate.providers.fake_upstream import FakeUpstream

__all__ = [
    "CLOCK",
    "RunningUpstream",
    "metric",
    "openai_provider",
    "pause",
    "running_upstream",
    "wait_until",
]

#: The real clock: the one way a test may measure wall time (ruff bans ``time.monotonic``).
CLOCK = SystemClock()

_START_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RunningUpstream:
    """A fake upstream being served: its URLs and its test endpoints."""

    url: str

    @property
    def base_url(self) -> str:
        """What a provider of type ``openai`` wants as ``base_url`` (it ends in ``/v1``)."""
        return f"{self.url}/v1"

    def attempts(self, model: str | None = None) -> list[dict[str, Any]]:
        """Every attempt the upstream saw, oldest first (``GET /_fake/attempts``)."""
        params = {} if model is None else {"model": model}
        response = httpx.get(f"{self.url}/_fake/attempts", params=params, trust_env=False)
        response.raise_for_status()
        attempts: list[dict[str, Any]] = response.json()["attempts"]
        return attempts

    def seen(self) -> list[tuple[str, str]]:
        """``(model, outcome)`` of every attempt, oldest first: the shape most tests assert."""
        return [(a["model"], a["outcome"]) for a in self.attempts()]

    def replace_script(self, script: Mapping[str, Any]) -> None:
        """Swap the script (``POST /_fake/script``); counters restart, the log is kept."""
        response = httpx.post(f"{self.url}/_fake/script", json=dict(script), trust_env=False)
        response.raise_for_status()


@contextmanager
def running_upstream(script: Mapping[str, Any]) -> Iterator[RunningUpstream]:
    """Serve ``script`` with :class:`FakeUpstream` on a free loopback port, in its own thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-upstream", daemon=True)
    thread.start()
    upstream = FakeUpstream(script)
    try:
        asyncio.run_coroutine_threadsafe(upstream.start(), loop).result(_START_TIMEOUT_S)
        yield RunningUpstream(upstream.url)
    finally:
        try:
            asyncio.run_coroutine_threadsafe(upstream.close(), loop).result(_START_TIMEOUT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(_START_TIMEOUT_S)
            loop.close()


def openai_provider(upstream: RunningUpstream, model: str, **extra: Any) -> dict[str, Any]:
    """A provider section of type ``openai`` pointing at ``upstream``, asking for ``model``,
    approved as an automatic fallback by the config (the tests' fallbacks have no eval verdict)."""
    return {
        "type": "openai",
        "base_url": upstream.base_url,
        "model": model,
        "approved_fallback": True,
        **extra,
    }


def pause(seconds: float) -> None:
    """Really wait (the tests' only sleep: ``time.sleep`` is banned outside the clock module)."""
    threading.Event().wait(seconds)


def wait_until(condition: Callable[[], bool], *, within: float, step: float = 0.02) -> bool:
    """Poll ``condition`` until it holds or ``within`` seconds pass; returns the last answer."""
    end = CLOCK.now() + within
    while not condition():
        if CLOCK.now() >= end:
            return condition()
        pause(step)
    return True


_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric(base: str, name: str, **labels: str) -> float | None:
    """The value of one sample from the gateway's ``/metrics``; ``None`` when it is absent.

    Every label given must match; labels not given may have any value, but then exactly one
    sample may match (so a test cannot silently read the wrong series).
    """
    response = httpx.get(f"{base}/metrics", trust_env=False)
    response.raise_for_status()
    found: list[float] = []
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"] != name:
            continue
        have = dict(_LABEL.findall(match["labels"] or ""))
        if all(have.get(key) == value for key, value in labels.items()):
            found.append(float(match["value"]))
    assert len(found) <= 1, f"{name} {labels} matches {len(found)} samples"
    return found[0] if found else None
