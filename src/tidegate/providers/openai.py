"""A provider for any OpenAI-compatible Chat Completions endpoint.

OpenAI itself, vLLM, Ollama, the llama.cpp server and TGI all speak this dialect, so the body is
passed through (only ``model`` may be renamed and ``stream`` is set). ``base_url`` includes the
API version, as the official SDK expects: ``https://api.openai.com/v1``,
``http://localhost:8000/v1`` (vLLM), ``http://localhost:11434/v1`` (Ollama).

Failures map to kinds as follows (the first matching row wins):

======================================================  ==================  =========
what the endpoint said                                  kind                retryable
======================================================  ==================  =========
code ``insufficient_quota`` (429)                       ``rate_limited``    no
429                                                     ``rate_limited``    yes
code ``context_length_exceeded``, or a 400 whose
message speaks of the context length/size/window        ``context_length``  no
code ``content_filter``/``content_policy_violation``    ``content_filter``  no
404, or code ``model_not_found``                        ``not_found``       no
401, 403                                                ``auth``            no
408, 504, or no answer within the timeout               ``timeout``         yes
503, 529                                                ``overloaded``      yes
any other 5xx                                           ``server``          yes
any other 4xx                                           ``bad_request``     no
refused, reset, DNS failure, a body cut off (shorter
than its ``Content-Length``)                            ``connection``      yes
a 2xx body that is not an answer (see below)            ``malformed``       yes
======================================================  ==================  =========

A non-streamed 2xx is an answer only when :func:`chat_completion_problem` (or, for embeddings,
:func:`embeddings_problem`) finds nothing wrong with it: ``choices`` a non-empty list of
objects, each ``message`` an object, ``usage`` an object, and no error report in the body
(``data`` a list of objects for embeddings). Anything else is ``malformed``, so the gateway
retries or fails over as after a 5xx instead of handing the caller a broken success. Inside a
stream, an ``{"error": ...}`` event is mapped by the table (as ``server`` when it names no
status or code).

``insufficient_quota`` means the account has run out of credit: waiting and retrying the same
account cannot help, so it is not retryable; its kind stays ``rate_limited`` so that a router may
still send the request to a provider billed to another account. ``Retry-After`` (or OpenAI's
``retry-after-ms``) is kept on every error that carries it.

Error messages carry the status, the endpoint's error code, its request id and its text, all
cleaned by :class:`~tidegate.providers.redact.Redactor`: OpenAI's 401 echoes the key it was sent.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from typing import Literal

import aiohttp
import orjson
from yarl import URL

from tidegate.clock import Clock, SystemClock
from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.providers.base import (
    JSONObject,
    MalformedChunk,
    RawChunks,
    RelayItem,
    StreamEnd,
    StreamItem,
)
from tidegate.providers.presets import Preset
from tidegate.providers.redact import NO_SECRETS, Redactor, secret_header_values
from tidegate.providers.sse import SSEDecoder, SSEEvent
from tidegate.providers.transport import (
    HeadersSeen,
    HTTPAnswer,
    answer_object,
    error_info,
    error_message,
    is_error_object,
    parse_json_object,
    post_json,
    retry_after_from,
    stream_events,
    stream_reads,
)

__all__ = [
    "OpenAIProvider",
    "OpenAIRelayDecoder",
    "chat_completion_problem",
    "embeddings_problem",
    "openai_answer",
    "openai_chunks",
    "openai_error_for",
]

K = ProviderErrorKind

_CONTEXT_MESSAGE = re.compile(r"context (length|size|window)", re.IGNORECASE)
_CONTEXT_CODES = frozenset({"context_length_exceeded", "exceed_context_size_error"})
_FILTER_CODES = frozenset({"content_filter", "content_policy_violation"})


def openai_error_for(
    answer: HTTPAnswer,
    *,
    provider: str,
    now_wall: float,
    redactor: Redactor = NO_SECRETS,
) -> ProviderError:
    """The :class:`ProviderError` for an unsuccessful answer from an OpenAI-compatible server.

    A 2xx reaches here as an error event inside a stream (mapped as ``server`` unless it names
    a status or a code), or as a body that is not the event stream asked for (``malformed``).
    The message is cleaned by ``redactor``.
    """
    info = error_info(answer.body)
    # An error event inside a 200 stream may carry the status it would have had.
    status = answer.status if answer.status >= 300 or info.status is None else info.status
    retry_after = retry_after_from(answer.headers, now_wall)
    codes = {info.code, info.type}
    message = error_message(answer, info, redactor)
    retryable: bool | None = None
    if "insufficient_quota" in codes:
        kind, retryable, retry_after = K.RATE_LIMITED, False, None
    elif status == 429:
        kind = K.RATE_LIMITED
    elif codes & _CONTEXT_CODES or (status == 400 and _CONTEXT_MESSAGE.search(info.message)):
        kind = K.CONTEXT_LENGTH
    elif codes & _FILTER_CODES:
        kind = K.CONTENT_FILTER
    elif status == 404 or "model_not_found" in codes:
        kind = K.NOT_FOUND
    elif status in (401, 403):
        kind = K.AUTH
    elif status in (408, 504):
        kind = K.TIMEOUT
    elif status in (503, 529):
        kind = K.OVERLOADED
    elif status >= 500:
        kind = K.SERVER
    elif status >= 400:
        kind = K.BAD_REQUEST
    elif _is_error_body(answer.body):
        # An error event in a stream: OpenAI and vLLM report a failure mid-stream this way.
        kind = K.SERVER
    else:
        kind = K.MALFORMED
        message = f"HTTP {status} with a body that is not the expected JSON"
    return ProviderError(
        kind,
        message,
        provider=provider,
        retryable=retryable,
        retry_after=retry_after,
        status=status,
    )


def _is_error_body(body: bytes) -> bool:
    data = parse_json_object(body)
    return data is not None and is_error_object(data)


def chat_completion_problem(data: JSONObject) -> str | None:
    """Why ``data`` is not a usable ``chat.completion``, or ``None`` when it is one.

    On every non-streamed answer, so only a few type checks: the gateway reads each choice's
    ``message`` and the ``usage``, and a wrong type there would be a crash, not an answer.
    """
    if is_error_object(data):
        return "an error object"
    choices = data.get("choices")
    if not isinstance(choices, list):
        return "no choices" if choices is None else "choices is not a list"
    if not choices:
        return "an empty choices list"
    for choice in choices:
        if not isinstance(choice, dict):
            return "a choice that is not an object"
        message = choice.get("message")
        if message is not None and not isinstance(message, dict):
            return "a message that is not an object"
    usage = data.get("usage")
    if usage is not None and not isinstance(usage, dict):
        return "usage is not an object"
    return None


def embeddings_problem(data: JSONObject) -> str | None:
    """Why ``data`` is not a usable embeddings response, or ``None`` when it is one."""
    if is_error_object(data):
        return "an error object"
    items = data.get("data")
    if not isinstance(items, list):
        return "no data" if items is None else "data is not a list"
    if not all(isinstance(item, dict) for item in items):
        return "a data item that is not an object"
    return None


def openai_answer(
    answer: HTTPAnswer,
    *,
    endpoint: Literal["chat", "embeddings"],
    provider: str,
    now_wall: float,
    redactor: Redactor = NO_SECRETS,
) -> JSONObject:
    """The decoded answer of a non-streamed call, or the :class:`ProviderError` it amounts to:
    the table's for a non-2xx, ``malformed`` for a 2xx that is not an answer."""

    def error_for(answer: HTTPAnswer) -> ProviderError:
        return openai_error_for(answer, provider=provider, now_wall=now_wall, redactor=redactor)

    check = chat_completion_problem if endpoint == "chat" else embeddings_problem
    return answer_object(answer, check, error_for=error_for, provider=provider, redactor=redactor)


