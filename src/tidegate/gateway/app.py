"""The ASGI application: routes, lifespan, the drain, one log line per request (the disconnect
watches are :mod:`tidegate.gateway.watch`'s)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import math
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Unpack

import structlog

from tidegate import __version__
from tidegate.errors import (
    ConfigError,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    QueueFull,
    StoreError,
    TidegateError,
)
from tidegate.gateway.admin import handle_admin, is_admin_path
from tidegate.gateway.admin_server import AdminApp, moved_to_admin
from tidegate.gateway.auth import KeyRing
from tidegate.gateway.canary import take_step
from tidegate.gateway.config import Config, resolve
from tidegate.gateway.door import AdmissionDoor, ShedCounter, admission_paths, render_shed
from tidegate.gateway.flags import refresh_flags
from tidegate.gateway.http import (
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    read_json,
    request_headers,
    send_bytes,
    send_error,
    send_json,
)
from tidegate.gateway.keys import sync_keys
from tidegate.gateway.logsink import configure_logging, flush_logs, log_request
from tidegate.gateway.openapi import OPENAPI
from tidegate.gateway.pipeline import (
    ENDPOINTS,
    Exchange,
    Handler,
    endpoints,
    identify,
    new_request_id,
)
from tidegate.gateway.pipeline.dialect import OPENAI, send_dialect_error
from tidegate.gateway.pipeline.messages import ANTHROPIC
from tidegate.gateway.pipeline.spans import request_attributes, request_outcome, skips
from tidegate.gateway.protocol import ADMIN_STATE_KEY, STATE_KEY, ConnectionLimits, Door
from tidegate.gateway.runtime import (
    Overrides,
    Runtime,
    build_runtime,
    close_runtime,
    expire_leases,
    refresh_verdicts,
)
from tidegate.gateway.watch import DisconnectWatches
from tidegate.gateway.worker_metrics import SharedMetrics, start_sharing
from tidegate.state.keys import KEYS_NOTICE
from tidegate.state.notify import WatchableFlagStore

__all__ = ["Gateway"]

log = structlog.get_logger("tidegate")

#: The model endpoints with every step (what a gateway serves until start-up has its runtime's).
POST_ROUTES: dict[str, Handler] = ENDPOINTS
#: How often each replica reloads the shared flags: a kill switch reaches all within a second.
FLAG_REFRESH_S = 0.25
#: Eval-gate verdicts change rarely: reload them every 20 flag rounds (5 s).
VERDICT_REFRESH_ROUNDS = 20


#: Allocations (less deallocations) of container objects between two young-generation garbage
#: collections in a serving process: Python's default of 700 runs one per request or so.
GC_YOUNG_THRESHOLD = 5_000


def tune_gc() -> None:
    """Make the cyclic garbage collector cheap for a long-running server (``tidegate serve``).

    Everything built at start-up (modules, config, runtime) lives as long as the process:
    ``gc.freeze()`` leaves it out of every later collection instead of walking it again in each
    full one. A larger young-generation threshold collects the short-lived objects of requests in
    fewer, larger rounds. Neither changes what is freed, only how often the collector looks.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


#: The requests still running this long before uvicorn's drain deadline are ended by the
#: gateway (a stream with its in-band error event, an answer not begun with 503), leaving
#: uvicorn's own cancellation nothing to cut; half the drain when that is shorter.
DRAIN_MARGIN_S = 0.25
#: What the SIGHUP log lines add: the keys file is all a reload reads.
_RESTART_NOTE = "other config changes take effect on restart"


