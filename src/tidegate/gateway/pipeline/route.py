"""Step 9, route: the providers this request may reach, in route order, and why the others are
skipped (:func:`~tidegate.policy.routing.plan_route`): the data class, fallbacks the release gate
(and the eval gate) did not approve, open breakers. With none left the request is refused: 503
``circuit_open`` when breakers are the reason, else 403."""

from __future__ import annotations

from tidegate.errors import CircuitOpen, Forbidden
from tidegate.gateway.pipeline.request import Request
from tidegate.policy.routing import SkipReason

__all__ = ["plan"]

_NONE_OPEN: frozenset[str] = frozenset()


def plan(request: Request) -> bool:
    """The request's route plan (``request.plan``), or the refusal when it has no candidate."""
    rt, identity, route = request.rt, request.identity, request.route
    breakers = rt.breakers
    open_breakers = _NONE_OPEN
    for spec in route.specs:
        if not breakers[spec.name].would_admit():
            open_breakers = open_breakers | {spec.name}
    request.plan = found = route.plan(identity.data_class, rt.approved_fallbacks(), open_breakers)
    request.ex.skipped = found.skipped
    if found.candidates:
        return False
    opened = [s.name for s in found.skipped if s.reason is SkipReason.BREAKER_OPEN]
    if opened:
        wait = min(breakers[name].retry_after() for name in opened)
        raise CircuitOpen(
            "every provider that may serve this request is failing; its breaker is open",
            policy="breaker",
            retry_after=max(wait, 0.001),
        )
    raise Forbidden(f"no provider on this route may receive data class {identity.data_class!r}")