async def openai_chunks(
    events: AsyncGenerator[SSEEvent, None],
    error_for: Callable[[HTTPAnswer], ProviderError],
) -> AsyncGenerator[StreamItem, None]:
    """The items of an OpenAI-compatible event stream (``events`` from
    :func:`~tidegate.providers.transport.stream_events`, closed here).

    Each chunk is yielded as a dict, an event whose data is not a JSON object as
    :class:`MalformedChunk`; an ``{"error": ...}`` event (vLLM and OpenAI send these mid-stream)
    is raised as ``error_for`` maps it. The last item is ``StreamEnd(done_seen=...)``.
    """
    async with aclosing(events):
        async for event in events:
            if event.data.strip() == "[DONE]":
                yield StreamEnd(done_seen=True)
                return
            chunk = parse_json_object(event.data)
            if chunk is None:
                yield MalformedChunk(event.data)
            elif "error" in chunk and not chunk.get("choices"):
                raise error_for(HTTPAnswer(200, {}, event.data.encode()))
            else:
                yield chunk
    yield StreamEnd(done_seen=False)


class OpenAIRelayDecoder:
    """:func:`openai_chunks` for a relay, a read at a time: :meth:`feed` turns the bytes of one
    read of the body into its items, the chunks of the read together as one :class:`RawChunks`
    (each beside its data as received); :meth:`end` gives the last ones.

    Each event's data is decoded once, from its bytes (:meth:`SSEDecoder.feed_data`); only one
    that is not a chunk (``[DONE]``, an error, data that is not a JSON object or not UTF-8)
    takes :func:`openai_chunks`'s way, with the same outcome: an ``{"error": ...}`` event is
    raised as ``error_for`` maps it, and nothing after ``[DONE]`` is read.
    """

    __slots__ = ("_done", "_error_for", "_sse")

    def __init__(self, error_for: Callable[[HTTPAnswer], ProviderError]) -> None:
        self._sse = SSEDecoder()
        self._error_for = error_for
        self._done = False

    def feed(self, data: bytes) -> list[RelayItem]:
        """The items completed by one read of the body."""
        if self._done:
            return []
        events = self._sse.feed_data(data)
        if len(events) == 1:  # a read of one chunk, as a paced stream's are: the same, quicker
            try:
                chunk = orjson.loads(events[0])
            except orjson.JSONDecodeError:
                chunk = None
            if type(chunk) is dict and "error" not in chunk:
                return [RawChunks([chunk], events)]
        return self._items(events)

    def end(self) -> list[RelayItem]:
        """The body has ended: what was still pending, and the :class:`StreamEnd`."""
        if self._done:
            return []
        items = self._items([event.data.encode() for event in self._sse.end()])
        if not self._done:
            items.append(StreamEnd(done_seen=False))
        return items

    def _items(self, events: list[bytes]) -> list[RelayItem]:
        items: list[RelayItem] = []
        chunks: list[JSONObject] = []
        raw: list[bytes] = []
        for data in events:
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                chunk = None
            if type(chunk) is dict and ("error" not in chunk or chunk.get("choices")):
                chunks.append(chunk)
                raw.append(data)
                continue
            if chunks:
                items.append(RawChunks(chunks, raw))
                chunks, raw = [], []
            text = data.decode("utf-8", errors="replace")
            if text.strip() == "[DONE]":
                self._done = True
                items.append(StreamEnd(done_seen=True))
                return items
            parsed = parse_json_object(text)
            if parsed is None:
                items.append(MalformedChunk(text))
            elif "error" in parsed and not parsed.get("choices"):
                raise self._error_for(HTTPAnswer(200, {}, text.encode()))
            else:  # a chunk only once its bytes are read as UTF-8 with replacements
                items.append(parsed)
        if chunks:
            items.append(RawChunks(chunks, raw))
        return items


