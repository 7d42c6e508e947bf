"""What a breaker knows at one instant, for metrics and the admin API."""

from __future__ import annotations

from dataclasses import dataclass

from tidegate.policy.breaker.states import BreakerState

__all__ = ["BreakerSnapshot"]


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
