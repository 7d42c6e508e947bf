"""The failure window: calls and failures over the last seconds, in a fixed number of buckets,
and the rate test that trips a breaker on it."""

from __future__ import annotations

import math
from collections import deque

__all__ = ["FailureWindow", "rate_tripped"]


def rate_tripped(calls: int, failures: int, *, minimum_calls: int, failure_rate: float) -> bool:
    """Whether a window holds enough calls, and a large enough share of failures, to trip."""
    return calls >= minimum_calls and calls > 0 and failures / calls >= failure_rate


class FailureWindow:
    """Calls and failures over the last ``window`` seconds, in a fixed number of time buckets."""

    __slots__ = ("_buckets", "_count", "_newest", "_width")

    def __init__(self, *, window: float, buckets: int) -> None:
        self._count = buckets
        self._width = window / buckets
        # Each entry is [bucket index, calls, failures], oldest first; at most ``buckets`` long.
        self._buckets: deque[list[int]] = deque()
        #: The last entry of ``_buckets`` (``None`` while it is empty). Another record into it
        #: needs no eviction: the record that started it evicted for the same index, and entries
        #: have only been removed since (an entry added after it would be the last).
        self._newest: list[int] | None = None

    def _evict(self, index: int) -> None:
        while self._buckets and self._buckets[0][0] <= index - self._count:
            self._buckets.popleft()
        if not self._buckets:
            self._newest = None

    def record(self, now: float, *, failed: bool) -> None:
        """Count one call that ended at ``now``."""
        index = math.floor(now / self._width)
        bucket = self._newest
        if bucket is None or bucket[0] != index:
            # Another bucket than the last call's: evict what fell out, start the bucket.
            buckets = self._buckets
            if buckets and buckets[0][0] <= index - self._count:
                self._evict(index)
            if not buckets or buckets[-1][0] != index:
                buckets.append([index, 0, 0])
            bucket = self._newest = buckets[-1]
        bucket[1] += 1
        if failed:
            bucket[2] += 1

    def totals(self, now: float) -> tuple[int, int]:
        """``(calls, failures)`` still inside the window at ``now``."""
        self._evict(math.floor(now / self._width))
        return sum(b[1] for b in self._buckets), sum(b[2] for b in self._buckets)

    def clear(self) -> None:
        """Forget every call."""
        self._buckets.clear()
        self._newest = None

    def __len__(self) -> int:
        return len(self._buckets)
