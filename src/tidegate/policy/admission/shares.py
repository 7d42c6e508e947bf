"""The weighted share of service across classes (``dequeue="weighted"``), by stride scheduling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

__all__ = ["WeightedShares"]

# Stride passes grow without bound; rebasing them keeps float spacing fine over long lab runs.
_REBASE_PASSES_AT: Final = float(2**20)


class WeightedShares:
    """Which class is owed service: each class's pass grows by ``1 / weight`` per ticket it is
    served, and the class with the lowest pass goes next, so over a busy period each class gets
    service in proportion to its weight and none starves.

    A class that sat idle does not bank credit: its pass counts from the current virtual time
    (the pass the last served class started from), so it rejoins level with the others instead
    of taking every slot until it has caught up.
    """

    __slots__ = ("_passes", "_strides", "_vtime", "weights")

    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = list(weights)
        self._strides = [1.0 / weight for weight in self.weights]
        self._passes = [0.0] * len(self.weights)
        self._vtime = 0.0

    def key(self, index: int) -> float:
        """Class ``index``'s place in line: the lowest key is served next."""
        return max(self._passes[index], self._vtime)

    def served(self, index: int) -> None:
        """Class ``index`` was served one ticket."""
        start = max(self._passes[index], self._vtime)
        self._vtime = start
        self._passes[index] = start + self._strides[index]
        if self._vtime > _REBASE_PASSES_AT:
            base = self._vtime
            self._passes = [p - base for p in self._passes]
            self._vtime = 0.0