class OpenAIProvider:
    """Chat completions, streams and embeddings from an OpenAI-compatible HTTP endpoint.

    ``session`` is the process's shared ``aiohttp.ClientSession``: the provider borrows it and
    never closes it. ``model_map`` renames models on the way out (for example a served name in
    vLLM); a model not in it is sent as it is. ``headers`` are added to every request (for
    example ``OpenAI-Organization``). ``clock`` is read only to interpret an HTTP-date
    ``Retry-After``. ``preset`` (:mod:`tidegate.providers.presets`) drops, renames or refuses
    the request fields its service does not take, before anything is sent.
    """

    #: Told every answer's headers (the headroom it reports), when the gateway watches them.
    headers_seen: HeadersSeen | None = None
    headroom_dialect = "openai"

    def __init__(
        self,
        name: str,
        base_url: str,
        api_key: str | None,
        session: aiohttp.ClientSession,
        *,
        model_map: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        clock: Clock | None = None,
        preset: Preset | None = None,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        # Parsed once: aiohttp would parse the string on every request.
        self._chat_url = URL(f"{self.base_url}/chat/completions")
        self._session = session
        self._model_map = dict(model_map or {})
        self._clock: Clock = clock or SystemClock()
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._redactor = Redactor([api_key, *secret_header_values(headers)])
        self.preset = preset
        if preset is not None:  # without one, the request path is unchanged
            self._payload = self._preset_payload  # type: ignore[method-assign]

    def __repr__(self) -> str:
        return f"OpenAIProvider(name={self.name!r}, base_url={self.base_url!r})"

    async def complete(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """POST ``/chat/completions`` with ``stream: false``."""
        answer = await post_json(
            self._session,
            self._chat_url,
            headers=self._headers,
            payload=self._payload(body, stream=False),
            timeout=timeout,
            provider=self.name,
            redactor=self._redactor,
            observe=self.headers_seen,
        )
        return self._answer(answer, "chat")

    async def stream(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
        chunk_timeout: float | None = None,
        total_timeout: float | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """POST ``/chat/completions`` with ``stream: true`` and yield the parsed chunks, as
        :func:`openai_chunks` reads them (the last item is ``StreamEnd(done_seen=...)``)."""
        events = stream_events(
            self._session,
            f"{self.base_url}/chat/completions",
            headers={**self._headers, "Accept": "text/event-stream"},
            payload=self._payload(body, stream=True),
            provider=self.name,
            timeout=timeout,
            chunk_timeout=chunk_timeout,
            total_timeout=total_timeout,
            error_for=self._error_for,
            redactor=self._redactor,
            observe=self.headers_seen,
        )
        async with aclosing(openai_chunks(events, self._error_for)) as items:
            async for item in items:
                yield item

    def stream_raw(
        self,
        body: JSONObject,
        *,
        timeout: float,
        chunk_timeout: float | None = None,
        total_timeout: float | None = None,
    ) -> AsyncGenerator[list[RelayItem], None]:
        """:meth:`stream` for a relay: the items of each read of the body together, its chunks
        as :class:`RawChunks` (:class:`OpenAIRelayDecoder`). The body is made (and a preset's
        refusal raised) by this call, not by the first read."""
        decoder = OpenAIRelayDecoder(self._error_for)
        return stream_reads(
            self._session,
            f"{self.base_url}/chat/completions",
            headers={**self._headers, "Accept": "text/event-stream"},
            payload=self._payload(body, stream=True),
            provider=self.name,
            timeout=timeout,
            chunk_timeout=chunk_timeout,
            total_timeout=total_timeout,
            error_for=self._error_for,
            decode=decoder.feed,
            end=decoder.end,
            redactor=self._redactor,
            observe=self.headers_seen,
        )

    async def embed(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """POST ``/embeddings``."""
        answer = await post_json(
            self._session,
            f"{self.base_url}/embeddings",
            headers=self._headers,
            payload=self._payload(body, stream=None),
            timeout=timeout,
            provider=self.name,
            redactor=self._redactor,
            observe=self.headers_seen,
        )
        return self._answer(answer, "embeddings")

    async def aclose(self) -> None:
        """Nothing to release: the session belongs to whoever created it."""

    def _payload(self, body: JSONObject, *, stream: bool | None) -> JSONObject:
        payload = dict(body)
        model = payload.get("model")
        if isinstance(model, str):
            payload["model"] = self._model_map.get(model, model)
        if stream is not None:
            payload["stream"] = stream
        if not stream:
            payload.pop("stream_options", None)  # servers reject it on a non-streamed call
        return payload

    def _preset_payload(self, body: JSONObject, *, stream: bool | None) -> JSONObject:
        payload = OpenAIProvider._payload(self, body, stream=stream)
        assert self.preset is not None
        self.preset.apply(payload, provider=self.name)
        return payload

    def _error_for(self, answer: HTTPAnswer) -> ProviderError:
        return openai_error_for(
            answer, provider=self.name, now_wall=self._clock.wall(), redactor=self._redactor
        )

    def _answer(self, answer: HTTPAnswer, endpoint: Literal["chat", "embeddings"]) -> JSONObject:
        return openai_answer(
            answer,
            endpoint=endpoint,
            provider=self.name,
            now_wall=self._clock.wall(),
            redactor=self._redactor,
        )
