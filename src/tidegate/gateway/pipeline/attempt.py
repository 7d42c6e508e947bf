"""The gateway's driver of :mod:`tidegate.policy.attempts`: the policy decides which provider
next, for how long, whether to wait and retry, when to stop, and how each outcome ends the
breaker permit; this loop only makes the calls and the waits it asks for, on asyncio.

Every model call goes through it: a JSON answer, a stream up to its first chunk, a stream's
rescue, embeddings. With a Redis store each provider's first try is counted in the fleet's
retry budget too, and a retry needs that budget as well as this process's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from tidegate.errors import ProviderError, StoreError
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.spans import attempt_attributes
from tidegate.gateway.runtime import Runtime
from tidegate.policy.attempts import Attempts, Call, Step, Wait

__all__ = ["attempt"]

R = TypeVar("R")


async def attempt(
    request: Request,
    attempts: Attempts,
    call: Callable[[Request, Call], Awaitable[R]],
    *,
    settle: bool = True,
    operation: str = "chat",
) -> tuple[Call, R]:
    """Make the calls ``attempts`` asks for until one answers (its step and result), or raise
    the error it stops with. ``call(request, step)`` makes one call within ``step.timeout``.
    With ``settle`` an answer is a success for the breaker at once; without it the caller ends
    the permit later (a stream, when it ends). Tracing on, each call is a ``tidegate.attempt``
    span whose ``gen_ai.operation.name`` is ``operation``."""
    rt = request.rt
    step: Step = attempts.begin()
    while True:
        if isinstance(step, Call):
            if step.attempt == 1 and rt.fleet_retry_budget is not None:
                await _first_try(rt)
            try:
                if rt.tracing.enabled:
                    attributes = attempt_attributes(request, step, operation)
                    result = await rt.tracing.attempt(call(request, step), attributes)
                else:
                    result = await call(request, step)
            except ProviderError as error:
                rt.metrics.attempts.labels(step.spec.name, error.kind.value).inc()
                step = attempts.failed(error)
                continue
            except BaseException:
                attempts.abandoned()
                raise
            if settle:
                attempts.succeeded()
                rt.metrics.attempts.labels(step.spec.name, "ok").inc()
            return step, result
        if isinstance(step, Wait):
            await rt.sleep(step.delay)
            step = await _resume(rt, attempts)
            continue
        raise step.error


async def _first_try(rt: Runtime) -> None:
    """Count a provider's first try in the fleet's retry budget (fails open)."""
    assert rt.fleet_retry_budget is not None
    try:
        await rt.fleet_retry_budget.record_first_try()
    except StoreError:
        rt.metrics.store_errors.labels("retry_budget", "fail_open").inc()


async def _resume(rt: Runtime, attempts: Attempts) -> Step:
    """After a wait: the retry, if the fleet's retry budget (with Redis) grants it too."""
    fleet = rt.fleet_retry_budget
    if fleet is not None:
        try:
            granted = await fleet.try_spend()
        except StoreError:
            rt.metrics.store_errors.labels("retry_budget", "fail_open").inc()
            granted = True
        if not granted:
            return attempts.retry_refused()
    return attempts.resume()
