"""Step 10 of ``POST /v1/embeddings``: the embeddings call, through the same attempts policy as
every model call (retries, breakers, failover by the routing rules).

The provider is asked for floats (the field is left out, OpenAI's default) and the gateway
writes the vectors as the caller asked (``encoding_format``: ``float``, or ``base64`` as the
OpenAI SDKs decode it), so that a provider which ignores the field, or answers in the other
encoding, cannot hand a caller vectors it decodes wrongly. An answer whose vectors are not
numbers is the provider's ``malformed`` error (and so fails over).
"""

from __future__ import annotations

from typing import Any

import orjson

from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.gateway.http import send_bytes
from tidegate.gateway.pipeline.attempt import attempt
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.spend import account, is_count, price
from tidegate.policy.attempts import Call
from tidegate.providers.wire import decode_vector, encode_vector

__all__ = ["embed"]


async def _embed(request: Request, step: Call) -> dict[str, Any]:
    rt, name = request.rt, step.spec.name
    upstream = {k: v for k, v in request.body.items() if k != "encoding_format"}
    upstream["model"] = rt.model_ids[name]
    answer = await rt.providers[name].embed(upstream, timeout=step.timeout)
    base64 = request.body.get("encoding_format") == "base64"
    for item in answer["data"]:
        item["embedding"] = _encoded(item.get("embedding"), base64=base64, provider=name)
    return answer


def _encoded(vector: Any, *, base64: bool, provider: str) -> list[float] | str:
    """``vector`` (floats, or the base64 a provider answered anyway) as the caller asked."""
    if isinstance(vector, str):
        decoded = decode_vector(vector)
        if decoded is not None:
            return vector if base64 else decoded
    elif isinstance(vector, list) and all(type(value) in (float, int) for value in vector):
        return encode_vector(vector) if base64 else vector
    raise ProviderError(
        ProviderErrorKind.MALFORMED, "an embedding that is not a vector", provider=provider
    )


async def embed(request: Request) -> bool:
    """Answer with the vectors of the first provider that gives them."""
    rt, ex = request.rt, request.ex
    attempts = rt.attempts.start(request.plan, request.deadline, request.route.limit, ex.tried)
    step, answer = await attempt(request, attempts, _embed, operation="embeddings")
    ex.served_by = step.spec.name
    ex.served_model = answer["model"] = rt.model_ids[step.spec.name]
    usage = answer.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not is_count(prompt):  # missing, or not a count (see usage_of)
        prompt = rt.input_counters[step.spec.name](request.body["input"])
    ex.usage = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
    ex.cost = price(rt, ex.served_model, prompt, 0)
    account(rt, ex)
    request.served = True
    ex.status = 200
    await send_bytes(request.send, 200, orjson.dumps(answer), ex.answer_headers())
    return True
