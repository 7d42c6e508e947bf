"""The retry budget: retries may add only a small share of the first tries, plus a small floor."""

from __future__ import annotations

import math

from tidegate.clock import Clock
from tidegate.policy.retry.options import check_finite

__all__ = ["RetryBudget"]


class RetryBudget:
    """Retries may add at most ``ratio`` of the first tries, plus a small floor.

    Over a sliding window the budget grants a retry only while the retries granted in the window
    stay within ``ratio * first tries in the window + min_retries_per_second * window``. The floor
    lets a quiet service retry at all (with 3 first tries a minute, 10% of them is no retry);
    the default of one retry a second is small next to the traffic it guards and still covers
    the occasional blip.

    Time is counted in ``buckets`` equal slices of the window, kept in a ring, so memory does not
    grow with traffic. Rounding is always in the provider's favour: a granted retry counts until
    one whole window has passed after its own slice, while a first try stops counting once its
    slice is a window old. So for every retry granted at ``t``, the retries granted in
    ``(t - window, t]`` never exceed ``ratio`` times the first tries recorded in that interval
    plus the floor times ``window``.

    One budget guards one provider (or one process); it is not thread-safe.
    """

    __slots__ = (
        "_clock",
        "_current",
        "_firsts",
        "_min_retries_per_second",
        "_ratio",
        "_retries",
        "_slot",
        "_width",
        "_window",
    )

    def __init__(
        self,
        clock: Clock,
        *,
        ratio: float = 0.1,
        min_retries_per_second: float = 1.0,
        window: float = 10.0,
        buckets: int = 10,
    ) -> None:
        check_finite("ratio", ratio, minimum=0.0)
        check_finite("min_retries_per_second", min_retries_per_second, minimum=0.0)
        check_finite("window", window, minimum=0.0)
        if window == 0:
            raise ValueError("window must be > 0 seconds, got 0")
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
            raise ValueError(f"buckets must be an int >= 1, got {buckets!r}")
        self._clock = clock
        self._ratio = float(ratio)
        self._min_retries_per_second = float(min_retries_per_second)
        self._window = float(window)
        self._width = self._window / buckets
        # One slot more than the window holds, for the retries of the slice leaving the window.
        self._firsts = [0] * (buckets + 1)
        self._retries = [0] * (buckets + 1)
        self._current = self._index(clock.now())
        #: ``_current``'s slot in the ring: where its first tries and retries are counted.
        self._slot = self._current % (buckets + 1)

    @property
    def ratio(self) -> float:
        """The share of first tries that may be retried."""
        return self._ratio

    @property
    def min_retries_per_second(self) -> float:
        """The floor: retries allowed per second of window even without first tries."""
        return self._min_retries_per_second

    @property
    def window(self) -> float:
        """The seconds over which first tries and retries are counted."""
        return self._window

    def _index(self, now: float) -> int:
        return math.floor(now / self._width)

    def _roll(self) -> int:
        """Clear the slices that fell out of the ring since the last call; the current slot."""
        index = self._index(self._clock.now())
        if index > self._current:
            self._advance(index)
        return self._slot

    def _advance(self, index: int) -> None:
        """Make slice ``index`` (later than the current one) current, clearing the slots of the
        slices that fell out of the ring on the way."""
        size = len(self._firsts)
        for stale in range(self._current + 1, self._current + 1 + min(index - self._current, size)):
            self._firsts[stale % size] = 0
            self._retries[stale % size] = 0
        self._current = index
        self._slot = index % size

    def _allowance_and_spent(self) -> tuple[float, int]:
        slot = self._roll()
        oldest = (slot + 1) % len(self._firsts)
        firsts = sum(self._firsts) - self._firsts[oldest]
        allowance = self._ratio * firsts + self._min_retries_per_second * self._window
        return allowance, sum(self._retries)

    def record_first_try(self) -> None:
        """Count one first try (not a retry); each adds ``ratio`` to the allowance."""
        self._firsts[self._roll()] += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget if it allows one; ``True`` means it was taken.

        Call it when a retry is scheduled, not when it starts: a granted retry counts at once.
        """
        allowance, spent = self._allowance_and_spent()
        if spent + 1 <= allowance:
            self._retries[self._slot] += 1
            return True
        return False

    def available(self) -> float:
        """How many retries the budget would grant now (may be fractional; never negative)."""
        allowance, spent = self._allowance_and_spent()
        return max(0.0, allowance - spent)

    def __repr__(self) -> str:
        return (
            f"RetryBudget(ratio={self._ratio!r}, "
            f"min_retries_per_second={self._min_retries_per_second!r}, window={self._window!r})"
        )
