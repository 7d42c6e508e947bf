"""A circuit breaker per provider: fail fast while a provider is down, probe for its recovery.

The breaker is closed while calls go through, opens when failures pile up (too many in a row, or
too high a share of a sliding time window), stays open for a jittered recovery time, then lets
exactly one probe through (half-open). The probe's success closes the circuit and its failure
opens it again.

Every call is a :class:`Permit` from :meth:`CircuitBreaker.acquire`, settled by exactly one of
``success()``, ``failure()`` or ``release()``. ``release()`` is for an outcome that says nothing
about the provider (the caller went away, the request was bad): it frees the probe slot and
changes nothing else, so a cancelled probe cannot leave the breaker half-open with its only slot
taken. The probe slot is also a lease: when it runs out, the next request may probe and the late
verdict is ignored. Every settlement is synchronous, so it completes inside a ``finally`` or a
``with`` exit even while the calling task is being cancelled.

A breaker lives in one process and is not thread-safe: drive it from one thread (an event loop).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType, TracebackType
from typing import Final, Literal

from tidegate.clock import Clock
from tidegate.errors import CircuitOpen

__all__ = [
    "TRANSITIONS",
    "BreakerEvent",
    "BreakerOptions",
    "BreakerSnapshot",
    "BreakerState",
    "CallRejected",
    "CircuitBreaker",
    "CircuitClosed",
    "CircuitHalfOpened",
    "CircuitOpened",
    "FailureWindow",
    "IllegalTransition",
    "OpenReason",
    "Permit",
    "PermitAlreadyUsed",
    "ProbeLeaseExpired",
    "ProbeReleased",
    "ProbeStarted",
    "StaleVerdictIgnored",
    "check_transition",
    "open_duration",
    "rate_tripped",
]

_POLICY: Final = "breaker"
_floor: Final = math.floor


class BreakerState(StrEnum):
    """Where a breaker is: passing calls, refusing them, or trying one."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# The states as module constants: reading a member off its enum class costs a metaclass lookup
# (~0.1 µs on Python 3.11), and the breaker is asked about its state on every call.
_CLOSED: Final = BreakerState.CLOSED
_OPEN: Final = BreakerState.OPEN
_HALF_OPEN: Final = BreakerState.HALF_OPEN


class OpenReason(StrEnum):
    """Why a circuit opened."""

    CONSECUTIVE_FAILURES = "consecutive_failures"
    FAILURE_RATE = "failure_rate"
    PROBE_FAILED = "probe_failed"


_S = BreakerState

#: The only moves a breaker makes; :func:`check_transition` refuses any other.
TRANSITIONS: Final[Mapping[BreakerState, frozenset[BreakerState]]] = MappingProxyType(
    {
        _S.CLOSED: frozenset({_S.OPEN}),
        _S.OPEN: frozenset({_S.HALF_OPEN}),
        _S.HALF_OPEN: frozenset({_S.CLOSED, _S.OPEN}),
    }
)


class IllegalTransition(RuntimeError):
    """A move that :data:`TRANSITIONS` does not allow; always a bug in the caller."""

    def __init__(self, source: BreakerState, target: BreakerState) -> None:
        super().__init__(f"a breaker cannot go from {source.value} to {target.value}")
        self.source = source
        self.target = target


class PermitAlreadyUsed(RuntimeError):
    """A permit was settled twice; each permit takes exactly one verdict or release."""


def check_transition(source: BreakerState, target: BreakerState) -> None:
    """Raise :class:`IllegalTransition` unless ``source -> target`` is in :data:`TRANSITIONS`."""
    if target not in TRANSITIONS[source]:
        raise IllegalTransition(source, target)


def open_duration(recovery: float, jitter: float, draw: float) -> float:
    """The open time for a uniform ``draw`` in [0, 1): in [recovery, recovery * (1 + jitter))."""
    return recovery + recovery * jitter * draw


