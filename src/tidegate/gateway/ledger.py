"""The spend ledger's writer: a row per settled request, written to the durable store in batches.

The request path does as little as it can: :meth:`LedgerWriter.record` reads what the request's
log line already holds and appends one tuple to a list. Everything else happens off the path:
a batch is written when it holds ``ledger.batch_rows`` rows, or ``ledger.flush_s`` after its
first row, in one transaction (:meth:`~tidegate.state.ledger.LedgerStore.append`); the flags
(degraded, cached, replayed) are worked out then. Shutdown writes what is left
(:meth:`LedgerWriter.close`, from ``close_runtime``, before the stores close), so a SIGTERM
loses nothing. A batch the store refuses stays buffered and is tried again with the next one
(up to :data:`MAX_BUFFERED` rows; past that the oldest are dropped, logged and counted). Once an
hour, after a batch, rows older than ``ledger.retention_days`` are deleted.

A request is *settled* once the pipeline's settle step ran for it (``Exchange.settling``): every
request that got past identification and reading its body. It is *billed* when its budget
reservation was settled rather than refunded, which is what the daily budget counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog

from tidegate.clock import Clock
from tidegate.errors import StoreError
from tidegate.gateway.config import LedgerConfig
from tidegate.state.ledger import LedgerStore, Settled

if TYPE_CHECKING:
    from tidegate.gateway.metrics import Metrics
    from tidegate.gateway.pipeline.exchange import Exchange

__all__ = ["MAX_BUFFERED", "PURGE_EVERY_S", "LedgerOff", "LedgerWriter", "ledger_from"]

log = structlog.get_logger("tidegate")

#: How often the writer deletes the rows past their retention.
PURGE_EVERY_S = 3600.0
#: The most rows kept while the store refuses them.
MAX_BUFFERED = 200_000


class LedgerOff:
    """``ledger.enabled: false``: nothing is recorded."""

    enabled = False

    def record(self, fields: dict[str, Any], ex: Exchange) -> None:
        return None

    async def flush(self) -> int:
        return 0

    async def close(self) -> None:
        return None


class LedgerWriter:
    """Buffers the rows of settled requests and writes them in batches (see the module)."""

    enabled = True

    def __init__(
        self,
        store: LedgerStore,
        config: LedgerConfig,
        clock: Clock,
        sleep: Callable[[float], Awaitable[None]],
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self._batch_rows = config.batch_rows
        self._flush_s = config.flush_s
        self._retention_s = (
            None if config.retention_days is None else config.retention_days * 86_400.0
        )
        self._wall = clock.wall
        self._sleep = sleep
        self._metrics = metrics
        self._rows: list[Settled] = []
        self._lock = asyncio.Lock()
        #: The task waiting ``flush_s`` to write the buffer (None: none waiting).
        self._timer: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._next_purge = 0.0
        self._closed = False

    @property
    def buffered(self) -> int:
        return len(self._rows)

    def record(self, fields: dict[str, Any], ex: Exchange) -> None:
        """Buffer a settled request (:data:`~tidegate.state.ledger.Settled`), from what its log
        line holds: one tuple, on the request path."""
        identity = ex.identity
        if not ex.settling or identity is None:
            return
        rows = self._rows
        if not rows:
            self._arm()
        rows.append(
            (
                ex.request_id,
                self._wall(),
                identity.key_id,
                identity.tenant,
                identity.user,
                ex.route,
                ex.served_by,
                ex.served_model,
                fields["prompt_tokens"],
                fields["completion_tokens"],
                ex.cost,
                ex.outcome,
                ex.status,
                ex.billed,
                ex.budget,
                ex.cache,
            )
        )
        if len(rows) >= self._batch_rows:
            self._spawn(self.flush())

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _arm(self) -> None:
        if self._timer is None and not self._closed:
            self._timer = self._spawn(self._later())

    async def _later(self) -> None:
        try:
            await self._sleep(self._flush_s)
        finally:
            self._timer = None  # from here on close() leaves this task to finish its write
        await self.flush()

    async def flush(self) -> int:
        """Write every buffered row now, in one transaction; how many were written."""
        async with self._lock:
            raw, self._rows = self._rows, []
            if not raw:
                return 0
            try:
                await self.store.append(raw)
            except StoreError as exc:
                self._keep(raw, exc)
                return 0
            await self._purge_due()
            return len(raw)

    def _keep(self, raw: list[Settled], exc: StoreError) -> None:
        """Put a refused batch back in front of the buffer, within :data:`MAX_BUFFERED`."""
        rows = raw + self._rows
        dropped = max(0, len(rows) - MAX_BUFFERED)
        self._rows = rows[dropped:]
        if self._metrics is not None:
            self._metrics.store_errors.labels("ledger", "write_failed").inc()
        log.warning("ledger_write_failed", rows=len(raw), dropped=dropped, error=str(exc))
        if not self._closed:
            self._arm()

    async def _purge_due(self) -> None:
        if self._retention_s is None:
            return
        now = self._wall()
        if now < self._next_purge:
            return
        self._next_purge = now + PURGE_EVERY_S
        try:
            removed = await self.store.purge(now - self._retention_s)
        except StoreError as exc:
            log.warning("ledger_purge_failed", error=str(exc))
            return
        if removed:
            log.info("ledger_purged", rows=removed)

    async def close(self) -> None:
        """Write what is left (at shutdown, before the stores close); the rows the store
        refuses even now are logged as lost."""
        self._closed = True
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        pending = [t for t in self._tasks if t is not timer]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await self.flush()
        if self._rows:
            log.error("ledger_rows_lost", rows=len(self._rows))
            self._rows = []


def ledger_from(
    store: LedgerStore,
    config: LedgerConfig,
    clock: Clock,
    sleep: Callable[[float], Awaitable[None]],
    metrics: Metrics | None = None,
) -> LedgerWriter | LedgerOff:
    """The writer ``config`` asks for."""
    if not config.enabled:
        return LedgerOff()
    return LedgerWriter(store, config, clock, sleep, metrics)
