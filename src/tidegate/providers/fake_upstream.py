"""A standalone OpenAI-compatible server whose models misbehave on cue, for tests and game days.

Each model's behaviour (latency, time to first token, pace, text, context window, prefill
support and faults) comes from a script; see :mod:`tidegate.providers.script` for the format
and ``fake_upstream_example.yaml`` beside this module for an example. A ``raw`` fault sends a
scripted status, headers and body byte for byte (a 200 that is not an answer, an event stream
written by hand); its attempt's outcome is ``raw_<status>``.

Endpoints: ``POST /v1/chat/completions`` (streamed or not; ``stream_options.include_usage`` is
honoured), ``POST /v1/embeddings``, ``GET /v1/models``, and for tests ``GET /_fake/attempts``
(every attempt seen; ``?model=`` filters), ``POST /_fake/reset`` (forget attempts and counters)
and ``POST /_fake/script`` (replace the script; counters restart, the attempt log is kept).

This module is an I/O edge: it really waits (through ``SystemClock().asleep``), in slices short
enough to notice a client that hung up or a server that is shutting down.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import orjson
from aiohttp import web

from tidegate.clock import Clock, SystemClock
from tidegate.errors import ConfigError
from tidegate.providers.base import JSONObject, MalformedChunk
from tidegate.providers.script import (
    FakeScript,
    Pause,
    Plan,
    ScriptRunner,
    load_script,
    parse_script,
)
from tidegate.providers.wire import openai_error

__all__ = [
    "EXAMPLE_SCRIPT",
    "FakeUpstream",
    "FakeUpstreamState",
    "create_app",
    "load_script",
    "run_fake_upstream",
]

#: The example script shipped with the package.
EXAMPLE_SCRIPT = Path(__file__).with_name("fake_upstream_example.yaml")

_REAL = SystemClock()
_SLICE = 0.02  # seconds between checks for a departed client or a shutdown while waiting


class FakeUpstreamState:
    """What the server remembers: the script runner and the log of attempts."""

    def __init__(self, script: FakeScript, clock: Clock) -> None:
        self.runner = ScriptRunner(script)
        self.clock = clock
        self.attempts: list[JSONObject] = []
        self.stopping = asyncio.Event()

    def record(self, plan: Plan | None, body: JSONObject, endpoint: str) -> JSONObject:
        """Add an attempt to the log (its ``outcome`` is filled in when it ends)."""
        entry: JSONObject = {
            "model": body.get("model") if plan is None else plan.model,
            "attempt": None if plan is None else plan.attempt,
            "endpoint": endpoint,
            "received_at": self.clock.wall(),
            "stream": bool(body.get("stream")),
            "messages": body.get("messages"),
            "fault": None if plan is None else plan.fault,
            "outcome": "pending",
        }
        self.attempts.append(entry)
        return entry


_STATE = web.AppKey("tidegate_fake_upstream", FakeUpstreamState)


def _json(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, headers=headers, content_type="application/json"
    )


def _connected(request: web.Request) -> bool:
    transport = request.transport
    return transport is not None and not transport.is_closing()


async def _wait(request: web.Request, seconds: float) -> bool:
    """Wait ``seconds`` (``inf``: until the end); False if the client left or we are stopping."""
    state = request.app[_STATE]
    end = _REAL.now() + seconds
    while True:
        if state.stopping.is_set() or not _connected(request):
            return False
        remaining = end - _REAL.now()
        if remaining <= 0:
            return True
        await _REAL.asleep(min(remaining, _SLICE))


def _abort(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


async def _read_body(request: web.Request) -> JSONObject | None:
    try:
        data = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


async def _act(request: web.Request, plan: Plan, entry: JSONObject) -> web.StreamResponse:
    if plan.action == "no_response":
        await _wait(request, math.inf)
        entry["outcome"] = "no_response"
        return web.Response(status=204)
    if not await _wait(request, plan.latency):
        entry["outcome"] = "client_disconnected"
        return web.Response(status=204)
    if plan.action == "reset":
        _abort(request)
        entry["outcome"] = "reset"
        return web.Response(status=204)
    if plan.action == "error":
        entry["outcome"] = f"http_{plan.status}"
        return _json(plan.body, plan.status, plan.headers)
    if plan.action == "raw":
        entry["outcome"] = f"raw_{plan.status}"
        return web.Response(body=plan.raw, status=plan.status, headers=plan.headers)
    if plan.action == "answer":
        return await _answer(request, plan, entry)
    return await _stream(request, plan, entry)


async def _answer(request: web.Request, plan: Plan, entry: JSONObject) -> web.StreamResponse:
    raw = orjson.dumps(plan.body)
    if plan.body_fault == "malformed":
        entry["outcome"] = "malformed"
        return web.Response(body=raw[: len(raw) // 2], content_type="application/json")
    if plan.body_fault is None:
        entry["outcome"] = "ok"
        return web.Response(body=raw, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = len(raw)
    await response.prepare(request)
    await response.write(raw[: len(raw) // 2])
    if plan.body_fault == "cut":
        _abort(request)
        entry["outcome"] = "cut"
    else:
        await _wait(request, math.inf)
        entry["outcome"] = "stalled"
    return response


async def _stream(request: web.Request, plan: Plan, entry: JSONObject) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        for step in plan.steps:
            if isinstance(step, Pause):
                if not await _wait(request, step.seconds):
                    entry["outcome"] = "client_disconnected"
                    return response
            elif isinstance(step, MalformedChunk):
                await response.write(f"data: {step.raw}\n\n".encode())
            else:
                await response.write(b"data: " + orjson.dumps(step) + b"\n\n")
        if plan.ending == "cut":
            _abort(request)
            entry["outcome"] = "cut"
            return response
        if plan.ending == "stall":
            await _wait(request, math.inf)
            entry["outcome"] = "stalled"
            return response
        if plan.ending == "done":
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        entry["outcome"] = "client_disconnected"
        return response
    entry["outcome"] = "ok" if plan.ending == "done" else plan.ending
    return response


async def _model_call(
    request: web.Request, endpoint: Literal["chat", "embeddings"]
) -> web.StreamResponse:
    state = request.app[_STATE]
    body = await _read_body(request)
    if body is None or not isinstance(body.get("model"), str):
        state.record(None, body or {}, endpoint)["outcome"] = "invalid_request"
        return _json(
            openai_error(
                "the body must be a JSON object with a string 'model'",
                type="invalid_request_error",
            ),
            400,
        )
    if endpoint == "embeddings":
        body.pop("stream", None)
    plan = state.runner.plan(body, endpoint=endpoint, created=int(state.clock.wall()))
    entry = state.record(plan, body, endpoint)
    return await _act(request, plan, entry)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _model_call(request, "chat")


async def _embeddings(request: web.Request) -> web.StreamResponse:
    return await _model_call(request, "embeddings")


async def _models(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    names = [name for name in state.runner.script.models if name != "*"]
    return _json(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "tidegate-fake"}
                for name in names
            ],
        }
    )


async def _attempts(request: web.Request) -> web.Response:
    attempts = request.app[_STATE].attempts
    model = request.query.get("model")
    if model is not None:
        attempts = [entry for entry in attempts if entry["model"] == model]
    return _json({"attempts": attempts})


async def _reset(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    state.attempts.clear()
    state.runner.reset()
    return _json({"reset": True})


async def _replace_script(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    body = await _read_body(request)
    try:
        script = parse_script(body, source="script")
    except ConfigError as exc:
        return _json(openai_error(exc.message, type="invalid_request_error"), 400)
    state.runner.reset(script)
    return _json({"models": sorted(script.models)})


async def _on_shutdown(app: web.Application) -> None:
    app[_STATE].stopping.set()


def create_app(
    script: FakeScript | Mapping[str, Any], *, clock: Clock | None = None
) -> web.Application:
    """The fake upstream as an ``aiohttp.web`` application. ``clock`` stamps the attempt log."""
    if not isinstance(script, FakeScript):
        script = parse_script(script)
    app = web.Application()
    app[_STATE] = FakeUpstreamState(script, clock or _REAL)
    app.on_shutdown.append(_on_shutdown)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/_fake/attempts", _attempts)
    app.router.add_post("/_fake/reset", _reset)
    app.router.add_post("/_fake/script", _replace_script)
    return app


def run_fake_upstream(host: str, port: int, script_path: str | Path) -> None:
    """Serve the fake upstream until interrupted (the ``tidegate fake-upstream`` command)."""
    app = create_app(load_script(script_path))
    web.run_app(app, host=host, port=port, shutdown_timeout=1.0)


class FakeUpstream:
    """The fake upstream on a real socket, as an async context manager (port 0: any free one).

    ``base_url`` is what an :class:`~tidegate.providers.openai.OpenAIProvider` wants;
    ``attempts`` is the live attempt log.
    """

    def __init__(
        self,
        script: FakeScript | Mapping[str, Any],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Clock | None = None,
    ) -> None:
        self.app = create_app(script, clock=clock)
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL, ending in ``/v1``."""
        return f"{self.url}/v1"

    @property
    def state(self) -> FakeUpstreamState:
        return self.app[_STATE]

    @property
    def attempts(self) -> list[JSONObject]:
        return self.state.attempts

    def replace_script(self, script: FakeScript | Mapping[str, Any]) -> None:
        """Swap the script in place; attempt counters restart."""
        self.state.runner.reset(script if isinstance(script, FakeScript) else parse_script(script))

    async def start(self) -> None:
        runner = web.AppRunner(self.app, shutdown_timeout=1.0, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        await site.start()
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
