"""How an endpoint speaks to its callers: the shape of its answers and of its errors.

The steps work on OpenAI's chat shapes (the lingua franca inside tidegate). An endpoint of
another API (Anthropic's ``/v1/messages``) has a :class:`Dialect` that translates the answer and
the error on the way out, so that every endpoint goes through the same steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from tidegate.errors import http_error
from tidegate.gateway.http import Send, send_json

__all__ = [
    "OPENAI",
    "Dialect",
    "ErrorBody",
    "StreamShape",
    "render_error",
    "send_dialect_error",
]

#: An error's status and body.
ErrorBody = tuple[int, dict[str, Any]]


class StreamShape(Protocol):
    """Writes one stream's OpenAI chunks as another API's events."""

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The events of one chunk (none for a usage-only chunk)."""
        ...

    def end(self, usage: dict[str, Any] | None) -> bytes:
        """The events that end a complete answer."""
        ...

    def error(self, payload: dict[str, Any]) -> bytes:
        """An in-band error (OpenAI-shaped) as this API's error event."""
        ...


def _same(status: int, body: dict[str, Any]) -> ErrorBody:
    return status, body


@dataclass(frozen=True, slots=True)
class Dialect:
    """An API's shapes: ``answer`` turns a ``chat.completion`` into this API's answer (None:
    it is the answer), ``error`` an OpenAI-shaped error into this API's status and body."""

    name: str
    answer: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    error: Callable[[int, dict[str, Any]], ErrorBody] = _same
    #: A header that may carry the API key instead of ``Authorization: Bearer`` (Anthropic's
    #: ``x-api-key``).
    key_header: str | None = None
    #: Makes the translator of one stream (None: OpenAI's chunks are the events).
    stream: Callable[[], StreamShape] | None = None

    def payload(self, completion: bytes) -> bytes:
        """The answer to send for a ``chat.completion`` written as ``completion``."""
        if self.answer is None:
            return completion
        return orjson.dumps(self.answer(orjson.loads(completion)))

    def authorization(self, headers: Mapping[str, str]) -> str | None:
        """The ``Authorization`` value the caller sent, in this dialect's header if not there."""
        given = headers.get("authorization")
        if not given and self.key_header is not None:
            key = headers.get(self.key_header)
            return f"Bearer {key}" if key else given
        return given


#: OpenAI's own API: answers and errors as the steps write them.
OPENAI = Dialect("openai")


def render_error(
    dialect: Dialect, error: BaseException
) -> tuple[int, dict[str, Any], dict[str, str], str]:
    """``(status, body, headers, code)`` of ``error`` in ``dialect``; ``code`` is tidegate's
    (the log line's outcome), whatever the body says."""
    status, body, extra = http_error(error)
    code = str(body["error"]["code"])
    status, shaped = dialect.error(status, body)
    return status, shaped, extra, code


async def send_dialect_error(
    send: Send, dialect: Dialect, error: BaseException, headers: Iterable[tuple[str, str]] = ()
) -> tuple[int, str]:
    """Answer ``error`` in ``dialect``; its status and tidegate's code."""
    status, body, extra, code = render_error(dialect, error)
    await send_json(send, status, body, [*headers, *extra.items()])
    return status, code
