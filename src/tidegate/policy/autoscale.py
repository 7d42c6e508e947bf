"""Autoscaling laws: a damped law for production and a naive proportional law as the baseline.

New replicas take a provisioning lead time before they serve. A law that reads only the serving
count keeps ordering the same replicas again until the first order arrives, overshoots, then tears
the surplus down: it oscillates. :class:`DampedLaw` avoids that by

* counting supply already in flight (serving plus pending replicas),
* taking the larger of a rate signal and a queue signal (the backlog must drain too),
* ignoring recommendations inside a tolerance band around the current supply,
* capping how far one decision may move the fleet, up or down,
* scaling down only to the highest recommendation seen within a stabilisation window.

:class:`ProportionalLaw` sizes the fleet from the arrival rate alone and ignores pending supply; it
exists so that the lab and the tests can show what the damping buys.

Both laws are pure and synchronous. Time comes only from :attr:`ScaleSignals.now`, which the
caller reads from its :class:`~tidegate.clock.Clock`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeAlias

from tidegate.clock import ClockWentBackwards

__all__ = [
    "AutoscaleEvent",
    "DampedLaw",
    "DampedOptions",
    "ProportionalLaw",
    "ScaleDecision",
    "ScaleDownHeld",
    "ScaleReason",
    "ScaleSignals",
    "ScaledDown",
    "ScaledUp",
    "clamp",
    "recommend",
    "replicas_for_queue",
    "replicas_for_rate",
    "step_limit",
    "within_tolerance",
]

# A replica count is a ceiling of a float ratio; 2.1 / 0.7 is 3.0000000000000004, and float
# noise of that size must not buy an extra replica. Nine decimals is far below any real signal.
_CEIL_DECIMALS = 9


def _ceil(x: float) -> int:
    return math.ceil(round(x, _CEIL_DECIMALS))


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


# --------------------------------------------------------------------------- signals and decisions


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleSignals:
    """What a law may know about the fleet at one instant.

    ``now`` is monotonic seconds from the caller's clock. ``current_replicas`` are serving;
    ``pending_replicas`` are ordered but not serving yet (provisioning, loading, warming up).
    ``queue_depth`` is the number of requests waiting to start, ``arrival_rate`` the offered load
    in requests per second, and ``per_replica_rate`` what one replica serves per second when fully
    busy. Requests already running are not a signal: they occupy the serving replicas, whose
    capacity ``per_replica_rate`` already describes.
    """

    now: float
    current_replicas: int
    pending_replicas: int = 0
    queue_depth: float = 0.0
    arrival_rate: float
    per_replica_rate: float

    def __post_init__(self) -> None:
        _check_finite("now", self.now)
        if self.current_replicas < 0:
            raise ValueError(f"current_replicas must be >= 0, got {self.current_replicas!r}")
        if self.pending_replicas < 0:
            raise ValueError(f"pending_replicas must be >= 0, got {self.pending_replicas!r}")
        _check_finite("queue_depth", self.queue_depth)
        if self.queue_depth < 0:
            raise ValueError(f"queue_depth must be >= 0, got {self.queue_depth!r}")
        _check_finite("arrival_rate", self.arrival_rate)
        if self.arrival_rate < 0:
            raise ValueError(f"arrival_rate must be >= 0, got {self.arrival_rate!r}")
        _check_finite("per_replica_rate", self.per_replica_rate)
        if self.per_replica_rate <= 0:
            raise ValueError(f"per_replica_rate must be > 0, got {self.per_replica_rate!r}")

    @property
    def supply(self) -> int:
        """Serving plus pending replicas: everything already paid for."""
        return self.current_replicas + self.pending_replicas


class ScaleReason(StrEnum):
    """Which rule settled a decision."""

    STEADY = "steady"
    """The recommendation equals the supply."""
    WITHIN_TOLERANCE = "within_tolerance"
    """The recommendation differs from the supply by no more than the tolerance band."""
    SCALE_UP = "scale_up"
    """The fleet grows to the recommendation."""
    SCALE_UP_CAPPED = "scale_up_capped"
    """The fleet grows by the step cap, short of the recommendation."""
    SCALE_DOWN = "scale_down"
    """The fleet shrinks to the recommendation (or the window's highest one)."""
    SCALE_DOWN_CAPPED = "scale_down_capped"
    """The fleet shrinks by the step cap, short of the recommendation."""
    SCALE_DOWN_HELD = "scale_down_held"
    """A lower recommendation waits: a higher one is still inside the stabilisation window."""
    BOUNDS = "bounds"
    """The supply was outside ``[min_replicas, max_replicas]`` and is brought back to the edge."""


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """The fleet size a law wants, and what to do to get there.

    ``desired`` is the total fleet, pending replicas included. ``delta`` is what to order now
    (positive) or retire now (negative), measured from the supply the law counts: serving plus
    pending for :class:`DampedLaw`, serving only for :class:`ProportionalLaw`.
    """

    desired: int
    delta: int
    reason: ScaleReason


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class ScaledUp:
    """The damped law asked for more replicas."""

    at: float
    supply: int
    desired: int
    recommended: int
    capped: bool


@dataclass(frozen=True, slots=True)
class ScaledDown:
    """The damped law asked for fewer replicas."""

    at: float
    supply: int
    desired: int
    recommended: int
    capped: bool


@dataclass(frozen=True, slots=True)
class ScaleDownHeld:
    """A lower recommendation was held back by a higher one inside the stabilisation window."""

    at: float
    supply: int
    recommended: int
    window_high: int


AutoscaleEvent: TypeAlias = ScaledUp | ScaledDown | ScaleDownHeld


# --------------------------------------------------------------------------- pure helper math


def clamp(replicas: int, min_replicas: int, max_replicas: int) -> int:
    """``replicas`` moved into ``[min_replicas, max_replicas]``."""
    return max(min_replicas, min(max_replicas, replicas))


def replicas_for_rate(
    arrival_rate: float, per_replica_rate: float, target_utilisation: float
) -> int:
    """Replicas that serve ``arrival_rate`` with each one busy ``target_utilisation`` of the time."""
    return _ceil(arrival_rate / (per_replica_rate * target_utilisation))


def replicas_for_queue(
    queue_depth: float, arrival_rate: float, per_replica_rate: float, drain_seconds: float
) -> int:
    """Replicas that keep up with arrivals and also drain ``queue_depth`` within ``drain_seconds``.

    Sized at full utilisation: draining a backlog is the one time replicas should run flat out;
    the steady-state headroom is the rate signal's job.
    """
    return _ceil((arrival_rate + queue_depth / drain_seconds) / per_replica_rate)


def step_limit(supply: int, absolute: int, fraction: float) -> int:
    """The most one decision may move a fleet of ``supply``: the larger of the two limits.

    ``absolute`` lets a small fleet move at all; ``fraction`` lets a large one move in proportion.
    """
    return max(absolute, math.floor(supply * fraction))


def within_tolerance(recommended: int, supply: int, tolerance: float) -> bool:
    """Whether ``recommended`` is within ``±tolerance`` (a fraction) of ``supply``, inclusive."""
    return abs(recommended - supply) <= tolerance * supply


def recommend(signals: ScaleSignals, options: DampedOptions) -> int:
    """The damped law's undamped recommendation: the larger signal, inside the bounds."""
    rate = replicas_for_rate(
        signals.arrival_rate, signals.per_replica_rate, options.target_utilisation
    )
    queue = replicas_for_queue(
        signals.queue_depth,
        signals.arrival_rate,
        signals.per_replica_rate,
        options.queue_drain_seconds,
    )
    return clamp(max(rate, queue), options.min_replicas, options.max_replicas)


def _check_bounds(min_replicas: int, max_replicas: int) -> None:
    if min_replicas < 0:
        raise ValueError(f"min_replicas must be >= 0, got {min_replicas!r}")
    if max_replicas < max(1, min_replicas):
        raise ValueError(
            f"max_replicas must be >= 1 and >= min_replicas ({min_replicas!r}), "
            f"got {max_replicas!r}"
        )


def _check_utilisation(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"target_utilisation must be in (0, 1], got {value!r}")


# --------------------------------------------------------------------------- the baseline


@dataclass(frozen=True, slots=True, kw_only=True)
class ProportionalLaw:
    """Size the serving fleet from the arrival rate alone; no damping, pending supply ignored.

    This is the baseline that oscillates under a provisioning lead time: until an order arrives
    the serving count stays low, so every decision orders the same replicas again.
    """

    target_utilisation: float = 0.7
    """Fraction of each replica's capacity to plan for."""
    min_replicas: int = 1
    """Never recommend fewer serving replicas."""
    max_replicas: int = 100
    """Never recommend more serving replicas."""

    def __post_init__(self) -> None:
        _check_utilisation(self.target_utilisation)
        _check_bounds(self.min_replicas, self.max_replicas)

    def decide(self, signals: ScaleSignals) -> ScaleDecision:
        """``ceil(arrival_rate / (per_replica_rate * target))``, clamped; delta from serving only."""
        desired = clamp(
            replicas_for_rate(
                signals.arrival_rate, signals.per_replica_rate, self.target_utilisation
            ),
            self.min_replicas,
            self.max_replicas,
        )
        delta = desired - signals.current_replicas
        if delta > 0:
            reason = ScaleReason.SCALE_UP
        elif delta < 0:
            reason = ScaleReason.SCALE_DOWN
        else:
            reason = ScaleReason.STEADY
        return ScaleDecision(desired, delta, reason)


# --------------------------------------------------------------------------- the damped law


@dataclass(frozen=True, slots=True, kw_only=True)
class DampedOptions:
    """Settings of :class:`DampedLaw`.

    The tolerance, the scale-down window and the scale-up step match the Kubernetes HPA's
    defaults; scale-down is slower than the HPA's on purpose, since a cold start costs a lead time.
    """

    target_utilisation: float = 0.7
    """Fraction of each replica's capacity the rate signal plans for; the rest is headroom."""
    queue_drain_seconds: float = 60.0
    """The queue signal sizes the fleet to drain the backlog within this many seconds."""
    max_step_up: int = 4
    """A decision may always add this many replicas."""
    max_step_up_fraction: float = 1.0
    """A decision may add this fraction of the supply, if that is more than ``max_step_up``."""
    max_step_down: int = 1
    """A decision may always retire this many replicas."""
    max_step_down_fraction: float = 0.1
    """A decision may retire this fraction of the supply, if that is more than ``max_step_down``."""
    stabilisation_seconds: float = 300.0
    """Scale down only to the highest recommendation made within this many seconds."""
    tolerance: float = 0.1
    """Ignore recommendations within this fraction of the supply, either way."""
    min_replicas: int = 1
    """The fleet never goes below this (a warm floor)."""
    max_replicas: int = 100
    """The fleet never goes above this (a cost ceiling)."""

    def __post_init__(self) -> None:
        _check_utilisation(self.target_utilisation)
        _check_finite("queue_drain_seconds", self.queue_drain_seconds)
        if self.queue_drain_seconds <= 0:
            raise ValueError(f"queue_drain_seconds must be > 0, got {self.queue_drain_seconds!r}")
        if self.max_step_up < 1:
            raise ValueError(f"max_step_up must be >= 1, got {self.max_step_up!r}")
        if self.max_step_down < 1:
            raise ValueError(f"max_step_down must be >= 1, got {self.max_step_down!r}")
        for name, fraction in (
            ("max_step_up_fraction", self.max_step_up_fraction),
            ("max_step_down_fraction", self.max_step_down_fraction),
        ):
            _check_finite(name, fraction)
            if fraction < 0:
                raise ValueError(f"{name} must be >= 0, got {fraction!r}")
        if self.max_step_down_fraction > 1:
            raise ValueError(
                f"max_step_down_fraction must be <= 1, got {self.max_step_down_fraction!r}"
            )
        _check_finite("stabilisation_seconds", self.stabilisation_seconds)
        if self.stabilisation_seconds < 0:
            raise ValueError(
                f"stabilisation_seconds must be >= 0, got {self.stabilisation_seconds!r}"
            )
        _check_finite("tolerance", self.tolerance)
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance!r}")
        _check_bounds(self.min_replicas, self.max_replicas)


