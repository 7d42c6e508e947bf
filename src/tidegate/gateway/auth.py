"""Who is calling: API keys, hashed at rest, to a tenant, user, priority class and data class;
and the operators' admin keys, kept apart from them.

The keys file holds only SHA-256 digests of the keys. A presented key is hashed; the first 16 hex
digits of its digest find the candidate entry, and the full digests are then compared with
:func:`hmac.compare_digest`, so the time taken does not depend on how much of a digest matched.

Keys file (YAML)::

    keys:
      - id: checkout-service          # a name for logs, never the key
        sha256: 9f86d081884c7d65...   # hashlib.sha256(key.encode()).hexdigest()
        tenant: shop
        user: checkout
        priority: critical            # an admission class
        data_class: internal          # what providers may see this caller's data
        models: ["chat-default"]      # allowed aliases; "*" for all

Virtual keys made with ``tidegate keys`` (or ``/admin/keys``) live in the durable store
(:mod:`tidegate.gateway.keys`); the ring holds both, the file's and the store's, and a store key
may carry its own rate limit, daily budget and expiry. A revoked or expired key is still found
(so the caller learns which: ``key_revoked``, ``key_expired``), then refused.

The admin keys file (``auth.admin_keys_file``) has the same digests with an ``id`` each, and
nothing else: an admin key names an operator, for the audit history, and opens the admin API.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Final
from urllib.parse import quote

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidegate.clock import SystemClock
from tidegate.errors import ConfigError, Forbidden, KeyExpired, KeyRevoked, Unauthenticated
from tidegate.policy.budget import BudgetOptions
from tidegate.policy.ratelimit import BucketOptions

__all__ = ["AdminKeys", "Identity", "KeyRing", "hash_key"]


def hash_key(key: str) -> str:
    """The digest stored in a keys file for ``key``."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _by_wildcard(models: frozenset[str], model: str) -> bool:
    """Whether a ``"<prefix>/*"`` entry of ``models`` covers ``model``."""
    prefix, slash, rest = model.partition("/")
    while slash and rest:
        if prefix + "/*" in models:
            return True
        head, slash, rest = rest.partition("/")
        prefix = f"{prefix}/{head}"
    return False


@dataclass(frozen=True, slots=True)
class Identity:
    key_id: str
    tenant: str
    user: str
    priority: str
    data_class: str
    models: frozenset[str]
    #: The per-user and per-tenant rate-limit bucket keys and the daily budget's subject, made
    #: once per key rather than once per request.
    user_bucket: str = field(init=False, repr=False, compare=False)
    tenant_bucket: str = field(init=False, repr=False, compare=False)
    budget_subject: str = field(init=False, repr=False, compare=False)
    #: What an Idempotency-Key is stored under, before the key itself: the tenant and the user,
    #: so that no other caller can replay this one's answers or learn which keys it used. Not
    #: the key id: a caller's retry still replays while its key is being rotated. Both names are
    #: quoted, so no two (tenant, user) pairs share a prefix.
    idempotency_scope: str = field(init=False, repr=False, compare=False)
    #: The key's own rate limit (a bucket of its own, on top of the user's and the tenant's).
    rate_limit: BucketOptions | None = None
    #: The key's own daily budget, instead of the deployment's per-user one (subject
    #: ``@key:<id>``).
    budget: BudgetOptions | None = None
    #: When the key stops working (Unix seconds; ``-inf`` once revoked), and why: ``revoked``,
    #: ``expired`` or ``rotated``. None: it never does.
    lapses_at: float | None = None
    lapse: str = ""
    #: The key's own bucket: ``key:<id>``.
    key_bucket: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "user_bucket", f"user:{self.tenant}:{self.user}")
        object.__setattr__(self, "tenant_bucket", f"tenant:{self.tenant}")
        own = f"@key:{quote(self.key_id, safe='')}"
        subject = own if self.budget is not None else f"{self.tenant}:{self.user}"
        object.__setattr__(self, "budget_subject", subject)
        object.__setattr__(self, "key_bucket", f"key:{quote(self.key_id, safe='')}")
        object.__setattr__(
            self, "idempotency_scope", f"{quote(self.tenant, safe='')}:{quote(self.user, safe='')}:"
        )

    def may_use(self, model: str) -> bool:
        """A listed alias, any with ``"*"``, or a wildcard alias's model (``"openai/*"`` lets
        the key use ``openai/gpt-4o-mini``)."""
        return "*" in self.models or model in self.models or _by_wildcard(self.models, model)


class _KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tenant: str
    user: str
    priority: str = "standard"
    data_class: str = "internal"
    models: tuple[str, ...] = ("*",)


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: tuple[_KeyEntry, ...]


