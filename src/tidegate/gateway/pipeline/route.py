"""Step 9, route: the providers this request may reach, in route order, and why the others are
skipped (:func:`~tidegate.policy.routing.plan_route`): the data class, fallbacks the release gate
(and the eval gate) did not approve, open breakers, and, on a route where a context window is
known, the providers whose window the prompt plus ``max_tokens`` would overflow
(:func:`~tidegate.policy.routing.fit_context`); with ``headroom.prefer_others``, the candidates
whose provider reported low headroom go last (:mod:`tidegate.policy.headroom`), and so does a
recovered provider its slow start holds back (:mod:`tidegate.policy.slowstart`). With none left
the request is refused: 503 ``circuit_open`` when breakers are the reason, 400
``context_length_exceeded`` when windows are, else 403. Nothing has been sent by then, and the
settle step refunds the budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tidegate.errors import CircuitOpen, ContextLengthExceeded, Forbidden
from tidegate.gateway.pipeline.request import Request
from tidegate.policy.headroom import prefer_ample
from tidegate.policy.routing import ProviderSpec, RoutePlan, SkipReason, fit_context

__all__ = ["plan", "prompt_bound"]

_NONE_OPEN: frozenset[str] = frozenset()
#: The most tokens a character can be (a UTF-8 character is at most four bytes, a token at
#: least one), and OpenAI's framing: per message, and to prime the reply.
_TOKENS_PER_CHAR = 4
_FRAMING_PER_MESSAGE = 3
_FRAMING = 3


def plan(request: Request) -> bool:
    """The request's route plan (``request.plan``), or the refusal when it has no candidate."""
    rt, identity, route = request.rt, request.identity, request.route
    breakers = rt.breakers
    open_breakers = _NONE_OPEN
    for name in route.names:
        if not breakers[name].would_admit():
            open_breakers = open_breakers | {name}
    found = route.plan(identity.data_class, rt.approved_fallbacks(), open_breakers)
    if route.smallest_window is not None:
        found = _fitting(request, found, route.smallest_window)
    if len(found.candidates) > 1 and (rt.headroom.prefer_others or rt.slow_start is not None):
        found = _reordered(request, found)
    request.plan = found
    request.ex.skipped = found.skipped
    if found.candidates:
        return False
    return _refuse(request, found)


def _reordered(request: Request, found: RoutePlan) -> RoutePlan:
    """The plan with some candidates behind the others: those whose reported headroom is low
    (``headroom.prefer_others``; looked up under the upstream's own name), and those a
    provider's slow start holds back from this request (``breaker.slow_start_s``)."""
    rt = request.rt
    behind: list[str] = []
    if rt.headroom.prefer_others:
        providers, headroom = rt.providers, rt.headroom
        behind += [
            c.name for c in found.candidates if headroom.low(providers[c.name].name) is not None
        ]
    if rt.slow_start is not None:
        behind += rt.slow_start.held_back(c.name for c in found.candidates)
    return prefer_ample(found, behind) if behind else found


def _refuse(request: Request, found: RoutePlan) -> bool:
    breakers = request.rt.breakers
    opened = [s.name for s in found.skipped if s.reason is SkipReason.BREAKER_OPEN]
    if opened:
        wait = min(breakers[name].retry_after() for name in opened)
        raise CircuitOpen(
            "every provider that may serve this request is failing; its breaker is open",
            policy="breaker",
            retry_after=max(wait, 0.001),
        )
    if any(s.reason is SkipReason.CONTEXT_WINDOW for s in found.skipped):
        raise ContextLengthExceeded(
            "the prompt and max_tokens exceed the context window of every provider this"
            " request may use; shorten the prompt or lower max_tokens"
        )
    data_class = request.identity.data_class
    raise Forbidden(f"no provider on this route may receive data class {data_class!r}")


def prompt_bound(body: dict[str, Any]) -> int:
    """The most tokens the request's prompt can be under any counter: every character as four
    tokens, with the framing. Cheap, and far above the count for any real text, so a prompt
    under the smallest window by this bound is counted no further."""
    if "input" in body:  # embeddings: text, token ids, or lists of them
        value = body["input"]
        items = [value] if isinstance(value, str) else value
        return sum(len(item) * _TOKENS_PER_CHAR for item in items if isinstance(item, str)) + sum(
            1 if isinstance(item, int) else len(item) for item in items if not isinstance(item, str)
        )
    chars = 0
    messages = body.get("messages", ())
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(str(p.get("text", ""))) for p in content if isinstance(p, dict))
    return chars * _TOKENS_PER_CHAR + _FRAMING_PER_MESSAGE * len(messages) + _FRAMING


def _fitting(request: Request, found: RoutePlan, smallest: int) -> RoutePlan:
    """``found`` less the candidates the request would overflow; counted by each provider's
    own counter (once per counter) only when the cheap bound does not fit the smallest window."""
    body = request.body
    completion = body.get("max_tokens") or 0
    if prompt_bound(body) + completion <= smallest:
        return found
    rt = request.rt
    chat = "input" not in body
    counts: dict[int, int] = {}

    def needed(spec: ProviderSpec) -> int:
        counter: Callable[[Any], int]
        if chat:
            counter = rt.prompt_counters[spec.name]
            argument: Any = body
        else:
            counter = rt.input_counters[spec.name]
            argument = body["input"]
        tokens = counts.get(id(counter))
        if tokens is None:
            tokens = counts[id(counter)] = counter(argument)
        return tokens + completion

    return fit_context(found, needed)
