"""Token-bucket rate limiting: a refill rate and a burst, per key.

A bucket holds up to ``burst`` tokens and gains ``rate`` tokens per second. A request takes ``n``
tokens (1 by default; a fractional ``n`` weighs requests by size). If the bucket holds fewer than
``n`` it is refused, and told exactly how long to wait.

The state of one bucket is the small immutable :class:`BucketState` ``(tokens, updated)``, and the
whole decision is the pure function :func:`take`, so that a shared store can hold the state and
repeat the same arithmetic atomically (a Lua script, one SQL statement). The formulas, for a take of
``n >= 0`` tokens at time ``now`` (seconds on the deciding clock)::

    elapsed     = max(0, now - updated)                      a clock behind the state adds nothing
    available   = min(burst, tokens + rate * elapsed)
    updated'    = max(updated, now)
    allowed     = available >= n
    tokens'     = available - n          if allowed
                = available              otherwise (the refill is kept, nothing is taken)
    retry_after = 0                                          if allowed
                = inf                                        if n > burst (never satisfiable)
                = (n - available) / rate + (updated' - now)  otherwise
    reset_after = (burst - tokens') / rate + (updated' - now)    seconds until the bucket is full
    remaining   = tokens'

A new key starts full: :func:`full_bucket` is ``(burst, now)``. The state is written back on every
take, refused or not.

Tokens taken but not used (a lease's rest, see :mod:`tidegate.state.leases`) go back with
:func:`give_back`, never past the burst::

    tokens'  = min(burst, available + n)
    updated' = max(updated, now)

``retry_after`` is exact in floating point: after computing it as above, :func:`take` raises it by
the fewest representable steps needed so that a take of the same ``n`` at ``now + retry_after``
succeeds (the division and the later subtraction can each round down by one unit in the last
place). A store that only reports whole seconds (``Retry-After``) may skip that step.

:func:`ratelimit_headers` renders the ``RateLimit`` and ``RateLimit-Policy`` fields of
draft-ietf-httpapi-ratelimit-headers in the structured-field form introduced in draft-08 and kept
through draft-11 (a List of one String Item with Integer parameters)::

    RateLimit-Policy: "<name>";q=<floor(burst)>;w=<ceil(burst / rate)>
    RateLimit: "<name>";r=<floor(remaining)>;t=<ceil(reset_after)>
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tidegate.clock import Clock
from tidegate.errors import RateLimited

__all__ = [
    "BucketOptions",
    "BucketState",
    "RateLimitEvent",
    "TakeRefused",
    "TakeResult",
    "TokenBucket",
    "TokensTaken",
    "full_bucket",
    "give_back",
    "ratelimit_headers",
    "refill",
    "take",
]

# The largest Integer a structured field may carry (RFC 9651, section 3.3.1).
_SF_INTEGER_MAX = 999_999_999_999_999


def _positive_finite(value: float, name: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketOptions:
    """How fast a bucket refills and how much it holds.

    Both fields are required: there is no rate limit that is right for every service.
    """

    #: Tokens added per second (the sustained rate). Finite, > 0.
    rate: float
    #: Capacity: the most tokens a bucket can hold, so the largest burst it admits at once.
    #: Finite, > 0. A take of more than ``burst`` tokens can never succeed.
    burst: float

    def __post_init__(self) -> None:
        _positive_finite(self.rate, "rate")
        _positive_finite(self.burst, "burst")

    @property
    def window(self) -> float:
        """Seconds an empty bucket takes to fill: ``burst / rate``."""
        return self.burst / self.rate


@dataclass(frozen=True, slots=True)
class BucketState:
    """One bucket: ``tokens`` held as of time ``updated`` (seconds on the deciding clock)."""

    tokens: float
    updated: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TakeResult:
    """What one take decided, and what the caller may tell the client."""

    #: Whether the tokens were taken.
    allowed: bool
    #: Tokens left in the bucket after this take (fractional).
    remaining: float
    #: Seconds until a take of the same size would succeed: 0.0 when allowed, ``math.inf`` when
    #: the take is larger than the burst and can never succeed.
    retry_after: float
    #: Seconds until the bucket is full again if nothing more is taken.
    reset_after: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TokensTaken:
    """A take succeeded."""

    key: str
    n: float
    remaining: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TakeRefused:
    """A take was refused because the bucket held too few tokens."""

    key: str
    n: float
    retry_after: float


RateLimitEvent = TokensTaken | TakeRefused


def full_bucket(options: BucketOptions, now: float) -> BucketState:
    """The state of a bucket first seen at ``now``: full."""
    return BucketState(tokens=options.burst, updated=now)


def refill(state: BucketState, options: BucketOptions, now: float) -> float:
    """Tokens in the bucket at ``now``: ``min(burst, tokens + rate * max(0, now - updated))``."""
    elapsed = max(0.0, now - state.updated)
    return min(options.burst, state.tokens + options.rate * elapsed)


def _wait(state: BucketState, options: BucketOptions, now: float, n: float) -> float:
    """Seconds from ``now`` until ``refill(state, now + wait) >= n``; requires ``n <= burst``."""
    wait = (n - state.tokens) / options.rate + (state.updated - now)
    # The division and the clock's own addition may each round down; step up one unit in the last
    # place of the instant at a time until the very arithmetic take() will use agrees.
    while refill(state, options, now + wait) < n:
        wait += math.ulp(now + wait)
    return wait


def take(
    state: BucketState, options: BucketOptions, now: float, n: float = 1.0
) -> tuple[BucketState, TakeResult]:
    """Refill ``state`` to ``now`` and try to take ``n`` tokens; see the module docstring."""
    if not (math.isfinite(n) and n >= 0):
        raise ValueError(f"n must be a finite number >= 0, got {n!r}")
    available = refill(state, options, now)
    updated = max(state.updated, now)
    allowed = available >= n
    tokens = available - n if allowed else available
    new_state = BucketState(tokens=tokens, updated=updated)
    if allowed:
        retry_after = 0.0
    elif n > options.burst:
        retry_after = math.inf
    else:
        retry_after = _wait(new_state, options, now, n)
    reset_after = (options.burst - tokens) / options.rate + (updated - now)
    result = TakeResult(
        allowed=allowed, remaining=tokens, retry_after=retry_after, reset_after=reset_after
    )
    return new_state, result


def give_back(state: BucketState, options: BucketOptions, now: float, n: float) -> BucketState:
    """``state`` refilled to ``now`` with ``n`` unused tokens returned, at most up to the burst."""
    if not (math.isfinite(n) and n >= 0):
        raise ValueError(f"n must be a finite number >= 0, got {n!r}")
    available = refill(state, options, now)
    return BucketState(tokens=min(options.burst, available + n), updated=max(state.updated, now))


def _sf_integer(value: float, rounding: Callable[[float], int]) -> int:
    return rounding(min(float(_SF_INTEGER_MAX), max(0.0, value)))


def _sf_string(value: str) -> str:
    if not value or any(not (" " <= char <= "~") for char in value):
        raise ValueError(f"policy_name must be non-empty printable ASCII, got {value!r}")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def ratelimit_headers(
    options: BucketOptions, result: TakeResult, *, policy_name: str = "default"
) -> dict[str, str]:
    """The ``RateLimit-Policy`` and ``RateLimit`` fields describing ``result``.

    ``q`` is the burst rounded down (the whole requests a full bucket admits), ``w`` the seconds a
    bucket takes to fill rounded up, ``r`` the tokens left rounded down and ``t`` the seconds until
    the bucket is full rounded up, so a client reading them is never told it may send more, or
    sooner, than it can.
    """
    name = _sf_string(policy_name)
    quota = _sf_integer(options.burst, math.floor)
    window = _sf_integer(options.window, math.ceil)
    remaining = _sf_integer(result.remaining, math.floor)
    reset = _sf_integer(result.reset_after, math.ceil)
    return {
        "RateLimit-Policy": f"{name};q={quota};w={window}",
        "RateLimit": f"{name};r={remaining};t={reset}",
    }


class TokenBucket:
    """Token buckets kept in this process, one per key; for tests and single-process use.

    A gateway with more than one replica must keep buckets in a shared store instead: a bucket per
    process multiplies the limit by the number of processes.
    """

    __slots__ = ("_buckets", "_clock", "_on_event", "options")

    def __init__(
        self,
        options: BucketOptions,
        clock: Clock,
        *,
        on_event: Callable[[RateLimitEvent], None] | None = None,
    ) -> None:
        self.options = options
        self._clock = clock
        self._on_event = on_event
        self._buckets: dict[str, BucketState] = {}

    def take(self, key: str, n: float = 1.0) -> TakeResult:
        """Take ``n`` tokens from ``key``'s bucket (created full on first use)."""
        now = self._clock.now()
        state = self._buckets.get(key)
        if state is None:
            state = full_bucket(self.options, now)
        self._buckets[key], result = take(state, self.options, now, n)
        if self._on_event is not None:
            event: RateLimitEvent
            if result.allowed:
                event = TokensTaken(key=key, n=n, remaining=result.remaining)
            else:
                event = TakeRefused(key=key, n=n, retry_after=result.retry_after)
            self._on_event(event)
        return result

    def state(self, key: str) -> BucketState | None:
        """The stored state of ``key``'s bucket, or None if it has none."""
        return self._buckets.get(key)

    def prune(self) -> int:
        """Forget buckets that have refilled completely (a new one would be the same); return how
        many were forgotten."""
        now = self._clock.now()
        full = [
            key
            for key, state in self._buckets.items()
            if refill(state, self.options, now) >= self.options.burst
        ]
        for key in full:
            del self._buckets[key]
        return len(full)

    def rejection(self, result: TakeResult) -> RateLimited:
        """The error to raise for a refused take (``retry_after`` None when waiting cannot help)."""
        if result.allowed:
            raise ValueError("cannot build a rejection for an allowed take")
        if math.isinf(result.retry_after):
            return RateLimited(
                f"the request needs more than the burst of {self.options.burst:g} tokens",
                policy="ratelimit",
                retry_after=None,
            )
        return RateLimited(
            f"rate limit exceeded; retry in {result.retry_after:.3g} s",
            policy="ratelimit",
            retry_after=result.retry_after,
        )

    def __repr__(self) -> str:
        return f"TokenBucket({self.options!r}, keys={len(self._buckets)})"