#: What tells a key ring the time when it is given nothing else.
_SYSTEM_WALL: Final = SystemClock().wall


def _lapsed(identity: Identity) -> Unauthenticated:
    if identity.lapse == "revoked":
        return KeyRevoked(f"API key {identity.key_id!r} was revoked")
    if identity.lapse == "rotated":
        return KeyExpired(f"API key {identity.key_id!r} was rotated: use its new secret")
    return KeyExpired(f"API key {identity.key_id!r} expired")


class KeyRing:
    """Digest -> identity: the keys file's (read at start-up and on SIGHUP) and the store's
    (:meth:`with_store`, each time the key store changed). ``wall`` tells when a key lapses."""

    _PREFIX = 16

    def __init__(
        self, identities: Mapping[str, Identity], *, wall: Callable[[], float] = _SYSTEM_WALL
    ) -> None:
        self._by_prefix: dict[str, tuple[str, Identity]] = {}
        self._wall = wall
        #: The keys file's part, kept so that the store's part can be replaced on its own.
        self.file_identities: dict[str, Identity] = dict(identities)
        #: The store's change counter the store part was read at (-1: not read), and when this
        #: process last asked (its monotonic clock).
        self.store_version = -1
        self.checked_at = -math.inf
        self.store_size = 0
        for digest, identity in identities.items():
            self._put(digest, identity)

    def with_store(
        self, identities: Mapping[str, Identity], version: int, *, wall: Callable[[], float]
    ) -> tuple[KeyRing, list[str]]:
        """A ring of this one's file keys and ``identities`` (the store's, read at ``version``),
        and the ids of store keys left out (one whose digest prefix another key has)."""
        ring = KeyRing(self.file_identities, wall=wall)
        ring.store_version, ring.checked_at = version, self.checked_at
        skipped = []
        for digest, identity in identities.items():
            if digest[: self._PREFIX] in ring._by_prefix:
                skipped.append(identity.key_id)
                continue
            ring._put(digest, identity)
            ring.store_size += 1
        return ring, skipped

    def store_part(self) -> dict[str, Identity]:
        """The store's keys in this ring, by digest (to carry over into a reloaded file's ring)."""
        return {
            digest: identity
            for digest, identity in self._by_prefix.values()
            if digest not in self.file_identities
        }

    def _put(self, digest: str, identity: Identity) -> None:
        prefix = digest[: self._PREFIX]
        if prefix in self._by_prefix:
            raise ConfigError(f"key {identity.key_id!r} shares a digest prefix with another key")
        self._by_prefix[prefix] = (digest, identity)

    @classmethod
    def from_file(cls, path: Path, *, classes: Sequence[str]) -> KeyRing:
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            parsed = _KeysFile.model_validate(raw)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the keys file ({exc.strerror})") from exc
        except (yaml.YAMLError, ValidationError) as exc:
            raise ConfigError(f"{path}: not a valid keys file: {exc}") from exc
        ring: dict[str, Identity] = {}
        for entry in parsed.keys:
            if entry.priority not in classes:
                raise ConfigError(
                    f"{path}: key {entry.id!r} has priority {entry.priority!r};"
                    f" admission classes are {list(classes)}"
                )
            if entry.sha256 in ring:
                raise ConfigError(f"{path}: key {entry.id!r} repeats another key's digest")
            ring[entry.sha256] = Identity(
                entry.id,
                entry.tenant,
                entry.user,
                entry.priority,
                entry.data_class,
                frozenset(entry.models),
            )
        return cls(ring)

    def add(self, key: str, identity: Identity) -> None:
        digest = hash_key(key)
        self._put(digest, identity)
        self.file_identities[digest] = identity

    def __len__(self) -> int:
        return len(self._by_prefix)

    def identify(self, authorization: str | None) -> Identity:
        """The caller behind an ``Authorization: Bearer <key>`` header, or ``Unauthenticated``."""
        if not authorization:
            raise Unauthenticated("missing API key: send Authorization: Bearer <key>")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if not key or (scheme != "Bearer" and scheme.lower() != "bearer"):
            raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
        digest = sha256(key.encode("utf-8")).hexdigest()  # hash_key(key), without the call
        stored, identity = self._by_prefix.get(digest[: self._PREFIX], ("", None))
        if identity is None or not hmac.compare_digest(stored, digest):
            raise Unauthenticated("unknown API key")
        if identity.lapses_at is not None and identity.lapses_at <= self._wall():
            raise _lapsed(identity)
        return identity

    @staticmethod
    def authorize(identity: Identity, model: str) -> None:
        if not identity.may_use(model):
            raise Forbidden(f"this API key may not use model {model!r}")


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
