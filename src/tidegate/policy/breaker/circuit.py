"""The breaker itself and its permits: one breaker per provider, one permit per call.

A breaker lives in one process and is not thread-safe: drive it from one thread (an event loop).
The two live together because each settles through the other: a breaker grants permits, and a
permit's verdict or release is the breaker's to apply.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from types import TracebackType
from typing import Final

from tidegate.clock import Clock
from tidegate.errors import CircuitOpen
from tidegate.policy.breaker.events import (
    BreakerEvent,
    CallRejected,
    CircuitClosed,
    CircuitHalfOpened,
    CircuitOpened,
    ProbeLeaseExpired,
    ProbeReleased,
    ProbeStarted,
    StaleVerdictIgnored,
)
from tidegate.policy.breaker.options import BreakerOptions
from tidegate.policy.breaker.snapshot import BreakerSnapshot
from tidegate.policy.breaker.states import BreakerState, OpenReason, check_transition
from tidegate.policy.breaker.window import FailureWindow, rate_tripped

__all__ = ["CircuitBreaker", "Permit", "PermitAlreadyUsed", "open_duration"]

_POLICY: Final = "breaker"


def open_duration(recovery: float, jitter: float, draw: float) -> float:
    """The open time for a uniform ``draw`` in [0, 1): in [recovery, recovery * (1 + jitter))."""
    return recovery + recovery * jitter * draw


class PermitAlreadyUsed(RuntimeError):
    """A permit was settled twice; each permit takes exactly one verdict or release."""


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
        self._settle()
        return self._breaker._verdict(self, failed=False)

    def failure(self) -> bool:
        """The provider failed (timeout, 5xx, overload); returns whether the breaker counted it."""
        self._settle()
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
        self._state = BreakerState.CLOSED
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
        # Closed: no half-open time and no probe lease, so _wait() is 0.0 at any time.
        if self._state is BreakerState.CLOSED:
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
        if self._state is BreakerState.CLOSED:
            self._serial += 1
            return Permit(
                self, generation=self._generation, serial=self._serial, lease_ends_at=None
            )
        now = self._clock.now()
        self._catch_up(now)
        if self._state is BreakerState.HALF_OPEN and self._probe_serial is None:
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
        if self._state is BreakerState.OPEN:
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
        if (
            self._state is BreakerState.OPEN
            and self._half_open_at is not None
            and now >= self._half_open_at
        ):
            self._half_open(now)
        if (
            self._state is BreakerState.HALF_OPEN
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
        self._enter(BreakerState.OPEN)
        options = self.options
        half_open_at = now + open_duration(
            options.recovery, options.recovery_jitter, self._rng.random()
        )
        self._half_open_at = half_open_at
        self._emit(CircuitOpened(name=self.name, at=now, reason=reason, half_open_at=half_open_at))

    def _half_open(self, now: float) -> None:
        self._enter(BreakerState.HALF_OPEN)
        self._emit(CircuitHalfOpened(name=self.name, at=now))

    def _close(self, now: float) -> None:
        self._enter(BreakerState.CLOSED)
        self._emit(CircuitClosed(name=self.name, at=now))

    def _is_current(self, permit: Permit) -> bool:
        if permit._generation != self._generation:
            return False
        return permit._lease_ends_at is None or permit._serial == self._probe_serial

    def _verdict(self, permit: Permit, *, failed: bool) -> bool:
        now = self._clock.now()
        if self._state is not BreakerState.CLOSED:
            self._catch_up(now)
        if not self._is_current(permit):
            return self._ignore(permit, now, failed=failed)
        if permit._lease_ends_at is not None:  # the probe's verdict decides alone
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
