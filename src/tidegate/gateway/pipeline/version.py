"""Step 5, version: on a route with a canary, the caller's version (``baseline`` or
``candidate``) by the sticky hash of its cohort, and the request as that version sends it (its
prompt and parameters, and its own providers if it has them).

It comes before idempotency and the cache: the fingerprint and the cache key are of the request
as the version sends it. It comes after the budget, which may move the request to a cheaper
route (with a canary of its own).
"""

from __future__ import annotations

from tidegate.gateway.canary import apply_version
from tidegate.gateway.pipeline.request import Request

__all__ = ["select_version"]


def select_version(request: Request) -> bool:
    """Choose the canary version of the request's route, if it has a canary."""
    rt, ex = request.rt, request.ex
    canary = rt.canaries.get(request.alias)
    if canary is None:
        return False
    request.canary = canary
    # The end user (OpenAI's ``user`` field) when the caller names one, else the key's.
    named = request.body.get("user")
    end_user = named if isinstance(named, str) and named else request.identity.user
    ex.version, version = canary.version_for(rt.flags, request.identity.tenant, end_user)
    request.body = apply_version(request.body, version)
    request.stream = request.body.get("stream") is True
    request.route = rt.version_routes.get((request.alias, ex.version), request.route)
    return False
