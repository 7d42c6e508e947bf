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

The admin keys file (``auth.admin_keys_file``) has the same digests with an ``id`` each, and
nothing else: an admin key names an operator, for the audit history, and opens the admin API.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from urllib.parse import quote

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidegate.errors import ConfigError, Forbidden, Unauthenticated

__all__ = ["AdminKeys", "Identity", "KeyRing", "hash_key"]


def hash_key(key: str) -> str:
    """The digest stored in a keys file for ``key``."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "user_bucket", f"user:{self.tenant}:{self.user}")
        object.__setattr__(self, "tenant_bucket", f"tenant:{self.tenant}")
        object.__setattr__(self, "budget_subject", f"{self.tenant}:{self.user}")
        object.__setattr__(
            self, "idempotency_scope", f"{quote(self.tenant, safe='')}:{quote(self.user, safe='')}:"
        )

    def may_use(self, model: str) -> bool:
        return "*" in self.models or model in self.models


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


class KeyRing:
    """Digest -> identity, built once at start-up."""

    _PREFIX = 16

    def __init__(self, identities: Mapping[str, Identity]) -> None:
        self._by_prefix: dict[str, tuple[str, Identity]] = {}
        for digest, identity in identities.items():
            self._put(digest, identity)

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
        self._put(hash_key(key), identity)

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
