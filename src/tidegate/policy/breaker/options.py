"""How a breaker trips and recovers: its frozen options, checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BreakerOptions"]


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