class DampedLaw:
    """Size the fleet so that it converges under a provisioning lead time instead of oscillating.

    The law is a small stateful object: it remembers the recommendations of the last
    ``stabilisation_seconds`` (read from :attr:`ScaleSignals.now`, which must not go backwards).
    The bounds are hard; the step caps apply to moves inside them.
    """

    __slots__ = ("_history", "_last_now", "_on_event", "options")

    def __init__(
        self,
        options: DampedOptions | None = None,
        *,
        on_event: Callable[[AutoscaleEvent], None] | None = None,
    ) -> None:
        self.options = options if options is not None else DampedOptions()
        self._on_event = on_event
        self._last_now: float | None = None
        # (time, recommendation) pairs with strictly decreasing recommendations: the front is the
        # highest within the window, and an entry that a later, higher one outranks can never be
        # the answer again, so the deque holds at most max_replicas - min_replicas + 1 entries.
        self._history: deque[tuple[float, int]] = deque()

    def decide(self, signals: ScaleSignals) -> ScaleDecision:
        """The fleet size to aim for now, counting pending replicas as supply."""
        opts = self.options
        now = signals.now
        if self._last_now is not None and now < self._last_now:
            raise ClockWentBackwards(f"signals.now went back from {self._last_now!r} to {now!r}")
        self._last_now = now

        supply = signals.supply
        base = clamp(supply, opts.min_replicas, opts.max_replicas)
        recommended = recommend(signals, opts)
        window_high = self._remember(now, recommended)

        event: AutoscaleEvent | None = None
        if recommended == base:
            desired, reason = base, ScaleReason.STEADY
        elif within_tolerance(recommended, base, opts.tolerance):
            desired, reason = base, ScaleReason.WITHIN_TOLERANCE
        elif recommended > base:
            limit = step_limit(base, opts.max_step_up, opts.max_step_up_fraction)
            capped = recommended - base > limit
            desired = base + limit if capped else recommended
            reason = ScaleReason.SCALE_UP_CAPPED if capped else ScaleReason.SCALE_UP
            event = ScaledUp(now, supply, desired, recommended, capped)
        elif window_high >= base:
            desired, reason = base, ScaleReason.SCALE_DOWN_HELD
            event = ScaleDownHeld(now, supply, recommended, window_high)
        else:
            limit = step_limit(base, opts.max_step_down, opts.max_step_down_fraction)
            capped = base - window_high > limit
            desired = base - limit if capped else window_high
            reason = ScaleReason.SCALE_DOWN_CAPPED if capped else ScaleReason.SCALE_DOWN
            event = ScaledDown(now, supply, desired, recommended, capped)

        if base != supply and desired == base:
            reason = ScaleReason.BOUNDS
        if event is not None and self._on_event is not None:
            self._on_event(event)
        return ScaleDecision(desired, desired - supply, reason)

    def _remember(self, now: float, recommended: int) -> int:
        """Record ``recommended`` at ``now`` and return the highest one within the window."""
        history = self._history
        horizon = now - self.options.stabilisation_seconds
        while history and history[0][0] <= horizon:
            history.popleft()
        while history and history[-1][1] <= recommended:
            history.pop()
        history.append((now, recommended))
        return history[0][1]

    def __repr__(self) -> str:
        return f"DampedLaw({self.options!r})"
