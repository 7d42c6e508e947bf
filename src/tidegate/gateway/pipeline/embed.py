"""Step 10 of ``POST /v1/embeddings``: the embeddings call, through the same attempts policy as
every model call (retries, breakers, failover by the routing rules)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import orjson

from tidegate.gateway.http import send_bytes
from tidegate.gateway.pipeline.attempt import attempt
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.spend import account, input_tokens, price
from tidegate.policy.attempts import Call

__all__ = ["embed"]


def _embed(request: Request, step: Call) -> Awaitable[dict[str, Any]]:
    rt, name = request.rt, step.spec.name
    upstream = {**request.body, "model": rt.model_ids[name]}
    return rt.providers[name].embed(upstream, timeout=step.timeout)


async def embed(request: Request) -> bool:
    """Answer with the vectors of the first provider that gives them."""
    rt, ex = request.rt, request.ex
    attempts = rt.attempts.start(request.plan, request.deadline, request.route.limit, ex.tried)
    step, answer = await attempt(request, attempts, _embed)
    ex.served_by = step.spec.name
    ex.served_model = answer["model"] = rt.model_ids[step.spec.name]
    usage = answer.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if type(prompt) is not int:
        prompt = input_tokens(request.body["input"])
    ex.usage = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
    ex.cost = price(rt, ex.served_model, prompt, 0)
    account(rt, ex)
    request.served = True
    ex.status = 200
    await send_bytes(request.send, 200, orjson.dumps(answer), ex.answer_headers())
    return True
