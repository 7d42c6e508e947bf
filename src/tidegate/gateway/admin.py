"""The admin API: flags and their audit history, the kill switch, breakers, queues, pending actions.

Every route needs an admin key (``auth.admin_keys_file``, the same digest format as API keys,
separate keys); without that file the admin API answers 404 as if it did not exist. Flag changes
go to the shared flag store first, so every replica sees them (on its next refresh, within a
second) and the audit history survives restarts.

=======  ===============================  ===============================================
GET      /admin/flags                      every flag's value, default and description
PUT      /admin/flags/{name}               ``{"value", "who", "why"}``: change one flag
GET      /admin/audit[?flag=&limit=]       the audit history, newest first
POST     /admin/kill-switch                ``{"mode": full|degraded|unavailable, "who", "why"}``
GET      /admin/breakers                   each provider's breaker
GET      /admin/admission                  queue depths, in-flight, refusals by class
GET      /admin/rollouts[/{route}]         each canary's state, share and windows
POST     /admin/rollouts/{route}/ACTION    start, pause, resume, abort, or evaluate now
*        /admin/keys[/{id}[/ACTION]]       virtual API keys (:mod:`tidegate.gateway.keys`)
GET      /admin/spend[/rows]               the spend ledger by group, or its rows (spend_api)
POST     /v1/actions                       ``{"kind", "payload", "ttl_s", "who"}``: propose
GET      /v1/actions/{id}                  one action as it stands
POST     /v1/actions/{id}/approve|reject   ``{"who"}``: decide it, exactly once
=======  ===============================  ===============================================
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from tidegate.errors import (
    ActionExpired,
    AlreadyDecided,
    InvalidRequest,
    NotFound,
    TidegateError,
)
from tidegate.gateway.auth import AdminKeys
from tidegate.gateway.canary import control, take_step
from tidegate.gateway.flags import set_flag
from tidegate.gateway.http import (
    Receive,
    Scope,
    Send,
    plain,
    read_json,
    request_headers,
    send_error,
    send_json,
)
from tidegate.gateway.keys import handle_keys, is_keys_path
from tidegate.gateway.runtime import Runtime
from tidegate.gateway.spend_api import handle_spend, is_spend_path
from tidegate.policy.flags import ANSWER_MODE, KillSwitchMode
from tidegate.state.actions import ActionAlreadyDecided, ActionNotFound
from tidegate.state.actions import ActionExpired as StoreActionExpired

__all__ = ["AdminKeys", "handle_admin", "is_admin_path", "set_flag"]

log = structlog.get_logger("tidegate")


def is_admin_path(path: str) -> bool:
    return path.startswith(("/admin/", "/v1/actions"))


def _text(body: Mapping[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{field!r} is required: a non-empty string")
    return value.strip()


async def handle_admin(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    """Route one admin request; every failure is the documented error body."""
    try:
        if rt.admin_keys is None:
            raise NotFound(
                f"no route {scope['path']} (the admin API is off: no auth.admin_keys_file)"
            )
        headers = request_headers(scope)
        operator = rt.admin_keys.identify(headers.get("authorization"))
        if is_spend_path(scope["path"]):  # the spend ledger: JSON or CSV (spend_api)
            await handle_spend(rt.stores.ledger, rt.clock.wall(), scope, send)
            return
        if is_keys_path(scope["path"]):  # virtual keys (gateway.keys)
            status, body = await handle_keys(rt, scope, receive, headers, operator)
        else:
            status, body = await _route(rt, scope, receive, headers, operator)
        await send_json(send, status, body)
    except TidegateError as error:
        await send_error(send, error)
    except Exception as error:  # a bug: answer with the documented 500 body, log the details
        log.exception("admin_internal_error", path=scope["path"])
        await send_error(send, error)


@dataclass(frozen=True, slots=True)
class _Call:
    """One admin request as a route's handler reads it: the method, the path's parts after
    the route's own two, the query and, on demand, the JSON body."""

    rt: Runtime
    method: str
    rest: list[str]
    query: dict[str, str]
    body: Callable[[], Awaitable[dict[str, Any]]]


#: What a route's handler answers: a status and a body, or ``None`` for "no such route here".
_Answer = tuple[int, Any] | None


async def _route(
    rt: Runtime, scope: Scope, receive: Receive, headers: dict[str, str], operator: str
) -> tuple[int, Any]:
    method, path = scope["method"], scope["path"].rstrip("/")
    parts = path.strip("/").split("/")
    query = dict(
        p.split("=", 1) for p in scope.get("query_string", b"").decode().split("&") if "=" in p
    )

    async def body() -> dict[str, Any]:
        return await read_json(receive, headers, rt.config.server.max_body_bytes)

    handler = _ROUTES.get((parts[0], parts[1]) if len(parts) > 1 else ("", ""))
    if handler is not None:
        answer = await handler(_Call(rt, method, parts[2:], query, body))
        if answer is not None:
            return answer
    raise NotFound(f"no admin route {method} {path}")


