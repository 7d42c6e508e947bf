"""The one seam between the gateway and a model provider.

A provider takes an OpenAI-shaped Chat Completions body (a plain ``dict`` whose ``model`` is
already the provider's own model id) and answers in the OpenAI wire format: a
``chat.completion`` dict, or a stream of ``chat.completion.chunk`` dicts. Every failure is a
:class:`~tidegate.errors.ProviderError` whose ``kind`` says how the call failed; cancellation
(``asyncio.CancelledError``) is never turned into an error and always propagates.

A stream yields three kinds of item, so that the caller decides what a damaged stream means:

- a ``dict``: one ``chat.completion.chunk``;
- :class:`MalformedChunk`: an event whose data could not be parsed. It is yielded, not raised,
  so that a caller can skip and count bad chunks instead of losing the whole answer;
- :class:`StreamEnd`: always the last item of a stream that ended without an error.
  ``done_seen`` says whether the provider sent its end marker (``data: [DONE]`` for OpenAI,
  ``message_stop`` for Anthropic); a stream that stopped cleanly without it may be truncated.

A provider that can relay a stream as received also has ``stream_raw`` (same arguments): it
yields a list of items a read of the body, the items of ``stream`` except that the chunks of a
read come together as one :class:`RawChunks`, each chunk decoded and beside its data as the
provider sent it, so that a relay may send on the bytes instead of encoding the chunk again.

A connection that breaks mid-stream raises ``ProviderError(kind="connection")``; a stream that
goes quiet for longer than ``chunk_timeout`` raises ``ProviderError(kind="timeout")``.
"""

from __future__ import annotations

import email.utils
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from datetime import UTC
from typing import Any, NamedTuple, Protocol, TypeAlias, runtime_checkable

__all__ = [
    "JSONObject",
    "MalformedChunk",
    "Provider",
    "RawChunks",
    "RelayItem",
    "StreamEnd",
    "StreamItem",
    "parse_retry_after",
]

#: A decoded JSON object, as the OpenAI wire format uses it.
JSONObject: TypeAlias = dict[str, Any]


@dataclass(frozen=True, slots=True)
class MalformedChunk:
    """A stream event whose data was not a JSON object; ``raw`` is the data as received."""

    raw: str


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The stream finished without an error; ``done_seen`` is False if the end marker never came."""

    done_seen: bool


#: One item of :meth:`Provider.stream`.
StreamItem: TypeAlias = JSONObject | MalformedChunk | StreamEnd


class RawChunks(NamedTuple):
    """The chunks of one read of a stream, in order: ``chunks[i]`` decoded from ``data[i]``,
    the event's data exactly as the provider sent it (UTF-8 JSON). A named tuple: one is built
    for nearly every read of a relayed stream."""

    chunks: list[JSONObject]
    data: list[bytes]


#: One item of the lists a provider's ``stream_raw`` yields.
RelayItem: TypeAlias = StreamItem | RawChunks


@runtime_checkable
class Provider(Protocol):
    """A model provider behind the OpenAI wire format.

    ``timeout`` is the limit for one attempt: for :meth:`complete` and :meth:`embed` the whole
    call, for :meth:`stream` the time until the first chunk arrives (connection, headers and
    first event). ``chunk_timeout`` limits the silence between two later chunks and
    ``total_timeout`` the whole stream; ``None`` means no limit.
    """

    name: str

    async def complete(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """One ``chat.completion`` for ``body``."""
        ...

    def stream(
        self,
        body: JSONObject,
        *,
        timeout: float,
        chunk_timeout: float | None = None,
        total_timeout: float | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """The chunks of a streamed completion, ending with a :class:`StreamEnd`.

        An async generator: a caller that stops early should close it (``contextlib.aclosing``)
        so that the connection is released at once rather than when it is collected.
        """
        ...

    async def embed(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """An OpenAI-shaped embeddings response (``{"object": "list", "data": [...]}``)."""
        ...

    async def aclose(self) -> None:
        """Release what the provider owns (not the shared HTTP session, which it borrows)."""
        ...


def parse_retry_after(value: str | None, now_wall: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delay-seconds or an HTTP-date.

    ``now_wall`` is the current Unix time, used only for the HTTP-date form. A date in the past
    gives ``0.0``; a missing, negative or unparsable value gives ``None``.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        # float() also accepts "nan" and "inf", which no server means.
        if math.isfinite(seconds) and seconds >= 0:
            return seconds
        return None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        # RFC 9110 dates are always GMT; parsedate_to_datetime leaves "-0000" naive.
        return max(0.0, when.replace(tzinfo=UTC).timestamp() - now_wall)
    return max(0.0, when.timestamp() - now_wall)
