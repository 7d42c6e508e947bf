"""The request path: each endpoint is an ordered tuple of named steps over one request context.

The order is data, stated once: :data:`CHAT` and :data:`EMBEDDINGS` below (docs/ARCHITECTURE.md
and DESIGN's list point here, and a test checks them against each other). For
``POST /v1/chat/completions``:

identify → flags → rate_limit → budget → version → idempotency → cache → admission → route →
call → degrade → settle

Each step is a small module, and asks a policy object from :mod:`tidegate.policy` what to do;
the steps only sequence them, turn their verdicts into HTTP, and make sure the bookkeeping
happens whatever goes wrong. ``POST /v1/embeddings`` runs the same steps less those it does not
need: ``version`` (canaries are for chat routes), ``idempotency`` (an embedding has no side
effect: a retry recomputes the same vectors), ``cache`` (vectors are not kept) and ``degrade``
(there is no degraded embedding to stand in).

A runtime serves each endpoint with the steps its configuration needs (:func:`endpoints`): the
rate limit only with a rate limit configured, the budget step (which also waits for the rate
limit's decisions to be durable) only with either, ``version`` only with a canary, ``cache``
only with the cache on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from tidegate.gateway.http import Send
from tidegate.gateway.pipeline.admission import admit
from tidegate.gateway.pipeline.budget import reserve_chat, reserve_embeddings
from tidegate.gateway.pipeline.cache import look_up
from tidegate.gateway.pipeline.call import call_model
from tidegate.gateway.pipeline.checks import MAX_CHOICES, MAX_INTEGER
from tidegate.gateway.pipeline.degrade import degrade
from tidegate.gateway.pipeline.dialect import OPENAI, Dialect
from tidegate.gateway.pipeline.embed import embed
from tidegate.gateway.pipeline.exchange import Exchange, new_request_id
from tidegate.gateway.pipeline.flags import kill_switch
from tidegate.gateway.pipeline.idempotency import claim
from tidegate.gateway.pipeline.identify import identify, identify_chat, identify_embeddings
from tidegate.gateway.pipeline.limits import rate_limit
from tidegate.gateway.pipeline.messages import (
    ANTHROPIC,
    count_tokens,
    identify_count,
    identify_messages,
)
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.responses import RESPONSES, identify_response
from tidegate.gateway.pipeline.route import plan
from tidegate.gateway.pipeline.steps import Pipeline, Step, run
from tidegate.gateway.pipeline.version import select_version
from tidegate.gateway.runtime import Runtime

__all__ = [
    "CHAT",
    "COUNT_TOKENS",
    "EMBEDDINGS",
    "ENDPOINTS",
    "MAX_CHOICES",
    "MAX_INTEGER",
    "MESSAGES",
    "RESPONSES_STEPS",
    "Endpoint",
    "Exchange",
    "Handler",
    "Pipeline",
    "Request",
    "Step",
    "endpoints",
    "identify",
    "new_request_id",
]


def _rate_limited(rt: Runtime) -> bool:
    return rt.user_bucket is not None or rt.tenant_bucket is not None


def _budgeted(rt: Runtime) -> bool:
    # The budget step also awaits the commit of the rate limit's batch.
    return rt.budget is not None or _rate_limited(rt)


def _has_canary(rt: Runtime) -> bool:
    return bool(rt.canaries)


def _caching(rt: Runtime) -> bool:
    return rt.config.cache.enabled


#: ``POST /v1/chat/completions``, in the order a request meets the steps.
CHAT: Final = Pipeline(
    (
        Step("identify", identify_chat),
        Step("flags", kill_switch),
        Step("rate_limit", rate_limit, _rate_limited),
        Step("budget", reserve_chat, _budgeted),
        Step("version", select_version, _has_canary),
        Step("idempotency", claim),
        Step("cache", look_up, _caching),
        Step("admission", admit),
        Step("route", plan),
        Step("call", call_model),
        Step("degrade", degrade),
    )
)

#: ``POST /v1/embeddings``: the chat steps less version, idempotency, cache and degrade.
EMBEDDINGS: Final = Pipeline(
    (
        Step("identify", identify_embeddings),
        Step("flags", kill_switch),
        Step("rate_limit", rate_limit, _rate_limited),
        Step("budget", reserve_embeddings, _budgeted),
        Step("admission", admit),
        Step("route", plan),
        Step("call", embed),
    )
)


#: ``POST /v1/messages``: Anthropic's Messages API, translated, on the chat steps.
MESSAGES: Final = Pipeline((Step("identify", identify_messages), *CHAT.steps[1:]))
#: ``POST /v1/responses``: OpenAI's Responses API, translated, on the chat steps.
RESPONSES_STEPS: Final = Pipeline((Step("identify", identify_response), *CHAT.steps[1:]))
#: ``POST /v1/messages/count_tokens``: no model call, nothing spent.
COUNT_TOKENS: Final = Pipeline((Step("identify", identify_count), Step("count", count_tokens)))


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One endpoint's handler: its pipeline, as a runtime needs it, over a new request, and the
    API its callers speak."""

    pipeline: Pipeline
    dialect: Dialect = OPENAI

    def __call__(
        self,
        rt: Runtime,
        ex: Exchange,
        headers: Mapping[str, str],
        body: dict[str, Any],
        send: Send,
    ) -> Awaitable[None]:
        request = Request(rt, ex, headers, body, send)
        if self.dialect is not OPENAI:
            request.dialect = self.dialect
        return run(self.pipeline, request)


#: An endpoint's handler, as the gateway calls it.
Handler = Endpoint

#: The model endpoints by path, with every step.
ENDPOINTS: Final = {
    "/v1/chat/completions": Endpoint(CHAT),
    "/v1/embeddings": Endpoint(EMBEDDINGS),
    "/v1/messages": Endpoint(MESSAGES, ANTHROPIC),
    "/v1/messages/count_tokens": Endpoint(COUNT_TOKENS, ANTHROPIC),
    "/v1/responses": Endpoint(RESPONSES_STEPS, RESPONSES),
}


def endpoints(rt: Runtime) -> dict[str, Endpoint]:
    """The model endpoints by path, each with the steps ``rt`` needs."""
    return {
        path: Endpoint(endpoint.pipeline.for_runtime(rt), endpoint.dialect)
        for path, endpoint in ENDPOINTS.items()
    }
