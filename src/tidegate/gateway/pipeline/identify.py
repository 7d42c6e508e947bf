"""Step 1, identify: who is calling, what they may use, and what they ask.

The caller is identified by the app before its body is read (a caller without a valid key learns
that, 401, and its body is never read); this step then checks the body, the model and that the
key may use it, and works out the request's deadline.
"""

from __future__ import annotations

from collections.abc import Mapping

from tidegate.errors import ModelNotFound
from tidegate.gateway.auth import Identity
from tidegate.gateway.passthrough import passthrough_route
from tidegate.gateway.pipeline.checks import (
    check_choices,
    check_embeddings_options,
    deadline_for,
    embeddings_input,
    model_of,
    validate_chat,
)
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.runtime import Runtime

__all__ = ["identify", "identify_chat", "identify_embeddings"]


def identify(rt: Runtime, headers: Mapping[str, str]) -> Identity:
    """The caller behind the request's API key (``Unauthenticated`` without a valid one)."""
    if rt.config.auth.keys_file is None and len(rt.keys) == 0:
        # No keys configured (dev only: production refuses to start like this).
        classes = rt.config.admission.classes
        return Identity(
            "anonymous",
            "anonymous",
            "anonymous",
            classes[min(1, len(classes) - 1)],
            rt.config.default_data_class,
            frozenset({"*"}),
        )
    return rt.keys.identify(headers.get("authorization"))


def _known(request: Request, alias: str) -> None:
    """The model is routed and the caller may use it; the request takes its route and deadline."""
    rt, ex = request.rt, request.ex
    identity = ex.identity  # identified by the app, before the body was read
    assert identity is not None
    request.identity = identity
    route = rt.routes.get(alias)
    if route is None:
        # A wildcard alias's model no provider lists (its listed ones are routes already).
        route = passthrough_route(rt, alias)
        if route is None:  # the caller's text: never a metric label (ex.route stays -)
            raise ModelNotFound(f"no model named {alias!r}; GET /v1/models lists them")
    request.alias = ex.route = alias
    rt.keys.authorize(identity, alias)
    request.route = route
    request.deadline = ex.deadline = deadline_for(rt, request.headers)
    if rt.canaries:  # a canary's latency counts from here
        request.started = rt.clock.now()


def identify_chat(request: Request) -> bool:
    """A chat completion: a valid body, a known model, a key that may use it."""
    body = request.body
    choices = validate_chat(body)
    _known(request, body["model"])
    if choices > 1:
        check_choices(request.rt, request.route, request.alias, choices)
    request.choices = choices
    request.stream = body.get("stream") is True
    return False


def identify_embeddings(request: Request) -> bool:
    """An embeddings request: a model, an input in one of OpenAI's shapes, a key that may use it."""
    body = request.body
    model = model_of(body)
    body["input"] = embeddings_input(body.get("input"))
    check_embeddings_options(body)
    _known(request, model)
    return False