class Gateway:
    """An ASGI app; the runtime is built at lifespan start-up (or passed in by tests)."""

    def __init__(
        self,
        config: Config,
        config_path: Path,
        *,
        runtime: Runtime | None = None,
        tune_gc: bool = False,
        reload_on_sighup: bool = False,
        **overrides: Unpack[Overrides],
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.runtime = runtime
        self.tune_gc = tune_gc
        #: Serving from ``tidegate serve`` (the main thread of a process of its own): SIGHUP
        #: reloads the keys file instead of killing the process.
        self.reload_on_sighup = reload_on_sighup
        #: What :func:`build_runtime` is given besides the config (the git sha, test hooks).
        self._overrides = overrides
        self._refresher: asyncio.Task[None] | None = None
        self._controller: asyncio.Task[None] | None = None
        self._watches = DisconnectWatches()
        #: The model endpoints, each with the steps the runtime needs (set at start-up).
        self._endpoints = POST_ROUTES
        self._drain_timer: asyncio.TimerHandle | None = None
        #: Writes the request's log line; start-up sets the cheapest writer the logging allows.
        self._log_request: Callable[[dict[str, Any]], None] = log_request
        #: The admin listener's app (``server.admin_port``): then this port has no admin API,
        #: and the GET paths it took over (/metrics) answer 404 here.
        self.admin = AdminApp(self, config.server) if config.server.admin_port is not None else None
        moved = moved_to_admin(config.server)
        self._get_routes = {
            p: (Gateway.not_here if p in moved else h) for p, h in GET_ROUTES.items()
        }
        self._shared_metrics: SharedMetrics | None = None
        #: Counts the door's refusals (made with the door, once the runtime is built).
        self._shed_counter: ShedCounter | None = None

    # ------------------------------------------------------------------ lifespan

    async def startup(self) -> None:
        self._log_request = configure_logging(self.config)
        if self.runtime is None:
            self.runtime = await build_runtime(self.config, self.config_path, **self._overrides)
        self._endpoints = endpoints(self.runtime)
        self._shared_metrics = start_sharing(self.runtime)
        if self.tune_gc:
            tune_gc()
        loop = asyncio.get_running_loop()
        self._refresher = loop.create_task(self._refresh_flags_forever())
        if self.runtime.canaries:
            self._controller = loop.create_task(self._control_rollouts_forever())
        if self.reload_on_sighup:
            loop.add_signal_handler(signal.SIGHUP, self.reload_keys)
            # One line per serving process: uvicorn's own (a worker replaced on the
            # supervisor's SIGHUP, one that died) are below the log level it is given.
            log.info("serving", pid=os.getpid())

    async def shutdown(self) -> None:
        if self.reload_on_sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            log.info("stopping", pid=os.getpid())
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self._watches.close()
        if self._shed_counter is not None:
            self._shed_counter.flush()
        for task in (self._refresher, self._controller):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.runtime is not None:
            if self._shared_metrics is not None:
                await self._shared_metrics.stop()
            await close_runtime(self.runtime)
        flush_logs()

    async def _refresh_flags_forever(self) -> None:
        """Reload the shared flags: at once on a store's change notice, and on a short timer
        (notices are a hint: one sent while the subscription was down is never delivered).
        The same rounds settle the budget leases whose time is up."""
        rt = self.runtime
        assert rt is not None
        if isinstance(rt.stores.flags, WatchableFlagStore):
            await self._follow_flag_notices(rt, rt.stores.flags)
            return
        rounds = 0
        while True:
            await rt.sleep(FLAG_REFRESH_S)
            await refresh_flags(rt)
            await sync_keys(rt)
            await expire_leases(rt)
            rounds += 1
            if rounds % VERDICT_REFRESH_ROUNDS == 0:
                refresh_verdicts(rt)

    @staticmethod
    async def _follow_flag_notices(rt: Runtime, flags: WatchableFlagStore) -> None:
        rounds = 0
        while True:
            try:
                async with flags.watch() as changes:
                    await refresh_flags(rt)  # what changed while not subscribed
                    await sync_keys(rt, changed=True)
                    while True:
                        notice = await changes.next(FLAG_REFRESH_S)
                        await refresh_flags(rt)
                        await sync_keys(rt, changed=notice == KEYS_NOTICE)
                        await expire_leases(rt)
                        rounds += 1
                        if rounds % VERDICT_REFRESH_ROUNDS == 0:
                            refresh_verdicts(rt)
            except Exception as exc:  # the subscription broke: poll once, then subscribe again
                log.warning("flag_notices_lost", error=str(exc))
                await rt.sleep(FLAG_REFRESH_S)
                await refresh_flags(rt)

    async def _control_rollouts_forever(self) -> None:
        """The canary controller: judge every running rollout at its evaluation interval."""
        rt = self.runtime
        assert rt is not None
        every = min(c.config.evaluate_every_s for c in rt.canaries.values())
        while True:
            await rt.sleep(every)
            for alias in rt.canaries:
                try:
                    await take_step(rt, alias)
                except TidegateError as exc:  # a store blip: try again next round
                    log.warning("rollout_step_failed", route=alias, error=exc.message)

    def reload_keys(self) -> None:
        """SIGHUP: read ``auth.keys_file`` again; a file that does not load keeps the old keys.

        A request holds the identity it was given; the next one is checked against the new
        keys. Nothing else of the config is read again: other changes need a restart.
        """
        rt = self.runtime
        assert rt is not None, "the handler is installed once the runtime is built"
        keys_file = self.config.auth.keys_file
        if keys_file is None:
            log.warning("sighup_ignored", reason="no auth.keys_file to reload", note=_RESTART_NOTE)
            return
        path = resolve(self.config_path, keys_file)
        try:
            keys = KeyRing.from_file(path, classes=self.config.admission.classes)
        except ConfigError as exc:
            log.error("keys_reload_failed", error=exc.message, keys_kept=len(rt.keys))
            return
        rt.keys, _ = keys.with_store(
            rt.keys.store_part(), rt.keys.store_version, wall=rt.clock.wall
        )
        log.info("keys_reloaded", keys=len(keys), file=str(keys_file), note=_RESTART_NOTE)

    def begin_drain(self) -> None:
        """uvicorn began its graceful shutdown (the connections are told, see ``protocol``).

        Shortly before ``server.drain_seconds`` is up, :meth:`_end_drain` ends what is still
        running itself; uvicorn cancels what is left at the deadline, mid-write, and prints a
        traceback for each.
        """
        if self._drain_timer is not None:
            return
        drain = self.config.server.drain_seconds
        loop = asyncio.get_running_loop()
        self._drain_timer = loop.call_later(drain - min(DRAIN_MARGIN_S, drain / 2), self._end_drain)
        in_flight = self.runtime.in_flight if self.runtime is not None else 0
        log.info("drain_started", in_flight=in_flight, drain_seconds=drain)

    def _end_drain(self) -> None:
        ended = self._watches.end_all()
        if ended:
            log.warning("drain_ended", requests_ended=ended)

    # ------------------------------------------------------------------ the door

    def door(self) -> Door:
        """The guard the connections apply (``server.max_open_requests``, and full admission:
        :mod:`tidegate.gateway.door`): its refusals rendered once, in each API's shape, and how
        each is counted."""
        rt = self.runtime
        assert rt is not None, "the door is opened once the runtime is built"
        limit = self.door_limit
        error = QueueFull(
            f"the process holds its limit of {limit} open requests (server.max_open_requests)",
            policy="server",
            retry_after=1.0,
        )
        paths = admission_paths(self._endpoints.items())
        full = AdmissionDoor(rt, paths) if paths else None
        openai, messages = render_shed(OPENAI, error), render_shed(ANTHROPIC, error)
        if self._shed_counter is None:
            self._shed_counter = ShedCounter(rt, limit)
        return Door(limit, openai, messages, self._shed_counter, full)

    @property
    def door_limit(self) -> int:
        admission = self.config.admission
        return self.config.server.max_open_requests or 2 * (admission.slots + admission.queue_cap)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.error("startup_failed", error=str(exc))
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                if "state" in scope:  # what uvicorn hands every connection it makes
                    scope["state"][STATE_KEY] = ConnectionLimits.from_config(
                        self.config.server, self.begin_drain, self.door()
                    )
                    if self.admin is not None:
                        port = self.config.server.admin_port
                        scope["state"][ADMIN_STATE_KEY] = (port, self.admin)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if kind != "http":
            return
        rt = self.runtime
        assert rt is not None, "the gateway received a request before start-up finished"
        path: str = scope["path"]
        method: str = scope["method"]
        if method == "POST" and path in POST_ROUTES:  # first: nearly every request is one
            await self._model_call(rt, self._endpoints[path], scope, receive, send)
        elif is_admin_path(path) and self.admin is None:
            await handle_admin(rt, scope, receive, send)
        elif method == "GET" and path in self._get_routes:
            await self._get_routes[path](self, rt, scope, send)
        elif method == "GET" and path.startswith(MODEL_PATH):
            await self.model(rt, path[len(MODEL_PATH) :], scope, send)
        else:
            await _refuse_path(method, path, send)

    async def _model_call(
        self, rt: Runtime, handler: Handler, scope: Scope, receive: Receive, send: Send
    ) -> None:
        path: str = scope["path"]
        headers = request_headers(scope)
        ex = Exchange(request_id=new_request_id(headers))
        started = rt.clock.now()
        dialect = handler.dialect
        if dialect.key_header is not None:  # the API's own key header stands for Authorization
            given = dialect.authorization(headers)
            if given is not None:
                headers["authorization"] = given
        rt.in_flight += 1
        try:
            try:
                # Who is calling comes first: a caller without a valid key learns that (401),
                # not what is wrong with its body, and its body is not read.
                ex.identity = identify(rt, headers)
                body = await read_json(receive, headers, rt.config.server.max_body_bytes)
            except ClientDisconnected:
                ex.outcome, ex.status = "client_closed", 499
                return
            except TidegateError as error:
                ex.status, ex.outcome = await send_dialect_error(
                    send, dialect, error, [("x-request-id", ex.request_id)]
                )
                return
            answer = functools.partial(handler, rt, ex, headers, body)
            if not rt.tracing.enabled:
                await self._watches.run(ex, receive, send, answer)
                return
            # The caller's trace continued (traceparent), with the GenAI attributes.
            start = request_attributes(path, ex.request_id, body)
            with rt.tracing.request(headers, start) as span:
                await self._watches.run(ex, receive, send, answer)
                done = request_outcome(rt, ex)
                rt.tracing.finish(span, done, skips(ex), failed=ex.status >= 500)
        finally:
            rt.in_flight -= 1
            elapsed = rt.clock.now() - started
            metrics, identity = rt.metrics, ex.identity
            metrics.requests.labels(ex.route, ex.served_model, ex.served_by, ex.outcome).inc()
            metrics.latency.labels(ex.route, ex.outcome).observe(elapsed)
            if ex.outcome != "ok" and ex.status >= 400:
                klass = identity.priority if identity else "-"
                metrics.refusals.labels(klass, ex.outcome).inc()
            self._log_request(
                fields := {
                    "request_id": ex.request_id,
                    "route": ex.route,
                    "tenant": identity.tenant if identity else None,
                    "user": identity.user if identity else None,
                    "priority": identity.priority if identity else None,
                    "status": ex.status,
                    "outcome": ex.outcome,
                    "served_by": ex.served_by,
                    "model": ex.served_model,
                    "tried": ex.tried_header(),
                    "cache": ex.cache or None,
                    "prompt_tokens": ex.usage.get("prompt_tokens"),
                    "completion_tokens": ex.usage.get("completion_tokens"),
                    "cost_usd": round(ex.cost, 8),
                    "ttft_s": None if ex.first_token_s is None else round(ex.first_token_s, 4),
                    "duration_s": round(elapsed, 4),
                    "deadline_ms": None if (end := ex.deadline) is None else _ms(end.at - started),
                }
            )
            rt.ledger.record(fields, ex)  # the spend ledger's row, from the line's fields

    # ------------------------------------------------------------------ GET routes

    async def not_here(self, rt: Runtime, scope: Scope, send: Send) -> None:
        """A path the admin listener serves instead of this port (``server.admin_port``)."""
        await send_error(send, NotFound(f"no route {scope['path']}"))

    async def healthz(self, rt: Runtime, scope: Scope, send: Send) -> None:
        await send_json(send, 200, {"status": "ok"})

    async def readyz(self, rt: Runtime, scope: Scope, send: Send) -> None:
        problems = rt.ready_problems()
        try:
            await rt.stores.ping_durable()
            store = "ok"
        except StoreError as exc:
            store = f"unreachable: {exc.message}"
            problems.append("state store unreachable")
        breakers = {name: b.state.value for name, b in rt.breakers.items()}
        body = {
            "status": "ready" if not problems else "not_ready",
            "problems": problems,
            "state_store": store,
            "providers": sorted(rt.providers),
            "breakers": breakers,
            "headroom": rt.headroom.snapshot(),
            "slow_start": {} if rt.slow_start is None else rt.slow_start.ramping(),
        }
        await send_json(send, 200 if not problems else 503, body)

    async def metrics(self, rt: Runtime, scope: Scope, send: Send) -> None:
        rt.refresh_gauges()
        await send_bytes(
            send, 200, rt.metrics.exposition(), content_type="text/plain; version=0.0.4"
        )

    async def version(self, rt: Runtime, scope: Scope, send: Send) -> None:
        await send_json(send, 200, {"version": __version__, "git_sha": rt.git_sha})

    async def openapi(self, rt: Runtime, scope: Scope, send: Send) -> None:
        await send_json(send, 200, OPENAPI)

    async def models(self, rt: Runtime, scope: Scope, send: Send) -> None:
        """The aliases the caller's key may use: behind a key like the routes they name."""
        try:
            identity = identify(rt, request_headers(scope))
        except TidegateError as error:
            await send_error(send, error)
            return
        data = [_model_object(alias) for alias in sorted(rt.routes) if identity.may_use(alias)]
        await send_json(send, 200, {"object": "list", "data": data})

    async def model(self, rt: Runtime, alias: str, scope: Scope, send: Send) -> None:
        """One alias the caller's key may use; any other is 404, as an unknown one is (a key
        learns nothing of the aliases it may not use)."""
        try:
            identity = identify(rt, request_headers(scope))
            if alias not in rt.routes or not identity.may_use(alias):
                raise ModelNotFound(f"no model named {alias!r}; GET /v1/models lists them")
        except TidegateError as error:
            await send_error(send, error)
            return
        await send_json(send, 200, _model_object(alias))


def _ms(seconds: float) -> int | None:
    """Whole milliseconds, or None for a span without end (no deadline at all)."""
    return round(seconds * 1000.0) if seconds < math.inf else None


async def _refuse_path(method: str, path: str, send: Send) -> None:
    """405 for another method on a known path; 404 for a path not served, saying what to use
    when there is something, and for an unknown one."""
    if path in POST_ROUTES or path in GET_ROUTES or path.startswith(MODEL_PATH):
        allowed = "POST" if path in POST_ROUTES else "GET"
        await send_error(
            send, MethodNotAllowed(f"{method} is not allowed on {path}", allow=allowed)
        )
    elif path in NOT_SERVED:
        await send_error(send, NotFound(NOT_SERVED[path]))
    else:
        await send_json(
            send,
            404,
            {
                "error": {
                    "type": "not_found_error",
                    "code": "not_found",
                    "message": f"no route {path}",
                    "retryable": False,
                }
            },
        )


def _model_object(alias: str) -> dict[str, Any]:
    """A route alias as OpenAI's ``model`` object."""
    return {"id": alias, "object": "model", "created": 0, "owned_by": "tidegate"}


#: ``GET /v1/models/{id}``: one alias.
MODEL_PATH = "/v1/models/"
#: OpenAI paths the gateway does not serve, and what to use instead (a 404 that says so).
NOT_SERVED = {
    "/v1/completions": "the legacy completions API is not served: use POST /v1/chat/completions",
}


GET_ROUTES: dict[str, Callable[[Gateway, Runtime, Scope, Send], Awaitable[None]]] = {
    "/healthz": Gateway.healthz,
    "/readyz": Gateway.readyz,
    "/metrics": Gateway.metrics,
    "/version": Gateway.version,
    "/openapi.json": Gateway.openapi,
    "/v1/models": Gateway.models,
}