async def _flags(call: _Call) -> _Answer:
    rt, method, rest = call.rt, call.method, call.rest
    if method == "GET" and not rest:
        return 200, {
            name: {
                "value": rt.flags.get(name),
                "default": spec.default,
                "type": spec.type.__name__,
                "description": spec.description,
            }
            for name, spec in sorted(rt.flags.specs.items())
        }
    if method == "PUT" and len(rest) == 1:
        data = await call.body()
        return 200, await set_flag(
            rt, rest[0], data.get("value"), _text(data, "who"), _text(data, "why")
        )
    return None


async def _audit(call: _Call) -> _Answer:
    if call.method != "GET" or call.rest:
        return None
    try:
        limit = int(call.query.get("limit", "100"))
    except ValueError:
        raise InvalidRequest("limit must be a whole number") from None
    records = await call.rt.stores.flags.history(call.query.get("flag") or None, limit=limit)
    return 200, [plain(r) for r in records]


async def _kill_switch(call: _Call) -> _Answer:
    if call.method != "POST" or call.rest:
        return None
    data = await call.body()
    mode = data.get("mode")
    if mode not in {m.value for m in KillSwitchMode}:
        raise InvalidRequest("mode must be one of full, degraded, unavailable")
    return 200, await set_flag(call.rt, ANSWER_MODE, mode, _text(data, "who"), _text(data, "why"))


async def _breakers(call: _Call) -> _Answer:
    if call.method != "GET" or call.rest:
        return None
    return 200, {name: plain(b.snapshot()) for name, b in sorted(call.rt.breakers.items())}


async def _admission(call: _Call) -> _Answer:
    if call.method != "GET" or call.rest:
        return None
    return 200, plain(call.rt.admission.controller.snapshot())


async def _rollouts(call: _Call) -> _Answer:
    rt, method, rest = call.rt, call.method, call.rest
    if method == "GET" and not rest:
        return 200, {alias: c.status(rt.flags) for alias, c in sorted(rt.canaries.items())}
    if not rest or rest[0] not in rt.canaries:
        raise NotFound(f"no rollout for route {rest[0] if rest else ''!r}")
    alias = rest[0]
    if method == "GET" and len(rest) == 1:
        return 200, rt.canaries[alias].status(rt.flags)
    if method == "POST" and len(rest) == 2:
        data = await call.body()
        who, why = _text(data, "who"), _text(data, "why")
        if rest[1] == "evaluate":
            return 200, await take_step(rt, alias, requested_by=who)
        if rest[1] in ("start", "pause", "resume", "abort"):
            return 200, await control(rt, alias, rest[1], who, why)
    raise NotFound(f"no rollout action {method} {'/'.join(rest)}")


async def _actions(call: _Call) -> _Answer:
    """The pending actions, with the store's refusals as the documented errors."""
    try:
        answer = await _action_route(call)
    except ActionNotFound as exc:
        raise NotFound(str(exc)) from None
    except ActionAlreadyDecided as exc:
        raise AlreadyDecided(str(exc)) from None
    except StoreActionExpired as exc:
        raise ActionExpired(str(exc)) from None
    if answer is None:
        raise NotFound(f"no admin route {call.method} /v1/actions/{'/'.join(call.rest)}")
    return answer


async def _action_route(call: _Call) -> _Answer:
    method, rest = call.method, call.rest
    if method == "POST" and not rest:
        return 201, await _propose(call)
    if method == "GET" and len(rest) == 1:
        found = await call.rt.stores.actions.get(rest[0])
        if found is None:
            raise NotFound(f"no action {rest[0]}")
        return 200, plain(found)
    if method == "POST" and len(rest) == 2 and rest[1] in ("approve", "reject"):
        who = _text(await call.body(), "who")
        actions = call.rt.stores.actions
        decide = actions.approve if rest[1] == "approve" else actions.reject
        return 200, plain(await decide(rest[0], who))
    return None


async def _propose(call: _Call) -> Any:
    data = await call.body()
    ttl = data.get("ttl_s", 3600)
    payload = data.get("payload", {})
    if not isinstance(ttl, int | float) or not 0 < ttl <= 7 * 86_400:
        raise InvalidRequest("ttl_s must be a number of seconds in (0, 604800]")
    if not isinstance(payload, dict):
        raise InvalidRequest("payload must be an object")
    action = await call.rt.stores.actions.propose(
        _text(data, "kind"), payload, ttl_s=float(ttl), proposed_by=_text(data, "who")
    )
    return plain(action)


#: Each route's handler by the path's first two parts.
_ROUTES: dict[tuple[str, str], Callable[[_Call], Awaitable[_Answer]]] = {
    ("admin", "flags"): _flags,
    ("admin", "audit"): _audit,
    ("admin", "kill-switch"): _kill_switch,
    ("admin", "breakers"): _breakers,
    ("admin", "admission"): _admission,
    ("admin", "rollouts"): _rollouts,
    ("v1", "actions"): _actions,
}
