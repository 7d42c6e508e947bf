"""Slow start: a provider whose breaker has just closed gets its share of a route's traffic back
gradually, not all at once.

The surge runbook's last step: restoring full share instantly moves the overload back into a
provider (or a replica) that has only just recovered. After a provider recovers at time ``t0``
(its breaker closed), a request that would go to it first keeps it first with probability

    share(t) = max(min_share, ((t - t0) / window_s) ** (1 / aggression))

and otherwise puts it behind the route's other candidates, so the approved fallback takes the
rest meanwhile (the gateway's route step, through
:func:`~tidegate.policy.headroom.prefer_ample`; the lab's scenarios call the same object). From
``t0 + window_s`` on the provider has its whole share again. ``aggression`` above 1 gives the
share back faster at first, below 1 slower; 1 is linear (Envoy's slow start has the same shape).
A provider that opens again is no longer ramping; one that closes again starts a new ramp.

Pure: time is read from the :class:`~tidegate.clock.Clock` it is given, chance from its
``random.Random``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from tidegate.clock import Clock
from tidegate.policy.breaker import BreakerEvent, CircuitClosed, CircuitOpened

__all__ = ["SlowStart", "SlowStartOptions", "ramp_share"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowStartOptions:
    """How a recovered provider's share comes back; ``window_s == 0`` switches slow start off."""

    window_s: float = 30.0
    #: The share right after recovery (a recovered provider is never shut out).
    min_share: float = 0.1
    aggression: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s >= 0):
            raise ValueError(f"window_s must be a finite number >= 0, got {self.window_s!r}")
        if not (math.isfinite(self.min_share) and 0 < self.min_share <= 1):
            raise ValueError(f"min_share must be in (0, 1], got {self.min_share!r}")
        if not (math.isfinite(self.aggression) and self.aggression > 0):
            raise ValueError(f"aggression must be positive, got {self.aggression!r}")


def ramp_share(elapsed: float, options: SlowStartOptions) -> float:
    """The share of its traffic a provider gets ``elapsed`` seconds after it recovered."""
    if options.window_s == 0 or elapsed >= options.window_s:
        return 1.0
    fraction = max(0.0, elapsed) / options.window_s
    share: float = fraction ** (1.0 / options.aggression)
    return max(options.min_share, share)


class SlowStart:
    """The providers ramping back after recovery, and which ones a request holds back."""

    def __init__(self, options: SlowStartOptions, clock: Clock, rng: random.Random) -> None:
        self.options = options
        self._clock = clock
        self._rng = rng
        #: Provider name -> clock time it recovered; only providers still ramping.
        self._since: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return self.options.window_s > 0

    def recovered(self, provider: str, at: float | None = None) -> None:
        """``provider`` is serving again (its breaker closed) at ``at`` (now by default)."""
        if self.enabled:
            self._since[provider] = self._clock.now() if at is None else at

    def failed(self, provider: str) -> None:
        """``provider`` is out again (its breaker opened): no longer ramping."""
        self._since.pop(provider, None)

    def on_event(self, event: BreakerEvent) -> None:
        """A breaker's event: a close starts a ramp, an open ends one."""
        if isinstance(event, CircuitClosed):
            self.recovered(event.name, event.at)
        elif isinstance(event, CircuitOpened):
            self.failed(event.name)

    def share(self, provider: str) -> float:
        """The share of its traffic ``provider`` gets now (1.0 unless ramping)."""
        since = self._since.get(provider)
        if since is None:
            return 1.0
        elapsed = self._clock.now() - since
        if elapsed >= self.options.window_s:
            del self._since[provider]  # ramped: the whole share from here on
            return 1.0
        return ramp_share(elapsed, self.options)

    def ramping(self) -> dict[str, float]:
        """Each provider still ramping, with its share now."""
        return {name: self.share(name) for name in list(self._since) if name in self._since}

    def held_back(self, candidates: Iterable[str]) -> list[str]:
        """The ``candidates`` this request holds back: each ramping one with probability
        ``1 - share`` (one draw each; none at all while nothing ramps)."""
        if not self._since:
            return []
        held = []
        for name in candidates:
            if name in self._since and self._rng.random() >= self.share(name):
                held.append(name)
        return held
