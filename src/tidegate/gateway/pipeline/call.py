"""Step 10, call: the model call, through the attempts policy (retries with jitter and a retry
budget, a breaker per provider, failover by the routing rules), streamed or answered whole.

A failure that a degraded answer may stand in for (no model could answer, retrying could, and
nothing was sent) is left to the degrade step; any other failure is the request's answer.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import orjson

from tidegate.errors import CircuitOpen, ProviderError, Unavailable
from tidegate.gateway.canary import validation_failed
from tidegate.gateway.pipeline.answer import answer_json
from tidegate.gateway.pipeline.attempt import attempt
from tidegate.gateway.pipeline.cache import put, single_flight
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.spend import account, price, usage_of
from tidegate.gateway.pipeline.stream import stream_answer
from tidegate.gateway.runtime import Flight, Runtime
from tidegate.policy.attempts import Call

__all__ = ["call_model", "lead"]


async def call_model(request: Request) -> bool:
    """Answer with the model's answer; a degradable failure is kept for the degrade step."""
    try:
        if request.stream:
            await stream_answer(request)
            return True
        if request.cache_key:
            payload = await single_flight(request, lambda: lead(request))
        else:  # nothing to share: the request leads its own call
            payload = (await lead(request))[0]
    except (ProviderError, CircuitOpen, Unavailable) as error:
        retryable = error.retryable if isinstance(error, ProviderError) else True
        if request.ex.first_token_s is not None or not retryable:
            raise
        request.failure = error
        return False
    await answer_json(request, payload)
    return True


def _complete(request: Request, step: Call) -> Awaitable[dict[str, Any]]:
    """One attempt's call (the provider's coroutine, awaited by the driver: no level between)."""
    rt, name = request.rt, step.spec.name
    upstream = {**request.body, "model": rt.model_ids[name]}
    return rt.providers[name].complete(upstream, timeout=step.timeout)


async def lead(request: Request) -> Flight:
    """The upstream call itself, its accounting, and (for the primary's answers) the cache."""
    rt, ex, route = request.rt, request.ex, request.route
    attempts = rt.attempts.start(request.plan, request.deadline, route.limit, ex.tried)
    step, answer = await attempt(request, attempts, _complete)
    name = step.spec.name
    served_model = rt.model_ids[name]
    answer["model"] = served_model
    text_chars = _clean(rt, answer)
    ex.served_by, ex.served_model = name, served_model
    if request.canary is not None:  # judged for the canary gate only
        choice = (answer.get("choices") or [{}])[0]
        ex.validation_failed = validation_failed(
            request.body,
            choice.get("finish_reason"),
            str((choice.get("message") or {}).get("content") or ""),
        )
    ex.usage = usage = usage_of(answer, request.body, text_chars)
    given = answer.get("usage")
    if given != usage:  # the provider's usage, completed with ours (usually it already is)
        answer["usage"] = {**(given or {}), **usage}
    ex.cost = price(rt, served_model, usage["prompt_tokens"], usage["completion_tokens"])
    account(rt, ex)
    payload = orjson.dumps(answer)
    if request.cache_key and name == route.specs[0].name:
        await put(request, payload)
    return payload, ex.served_by, ex.served_model, ex.usage


def _clean(rt: Runtime, answer: dict[str, Any]) -> int:
    """Pass every choice's text through the output filter; the characters of what is left (the
    completion's size, when the provider reports no usage)."""
    text_chars = 0
    clean = rt.output_filter.clean
    for choice in answer.get("choices") or ():
        message = choice.get("message") or {}
        content = message.get("content")
        if isinstance(content, str):
            content = message["content"] = clean(content)
            text_chars += len(content)
    return text_chars
