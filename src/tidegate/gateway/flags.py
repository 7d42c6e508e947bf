"""The deployment's flags as every replica shares them: one change checked, stored with its audit
record and reloaded; and the reload every replica runs a few times a second.

The flag store is the truth and each process's :class:`~tidegate.policy.flags.FlagSet` a copy
of it. The admin API and the canary controller change flags through :func:`set_flag`; the
runtime loads them (:func:`refresh_flags`) when it is built and the app on every refresh round.
Both functions take the part of the runtime they use, :class:`SharedFlags`, not the runtime
itself: the runtime holds the canaries, so the canary controller cannot import the runtime's
module, and through this one it does not need to.
"""

from __future__ import annotations

from typing import Any, Protocol

import structlog

from tidegate.clock import Clock
from tidegate.errors import InvalidRequest, NotFound, StoreError
from tidegate.gateway.http import plain
from tidegate.gateway.metrics import Metrics
from tidegate.policy.flags import FlagSet
from tidegate.state.url import Stores

__all__ = ["SharedFlags", "SharedState", "keep_last", "refresh_flags", "set_flag"]

log = structlog.get_logger("tidegate")


class SharedState(Protocol):
    """What of a runtime a copy of shared state uses: the clock, the stores and the metrics a
    failed reload counts in."""

    @property
    def clock(self) -> Clock: ...

    @property
    def stores(self) -> Stores: ...

    @property
    def metrics(self) -> Metrics: ...


class SharedFlags(SharedState, Protocol):
    """What of a runtime the shared flags use: this process's copy besides the clock it reads
    them with, the stores (the flag store among them) and the metrics."""

    @property
    def flags(self) -> FlagSet: ...


def keep_last(rt: SharedState, store: str, exc: StoreError) -> None:
    """A reload of ``store`` that failed with ``exc``: counted and logged; the last copy stays."""
    rt.metrics.store_errors.labels(store, "keep_last").inc()
    log.warning("store_unavailable", store=store, action="keep_last", error=str(exc))


async def set_flag(rt: SharedFlags, name: str, value: Any, who: str, why: str) -> dict[str, Any]:
    """Check the value against the flag's spec, store it (with its audit record), reload."""
    if name not in rt.flags.specs:
        raise NotFound(f"no flag named {name!r}")
    probe = type(rt.flags)(rt.flags.specs.values(), rt.clock)
    try:
        probe.set(name, value, who=who, why=why)  # the spec's type and choices decide
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    record = await rt.stores.flags.set(name, value, who=who, why=why)
    await refresh_flags(rt)
    answer: dict[str, Any] = plain(record)
    return answer


async def refresh_flags(rt: SharedFlags) -> None:
    """Load the shared flag values into this process's FlagSet (unknown flags are kept aside)."""
    try:
        values = await rt.stores.flags.values()
    except StoreError as exc:
        keep_last(rt, "flags", exc)
        return
    rt.flags.restore({"version": 1, "values": values, "history": []})
