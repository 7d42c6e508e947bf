"""A breaker's states and the only moves between them, as a table that refuses any other."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final

__all__ = ["TRANSITIONS", "BreakerState", "IllegalTransition", "OpenReason", "check_transition"]


class BreakerState(StrEnum):
    """Where a breaker is: passing calls, refusing them, or trying one."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class OpenReason(StrEnum):
    """Why a circuit opened."""

    CONSECUTIVE_FAILURES = "consecutive_failures"
    FAILURE_RATE = "failure_rate"
    PROBE_FAILED = "probe_failed"


#: The only moves a breaker makes; :func:`check_transition` refuses any other.
TRANSITIONS: Final[Mapping[BreakerState, frozenset[BreakerState]]] = MappingProxyType(
    {
        BreakerState.CLOSED: frozenset({BreakerState.OPEN}),
        BreakerState.OPEN: frozenset({BreakerState.HALF_OPEN}),
        BreakerState.HALF_OPEN: frozenset({BreakerState.CLOSED, BreakerState.OPEN}),
    }
)


class IllegalTransition(RuntimeError):
    """A move that :data:`TRANSITIONS` does not allow; always a bug in the caller."""

    def __init__(self, source: BreakerState, target: BreakerState) -> None:
        super().__init__(f"a breaker cannot go from {source.value} to {target.value}")
        self.source = source
        self.target = target


def check_transition(source: BreakerState, target: BreakerState) -> None:
    """Raise :class:`IllegalTransition` unless ``source -> target`` is in :data:`TRANSITIONS`."""
    if target not in TRANSITIONS[source]:
        raise IllegalTransition(source, target)
