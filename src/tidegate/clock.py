"""Time as a parameter.

Every policy reads time from a :class:`Clock` passed to it, never from the ``time`` module, so the
gateway (``SystemClock``), the lab (a virtual clock) and the tests (``ManualClock``) drive the same
code. ``now()`` is monotonic seconds for durations and deadlines; ``wall()`` is Unix time, for
timestamps that are stored or shown and for nothing else.

This module is the one place allowed to call ``time.*`` and ``asyncio.sleep`` (see the ruff
banned-API configuration in ``pyproject.toml``).
"""

from __future__ import annotations

import asyncio
import time
from time import monotonic
from time import time as time_

__all__ = ["Clock", "ClockWentBackwards", "ManualClock", "SystemClock", "loop_round"]


class Clock:
    """What a policy may know about time.

    A base class rather than a protocol: every clock is a :class:`SystemClock`, a
    :class:`ManualClock` or another subclass, which lets the compiled build (``make accel``) call
    ``now()`` directly instead of through a Python method lookup on every policy decision.
    """

    __slots__ = ()

    def now(self) -> float:
        """Monotonic seconds; only differences are meaningful."""
        raise NotImplementedError

    def wall(self) -> float:
        """Seconds since the Unix epoch, for stored timestamps only."""
        raise NotImplementedError


class ClockWentBackwards(ValueError):
    """A manual clock was asked to move into its past."""


class SystemClock(Clock):
    """The real clock, for the gateway process."""

    __slots__ = ()

    # Methods, for the compiled build: it calls a clock through Clock's method table, which a
    # class attribute does not override. As plain Python they are replaced below by the time
    # module's own functions, so that reading the clock (a dozen times a request) costs no frame.
    def now(self) -> float:
        return monotonic()

    def wall(self) -> float:
        return time_()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    async def asleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def __repr__(self) -> str:
        return "SystemClock()"


if __file__.endswith(".py"):  # plain Python (a compiled class takes no new attributes)
    setattr(SystemClock, "now", staticmethod(monotonic))  # noqa: B010  # past mypy's method check
    setattr(SystemClock, "wall", staticmethod(time_))  # noqa: B010


class ManualClock(Clock):
    """A clock that moves only when told to; for tests and virtual-time simulations.

    ``sleep`` and ``asleep`` advance the clock instead of waiting, so code that takes a sleep
    function runs instantly and exactly under test.
    """

    __slots__ = ("_now", "_wall_offset")

    def __init__(self, start: float = 0.0, *, wall_start: float = 1_767_225_600.0) -> None:
        self._now = float(start)
        # wall() moves with now(); 1_767_225_600 is 2026-01-01T00:00:00Z, an arbitrary fixed epoch.
        self._wall_offset = float(wall_start) - self._now

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0) and return the new time."""
        if seconds < 0:
            raise ClockWentBackwards(f"cannot advance by {seconds!r}: a clock never goes back")
        self._now += seconds
        return self._now

    def set(self, when: float) -> float:
        """Jump to absolute time ``when`` (not earlier than now) and return it."""
        if when < self._now:
            raise ClockWentBackwards(
                f"cannot set the clock to {when!r}: it is already {self._now!r}"
            )
        self._now = float(when)
        return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    async def asleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)  # still yield to the loop, as a real sleep would

    def __repr__(self) -> str:
        return f"ManualClock({self._now!r})"


async def loop_round() -> None:
    """Let the event loop run one round of other work; waits for no time at all (not a clock)."""
    await asyncio.sleep(0)
