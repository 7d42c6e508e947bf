"""The admin listener (``server.admin_port``): the admin API, the console and /metrics on a port
of their own, in the same process as the public one.

One uvicorn server listens on both sockets; :class:`~tidegate.gateway.protocol.GuardedHttpToolsProtocol`
looks at the local port of each connection once, when it is accepted, and a connection made to
the admin port is served by :class:`AdminApp` instead of the gateway. A request on the public
port pays nothing for it: the choice is made per connection, not per request. The gateway hands
the app and its port to the protocol in the lifespan state (:data:`ADMIN_STATE_KEY`), as it
hands over its connection limits; with ``--workers N`` every worker serves both sockets.

What the admin port answers:

=======  ======================  ====================================================
any      /admin/*, /v1/actions*  the admin API (:mod:`tidegate.gateway.admin`)
any      /console[/...]          the console (:mod:`tidegate.gateway.console`)
GET      /metrics                with ``server.admin_metrics`` (the default)
GET      /healthz                liveness, as on the public port
GET      /                       a redirect to /console
=======  ======================  ====================================================

Anything else is 404. The public port answers 404 for /admin/*, /v1/actions* and, with
``server.admin_metrics``, /metrics.
"""

from __future__ import annotations

from typing import Protocol

from tidegate.errors import MethodNotAllowed, NotFound
from tidegate.gateway.admin import handle_admin, is_admin_path
from tidegate.gateway.config import ServerConfig
from tidegate.gateway.console import handle_console, with_cookie_key
from tidegate.gateway.http import Receive, Scope, Send, send_bytes, send_error, send_json
from tidegate.gateway.protocol import ADMIN_STATE_KEY
from tidegate.gateway.runtime import Runtime

__all__ = ["ADMIN_STATE_KEY", "AdminApp", "metrics_answer", "moved_to_admin"]

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4"


class _HasRuntime(Protocol):
    """The gateway, as the admin app sees it: the runtime it builds at start-up."""

    runtime: Runtime | None


def moved_to_admin(server: ServerConfig) -> frozenset[str]:
    """The public GET paths the admin listener takes over (/metrics, when it serves it)."""
    if server.admin_port is None or not server.admin_metrics:
        return frozenset()
    return frozenset({"/metrics"})


async def metrics_answer(rt: Runtime, send: Send) -> None:
    """``GET /metrics``: the gauges read now, then the exposition (merged across workers)."""
    rt.refresh_gauges()
    await send_bytes(send, 200, rt.metrics.exposition(), content_type=METRICS_CONTENT_TYPE)


class AdminApp:
    """The ASGI app of the connections accepted on the admin port (no lifespan of its own:
    the gateway's runtime is built by the gateway's lifespan, on the same server)."""

    def __init__(self, gateway: _HasRuntime, server: ServerConfig) -> None:
        self._gateway = gateway
        self._metrics = server.admin_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        rt = self._gateway.runtime
        assert rt is not None, "the admin listener received a request before start-up finished"
        path: str = scope["path"]
        method: str = scope["method"]
        if is_admin_path(path):
            await handle_admin(rt, with_cookie_key(scope), receive, send)
        elif path == "/console" or path.startswith("/console/"):
            await handle_console(rt, scope, receive, send)
        elif path in ("/metrics", "/healthz", "/") and (path != "/metrics" or self._metrics):
            if method != "GET":
                await send_error(
                    send, MethodNotAllowed(f"{method} is not allowed on {path}", allow="GET")
                )
            elif path == "/metrics":
                await metrics_answer(rt, send)
            elif path == "/healthz":
                await send_json(send, 200, {"status": "ok"})
            else:
                await send_bytes(send, 303, b"", [("location", "/console")])
        else:
            await send_error(send, NotFound(f"no route {path} on the admin listener"))
