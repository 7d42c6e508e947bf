"""One deadline per request, and a check that the timeouts along the request chain nest.

A :class:`Deadline` is an absolute instant on a :class:`~tidegate.clock.Clock`. It is set once
when a request arrives and carried with it: every later step asks how much time is left and
spends no more. A caller may shorten it (a tighter timeout header), never lengthen it.

Every hop between the client and the model has its own timeout, and they must nest: each layer
has to give up before the layer that called it, or the outer layer abandons work that carries on
unseen (an orphaned model call that is still billed). :func:`chain_problems` lists every layer,
given from the outside in, that would outlive a layer above it.
:func:`tidegate.policy.retry.provider_layer` computes the innermost layer of a retrying provider
call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from tidegate.clock import Clock

__all__ = ["Deadline", "Layer", "chain_problems"]


#: How a frozen dataclass sets its own fields.
_set_field: Final = object.__setattr__


def _check_seconds(field: str, value: float) -> None:
    if math.isnan(value) or value < 0:
        raise ValueError(f"{field} must be a number of seconds >= 0, got {value!r}")


@dataclass(frozen=True, slots=True, init=False)
class Deadline:
    """An absolute, immutable instant ``at`` on ``clock`` by which the work must be done.

    ``at`` is monotonic seconds, on the same scale as ``clock.now()``. ``math.inf`` means no
    deadline: ``remaining()`` is then infinite and ``cap(s)`` is ``s``.
    """

    clock: Clock
    at: float

    # Written out instead of generated (one is made for every request): the generated __init__
    # with its check inlined, setting each field through a module constant for
    # object.__setattr__ (a frozen dataclass's own __setattr__ refuses).
    def __init__(self, clock: Clock, at: float) -> None:
        if math.isnan(at):
            raise ValueError("at must be an instant in seconds, got nan")
        _set_field(self, "clock", clock)
        _set_field(self, "at", at)

    @classmethod
    def after(cls, clock: Clock, seconds: float) -> Deadline:
        """The deadline ``seconds`` (>= 0) from now."""
        _check_seconds("seconds", seconds)
        return cls(clock, clock.now() + seconds)

    @classmethod
    def at_time(cls, clock: Clock, when: float) -> Deadline:
        """The deadline at the absolute monotonic instant ``when``."""
        return cls(clock, when)

    def remaining(self) -> float:
        """Seconds left before the deadline; ``0.0`` once it has passed, never negative."""
        return max(0.0, self.at - self.clock.now())

    def expired(self) -> bool:
        """Whether the deadline has been reached: at the instant itself nothing may start."""
        return self.clock.now() >= self.at

    def shorten(self, seconds: float) -> Deadline:
        """The earlier of this deadline and ``seconds`` from now.

        A later instant is never granted: this deadline itself is returned instead.
        """
        _check_seconds("seconds", seconds)
        candidate = self.clock.now() + seconds
        if candidate < self.at:
            return Deadline(self.clock, candidate)
        return self

    def cap(self, seconds: float) -> float:
        """``seconds``, cut down to the time left: ``min(seconds, remaining())``."""
        return min(seconds, self.remaining())


@dataclass(frozen=True, slots=True)
class Layer:
    """One hop of the request chain and how long it waits before giving up."""

    name: str
    timeout_s: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must not be empty")
        _check_seconds("timeout_s", self.timeout_s)


def _seconds(value: float) -> str:
    return f"{value:g}s"


def chain_problems(layers: Sequence[Layer]) -> list[str]:
    """Every layer that would outlive (>=) a layer above it, described in words.

    ``layers`` go from the outside in: client, load balancer, gateway request, stream limit,
    provider. Each layer is compared with the tightest layer above it (the nearest one when
    several tie), so a layer gives at most one problem. An empty list means the chain nests.
    """
    problems: list[str] = []
    tightest: Layer | None = None
    for layer in layers:
        if tightest is not None and layer.timeout_s >= tightest.timeout_s:
            if layer.timeout_s > tightest.timeout_s:
                verb, outcome = "outlives", "gives up first"
            else:
                verb, outcome = "lasts as long as", "may give up first"
            problems.append(
                f"{layer.name} ({_seconds(layer.timeout_s)}) {verb} {tightest.name} "
                f"({_seconds(tightest.timeout_s)}): the {tightest.name} {outcome} "
                f"and the {layer.name} is orphaned"
            )
        if tightest is None or layer.timeout_s <= tightest.timeout_s:
            tightest = layer
    return problems
