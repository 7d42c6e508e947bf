"""What a request costs: the token estimate a budget reserves, the price of tokens, and the
usage and spend of an answer once it is known.

The estimates (:func:`estimate_prompt_tokens`, :func:`input_tokens`: four characters a token)
live in :mod:`tidegate.catalogue.tokens`, beside the real encodings that OpenAI's models are
counted with (``Runtime.prompt_counters``); a provider's reported usage always wins."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

from tidegate.catalogue.tokens import estimate_input_tokens as input_tokens
from tidegate.catalogue.tokens import estimate_prompt_tokens
from tidegate.gateway.pipeline.checks import MAX_INTEGER
from tidegate.gateway.pipeline.exchange import Exchange
from tidegate.gateway.runtime import Runtime

__all__ = [
    "account",
    "account_usage",
    "estimate_prompt_tokens",
    "input_tokens",
    "is_count",
    "price",
    "usage_of",
]


def price(rt: Runtime, model: str, prompt_tokens: int, completion_tokens: int) -> float:
    """What ``model`` charges for these tokens, from the configured prices (0 if none)."""
    entry = rt.prices_per_1k.get(model)
    if entry is None:
        return 0.0
    return (prompt_tokens * entry[0] + completion_tokens * entry[1]) / 1000.0


def usage_of(answer: Mapping[str, Any], body: Mapping[str, Any], text_chars: int) -> dict[str, int]:
    """The tokens of an answer: the provider's count, else an estimate from the text.

    A count is the provider's only when it is a whole number the stores can add up (0 to
    ``MAX_INTEGER``): a negative or absurd count from a broken or hostile upstream would credit
    the budget and break the counters, so it is estimated instead, as a missing one is."""
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens") or 0
    if is_count(prompt):
        if not is_count(completion):
            completion = max(0, text_chars // 4)
    else:
        prompt = estimate_prompt_tokens(body)
        completion = max(0, text_chars // 4)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def is_count(value: object) -> TypeGuard[int]:
    """Whether ``value`` is a token count as a provider may report it."""
    return type(value) is int and 0 <= value <= MAX_INTEGER


def account(rt: Runtime, ex: Exchange) -> None:
    """Count the answer's spend and tokens against the model that served it."""
    spend, prompt, completion = rt.metrics.model_children(ex.served_model)
    usage = ex.usage
    spend.inc(ex.cost)
    prompt.inc(usage.get("prompt_tokens", 0))
    completion.inc(usage.get("completion_tokens", 0))


def account_usage(rt: Runtime, model: str, cost: float, usage: Mapping[str, int]) -> None:
    """Count ``cost`` and ``usage``'s tokens against ``model``."""
    spend, prompt, completion = rt.metrics.model_children(model)
    spend.inc(cost)
    prompt.inc(usage.get("prompt_tokens", 0))
    completion.inc(usage.get("completion_tokens", 0))
