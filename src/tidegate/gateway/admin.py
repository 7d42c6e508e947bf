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
POST     /v1/actions                       ``{"kind", "payload", "ttl_s", "who"}``: propose
GET      /v1/actions/{id}                  one action as it stands
POST     /v1/actions/{id}/approve|reject   ``{"who"}``: decide it, exactly once
=======  ===============================  ===============================================
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import structlog
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidegate.errors import (
    ActionExpired,
    AlreadyDecided,
    ConfigError,
    InvalidRequest,
    NotFound,
    TidegateError,
    Unauthenticated,
)
from tidegate.gateway.http import (
    Receive,
    Scope,
    Send,
    read_json,
    request_headers,
    send_error,
    send_json,
)
from tidegate.gateway.runtime import Runtime, refresh_flags
from tidegate.policy.flags import ANSWER_MODE, KillSwitchMode
from tidegate.state.actions import ActionAlreadyDecided, ActionNotFound
from tidegate.state.actions import ActionExpired as StoreActionExpired

__all__ = ["AdminKeys", "handle_admin", "is_admin_path", "set_flag"]

log = structlog.get_logger("tidegate")


class _AdminKey(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class _AdminKeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: tuple[_AdminKey, ...]


class AdminKeys:
    """Operators' keys: digests only, compared in constant time."""

    def __init__(self, digests: Mapping[str, str]) -> None:
        self._by_prefix = {digest[:16]: (digest, name) for digest, name in digests.items()}

    @classmethod
    def from_file(cls, path: Path) -> AdminKeys:
        try:
            parsed = _AdminKeysFile.model_validate(yaml.safe_load(path.read_text("utf-8")) or {})
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the admin keys file ({exc.strerror})") from exc
        except (yaml.YAMLError, ValidationError) as exc:
            raise ConfigError(f"{path}: not a valid admin keys file: {exc}") from exc
        return cls({k.sha256: k.id for k in parsed.keys})

    def identify(self, authorization: str | None) -> str:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("the admin API needs Authorization: Bearer <admin key>")
        digest = hashlib.sha256(key.strip().encode()).hexdigest()
        stored, name = self._by_prefix.get(digest[:16], ("", ""))
        if not name or not hmac.compare_digest(stored, digest):
            raise Unauthenticated("unknown admin key")
        return name


def is_admin_path(path: str) -> bool:
    return path.startswith(("/admin/", "/v1/actions"))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


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
        status, body = await _route(rt, scope, receive, headers, operator)
        await send_json(send, status, body)
    except TidegateError as error:
        await send_error(send, error)
    except Exception as error:  # a bug: answer with the documented 500 body, log the details
        log.exception("admin_internal_error", path=scope["path"])
        await send_error(send, error)


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

    if parts[:2] == ["admin", "flags"]:
        if method == "GET" and len(parts) == 2:
            specs = rt.flags.specs
            return 200, {
                name: {
                    "value": rt.flags.get(name),
                    "default": spec.default,
                    "type": spec.type.__name__,
                    "description": spec.description,
                }
                for name, spec in sorted(specs.items())
            }
        if method == "PUT" and len(parts) == 3:
            data = await body()
            return 200, await set_flag(
                rt, parts[2], data.get("value"), _text(data, "who"), _text(data, "why")
            )
    if path == "/admin/audit" and method == "GET":
        try:
            limit = int(query.get("limit", "100"))
        except ValueError:
            raise InvalidRequest("limit must be a whole number") from None
        records = await rt.stores.flags.history(query.get("flag") or None, limit=limit)
        return 200, [_plain(r) for r in records]
    if path == "/admin/kill-switch" and method == "POST":
        data = await body()
        mode = data.get("mode")
        if mode not in {m.value for m in KillSwitchMode}:
            raise InvalidRequest("mode must be one of full, degraded, unavailable")
        return 200, await set_flag(rt, ANSWER_MODE, mode, _text(data, "who"), _text(data, "why"))
    if path == "/admin/breakers" and method == "GET":
        return 200, {name: _plain(b.snapshot()) for name, b in sorted(rt.breakers.items())}
    if path == "/admin/admission" and method == "GET":
        return 200, _plain(rt.admission.controller.snapshot())
    if parts[:2] == ["admin", "rollouts"]:
        return await _rollouts(rt, method, parts[2:], body)
    if parts[:2] == ["v1", "actions"]:
        return await _actions(rt, method, parts[2:], body)
    raise NotFound(f"no admin route {method} {path}")


async def _rollouts(rt: Runtime, method: str, rest: list[str], body: Any) -> tuple[int, Any]:
    from tidegate.gateway.canary import control, take_step

    if method == "GET" and not rest:
        return 200, {alias: c.status(rt.flags) for alias, c in sorted(rt.canaries.items())}
    if not rest or rest[0] not in rt.canaries:
        raise NotFound(f"no rollout for route {rest[0] if rest else ''!r}")
    alias = rest[0]
    if method == "GET" and len(rest) == 1:
        return 200, rt.canaries[alias].status(rt.flags)
    if method == "POST" and len(rest) == 2:
        data = await body()
        who, why = _text(data, "who"), _text(data, "why")
        if rest[1] == "evaluate":
            return 200, await take_step(rt, alias, requested_by=who)
        if rest[1] in ("start", "pause", "resume", "abort"):
            return 200, await control(rt, alias, rest[1], who, why)
    raise NotFound(f"no rollout action {method} {'/'.join(rest)}")


async def set_flag(rt: Runtime, name: str, value: Any, who: str, why: str) -> dict[str, Any]:
    """Check the value against the flag's spec, store it (with its audit record), reload."""
    if name not in rt.flags.specs:
        raise NotFound(f"no flag named {name!r}")
    probe = type(rt.flags)(rt.flags.specs.values(), rt.clock)
    try:
        probe.set(name, value, who=who, why=why)  # the spec's type and choices decide
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    record = await rt.stores.flags.set(name, value, who=who, why=why)
    await refresh_flags(rt)
    plain: dict[str, Any] = _plain(record)
    return plain


async def _actions(rt: Runtime, method: str, rest: list[str], body: Any) -> tuple[int, Any]:
    actions = rt.stores.actions
    try:
        if method == "POST" and not rest:
            data = await body()
            ttl = data.get("ttl_s", 3600)
            payload = data.get("payload", {})
            if not isinstance(ttl, int | float) or not 0 < ttl <= 7 * 86_400:
                raise InvalidRequest("ttl_s must be a number of seconds in (0, 604800]")
            if not isinstance(payload, dict):
                raise InvalidRequest("payload must be an object")
            action = await actions.propose(
                _text(data, "kind"), payload, ttl_s=float(ttl), proposed_by=_text(data, "who")
            )
            return 201, _plain(action)
        if method == "GET" and len(rest) == 1:
            found = await actions.get(rest[0])
            if found is None:
                raise NotFound(f"no action {rest[0]}")
            return 200, _plain(found)
        if method == "POST" and len(rest) == 2 and rest[1] in ("approve", "reject"):
            who = _text(await body(), "who")
            decide = actions.approve if rest[1] == "approve" else actions.reject
            return 200, _plain(await decide(rest[0], who))
    except ActionNotFound as exc:
        raise NotFound(str(exc)) from None
    except ActionAlreadyDecided as exc:
        raise AlreadyDecided(str(exc)) from None
    except StoreActionExpired as exc:
        raise ActionExpired(str(exc)) from None
    raise NotFound(f"no admin route {method} /v1/actions/{'/'.join(rest)}")
