"""Timeouts that share one timer per event loop.

``asyncio.timeout`` arms a timer of the event loop for every use and disarms it on the way out.
On the gateway's request path (one timeout around every upstream call) that was a measurable
part of each request. :func:`timeout_after` (and :func:`timeout_at`) behave the same way (the block is cancelled when
the time is up and :class:`TimeoutError` is raised in its place; a cancellation from elsewhere
propagates unchanged), but every timeout on a loop waits in one heap, and the loop holds a
single timer, armed for the earliest of them. Most calls end long before their limit: leaving
the block only marks its entry done, and done entries are dropped when the timer next fires or
when they outnumber the live ones.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable
from types import TracebackType
from typing import Final, cast

__all__ = ["DONE", "SharedTimeouts", "timeout_after", "timeout_at"]

#: Done entries kept in the heap before it is rebuilt without them (besides one per live entry).
_SLACK: Final = 1024


class _Done(tuple[()]):
    """An awaitable that is already done: nothing to wait for.

    Awaiting it iterates an empty tuple, which ends at once with ``None``, without a Python frame.
    """

    __slots__ = ()
    __await__ = tuple.__iter__


#: An awaitable already done, for a function that usually has nothing to wait for (compare with
#: ``is`` to skip awaiting it): the request path then goes on without a coroutine.
DONE: Final = cast("Awaitable[None]", _Done())


class _Timeout:
    """One timeout: the async context manager :meth:`SharedTimeouts.at` returns, and, once
    entered with a limit, its own entry in the loop's heap (one object a use, not two)."""

    __slots__ = ("cancelling", "done", "expired", "owner", "task", "when")

    def __init__(
        self, owner: SharedTimeouts, when: float | None, task: asyncio.Task[object] | None = None
    ) -> None:
        self.owner = owner
        self.when = when
        #: The task to cancel: the maker's when it knew it, else the one that enters the block.
        self.task = task
        self.cancelling = 0
        self.done = False
        self.expired = False

    # Entering and leaving wait for nothing, so both are plain methods that return the ready
    # DONE instead of coroutines: no coroutine object per use (two of them around every
    # upstream call, and around every wait for a stream's next chunk).
    def __aenter__(self) -> Awaitable[None]:
        if self.when is not None:
            self.owner.add(self)
        return DONE

    def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> Awaitable[None]:
        if self.when is None:  # no limit
            return DONE
        self.owner.done(self)
        if (
            self.expired
            and self.task is not None
            and self.task.uncancel() <= self.cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc
        return DONE


class SharedTimeouts:
    """Every timeout of one event loop, behind one timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._heap: list[tuple[float, int, _Timeout]] = []
        self._order = itertools.count()
        self._live = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def at(self, when: float | None) -> _Timeout:
        """``async with timeouts.at(when):`` cancels the block at loop time ``when`` (None: never)."""
        return _Timeout(self, when)

    def add(self, timeout: _Timeout) -> None:
        """Start ``timeout`` (its ``when`` set): its task, the current one if it names none, is
        cancelled at ``when`` unless the block ends first."""
        task = timeout.task
        if task is None:
            task = timeout.task = asyncio.current_task()
            if task is None:
                raise RuntimeError("a timeout must be used inside a task")
        timeout.cancelling = task.cancelling()
        when = timeout.when
        assert when is not None
        heap = self._heap
        if len(heap) > 2 * self._live + _SLACK:
            heap[:] = [item for item in heap if not item[2].done]
            heapq.heapify(heap)
        heapq.heappush(heap, (when, next(self._order), timeout))
        self._live += 1
        if when < self._timer_at:
            self._arm(when)

    def done(self, timeout: _Timeout) -> None:
        if not timeout.done:
            timeout.done = True
            self._live -= 1

    def __len__(self) -> int:
        """Timeouts still running."""
        return self._live

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._fire)
        self._timer_at = when

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        now = self.loop.time()
        heap = self._heap
        while heap:
            when, _, entry = heap[0]
            if entry.done:
                heapq.heappop(heap)
                continue
            if when > now:
                self._arm(when)
                return
            heapq.heappop(heap)
            entry.expired = True
            self.done(entry)
            assert entry.task is not None  # set when it was added
            entry.task.cancel()


_by_loop: dict[int, SharedTimeouts] = {}
#: The timeouts asked for last (nearly always the one loop's): found without the dictionary.
_last: SharedTimeouts | None = None


def _shared(loop: asyncio.AbstractEventLoop) -> SharedTimeouts:
    global _last
    last = _last
    if last is not None and last.loop is loop:
        return last
    timeouts = _by_loop.get(id(loop))
    if timeouts is None or timeouts.loop is not loop:
        for key, other in list(_by_loop.items()):
            if other.loop.is_closed():
                del _by_loop[key]
        timeouts = _by_loop[id(loop)] = SharedTimeouts(loop)
    _last = timeouts
    return timeouts


def timeout_after(seconds: float) -> _Timeout:
    """Like ``asyncio.timeout(seconds)``, sharing the running loop's one timer; it times out
    the task that makes it (which is the one that enters it, in ``async with``)."""
    loop = asyncio.get_running_loop()
    # current_task() with the loop at hand: without it, it looks the running loop up again.
    return _Timeout(_shared(loop), loop.time() + seconds, asyncio.current_task(loop))


def timeout_at(when: float | None) -> _Timeout:
    """Like ``asyncio.timeout_at(when)``: at loop time ``when``, or never for None."""
    return _shared(asyncio.get_running_loop()).at(when)
