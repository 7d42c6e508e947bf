"""What the request's and each attempt's spans say (tracing on only): the OpenTelemetry GenAI
attributes (``gen_ai.*``) and tidegate's own (``tidegate.*``)."""

from __future__ import annotations

from typing import Any

from tidegate.gateway.pipeline.exchange import Exchange
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.runtime import Runtime
from tidegate.gateway.tracing import OPERATIONS, Described, gen_ai_provider, max_tokens_of
from tidegate.policy.attempts import Call

__all__ = ["attempt_attributes", "request_attributes", "request_outcome", "skips"]


def request_attributes(path: str, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request span's attributes at its start."""
    model = body.get("model")
    return {
        "tidegate.request_id": request_id,
        "url.path": path,
        "gen_ai.operation.name": OPERATIONS.get(path),
        "gen_ai.request.model": model if isinstance(model, str) else None,
        "gen_ai.request.max_tokens": max_tokens_of(body),
    }


def request_outcome(rt: Runtime, ex: Exchange) -> dict[str, Any]:
    """The request span's attributes once it is answered: who served, what it used, how it
    ended (``error.type``: the outcome of a refused or failed request)."""
    first = ex.served_by.split(",", 1)[0]
    config = rt.provider_configs.get(first)
    usage = ex.usage
    return {
        "tidegate.route": ex.route,
        "tidegate.served_by": ex.served_by,
        "tidegate.tried": ex.tried_header(),
        "tidegate.outcome": ex.outcome,
        "tidegate.cost_usd": ex.cost,
        "http.response.status_code": ex.status,
        "gen_ai.provider.name": None if config is None else gen_ai_provider(config),
        "gen_ai.response.model": None if ex.served_model == "-" else ex.served_model,
        "gen_ai.usage.input_tokens": usage.get("prompt_tokens"),
        "gen_ai.usage.output_tokens": usage.get("completion_tokens"),
        "error.type": ex.outcome if ex.status >= 400 else None,
    }


def skips(ex: Exchange) -> list[Described]:
    """The providers the route's plan left out (a breaker open, a data class, ...), as events."""
    return [
        ("tidegate.skipped", {"tidegate.provider": s.name, "tidegate.skip.reason": s.reason.value})
        for s in ex.skipped
    ]


def attempt_attributes(request: Request, step: Call, operation: str) -> dict[str, Any]:
    """An attempt span's attributes at its start."""
    rt, name = request.rt, step.spec.name
    return {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": gen_ai_provider(rt.provider_configs[name]),
        "gen_ai.request.model": rt.model_ids[name],
        "gen_ai.request.max_tokens": max_tokens_of(request.body),
        "tidegate.provider": name,
        "tidegate.attempt": step.attempt,
    }