def rate_tripped(calls: int, failures: int, *, minimum_calls: int, failure_rate: float) -> bool:
    """Whether a window holds enough calls, and a large enough share of failures, to trip."""
    return calls >= minimum_calls and calls > 0 and failures / calls >= failure_rate


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{field} {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakerOptions:
    """How a breaker trips and recovers. Times are seconds."""

    #: Open after this many failures in a row, whatever the window says.
    consecutive_failures: int = 5
    #: Open when at least this share of the calls in the window failed (0 < rate <= 1).
    failure_rate: float = 0.5
    #: Length of the sliding time window the failure rate is measured over.
    window: float = 30.0
    #: The window is kept as this many buckets, so memory does not grow with traffic; the oldest
    #: bucket drops out whole, so the rate covers between ``window * (1 - 1/window_buckets)``
    #: and ``window`` seconds.
    window_buckets: int = 10
    #: The failure rate trips only once the window holds at least this many calls.
    minimum_calls: int = 10
    #: Shortest time the circuit stays open before a probe is allowed.
    recovery: float = 30.0
    #: The open time is drawn uniformly from [recovery, recovery * (1 + recovery_jitter)], so
    #: replicas that opened together do not all probe at the same instant.
    recovery_jitter: float = 0.2
    #: How long a half-open probe holds the only probe slot when its permit has no deadline.
    probe_timeout: float = 30.0

    def __post_init__(self) -> None:
        _require(
            _is_int(self.consecutive_failures) and self.consecutive_failures >= 1,
            "consecutive_failures",
            f"must be an integer >= 1, got {self.consecutive_failures!r}",
        )
        _require(
            _is_finite(self.failure_rate) and 0.0 < self.failure_rate <= 1.0,
            "failure_rate",
            f"must be in (0, 1], got {self.failure_rate!r}",
        )
        _require(
            _is_finite(self.window) and self.window > 0.0,
            "window",
            f"must be a finite number > 0, got {self.window!r}",
        )
        _require(
            _is_int(self.window_buckets) and self.window_buckets >= 1,
            "window_buckets",
            f"must be an integer >= 1, got {self.window_buckets!r}",
        )
        _require(
            _is_int(self.minimum_calls) and self.minimum_calls >= 1,
            "minimum_calls",
            f"must be an integer >= 1, got {self.minimum_calls!r}",
        )
        _require(
            _is_finite(self.recovery) and self.recovery > 0.0,
            "recovery",
            f"must be a finite number > 0, got {self.recovery!r}",
        )
        _require(
            _is_finite(self.recovery_jitter) and self.recovery_jitter >= 0.0,
            "recovery_jitter",
            f"must be a finite number >= 0, got {self.recovery_jitter!r}",
        )
        _require(
            _is_finite(self.probe_timeout) and self.probe_timeout > 0.0,
            "probe_timeout",
            f"must be a finite number > 0, got {self.probe_timeout!r}",
        )


# Events. ``at`` is the breaker's clock when it noticed; a lazy transition is noticed on the
# first call that looks at the breaker after it became due.


@dataclass(frozen=True, slots=True, kw_only=True)
class CircuitOpened:
    """The circuit opened; calls are refused until ``half_open_at``."""

    name: str
    at: float
    reason: OpenReason
    half_open_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CircuitHalfOpened:
    """The recovery time passed; the next call may probe."""

    name: str
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CircuitClosed:
    """A probe succeeded; calls flow again and the failure counts start afresh."""

    name: str
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeStarted:
    """A half-open probe took the probe slot until ``lease_ends_at``."""

    name: str
    at: float
    lease_ends_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeReleased:
    """A probe ended without a verdict and gave the probe slot back."""

    name: str
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeLeaseExpired:
    """A probe held the slot past ``lease_ended_at``; the slot is free and its verdict is void."""

    name: str
    at: float
    lease_ended_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CallRejected:
    """A call was refused in ``state``; ``retry_after`` seconds is when it could be admitted."""

    name: str
    at: float
    state: BreakerState
    retry_after: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StaleVerdictIgnored:
    """A verdict arrived from a permit the breaker no longer counts (older state, lapsed lease)."""

    name: str
    at: float
    verdict: Literal["success", "failure"]
    permit_generation: int
    generation: int


BreakerEvent = (
    CircuitOpened
    | CircuitHalfOpened
    | CircuitClosed
    | ProbeStarted
    | ProbeReleased
    | ProbeLeaseExpired
    | CallRejected
    | StaleVerdictIgnored
)


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakerSnapshot:
    """What a breaker knows, for metrics and the admin API."""

    name: str
    state: BreakerState
    generation: int
    consecutive_failures: int
    window_calls: int
    window_failures: int
    #: When the circuit may half-open; ``None`` unless open.
    half_open_at: float | None
    #: When the outstanding probe's lease ends; ``None`` when no probe holds the slot.
    probe_lease_ends_at: float | None
    retry_after: float


class FailureWindow:
    """Calls and failures over the last ``window`` seconds, in a fixed number of time buckets."""

    __slots__ = ("_buckets", "_count", "_newest", "_width")

    def __init__(self, *, window: float, buckets: int) -> None:
        self._count = buckets
        self._width = window / buckets
        # Each entry is [bucket index, calls, failures], oldest first; at most ``buckets`` long.
        self._buckets: deque[list[int]] = deque()
        #: The last entry of ``_buckets`` (``None`` while it is empty). Another record into it
        #: needs no eviction: the record that started it evicted for the same index, and entries
        #: have only been removed since (an entry added after it would be the last).
        self._newest: list[int] | None = None

    def _evict(self, index: int) -> None:
        while self._buckets and self._buckets[0][0] <= index - self._count:
            self._buckets.popleft()
        if not self._buckets:
            self._newest = None

    def record(self, now: float, *, failed: bool) -> None:
        """Count one call that ended at ``now``."""
        index = _floor(now / self._width)
        bucket = self._newest
        if bucket is None or bucket[0] != index:
            # Another bucket than the last call's: evict what fell out, start the bucket.
            buckets = self._buckets
            if buckets and buckets[0][0] <= index - self._count:
                self._evict(index)
            if not buckets or buckets[-1][0] != index:
                buckets.append([index, 0, 0])
            bucket = self._newest = buckets[-1]
        bucket[1] += 1
        if failed:
            bucket[2] += 1

    def totals(self, now: float) -> tuple[int, int]:
        """``(calls, failures)`` still inside the window at ``now``."""
        self._evict(_floor(now / self._width))
        return sum(b[1] for b in self._buckets), sum(b[2] for b in self._buckets)

    def clear(self) -> None:
        """Forget every call."""
        self._buckets.clear()
        self._newest = None

    def __len__(self) -> int:
        return len(self._buckets)


class Permit:
    """Leave to make one call; settle it with exactly one of ``success``, ``failure``, ``release``.

    As a context manager, a permit that leaves the block without a verdict is released, whether
    the block ended normally or by an exception (a cancellation, a bad request, a bug): none of
    those is evidence about the provider. Record ``failure()`` inside the block for the errors
    that are.
    """

    __slots__ = ("_breaker", "_generation", "_lease_ends_at", "_serial", "_settled")

    def __init__(
        self,
        breaker: CircuitBreaker,
        *,
        generation: int,
        serial: int,
        lease_ends_at: float | None,
    ) -> None:
        self._breaker = breaker
        self._generation = generation
        self._serial = serial
        self._lease_ends_at = lease_ends_at
        self._settled = False

    @property
    def generation(self) -> int:
        """The breaker's generation when this permit was granted."""
        return self._generation

    @property
    def serial(self) -> int:
        """Unique per breaker; identifies a probe's lease."""
        return self._serial

    @property
    def lease_ends_at(self) -> float | None:
        """When a probe's hold on the slot ends; ``None`` for an ordinary closed-state call."""
        return self._lease_ends_at

    @property
    def is_probe(self) -> bool:
        """Whether this permit is the half-open probe."""
        return self.lease_ends_at is not None

    @property
    def settled(self) -> bool:
        """Whether a verdict or a release was already given."""
        return self._settled

    def _settle(self) -> None:
        if self._settled:
            raise PermitAlreadyUsed(f"permit {self.serial} was already settled")
        self._settled = True

    def success(self) -> bool:
        """The provider answered; returns whether the breaker counted it."""
        if self._settled:  # _settle(), inlined: every answered call comes here
            raise PermitAlreadyUsed(f"permit {self.serial} was already settled")
        self._settled = True
        return self._breaker._verdict(self, failed=False)

    def failure(self) -> bool:
        """The provider failed (timeout, 5xx, overload); returns whether the breaker counted it."""
        if self._settled:  # _settle(), inlined, as in success()
            raise PermitAlreadyUsed(f"permit {self.serial} was already settled")
        self._settled = True
        return self._breaker._verdict(self, failed=True)

    def release(self) -> None:
        """End without a verdict: free a probe slot, change nothing else."""
        self._settle()
        self._breaker._release(self)

    def __enter__(self) -> Permit:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._settled:
            self.release()

    def __repr__(self) -> str:
        kind = "probe" if self.is_probe else "call"
        return f"Permit({kind}, serial={self.serial}, generation={self.generation})"


class CircuitBreaker:
    """One provider's breaker. Time comes from ``clock``, the open-time jitter from ``rng``."""

    def __init__(
        self,
        name: str,
        options: BreakerOptions | None = None,
        *,
        clock: Clock,
        rng: random.Random,
        on_event: Callable[[BreakerEvent], None] | None = None,
    ) -> None:
        self.name = name
        self.options = options if options is not None else BreakerOptions()
        self._clock = clock
        self._rng = rng
        self._on_event = on_event
        self._state = _CLOSED
        self._generation = 0
        self._serial = 0
        self._consecutive = 0
        self._window = FailureWindow(
            window=self.options.window, buckets=self.options.window_buckets
        )
        self._half_open_at: float | None = None
        self._probe_serial: int | None = None
        self._probe_lease_ends_at: float | None = None

    # -- reading

    @property
    def state(self) -> BreakerState:
        """The current state; an open circuit whose recovery time passed half-opens here."""
        self._catch_up(self._clock.now())
        return self._state

    def would_admit(self) -> bool:
        """Whether :meth:`acquire` would grant a permit now; changes nothing, emits nothing."""
        if self._state is _CLOSED:  # no half-open time, no probe lease: _wait() is 0.0 at any time
            return True
        return self._wait(self._clock.now()) == 0.0

    def retry_after(self) -> float:
        """Seconds until a call could be admitted (0.0 if one could be now); changes nothing."""
        return self._wait(self._clock.now())

    def snapshot(self) -> BreakerSnapshot:
        """The breaker's state and counters, after applying any transition that came due."""
        now = self._clock.now()
        self._catch_up(now)
        calls, failures = self._window.totals(now)
        return BreakerSnapshot(
            name=self.name,
            state=self._state,
            generation=self._generation,
            consecutive_failures=self._consecutive,
            window_calls=calls,
            window_failures=failures,
            half_open_at=self._half_open_at,
            probe_lease_ends_at=self._probe_lease_ends_at,
            retry_after=self._wait(now),
        )

    # -- calling

    def acquire(self, deadline_at: float | None = None) -> Permit:
        """A permit for one call, or :class:`~tidegate.errors.CircuitOpen` with a retry hint.

        ``deadline_at`` (clock time) ends a half-open probe's lease; without it the lease lasts
        ``probe_timeout``. It does not matter for an ordinary closed-state call.
        """
        # Nothing comes due with time in the closed state: the clock is not even read.
        if self._state is _CLOSED:
            self._serial += 1
            return Permit(
                self, generation=self._generation, serial=self._serial, lease_ends_at=None
            )
        now = self._clock.now()
        self._catch_up(now)
        if self._state is _HALF_OPEN and self._probe_serial is None:
            lease_ends_at = now + self.options.probe_timeout if deadline_at is None else deadline_at
            self._serial += 1
            self._probe_serial = self._serial
            self._probe_lease_ends_at = lease_ends_at
            self._emit(ProbeStarted(name=self.name, at=now, lease_ends_at=lease_ends_at))
            return Permit(
                self, generation=self._generation, serial=self._serial, lease_ends_at=lease_ends_at
            )
        wait = self._wait(now)
        self._emit(CallRejected(name=self.name, at=now, state=self._state, retry_after=wait))
        if self._state is _OPEN:
            raise CircuitOpen(f"circuit {self.name!r} is open", policy=_POLICY, retry_after=wait)
        raise CircuitOpen(
            f"circuit {self.name!r} is half-open and its probe is in flight",
            policy=_POLICY,
            retry_after=wait,
            reason="probe_in_flight",
        )

    # -- internals

    def _emit(self, event: BreakerEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)

    def _wait(self, now: float) -> float:
        # Only an open circuit has a half-open time, and only a half-open one has a probe lease.
        if self._half_open_at is not None:
            return max(0.0, self._half_open_at - now)
        if self._probe_lease_ends_at is not None:
            return max(0.0, self._probe_lease_ends_at - now)
        return 0.0

    def _catch_up(self, now: float) -> None:
        """Apply the transitions that time alone causes: half-opening and a lapsed probe lease."""
        if self._state is _OPEN and self._half_open_at is not None and now >= self._half_open_at:
            self._half_open(now)
        if (
            self._state is _HALF_OPEN
            and self._probe_lease_ends_at is not None
            and now >= self._probe_lease_ends_at
        ):
            ended = self._probe_lease_ends_at
            self._probe_serial = None
            self._probe_lease_ends_at = None
            self._emit(ProbeLeaseExpired(name=self.name, at=now, lease_ended_at=ended))

    def _enter(self, target: BreakerState) -> None:
        check_transition(self._state, target)
        self._state = target
        self._generation += 1
        self._consecutive = 0
        self._window.clear()
        self._probe_serial = None
        self._probe_lease_ends_at = None
        self._half_open_at = None

    def _open(self, now: float, reason: OpenReason) -> None:
        self._enter(_OPEN)
        options = self.options
        half_open_at = now + open_duration(
            options.recovery, options.recovery_jitter, self._rng.random()
        )
        self._half_open_at = half_open_at
        self._emit(CircuitOpened(name=self.name, at=now, reason=reason, half_open_at=half_open_at))

    def _half_open(self, now: float) -> None:
        self._enter(_HALF_OPEN)
        self._emit(CircuitHalfOpened(name=self.name, at=now))

    def _close(self, now: float) -> None:
        self._enter(_CLOSED)
        self._emit(CircuitClosed(name=self.name, at=now))

    def _is_current(self, permit: Permit) -> bool:
        if permit._generation != self._generation:
            return False
        return permit._lease_ends_at is None or permit._serial == self._probe_serial

    def _verdict(self, permit: Permit, *, failed: bool) -> bool:
        now = self._clock.now()
        if self._state is not _CLOSED:
            self._catch_up(now)
        # The checks of _is_current(), inlined (every settled call comes here): a permit of an
        # earlier generation, or a probe whose lease lapsed, no longer counts.
        if permit._generation != self._generation:
            return self._ignore(permit, now, failed=failed)
        if permit._lease_ends_at is not None:  # the probe
            if permit._serial != self._probe_serial:
                return self._ignore(permit, now, failed=failed)
            if failed:
                self._open(now, OpenReason.PROBE_FAILED)
            else:
                self._close(now)
            return True
        self._window.record(now, failed=failed)
        if not failed:
            self._consecutive = 0
            return True
        self._consecutive += 1
        options = self.options
        if self._consecutive >= options.consecutive_failures:
            self._open(now, OpenReason.CONSECUTIVE_FAILURES)
            return True
        calls, failures = self._window.totals(now)
        if rate_tripped(
            calls,
            failures,
            minimum_calls=options.minimum_calls,
            failure_rate=options.failure_rate,
        ):
            self._open(now, OpenReason.FAILURE_RATE)
        return True

    def _ignore(self, permit: Permit, now: float, *, failed: bool) -> bool:
        """A verdict from a permit that no longer counts: reported, and otherwise ignored."""
        self._emit(
            StaleVerdictIgnored(
                name=self.name,
                at=now,
                verdict="failure" if failed else "success",
                permit_generation=permit.generation,
                generation=self._generation,
            )
        )
        return False

    def _release(self, permit: Permit) -> None:
        now = self._clock.now()
        self._catch_up(now)
        if permit.is_probe and self._is_current(permit):
            self._probe_serial = None
            self._probe_lease_ends_at = None
            self._emit(ProbeReleased(name=self.name, at=now))

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.name!r}, state={self._state.value})"
