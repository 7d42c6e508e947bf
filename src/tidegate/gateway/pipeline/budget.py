"""Step 4, budget: a daily budget per user on calls, tokens and cost (or the key's own, for a
virtual key that has one: :attr:`~tidegate.gateway.auth.Identity.budget`). The estimate is reserved
on entry (a few requests at a time: :mod:`tidegate.state.leases`), settled at what was spent or
refunded by the settle step; near the quota the request is degraded (a cheaper model, a lower
``max_tokens``), past it refused (429 until the next UTC midnight). A store that does not answer
fails closed (503).

The entry decisions (this step's and the rate limit's) take effect once durable: the step ends
by awaiting the store's commit (SQLite commits a round's batches together).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable

from tidegate.errors import BudgetExceeded, StoreError
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.spend import price
from tidegate.gateway.pipeline.steps import Outcome
from tidegate.policy.budget import BudgetDecision, BudgetVerdict, Cost
from tidegate.state.base import DONE

__all__ = ["DEFAULT_MAX_TOKENS", "reserve_chat", "reserve_embeddings"]

#: A chat request's completion estimate without ``max_tokens`` when only a key has a budget
#: (``budgets.default_max_tokens`` otherwise).
DEFAULT_MAX_TOKENS = 1024


def reserve_chat(request: Request) -> Outcome:
    """Reserve a chat completion: its prompt (as the primary's counter counts it) and ``n``
    times ``max_tokens`` of completion; from this process's lease when it holds the estimate
    (the usual case: no store call and, once nothing decided so far awaits its commit, no
    coroutine), else from the store."""
    rt, body = request.rt, request.body
    options = request.identity.budget or rt.budget
    if options is not None:
        budgets = rt.config.budgets
        default = budgets.default_max_tokens if budgets is not None else DEFAULT_MAX_TOKENS
        max_tokens = body.get("max_tokens") or default
        completion = max_tokens * request.choices
        count, input_per_1k, output_per_1k = rt.reserve_meters[request.route.specs[0].name]
        prompt = count(body)
        cost = (prompt * input_per_1k + completion * output_per_1k) / 1000.0  # as price() does
        estimate = Cost(calls=1, tokens=prompt + completion, cost=cost)
        drawn = rt.stores.reserve_now(request.identity.budget_subject, options, estimate)
        if drawn is None:
            return _reserve_chat(request, estimate, max_tokens)
        request.reservation = drawn
    commit = rt.stores.committed()
    return False if commit is DONE else _committed(request, commit)


async def _reserve_chat(request: Request, estimate: Cost, max_tokens: int) -> bool:
    decision = await _reserve(request, estimate)
    if decision.verdict is BudgetVerdict.DEGRADE:
        _degrade(request, max_tokens)
    return await _committed(request, request.rt.stores.committed())


async def reserve_embeddings(request: Request) -> bool:
    """Reserve an embeddings call: its input's tokens (as the primary's counter counts them)."""
    rt = request.rt
    if request.identity.budget is not None or rt.budget is not None:
        primary = request.route.specs[0].name
        tokens = rt.input_counters[primary](request.body["input"])
        model = rt.model_ids[primary]
        await _reserve(request, Cost(calls=1, tokens=tokens, cost=price(rt, model, tokens, 0)))
    return await _committed(request, rt.stores.committed())


async def _reserve(request: Request, estimate: Cost) -> BudgetDecision:
    """Hold ``estimate`` for the request's subject; a block is refused here."""
    rt = request.rt
    options = request.identity.budget or rt.budget
    assert options is not None
    with rt.stores.batch():  # committed with the rate limit's (see _committed)
        try:
            reservation, decision = await rt.stores.quotas.reserve(
                request.identity.budget_subject, options, estimate
            )
        except StoreError:
            rt.metrics.store_errors.labels("quotas", "fail_closed").inc()
            raise
    request.reservation = reservation
    if decision.verdict is BudgetVerdict.BLOCK:
        dimension = decision.reason.value if decision.reason is not None else "calls"
        rt.metrics.budget_denials.labels(dimension).inc()
        retry_after = None if math.isinf(decision.retry_after) else decision.retry_after
        raise BudgetExceeded(
            f"the daily {dimension} budget is spent", policy="budget", retry_after=retry_after
        )
    return decision


def _degrade(request: Request, max_tokens: int) -> None:
    """Near the quota: a lower ``max_tokens`` or a cheaper model, as configured."""
    rt, ex = request.rt, request.ex
    budgets = rt.config.budgets
    rt.metrics.budget_degraded.inc()
    ex.budget = "degraded"
    if budgets is None:  # a key's own budget, and no deployment budget saying how to degrade
        return
    if budgets.degrade.max_tokens is not None:
        request.body["max_tokens"] = min(max_tokens, budgets.degrade.max_tokens)
    if budgets.degrade.model is not None:
        request.alias = ex.route = budgets.degrade.model
        request.route = rt.routes[request.alias]


async def _committed(request: Request, commit: Awaitable[None]) -> bool:
    """Wait until the entry decisions are durable (``commit``: the store's ``committed()``); a
    failed commit undid them all, so the request holds no reservation and fails closed as a
    failed reservation would."""
    rt = request.rt
    try:
        await commit
    except StoreError:
        request.reservation = None
        rt.metrics.store_errors.labels("quotas" if rt.budget else "buckets", "fail_closed").inc()
        raise
    return False
