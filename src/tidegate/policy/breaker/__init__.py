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

The modules, one noun each: ``states`` (:class:`BreakerState` and the transition table),
``options`` (:class:`BreakerOptions`), ``events``, ``snapshot``, ``window``
(:class:`FailureWindow` and the rate test) and ``circuit`` (:class:`CircuitBreaker` and its
:class:`Permit`).
"""

from tidegate.policy.breaker.circuit import CircuitBreaker, Permit, PermitAlreadyUsed, open_duration
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
from tidegate.policy.breaker.states import (
    TRANSITIONS,
    BreakerState,
    IllegalTransition,
    OpenReason,
    check_transition,
)
from tidegate.policy.breaker.window import FailureWindow, rate_tripped

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
