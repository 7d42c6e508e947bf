"""Virtual API keys: made, changed, rotated and revoked through ``/admin/keys`` (and
``tidegate keys``), kept in the durable store, and followed by every replica.

A key is shown once, when it is created or rotated; the store keeps its SHA-256 digest. Each
replica holds every key in its :class:`~tidegate.gateway.auth.KeyRing` (the keys file's and the
store's), so a request's key is still one dict lookup and never a store call. The ring is rebuilt
when the store's change counter moved: at once on a change notice (the flags' subscription hears
:data:`~tidegate.state.keys.KEYS_NOTICE`), and on a check every :data:`KEY_CHECK_S` otherwise,
so a change reaches every replica within a second either way. A store that does not answer
keeps the last keys.

=======  ===============================  ===============================================
GET      /admin/keys                       every key (the store's and the keys file's)
POST     /admin/keys                       create one: the answer holds the key, once
GET      /admin/keys/{id}                  one key
PATCH    /admin/keys/{id}                  change its class, models, limits, budget, expiry, metadata
POST     /admin/keys/{id}/rotate           ``{"grace_s", "why"}``: a new secret, the old one kept
                                           for ``grace_s``
POST     /admin/keys/{id}/revoke           ``{"why"}``: refused (``key_revoked``) from now on
GET      /admin/keys/{id}/audit[?limit=]   its changes, newest first: who, when, what
=======  ===============================  ===============================================
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Annotated, Any, Final, Protocol, TypeVar

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidegate.errors import InvalidRequest, NotFound, StoreError
from tidegate.gateway.auth import Identity, KeyRing, hash_key
from tidegate.gateway.config import Config
from tidegate.gateway.flags import SharedState, keep_last
from tidegate.gateway.http import Receive, Scope, plain, read_json
from tidegate.policy.budget import BudgetOptions, Quota
from tidegate.policy.ratelimit import BucketOptions
from tidegate.state.base import KeyAudit, KeyConflict, KeyRecord

__all__ = [
    "KEY_CHECK_S",
    "KeyHolder",
    "handle_keys",
    "identities_of",
    "is_keys_path",
    "new_secret",
    "sync_keys",
]

log = structlog.get_logger("tidegate")

#: How often a replica asks the key store whether anything changed, notices or not.
KEY_CHECK_S: Final = 1.0
#: How many times a change is tried again when another replica changed the key meanwhile.
_TRIES: Final = 5
_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_MAX_GRACE_S: Final = 30 * 86_400.0


class KeyHolder(SharedState, Protocol):
    """What of a runtime the keys use: the ring requests are identified with (replaced, never
    changed in place) and the config, besides the clock, the stores and the metrics."""

    keys: KeyRing

    @property
    def config(self) -> Config: ...


def new_secret() -> str:
    """A new API key: 256 random bits."""
    return "tg-" + secrets.token_urlsafe(32)


# --------------------------------------------------------------------------- records to identities


def _identity(record: KeyRecord, config: Config) -> Identity:
    bucket = None
    if record.rate_limit is not None:
        bucket = BucketOptions(
            rate=record.rate_limit["rate_per_s"], burst=record.rate_limit["burst"]
        )
    budget = None
    if record.budget is not None:
        b = record.budget
        calls, tokens = b.get("calls"), b.get("tokens")
        quota = Quota(
            calls=None if calls is None else int(calls),
            tokens=None if tokens is None else int(tokens),
            cost=b.get("cost_usd"),
        )
        degrade_at = config.budgets.degrade_at if config.budgets is not None else 1.0
        budget = BudgetOptions(quota=quota, degrade_at=degrade_at)
    lapses_at, lapse = record.expires_at, "expired" if record.expires_at is not None else ""
    if record.revoked_at is not None:
        lapses_at, lapse = -math.inf, "revoked"
    return Identity(
        record.id,
        record.tenant,
        record.user,
        record.priority,
        record.data_class,
        frozenset(record.models),
        rate_limit=bucket,
        budget=budget,
        lapses_at=lapses_at,
        lapse=lapse,
    )


def identities_of(records: list[KeyRecord], config: Config) -> dict[str, Identity]:
    """The ring's entries for the store's keys, by digest: the current secret's and, for a
    rotated key, the old one's (lapsing when its grace ends). A key whose class the config no
    longer has is left out, with a warning."""
    found: dict[str, Identity] = {}
    for record in records:
        if record.priority not in config.admission.classes:
            log.warning("key_skipped", key=record.id, reason=f"no class {record.priority!r}")
            continue
        identity = found[record.sha256] = _identity(record, config)
        if record.previous_sha256 is not None and record.previous_until is not None:
            old = identity if identity.lapse == "revoked" else None
            if old is None:
                until = record.previous_until
                if identity.lapses_at is not None:
                    until = min(until, identity.lapses_at)
                old = replace(identity, lapses_at=until, lapse="rotated")
            found[record.previous_sha256] = old
    return found


async def sync_keys(rt: KeyHolder, changed: bool = False) -> None:
    """Rebuild the ring if the key store changed: asked when ``changed`` (a notice came) or
    when :data:`KEY_CHECK_S` passed since the last check; a store error keeps the last keys."""
    ring = rt.keys
    now = rt.clock.now()
    if not changed and now - ring.checked_at < KEY_CHECK_S:
        return
    ring.checked_at = now
    store = rt.stores.keys
    try:
        version = await store.version()
        if version == ring.store_version:
            return
        records = await store.all()
    except StoreError as exc:
        keep_last(rt, "keys", exc)
        return
    wall = rt.clock.wall
    fresh, skipped = rt.keys.with_store(identities_of(records, rt.config), version, wall=wall)
    for key_id in skipped:
        log.warning("key_skipped", key=key_id, reason="its digest prefix is another key's")
    rt.keys = fresh


# --------------------------------------------------------------------------- the admin API


class _RateLimit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rate_per_s: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    burst: Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    calls: Annotated[int, Field(ge=0)] | None = None
    tokens: Annotated[int, Field(ge=0)] | None = None
    cost_usd: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None


class _Change(BaseModel):
    """What a PATCH may set (a field sent as null clears a limit, the budget or the expiry)."""

    model_config = ConfigDict(extra="forbid")

    priority: str | None = None
    data_class: str | None = None
    models: Annotated[list[str], Field(min_length=1)] | None = None
    rate_limit: _RateLimit | None = None
    budget: _Budget | None = None
    expires_at: Annotated[float, Field(allow_inf_nan=False)] | None = None
    expires_in_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    metadata: dict[str, Any] | None = None
    why: str = ""


_M = TypeVar("_M", bound=BaseModel)


class _New(_Change):
    id: str | None = None
    tenant: Annotated[str, Field(min_length=1)]
    user: Annotated[str, Field(min_length=1)]


def _parse(model: type[_M], data: Mapping[str, Any]) -> _M:
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidRequest(f"invalid key: {problems}") from None


def _changes(change: _Change, config: Config, now: float) -> dict[str, Any]:
    """The record fields a create or a PATCH sets, checked against the config."""
    given = change.model_fields_set - {"why", "expires_in_s", "id", "tenant", "user"}
    fields: dict[str, Any] = {}
    for name in given:
        value = getattr(change, name)
        fields[name] = (
            value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
        )
    if fields.get("models") is not None:
        fields["models"] = tuple(fields["models"])
    if "expires_in_s" in change.model_fields_set and change.expires_in_s is not None:
        fields["expires_at"] = now + change.expires_in_s
    if fields.get("budget") == {}:
        raise InvalidRequest("budget needs calls, tokens or cost_usd")
    for name in ("priority", "data_class", "models", "metadata"):
        if name in fields and fields[name] is None:
            raise InvalidRequest(f"{name} cannot be null")
    classes = config.admission.classes
    if "priority" in fields and fields["priority"] not in classes:
        raise InvalidRequest(f"priority must be one of the admission classes {list(classes)}")
    if "data_class" in fields and not str(fields["data_class"]).strip():
        raise InvalidRequest("data_class must be a non-empty string")
    return fields


def _state(record: KeyRecord, wall: float) -> str:
    if record.revoked_at is not None:
        return "revoked"
    if record.expires_at is not None and record.expires_at <= wall:
        return "expired"
    return "active"


def _view(record: KeyRecord, wall: float) -> dict[str, Any]:
    """A key as the admin API shows it: never a digest, only the first 12 digits of one."""
    shown = record.to_json()
    for hidden in ("sha256", "previous_sha256"):
        shown.pop(hidden)
    shown["sha256_prefix"] = record.sha256[:12]
    shown["state"] = _state(record, wall)
    shown["source"] = "store"
    return shown


def _file_view(identity: Identity) -> dict[str, Any]:
    return {
        "id": identity.key_id,
        "tenant": identity.tenant,
        "user": identity.user,
        "priority": identity.priority,
        "data_class": identity.data_class,
        "models": sorted(identity.models),
        "state": "active",
        "source": "file",
    }


def _detail(old: KeyRecord | None, new: KeyRecord) -> dict[str, Any]:
    """What a write changed, field by field (the digests only as "changed")."""
    before = {} if old is None else old.to_json()
    after = new.to_json()
    changed: dict[str, Any] = {}
    for name, value in after.items():
        if name in ("revision", "created_at", "created_by") or before.get(name) == value:
            continue
        changed[name] = "changed" if name in ("sha256", "previous_sha256") else value
    return changed


async def _write(
    rt: KeyHolder, old: KeyRecord | None, new: KeyRecord, action: str, who_why: tuple[str, str]
) -> KeyRecord:
    audit = KeyAudit(new.id, action, who_why[0], who_why[1], 0.0, _detail(old, new))
    stored = await rt.stores.keys.put(
        new, expected_revision=0 if old is None else old.revision, audit=audit
    )
    log.info("key_changed", key=new.id, action=action, who=who_why[0])
    await sync_keys(rt, changed=True)  # this replica at once; the others on the notice
    return stored


async def _create(rt: KeyHolder, data: Mapping[str, Any], operator: str) -> dict[str, Any]:
    spec = _parse(_New, data)
    key_id = spec.id or f"key-{secrets.token_hex(6)}"
    if _ID.fullmatch(key_id) is None:
        raise InvalidRequest(
            "id must be 1-64 letters, digits and . _ - (starting with one of the first two)"
        )
    if any(i.key_id == key_id for i in rt.keys.file_identities.values()):
        raise InvalidRequest(f"id {key_id!r} is a key of the keys file")
    wall = rt.clock.wall()
    secret = new_secret()
    fields = _changes(spec, rt.config, wall)
    record = KeyRecord(
        id=key_id,
        sha256=hash_key(secret),
        tenant=spec.tenant,
        user=spec.user,
        created_at=wall,
        created_by=operator,
        **fields,
    )
    try:
        stored = await _write(rt, None, record, "create", (operator, spec.why))
    except KeyConflict:
        raise InvalidRequest(f"a key with id {key_id!r} exists") from None
    return {"key": secret, **_view(stored, wall)}


async def _change(
    rt: KeyHolder,
    key_id: str,
    action: str,
    make: Callable[[KeyRecord, float], KeyRecord],
    who_why: tuple[str, str],
) -> KeyRecord:
    """Read, change with ``make`` and write one key, again if another replica wrote it first."""
    for _ in range(_TRIES):
        old = await rt.stores.keys.get(key_id)
        if old is None:
            raise NotFound(f"no key {key_id!r} in the key store")
        try:
            return await _write(rt, old, make(old, rt.clock.wall()), action, who_why)
        except KeyConflict:
            continue
    raise StoreError(f"key {key_id!r} kept changing under {action}: try again")


async def _update(rt: KeyHolder, key_id: str, data: Mapping[str, Any], who: str) -> Any:
    spec = _parse(_Change, data)
    fields = _changes(spec, rt.config, rt.clock.wall())
    if not fields:
        raise InvalidRequest("nothing to change")

    def make(old: KeyRecord, wall: float) -> KeyRecord:
        if old.revoked_at is not None:
            raise InvalidRequest(f"key {key_id!r} is revoked")
        return replace(old, **fields)

    stored = await _change(rt, key_id, "update", make, (who, spec.why))
    return _view(stored, rt.clock.wall())


async def _rotate(rt: KeyHolder, key_id: str, data: Mapping[str, Any], who: str) -> Any:
    grace = data.get("grace_s", 0.0)
    if (
        not isinstance(grace, int | float)
        or isinstance(grace, bool)
        or not 0 <= grace <= _MAX_GRACE_S
    ):
        raise InvalidRequest(f"grace_s must be a number of seconds in [0, {_MAX_GRACE_S:g}]")
    secret = new_secret()

    def make(old: KeyRecord, wall: float) -> KeyRecord:
        if old.revoked_at is not None:
            raise InvalidRequest(f"key {key_id!r} is revoked: create a new one")
        return replace(
            old, sha256=hash_key(secret), previous_sha256=old.sha256, previous_until=wall + grace
        )

    stored = await _change(rt, key_id, "rotate", make, (who, _why(data)))
    return {"key": secret, **_view(stored, rt.clock.wall())}


class _Unchanged(Exception):
    def __init__(self, record: KeyRecord) -> None:
        self.record = record


async def _revoke(rt: KeyHolder, key_id: str, data: Mapping[str, Any], who: str) -> Any:
    """Revoke a key; revoking it again changes nothing (and writes nothing)."""

    def make(old: KeyRecord, wall: float) -> KeyRecord:
        if old.revoked_at is not None:
            raise _Unchanged(old)
        return replace(old, revoked_at=wall, revoked_by=who)

    try:
        stored = await _change(rt, key_id, "revoke", make, (who, _why(data)))
    except _Unchanged as same:
        stored = same.record
    return _view(stored, rt.clock.wall())


def _why(data: Mapping[str, Any]) -> str:
    why = data.get("why", "")
    if not isinstance(why, str):
        raise InvalidRequest("why must be a string")
    return why.strip()


def is_keys_path(path: str) -> bool:
    return path == "/admin/keys" or path.startswith("/admin/keys/")


async def handle_keys(
    rt: KeyHolder, scope: Scope, receive: Receive, headers: dict[str, str], operator: str
) -> tuple[int, Any]:
    """One ``/admin/keys`` request from ``operator`` (the admin key's name, for the audit)."""
    method = scope["method"]
    rest = [p for p in scope["path"].removeprefix("/admin/keys").split("/") if p]

    async def body() -> dict[str, Any]:
        return await read_json(receive, headers, rt.config.server.max_body_bytes)

    answer = await _dispatch(rt, method, rest, body, operator, scope.get("query_string", b""))
    if answer is None:
        raise NotFound(f"no admin route {method} {scope['path']}")
    return answer


async def _dispatch(
    rt: KeyHolder,
    method: str,
    rest: list[str],
    body: Callable[[], Awaitable[dict[str, Any]]],
    operator: str,
    query: bytes,
) -> tuple[int, Any] | None:
    if rest:
        return await _one(rt, method, rest, body, operator, query)
    if method == "GET":
        wall = rt.clock.wall()
        stored = [_view(r, wall) for r in await rt.stores.keys.all()]
        files = [_file_view(i) for i in rt.keys.file_identities.values()]
        return 200, {"keys": sorted(files, key=lambda v: v["id"]) + stored}
    return (201, await _create(rt, await body(), operator)) if method == "POST" else None


async def _one(
    rt: KeyHolder,
    method: str,
    rest: list[str],
    body: Callable[[], Awaitable[dict[str, Any]]],
    operator: str,
    query: bytes,
) -> tuple[int, Any] | None:
    """``/admin/keys/{id}[/ACTION]``."""
    key_id, action = rest[0], "/".join(rest[1:])
    if not action and method == "GET":
        found = await rt.stores.keys.get(key_id)
        if found is None:
            raise NotFound(f"no key {key_id!r} in the key store")
        return 200, _view(found, rt.clock.wall())
    if not action and method == "PATCH":
        return 200, await _update(rt, key_id, await body(), operator)
    if method == "POST" and action in ("rotate", "revoke"):
        act = _rotate if action == "rotate" else _revoke
        return 200, await act(rt, key_id, await body(), operator)
    if method == "GET" and action == "audit":
        return 200, [plain(a) for a in await rt.stores.keys.history(key_id, limit=_limit(query))]
    return None


def _limit(query: bytes) -> int:
    params = dict(p.split("=", 1) for p in query.decode().split("&") if "=" in p)
    try:
        return max(1, min(int(params.get("limit", "100")), 10_000))
    except ValueError:
        raise InvalidRequest("limit must be a whole number") from None
