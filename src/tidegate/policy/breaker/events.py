"""What a breaker reports as it happens: one past-tense event per transition, probe and refusal.

``at`` is the breaker's clock when it noticed; a lazy transition is noticed on the first call
that looks at the breaker after it became due.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

from tidegate.policy.breaker.states import BreakerState, OpenReason

__all__ = [
    "BreakerEvent",
    "CallRejected",
    "CircuitClosed",
    "CircuitHalfOpened",
    "CircuitOpened",
    "ProbeLeaseExpired",
    "ProbeReleased",
    "ProbeStarted",
    "StaleVerdictIgnored",
]


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


BreakerEvent: TypeAlias = (
    CircuitOpened
    | CircuitHalfOpened
    | CircuitClosed
    | ProbeStarted
    | ProbeReleased
    | ProbeLeaseExpired
    | CallRejected
    | StaleVerdictIgnored
)
