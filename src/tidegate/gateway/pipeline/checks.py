"""The checks a request body passes before any step decides anything: its fields, its types,
its bounds, and the deadline header.

An integer field takes what JSON Schema calls an integer: a number without a fraction, ``2`` or
``2.0`` (the latter rewritten as ``2`` for the provider). ``true`` is not one, though it is an
``int`` to ``isinstance``; the common case is checked with ``type(...) is int``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidegate.errors import InvalidRequest
from tidegate.gateway.config import ONE_CHOICE_TYPES
from tidegate.gateway.runtime import Route, Runtime
from tidegate.policy.deadline import Deadline

__all__ = [
    "DEADLINE_HEADER",
    "ENCODINGS",
    "MAX_CHOICES",
    "MAX_INTEGER",
    "check_choices",
    "check_embeddings_options",
    "deadline_for",
    "embeddings_input",
    "listed",
    "model_of",
    "validate_chat",
]

DEADLINE_HEADER = "x-tidegate-deadline-ms"
#: Digits of a deadline header worth reading: 12 are over 30 years, and a float takes them all.
_DEADLINE_DIGITS = 12


#: The most completions one request may ask for (``n``), as OpenAI allows.
MAX_CHOICES = 128
#: The largest ``max_tokens`` (and token id) a body may hold: far above any model's limit, and
#: small enough that a day of them, times ``n``, fits the stores' 64-bit integers.
MAX_INTEGER = 2**31 - 1


def validate_chat(body: dict[str, Any]) -> int:
    """Refuse a body the gateway cannot route or budget; returns the completions asked for."""
    model = body.get("model")  # as model_of() checks it, without the call
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a 'role'")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidRequest("'stream' must be true or false")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (
        type(max_tokens) is not int or not 0 < max_tokens <= MAX_INTEGER
    ):
        body["max_tokens"] = _integer("max_tokens", max_tokens, 1, MAX_INTEGER)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object")
    return _choices(body)


def model_of(body: Mapping[str, Any]) -> str:
    """The route alias the body names."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string")
    return model


def _choices(body: dict[str, Any]) -> int:
    """The completions asked for (``n``), 1 when the body does not say."""
    if "n" not in body:  # nearly every request: one completion
        return 1
    n = body["n"]
    if n is None:
        return 1
    if type(n) is not int or not 0 < n <= MAX_CHOICES:
        n = body["n"] = _integer("n", n, 1, MAX_CHOICES)
    return n


def _whole(value: Any) -> Any:
    """``value`` as an ``int`` if it is a float without a fraction (``2.0``), else as it is."""
    return int(value) if type(value) is float and value.is_integer() else value


def _integer(name: str, value: Any, low: int, high: int) -> int:
    """The integer field ``name`` as an ``int`` from ``low`` to ``high``, or ``InvalidRequest``."""
    value = _whole(value)
    if type(value) is not int or not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be an integer from {low} to {high}")
    return value


def _tokens(values: list[Any]) -> list[int] | None:
    """``values`` as token ids (integers from 0 to MAX_INTEGER), or None if one is not."""
    tokens = [_whole(value) for value in values]
    if all(type(t) is int and 0 <= t <= MAX_INTEGER for t in tokens):
        return tokens
    return None


def listed(body: dict[str, Any], field: str) -> list[Any]:
    """``body[field]`` when it is a list, ``[]`` when absent or null, else ``InvalidRequest``."""
    value = body.get(field)
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"{field}: a list is required")
    return value


#: What ``encoding_format`` may ask for.
ENCODINGS = ("float", "base64")


def check_embeddings_options(body: dict[str, Any]) -> None:
    """``encoding_format`` is ``float`` or ``base64`` (the vectors are encoded by the gateway,
    whatever the provider sends); ``dimensions``, passed to the provider, is a positive
    integer."""
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ENCODINGS:
        raise InvalidRequest(f"'encoding_format' must be 'float' or 'base64', got {encoding!r}")
    if body.get("dimensions") is not None:
        body["dimensions"] = _integer("dimensions", body["dimensions"], 1, MAX_INTEGER)


def embeddings_input(value: Any) -> str | list[Any]:
    """An embeddings ``input`` in one of OpenAI's four shapes (a string, or a non-empty array
    of strings, of token ids, or of non-empty arrays of token ids), or ``InvalidRequest``.
    Token ids written as ``2.0`` come back as ``2``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return value
        tokens = _tokens(value)
        if tokens is not None:
            return tokens
        if all(isinstance(item, list) and item for item in value):
            nested = [_tokens(item) for item in value]
            if None not in nested:
                return nested
    raise InvalidRequest(
        "'input' must be a string, or a non-empty array of strings, of token ids"
        f" (integers from 0 to {MAX_INTEGER}), or of non-empty arrays of token ids"
    )


def check_choices(rt: Runtime, route: Route, alias: str, choices: int) -> None:
    """Refuse ``n`` above 1 on a route whose primary cannot answer with several choices.

    An Anthropic provider returns one choice, and refuses ``n`` above 1 as a bad request, which
    ends the route there (no fallback is tried): so the request is refused now, before it is
    counted against a budget or waits for a slot. A route with such a provider as a fallback
    only is served by the primary; failing over to that fallback ends in the same refusal.
    """
    primary = route.specs[0].name
    kind = rt.provider_configs[primary].type
    if kind in ONE_CHOICE_TYPES:
        raise InvalidRequest(
            f"'n' is {choices}, but model {alias!r} is served by a provider of type {kind!r}"
            f" ({primary!r}), which answers with one choice"
        )


def deadline_for(rt: Runtime, headers: Mapping[str, str]) -> Deadline:
    """The request's deadline from config, shortened (never lengthened) by the caller's header."""
    clock = rt.clock  # the configured timeout is validated positive at load
    deadline = Deadline(clock, clock.now() + rt.config.server.request_timeout_s)
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return deadline
    # Decimal digits only: int() would also take "1_000", "+5" and other scripts' digits.
    if not (raw.isascii() and raw.isdigit()):
        raise InvalidRequest(f"{DEADLINE_HEADER} must be whole milliseconds, got {raw!r}")
    digits = raw.lstrip("0")
    if not digits:
        raise InvalidRequest(f"{DEADLINE_HEADER} must be positive, got {raw!r}")
    if len(digits) > _DEADLINE_DIGITS:  # longer than any configured timeout: shortens nothing
        return deadline
    return deadline.shorten(int(digits) / 1000.0)
