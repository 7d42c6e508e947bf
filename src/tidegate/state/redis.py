"""Redis stores (``redis://``): the fast shared state of a fleet.

Every store of a process shares one :class:`RedisDatabase`: one ``redis.asyncio`` client over one
bounded connection pool. Each operation that decides something runs as one Lua script (shipped in
``tidegate/state/lua`` and run by SHA with ``EVALSHA``, loading it on a miss), so it is atomic in the
server: a token-bucket take, a budget reservation, an idempotency claim. The scripts repeat the
arithmetic of :mod:`tidegate.policy.ratelimit` and :mod:`tidegate.policy.budget` operation for
operation, with the same IEEE doubles, so a Redis bucket and an in-memory bucket agree to the bit.

Time: scripts read "now" from the Redis server (``TIME``), so replicas whose clocks drift still
agree on refills, leases and midnights. A store built with ``clock=`` passes ``clock.wall()``
instead; that is for tests, which need exact, controllable time. Keys also get a Redis expiry (on
the server's clock) so that Redis forgets what no longer matters: a full bucket, a lapsed lease, an
old day.

Failures: every call is bounded by ``timeout_s`` (socket timeouts and an overall deadline), the
client never retries on its own (a retried script could take a token twice), and every driver error
or timeout surfaces as :class:`~tidegate.errors.StoreError` with the original kept. Whether to fail
open or closed is the caller's choice; ``docs/state.md`` lists the gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from types import TracebackType
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from tidegate.clock import Clock, SystemClock
from tidegate.errors import StoreError
from tidegate.ids import new_id
from tidegate.policy.budget import (
    BudgetDecision,
    BudgetDimension,
    BudgetOptions,
    BudgetVerdict,
    Cost,
    Reservation,
    Usage,
)
from tidegate.policy.ratelimit import BucketOptions, TakeResult
from tidegate.state.actions import (
    ActionAlreadyDecided,
    ActionExpired,
    ActionNotFound,
    ActionStatus,
    PendingAction,
    as_seen_at,
    check_ttl,
    new_action_id,
)
from tidegate.state.base import AuditRecord, CacheEntry, Claim, ClaimOutcome, StoredResponse
from tidegate.state.notify import FlagChangesIteration
from tidegate.state.rollout import RolloutRecord, VersionConflict, check_version

__all__ = [
    "AuditedRedisStore",
    "FlightFellBack",
    "FlightJoined",
    "FlightLed",
    "RedisBucketStore",
    "RedisCacheStore",
    "RedisDatabase",
    "RedisFlagChanges",
    "RedisFlagStore",
    "RedisIdempotencyStore",
    "RedisPendingActionStore",
    "RedisQuotaStore",
    "RedisRetryBudgetCounter",
    "RedisRolloutStore",
    "RedisSingleFlight",
    "SingleFlightEvent",
]

T = TypeVar("T")

_DRIVER_ERRORS = (RedisError, OSError, TimeoutError)


@functools.cache
def _load_script(name: str) -> str:
    folder = resources.files("tidegate") / "state" / "lua"
    prelude = (folder / "prelude.lua").read_text(encoding="utf-8")
    return prelude + (folder / f"{name}.lua").read_text(encoding="utf-8")


def _num(value: float) -> str:
    """A number as a script argument: ``repr`` of a float is exact, and Lua reads it exactly."""
    return repr(float(value))


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisDatabase:
    """One client and connection pool per process, shared by every Redis store.

    ``url`` is a redis-py URL (``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` for
    TLS). A ``prefix`` query parameter sets the key prefix (default ``tidegate:``), so that several
    deployments, or tests, can share one Redis without seeing each other's keys.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.5,
        prefix: str | None = None,
        max_connections: int = 64,
    ) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        url_prefix = query.pop("prefix", None)
        self.prefix = prefix if prefix is not None else (url_prefix or "tidegate:")
        self.timeout_s = timeout_s
        #: Where the store is, for messages: never the password.
        self.where = f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}"
        driver_url = urlunsplit(parts._replace(query=urlencode(query)))
        pool: BlockingConnectionPool = BlockingConnectionPool.from_url(
            driver_url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # A retried EVALSHA may already have run: a take or a claim would happen twice.
            retry=Retry(NoBackoff(), 0),
        )
        self.client: Redis = Redis.from_pool(pool)
        self._scripts: dict[str, AsyncScript] = {}

    def key(self, kind: str, name: str) -> str:
        """The Redis key of ``name`` in the store ``kind``, under this database's prefix."""
        return f"{self.prefix}{kind}:{name}"

    def _script(self, name: str) -> AsyncScript:
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = self.client.register_script(_load_script(name))
        return script

    def _error(self, what: str, exc: BaseException) -> StoreError:
        if isinstance(exc, TimeoutError):
            detail = f"no answer within {self.timeout_s:g} s"
        else:
            detail = f"{type(exc).__name__}: {exc}"
        return StoreError(f"redis {self.where}: {what}: {detail}", original=exc)

    async def run(self, what: str, operation: Callable[[], Awaitable[T]]) -> T:
        """Run one operation within the timeout, turning driver failures into ``StoreError``."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await operation()
        except _DRIVER_ERRORS as exc:
            raise self._error(what, exc) from exc

    async def script(self, name: str, keys: list[str], args: list[str | bytes]) -> Any:
        """Run the packaged script ``name`` (EVALSHA, loading it on a miss) within the timeout."""
        script = self._script(name)
        return await self.run(name, lambda: script(keys=keys, args=args))

    async def ping(self) -> None:
        """Raise ``StoreError`` unless Redis answers within the timeout."""
        await self.run("ping", self.client.ping)

    async def aclose(self) -> None:
        """Close the client and every pooled connection."""
        await self.client.aclose()

    def __repr__(self) -> str:
        return f"RedisDatabase({self.where!r}, prefix={self.prefix!r})"


def now_arg(clock: Clock | None) -> str:
    """The scripts' ``now`` argument: empty for the server's clock, else the injected wall time."""
    return "" if clock is None else _num(clock.wall())


class RedisBucketStore:
    """Token buckets as hashes ``(tokens, updated)``, taken from by ``bucket_take.lua``."""

    def __init__(self, db: RedisDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock

    async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult:
        if not (math.isfinite(n) and n >= 0):
            raise ValueError(f"n must be a finite number >= 0, got {n!r}")
        allowed, remaining, retry_after, reset_after = await self._db.script(
            "bucket_take",
            [self._db.key("bucket", key)],
            [now_arg(self._clock), _num(options.rate), _num(options.burst), _num(n)],
        )
        return TakeResult(
            allowed=bool(allowed),
            remaining=float(remaining),
            retry_after=float(retry_after),
            reset_after=float(reset_after),
        )

    async def give_back(self, key: str, options: BucketOptions, n: float) -> None:
        if not (math.isfinite(n) and n >= 0):
            raise ValueError(f"n must be a finite number >= 0, got {n!r}")
        await self._db.script(
            "bucket_take",
            [self._db.key("bucket", key)],
            [now_arg(self._clock), _num(options.rate), _num(options.burst), _num(n), "give"],
        )


def _limit(value: float | None) -> str:
    return "" if value is None else _num(value)


class RedisQuotaStore:
    """Daily usage as one hash per subject; each open reservation is a key that closing deletes."""

    def __init__(self, db: RedisDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock

    def _keys(self, subject: str, reservation_id: str) -> list[str]:
        # One hash tag per subject keeps its usage and reservations in one cluster slot.
        usage = self._db.key("quota", f"{{{subject}}}")
        return [usage, f"{usage}:reservation:{reservation_id}"]

    async def reserve(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> tuple[Reservation | None, BudgetDecision]:
        rid = new_id()
        quota = options.quota
        verdict, reason, retry_after, day = await self._db.script(
            "quota_reserve",
            self._keys(subject, rid),
            [
                now_arg(self._clock),
                _limit(quota.calls),
                _limit(quota.tokens),
                _limit(quota.cost),
                _num(options.degrade_at),
                _num(estimate.calls),
                _num(estimate.tokens),
                _num(estimate.cost),
            ],
        )
        decision = BudgetDecision(
            verdict=BudgetVerdict(as_text(verdict)),
            reason=BudgetDimension(as_text(reason)) if reason else None,
            retry_after=float(retry_after),
        )
        if decision.verdict is BudgetVerdict.BLOCK:
            return None, decision
        reservation = Reservation(id=rid, subject=subject, day=int(float(day)), amount=estimate)
        return reservation, decision

    async def _close(self, mode: str, reservation: Reservation, actual: Cost, *kept: str) -> bool:
        amount = reservation.amount
        closed = await self._db.script(
            "quota_close",
            self._keys(reservation.subject, reservation.id),
            [
                now_arg(self._clock),
                mode,
                str(reservation.day),
                _num(amount.calls),
                _num(amount.tokens),
                _num(amount.cost),
                _num(actual.calls),
                _num(actual.tokens),
                _num(actual.cost),
                *kept,
            ],
        )
        return bool(closed)

    async def settle(self, reservation: Reservation, actual: Cost) -> bool:
        return await self._close("settle", reservation, actual)

    async def refund(self, reservation: Reservation) -> bool:
        return await self._close("refund", reservation, Cost(calls=0))

    async def rebase(
        self, reservation: Reservation, actual: Cost, keep: Cost
    ) -> Reservation | None:
        kept = (_num(keep.calls), _num(keep.tokens), _num(keep.cost))
        if not await self._close("rebase", reservation, actual, *kept):
            return None
        return Reservation(
            id=reservation.id, subject=reservation.subject, day=reservation.day, amount=keep
        )

    async def usage(self, subject: str) -> Usage:
        day, calls, tokens, cost, rcalls, rtokens, rcost = await self._db.script(
            "quota_usage", self._keys(subject, "")[:1], [now_arg(self._clock)]
        )
        return Usage(
            day=int(float(day)),
            calls=int(float(calls)),
            tokens=int(float(tokens)),
            cost=float(cost),
            reserved_calls=int(float(rcalls)),
            reserved_tokens=int(float(rtokens)),
            reserved_cost=float(rcost),
        )


class RedisIdempotencyStore:
    """Idempotency keys as hashes with a Redis expiry, for deployments without Postgres.

    A claim takes the key if it is absent (or lapsed) with a lease, inside ``idempotency_claim.lua``;
    completing and abandoning check the claim's token inside their own scripts, so a holder whose
    lease lapsed cannot overwrite the next holder's answer.
    """

    def __init__(self, db: RedisDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock

    async def claim(self, key: str, fingerprint: str, *, lease_s: float) -> Claim:
        token = secrets.token_hex(8)
        reply = await self._db.script(
            "idempotency_claim",
            [self._db.key("idempotency", key)],
            [now_arg(self._clock), fingerprint, token, _num(lease_s)],
        )
        outcome = ClaimOutcome(as_text(reply[0]))
        if outcome is ClaimOutcome.CLAIMED:
            return Claim(outcome, token=token)
        if outcome is ClaimOutcome.REPLAY:
            status, headers, body = reply[1:]
            return Claim(outcome, response=StoredResponse(int(status), body, orjson.loads(headers)))
        return Claim(outcome)

    async def complete(
        self, key: str, token: str, response: StoredResponse, *, ttl_s: float
    ) -> bool:
        stored = await self._db.script(
            "idempotency_complete",
            [self._db.key("idempotency", key)],
            [
                now_arg(self._clock),
                token,
                str(response.status),
                orjson.dumps(response.headers),
                response.body,
                _num(ttl_s),
            ],
        )
        return bool(stored)

    async def abandon(self, key: str, token: str) -> bool:
        released = await self._db.script(
            "idempotency_abandon", [self._db.key("idempotency", key)], [token]
        )
        return bool(released)


class RedisCacheStore:
    """Cache entries as hashes with their fresh and stale ends; Redis expires them at the stale end.

    Size is bounded by Redis itself: every entry carries an expiry, so with a ``maxmemory`` and
    ``maxmemory-policy volatile-lru`` Redis evicts entries under memory pressure.
    """

    def __init__(self, db: RedisDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock

    async def get(self, key: str, *, allow_stale: bool = False) -> CacheEntry | None:
        reply = await self._db.script(
            "cache_get",
            [self._db.key("cache", key)],
            [now_arg(self._clock), "1" if allow_stale else "0"],
        )
        if reply is None:
            return None
        value, stored, fresh = reply
        return CacheEntry(value, float(stored), bool(fresh))

    async def put(self, key: str, value: bytes, *, ttl_s: float, stale_ttl_s: float = 0.0) -> None:
        await self._db.script(
            "cache_put",
            [self._db.key("cache", key)],
            [now_arg(self._clock), value, _num(ttl_s), _num(stale_ttl_s)],
        )


def _audit_record(raw: bytes | str) -> AuditRecord:
    record = orjson.loads(raw)
    old = record["old"]
    return AuditRecord(
        flag=record["flag"],
        old=None if old is None else orjson.loads(old),
        new=orjson.loads(record["new"]),
        who=record["who"],
        why=record["why"],
        at=float(record["at"]),
    )


class RedisFlagChanges(FlagChangesIteration):
    """A live subscription to flag changes on one pub/sub connection (see :meth:`RedisFlagStore.
    watch`)."""

    def __init__(self, db: RedisDatabase, channel: str) -> None:
        self._db = db
        self._channel = channel
        self._pubsub: PubSub | None = None

    async def __aenter__(self) -> RedisFlagChanges:
        pubsub = self._db.client.pubsub()
        self._pubsub = pubsub
        try:
            await self._db.run("subscribe", lambda: pubsub.subscribe(self._channel))
            # Wait for the confirmation: from then on, every change is delivered here.
            await self._db.run("subscribe", self._confirmed)
        except BaseException:
            await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # unannotated before redis-py 8.2
            raise
        return self

    async def _confirmed(self) -> None:
        assert self._pubsub is not None
        while True:
            message = await self._pubsub.get_message(timeout=self._db.timeout_s)
            if message is not None and as_text(message["type"]) == "subscribe":
                return

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._pubsub is not None:
            await self._pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # unannotated before redis-py 8.2
            self._pubsub = None

    async def next(self, timeout_s: float) -> str | None:
        """The next changed flag's name, or None if none changed within ``timeout_s``."""
        if self._pubsub is None:
            raise RuntimeError("use the subscription inside its 'async with' block")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (left := deadline - loop.time()) > 0:
            try:
                message = await self._pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=left
                )
            except _DRIVER_ERRORS as exc:
                raise self._db._error("flag changes", exc) from exc
            if message is not None and as_text(message["type"]) == "message":
                return as_text(message["data"])
        return None


class AuditedRedisStore:
    """A store whose writes keep an audit log in capped lists (one for all, one per name, at
    most ``audit_cap`` records each) and are announced on the flags' pub/sub channel;
    ``clock`` replaces the server's clock for the audit times (tests)."""

    #: The store's kind, the middle of its Redis keys.
    kind = ""

    def __init__(
        self, db: RedisDatabase, clock: Clock | None = None, *, audit_cap: int = 10_000
    ) -> None:
        if audit_cap < 1:
            raise ValueError(f"audit_cap must be >= 1, got {audit_cap!r}")
        self._db = db
        self._clock = clock
        self._cap = audit_cap
        #: The pub/sub channel that carries the name of every changed flag (and key notices).
        self.channel = db.key("flags", "changed")

    def _audit(self, name: str | None) -> str:
        """The audit list of ``name``, or of every name when None."""
        return self._db.key(self.kind, "audit" if name is None else f"audit:{name}")

    async def _newest(self, what: str, name: str | None, limit: int) -> list[Any]:
        """The first ``limit`` audit records of ``name`` (of all when None), newest first."""
        if limit <= 0:
            return []
        key = self._audit(name)
        found: list[Any] = await self._db.run(
            what, lambda: self._db.client.lrange(key, 0, limit - 1)
        )
        return found


class RedisFlagStore(AuditedRedisStore):
    """Flag values in one hash; the audit log in capped lists; changes announced by pub/sub."""

    kind = "flags"

    def __init__(
        self, db: RedisDatabase, clock: Clock | None = None, *, audit_cap: int = 10_000
    ) -> None:
        super().__init__(db, clock, audit_cap=audit_cap)
        self._values = db.key("flags", "values")

    async def values(self) -> dict[str, Any]:
        raw = await self._db.run("flags", lambda: self._db.client.hgetall(self._values))
        return {as_text(name): orjson.loads(value) for name, value in raw.items()}

    async def set(self, flag: str, value: Any, *, who: str, why: str) -> AuditRecord:
        at, old = await self._db.script(
            "flag_set",
            [self._values, self._audit(None), self._audit(flag)],
            [
                now_arg(self._clock),
                flag,
                orjson.dumps(value),
                who,
                why,
                str(self._cap),
                self.channel,
            ],
        )
        return AuditRecord(flag, orjson.loads(old) if old else None, value, who, why, float(at))

    async def history(self, flag: str | None = None, *, limit: int = 100) -> list[AuditRecord]:
        return [_audit_record(item) for item in await self._newest("flag history", flag, limit)]

    def watch(self) -> RedisFlagChanges:
        """Subscribe to flag changes: ``async with store.watch() as changes: ...``."""
        return RedisFlagChanges(self._db, self.channel)


@dataclass(frozen=True, slots=True)
class FlightLed:
    """This caller made the call; the others shared its result."""

    key: str


@dataclass(frozen=True, slots=True)
class FlightJoined:
    """This caller got the result of a call made by another caller (maybe on another replica)."""

    key: str


@dataclass(frozen=True, slots=True)
class FlightFellBack:
    """No result came within the bound: this caller made the call itself, outside the flight."""

    key: str


SingleFlightEvent = FlightLed | FlightJoined | FlightFellBack


class _Waiter(Protocol):
    def now(self) -> float: ...

    async def asleep(self, seconds: float) -> None: ...


class RedisSingleFlight:
    """Identical calls across every replica share one upstream call.

    The first caller takes the lead key with ``SET NX PX`` (a lease, so a leader that dies cannot
    block the key for long), makes the call, and stores the result under a result key for
    ``result_ttl_s``. The others poll that key every ``poll_s`` (no connection is held while
    waiting) for at most ``wait_s``; then they give up on the flight and call themselves. A leader
    whose call fails only gives up the lead: the next caller to poll takes it and tries again, so a
    failing upstream sees one call at a time instead of a stampede.

    Errors before the call (Redis down) raise ``StoreError`` and the caller decides (the gateway
    calls upstream directly: single-flight fails open). Once a call was made its result is returned
    even if Redis then fails to store it.
    """

    def __init__(
        self,
        db: RedisDatabase,
        *,
        lease_s: float = 60.0,
        wait_s: float = 30.0,
        result_ttl_s: float = 2.0,
        poll_s: float = 0.02,
        waiter: _Waiter | None = None,
        on_event: Callable[[SingleFlightEvent], None] | None = None,
    ) -> None:
        for name, value in (
            ("lease_s", lease_s),
            ("wait_s", wait_s),
            ("result_ttl_s", result_ttl_s),
            ("poll_s", poll_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        self._db = db
        self._lease_ms = str(math.ceil(lease_s * 1000))
        self._result_ms = str(math.ceil(result_ttl_s * 1000))
        self._wait_s = wait_s
        self._poll_s = poll_s
        self._waiter: _Waiter = waiter if waiter is not None else SystemClock()
        self._on_event = on_event

    def _emit(self, event: SingleFlightEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)

    async def run(
        self, key: str, call: Callable[[], Awaitable[bytes]], *, wait_s: float | None = None
    ) -> bytes:
        """``call()``'s result, from this caller's own call or from the flight it joined."""
        tag = self._db.key("flight", f"{{{key}}}")
        keys = [f"{tag}:result", f"{tag}:lead"]
        token = secrets.token_hex(8)
        deadline = self._waiter.now() + (self._wait_s if wait_s is None else wait_s)
        while True:
            reply = await self._db.script("flight_acquire", keys, [token, self._lease_ms])
            step = as_text(reply[0])
            if step == "done":
                self._emit(FlightJoined(key))
                return bytes(reply[1])
            if step == "lead":
                break
            left = deadline - self._waiter.now()
            if left <= 0:
                self._emit(FlightFellBack(key))
                return await call()
            await self._waiter.asleep(min(self._poll_s, left))
        self._emit(FlightLed(key))
        try:
            value = await call()
        except BaseException:
            await self._land(keys, token, b"", "0")
            raise
        await self._land(keys, token, value, self._result_ms)
        return value

    async def _land(self, keys: list[str], token: str, value: bytes, result_ms: str) -> None:
        # If Redis fails here the lease expires on its own; the followers then call themselves.
        with contextlib.suppress(StoreError):
            await self._db.script("flight_land", keys, [token, value, result_ms])


class RedisRetryBudgetCounter:
    """A retry budget shared by every replica: :class:`~tidegate.policy.retry.RetryBudget` in Redis.

    First tries and granted retries are counted per whole second of the deciding clock (the Redis
    server's, unless ``clock`` is given) in one hash per ``name``; ``try_spend`` grants a retry in
    one script while the retries of the window stay within ``ratio`` times its first tries plus
    ``min_retries_per_second * window``.
    """

    def __init__(
        self,
        db: RedisDatabase,
        name: str,
        *,
        ratio: float = 0.1,
        min_retries_per_second: float = 1.0,
        window: int = 10,
        clock: Clock | None = None,
    ) -> None:
        for field, value in (("ratio", ratio), ("min_retries_per_second", min_retries_per_second)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{field} must be a finite number >= 0, got {value!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a whole number of seconds >= 1, got {window!r}")
        self._db = db
        self._key = db.key("retry-budget", name)
        self._clock = clock
        self.ratio = ratio
        self.min_retries_per_second = min_retries_per_second
        self.window = window

    async def _call(self, op: str) -> tuple[bool, float]:
        granted, available = await self._db.script(
            "retry_budget",
            [self._key],
            [
                now_arg(self._clock),
                op,
                str(self.window),
                _num(self.ratio),
                _num(self.min_retries_per_second),
            ],
        )
        return bool(granted), float(available)

    async def record_first_try(self) -> None:
        """Count one first try (not a retry); each adds ``ratio`` to the allowance."""
        await self._call("first")

    async def try_spend(self) -> bool:
        """Take one retry from the budget if it allows one; True means it was taken."""
        granted, _ = await self._call("spend")
        return granted

    async def available(self) -> float:
        """How many retries the budget would grant now (may be fractional; never negative)."""
        _, available = await self._call("peek")
        return available


def _action(action_id: str, fields: list[bytes]) -> PendingAction:
    held = {as_text(fields[i]): fields[i + 1] for i in range(0, len(fields), 2)}
    decided_by = held.get("decided_by")
    decided_at = held.get("decided_at")
    return PendingAction(
        id=action_id,
        kind=as_text(held["kind"]),
        payload=orjson.loads(held["payload"]),
        status=ActionStatus(as_text(held["status"])),
        proposed_by=as_text(held["proposed_by"]),
        created_at=float(held["created_at"]),
        expires_at=float(held["expires_at"]),
        decided_by=None if decided_by is None else as_text(decided_by),
        decided_at=None if decided_at is None else float(decided_at),
    )


class RedisPendingActionStore:
    """Pending actions as hashes; each decision is one script that checks status and expiry.

    An action is kept ``keep_s`` seconds past its expiry so that its outcome can still be read.
    """

    def __init__(
        self, db: RedisDatabase, clock: Clock | None = None, *, keep_s: float = 7 * 86_400.0
    ) -> None:
        self._db = db
        self._clock = clock
        self._keep = _num(keep_s)

    async def propose(
        self, kind: str, payload: dict[str, Any], *, ttl_s: float, proposed_by: str
    ) -> PendingAction:
        check_ttl(ttl_s)
        action_id = new_action_id()
        blob = orjson.dumps(payload)
        created_at, expires_at = await self._db.script(
            "action_propose",
            [self._db.key("action", action_id)],
            [now_arg(self._clock), kind, blob, proposed_by, _num(ttl_s), self._keep],
        )
        return PendingAction(
            id=action_id,
            kind=kind,
            payload=orjson.loads(blob),
            status=ActionStatus.PENDING,
            proposed_by=proposed_by,
            created_at=float(created_at),
            expires_at=float(expires_at),
        )

    async def _decide(self, action_id: str, who: str, status: ActionStatus) -> PendingAction:
        reply = await self._db.script(
            "action_decide",
            [self._db.key("action", action_id)],
            [now_arg(self._clock), status.value, who],
        )
        outcome = as_text(reply[0])
        if outcome == "missing":
            raise ActionNotFound(f"no action {action_id}", action_id=action_id)
        action = as_seen_at(_action(action_id, reply[2:]), float(reply[1]))
        if outcome == "expired":
            raise ActionExpired(action)
        if outcome == "already":
            raise ActionAlreadyDecided(action)
        return action

    async def approve(self, action_id: str, who: str) -> PendingAction:
        return await self._decide(action_id, who, ActionStatus.APPROVED)

    async def reject(self, action_id: str, who: str) -> PendingAction:
        return await self._decide(action_id, who, ActionStatus.REJECTED)

    async def get(self, action_id: str) -> PendingAction | None:
        reply = await self._db.script(
            "action_get", [self._db.key("action", action_id)], [now_arg(self._clock)]
        )
        if len(reply) == 1:
            return None
        return as_seen_at(_action(action_id, reply[1:]), float(reply[0]))


class RedisRolloutStore:
    """Rollout state as hashes ``(value, version, updated_at)``; writes compare-and-set in Lua."""

    def __init__(self, db: RedisDatabase, clock: Clock | None = None) -> None:
        self._db = db
        self._clock = clock

    async def get(self, key: str) -> RolloutRecord | None:
        name = self._db.key("rollout", key)
        value, version, updated_at = await self._db.run(
            "rollout", lambda: self._db.client.hmget(name, ["value", "version", "updated_at"])
        )
        if value is None or version is None or updated_at is None:
            return None
        return RolloutRecord(
            key=key, value=orjson.loads(value), version=int(version), updated_at=float(updated_at)
        )

    async def put(self, key: str, value: Any, *, expected_version: int) -> RolloutRecord:
        check_version(expected_version)
        blob = orjson.dumps(value)
        reply = await self._db.script(
            "rollout_put",
            [self._db.key("rollout", key)],
            [now_arg(self._clock), str(expected_version), blob],
        )
        if not reply[0]:
            raise VersionConflict(key, expected=expected_version, current=int(reply[1]))
        return RolloutRecord(
            key=key, value=orjson.loads(blob), version=int(reply[1]), updated_at=float(reply[2])
        )
