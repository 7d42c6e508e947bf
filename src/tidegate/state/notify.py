"""Change notification for flags, so a kill switch reaches every replica within a second.

A flag store that can announce its changes offers ``watch()``: an async context manager whose value
is an async iterator of the names of flags that changed. The subscription is live when the ``async
with`` block is entered, so a change made after that is always seen::

    async with flags.watch() as changes:
        async for name in changes:
            current = await flags.values()   # re-read: the notice carries the name only

Notices are a hint, not the record: a replica that loses its connection misses the ones sent in
the meantime. So a replica re-reads every value when it (re)subscribes, and also on a slow timer.
Redis delivers notices by pub/sub (``PUBLISH`` inside the script that changes the flag), Postgres
by ``LISTEN``/``NOTIFY`` (``pg_notify`` inside the transaction that changes it, delivered only if it
commits).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Protocol, runtime_checkable

from tidegate.state.base import FlagStore

__all__ = ["FlagChanges", "FlagChangesIteration", "WatchableFlagStore"]


@runtime_checkable
class FlagChanges(Protocol):
    """A live subscription: iterate it for changed flag names, or wait for one with a bound."""

    def __aiter__(self) -> AsyncIterator[str]: ...

    async def __anext__(self) -> str: ...

    async def next(self, timeout_s: float) -> str | None:
        """The next changed flag's name, or None if none changed within ``timeout_s``."""
        ...


@runtime_checkable
class WatchableFlagStore(FlagStore, Protocol):
    def watch(self) -> AbstractAsyncContextManager[FlagChanges]:
        """Subscribe to flag changes for the duration of an ``async with`` block."""
        ...


class FlagChangesIteration:
    """``async for name in changes``, built on a subscription's ``next(timeout_s)``."""

    async def next(self, timeout_s: float) -> str | None:
        raise NotImplementedError

    def __aiter__(self) -> FlagChangesIteration:
        return self

    async def __anext__(self) -> str:
        while True:
            name = await self.next(1.0)
            if name is not None:
                return name
