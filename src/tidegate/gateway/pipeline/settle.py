"""The last step: pay what the request owes, once, whatever happened, shielded from the caller
going away: the admission slot, the budget reservation (settled at what was spent, or refunded),
the idempotency claim (completed with the answer, or abandoned), and the canary's windows."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import structlog

from tidegate.errors import StoreError
from tidegate.gateway.pipeline.request import Request
from tidegate.policy.budget import Cost
from tidegate.state.base import DONE

__all__ = ["record_canary", "settle", "settle_shielded"]

log = structlog.get_logger("tidegate")


def settle_shielded(request: Request) -> Awaitable[None]:
    """The settlement, to await: it runs so that no cancellation can cut it short.

    Normally it runs inline (a task per request would cost more than the settlement); the
    disconnect watcher leaves a settling request alone. When a cancellation is already under way
    (a disconnect before the answer, or the drain deadline at shutdown) it runs shielded.
    """
    ex = request.ex
    ex.settling = True
    ex.billed = request.served
    if _settled_now(request):
        return DONE
    task = ex.task or asyncio.current_task()
    if task is not None and task.cancelling():
        return asyncio.shield(settle(request))
    return settle(request)


def _settled_now(request: Request) -> bool:
    """The usual settlement, done here and now: no idempotency claim to close, and a served
    request's reservation (if any) drawn from a lease that settles it without a store call.
    False, with nothing done, otherwise."""
    if request.idempotency is not None:
        return False
    rt, reservation = request.rt, request.reservation
    if reservation is not None:
        if not request.served:
            return False
        ex = request.ex
        actual = Cost(calls=1, tokens=ex.usage.get("total_tokens", 0), cost=ex.cost)
        if not rt.stores.settle_now(reservation, actual):
            return False
        request.reservation = None
    if request.ticket is not None:
        rt.admission.exit(request.ticket, completed=request.served)
        request.ticket = None
    return True


async def settle(request: Request) -> None:
    """Settle what is owed, in one SQLite transaction committed with the other batches of this
    round; a store that fails (or whose commit fails) is logged as lost."""
    rt = request.rt
    written: list[str] = []
    with rt.stores.batch():
        if request.ticket is not None:
            rt.admission.exit(request.ticket, completed=request.served)
            request.ticket = None
        if request.reservation is not None and await _close_reservation(request):
            written.append("quotas")
        if request.idempotency is not None and await _close_claim(request):
            written.append("idempotency")
    if not written:
        return
    try:
        await rt.stores.committed()
    except StoreError as exc:
        for store in written:
            _lost(request, store, exc)


async def _close_reservation(request: Request) -> bool:
    """Settle the reservation at what was spent, or refund it; whether the store was written."""
    rt, ex = request.rt, request.ex
    reservation, request.reservation = request.reservation, None
    assert reservation is not None
    try:
        if request.served:
            tokens = ex.usage.get("total_tokens", 0)
            await rt.stores.quotas.settle(reservation, Cost(calls=1, tokens=tokens, cost=ex.cost))
        else:
            await rt.stores.quotas.refund(reservation)
    except StoreError as exc:
        _lost(request, "quotas", exc)
        return False
    return True


async def _close_claim(request: Request) -> bool:
    """Complete the idempotency claim with the stored answer, or abandon it so a retry may run;
    whether the write joins the budget's transaction (one backend) and so waits for its commit."""
    rt = request.rt
    assert request.idempotency is not None
    key, token = request.idempotency
    request.idempotency = None
    try:
        if request.stored is not None:
            await rt.stores.idempotency.complete(
                key, token, request.stored, ttl_s=rt.config.idempotency.ttl_s
            )
        else:
            await rt.stores.idempotency.abandon(key, token)
    except StoreError as exc:
        _lost(request, "idempotency", exc)
        return False
    return rt.stores.one_backend


def _lost(request: Request, store: str, exc: StoreError) -> None:
    request.rt.metrics.store_errors.labels(store, "settle_lost").inc()
    event = "budget_settle_failed" if store == "quotas" else "idempotency_settle_failed"
    log.warning(event, request_id=request.ex.request_id, error=str(exc))


def record_canary(request: Request) -> None:
    """Count the request in its version's window (client errors are not the version's fault)."""
    ex, canary = request.ex, request.canary
    if canary is None or not ex.version or 400 <= ex.status < 500:
        return
    failed = ex.status >= 500 or ex.outcome.startswith(("degraded", "stream_incomplete"))
    canary.windows[ex.version].record(
        error=failed,
        invalid=ex.validation_failed,
        latency=request.rt.clock.now() - request.started,
        cost=ex.cost,
    )
