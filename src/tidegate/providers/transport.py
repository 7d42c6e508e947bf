"""HTTP plumbing shared by the HTTP providers: one POST, one event stream, one error vocabulary.

Everything here borrows the caller's ``aiohttp.ClientSession`` (one per process) and turns every
way a call can fail into a :class:`~tidegate.errors.ProviderError`. Time limits are enforced
with :mod:`tidegate.timers` (``asyncio.timeout`` with one timer per event loop) around each
wait, never with the session's own ``ClientTimeout`` (which is switched off per request, so
that one mechanism decides and a long stream is not cut at the session default of five
minutes). Cancellation from outside is never converted: it propagates.

Every message built here from text the upstream or the HTTP client wrote (an error body, an
exception's text, which may hold a URL) goes through the provider's
:class:`~tidegate.providers.redact.Redactor`, so that no credential reaches a caller or a log.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing, suppress
from dataclasses import dataclass
from re import Pattern
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

import aiohttp
import orjson
from yarl import URL

from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.providers.base import JSONObject, MalformedChunk, parse_retry_after
from tidegate.providers.redact import MAX_RAW, NO_SECRETS, Redactor, cut, request_id_of
from tidegate.providers.sse import SSEDecoder, SSEEvent, SSELineTooLong
from tidegate.timers import timeout_after, timeout_at

__all__ = [
    "NO_CLIENT_TIMEOUT",
    "ErrorInfo",
    "HTTPAnswer",
    "HeadersSeen",
    "ReportsHeadroom",
    "answer_object",
    "error_info",
    "error_message",
    "exception_to_error",
    "is_error_object",
    "json_events",
    "kind_for_status",
    "not_an_answer",
    "parse_json_object",
    "post_json",
    "retry_after_from",
    "stream_events",
    "stream_reads",
]

#: Per-request override of the session's ``ClientTimeout``: the providers time calls themselves.
NO_CLIENT_TIMEOUT = aiohttp.ClientTimeout(
    total=None, connect=None, sock_read=None, sock_connect=None
)

K = ProviderErrorKind
T = TypeVar("T")
#: Told the headers of every answer (a provider's ``headers_seen``: reported headroom).
HeadersSeen = Callable[[Mapping[str, str]], object]


@runtime_checkable
class ReportsHeadroom(Protocol):
    """A provider whose API reports its rate limits' headroom in answer headers: the gateway
    sets ``headers_seen`` to hear of every answer's."""

    headers_seen: HeadersSeen | None
    #: Whose rate-limit headers its API sends: ``openai`` (``x-ratelimit-*``) or ``anthropic``.
    headroom_dialect: str


class HTTPAnswer(NamedTuple):
    """A whole HTTP response: status, headers and body bytes.

    A named tuple: immutable like a frozen dataclass, and built several times faster (one is
    built for every upstream answer).
    """

    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """What an error body says, whatever dialect it was written in."""

    message: str
    type: str
    code: str
    #: An HTTP status written inside the body (vLLM's integer ``code``), if any.
    status: int | None = None
    #: A ``request_id`` written in the body (Anthropic's error bodies carry one), raw.
    request_id: str = ""


def exception_to_error(
    exc: BaseException,
    *,
    provider: str,
    timeout_message: str,
    redactor: Redactor = NO_SECRETS,
) -> ProviderError | None:
    """The :class:`ProviderError` for a client-side failure, or ``None`` if ``exc`` is not one.

    ``None`` means the exception is a bug or a cancellation and must propagate unchanged. A body
    shorter than its ``Content-Length`` (the connection closed mid-body) is aiohttp's
    ``ClientPayloadError``, and so a retryable ``connection`` error.
    """
    if isinstance(exc, ProviderError):
        return exc
    # aiohttp's own ServerTimeoutError subclasses TimeoutError, so one branch covers both.
    if isinstance(exc, TimeoutError):
        return ProviderError(K.TIMEOUT, timeout_message, provider=provider)
    # aiohttp's texts can hold the request URL, and a URL can hold a key (``?key=...``).
    if isinstance(exc, aiohttp.ClientPayloadError):
        message = redactor.message(str(exc), head="the response was cut off")
        return ProviderError(K.CONNECTION, message, provider=provider)
    if isinstance(exc, aiohttp.ClientResponseError):
        message = redactor.message(str(exc), head="invalid HTTP response")
        return ProviderError(K.MALFORMED, message, provider=provider)
    if isinstance(exc, aiohttp.ClientError | OSError):
        message = redactor.message(str(exc)) or type(exc).__name__
        return ProviderError(K.CONNECTION, message, provider=provider)
    if isinstance(exc, SSELineTooLong):
        return ProviderError(K.MALFORMED, redactor.message(str(exc)), provider=provider)
    return None


def retry_after_from(headers: Mapping[str, str], now_wall: float) -> float | None:
    """Seconds to wait, from ``retry-after-ms`` (OpenAI's finer hint) or ``Retry-After``."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        seconds = parse_retry_after(millis, now_wall)
        if seconds is not None:
            return seconds / 1000.0
    return parse_retry_after(headers.get("retry-after"), now_wall)


def parse_json_object(raw: bytes | str) -> JSONObject | None:
    """``raw`` decoded as a JSON object, or ``None`` if it is not valid JSON or not an object."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def is_error_object(data: JSONObject) -> bool:
    """Whether a decoded body is an error report (``{"error": ...}``, vLLM's ``"object":
    "error"``, Anthropic's ``"type": "error"``) rather than an answer."""
    return bool(data.get("error")) or "error" in (data.get("object"), data.get("type"))


def error_info(body: bytes | JSONObject) -> ErrorInfo:
    """Message, type and code from an error body in any of the common dialects.

    Understood: OpenAI ``{"error": {"message", "type", "code"}}``, Anthropic
    ``{"type": "error", "error": {"type", "message"}, "request_id"}``, vLLM ``{"object":
    "error", "message", "type", "code"}``, Ollama ``{"error": "text"}``, and plain text. The
    text is raw (at most :data:`~tidegate.providers.redact.MAX_RAW` characters): it is for
    classifying the error, and :func:`error_message` makes what may be shown of it.
    """
    data = body if isinstance(body, dict) else parse_json_object(body)
    if data is None:
        text = body.decode("utf-8", errors="replace").strip() if isinstance(body, bytes) else ""
        return ErrorInfo(_raw(text), "", "")
    request_id = request_id_of({}, data)
    inner: Any = data.get("error", data)
    if isinstance(inner, str):
        return ErrorInfo(_raw(inner), "", "", request_id=request_id)
    if not isinstance(inner, dict):
        return ErrorInfo(_raw(orjson.dumps(data).decode()), "", "", request_id=request_id)
    message = inner.get("message")
    kind = inner.get("type")
    code = inner.get("code")
    status = code if type(code) is int and 400 <= code <= 599 else None
    return ErrorInfo(
        _raw(message) if isinstance(message, str) else "",
        kind if isinstance(kind, str) else "",
        code if isinstance(code, str) else "",
        status,
        request_id,
    )


def _raw(text: str) -> str:
    return cut(text, MAX_RAW, whole_tokens=True)


def error_message(answer: HTTPAnswer, info: ErrorInfo, redactor: Redactor) -> str:
    """What a caller may see of an error answer: ``HTTP <status> <code>: <text> (request id
    <id>)``, cleaned by ``redactor``. The status is left out for an error event inside a 200
    stream, whose HTTP status says nothing about it."""
    code = redactor.code(info.code) or redactor.code(info.type)
    status = f"HTTP {answer.status}" if answer.status >= 300 else ""
    head = " ".join(part for part in (status, code) if part)
    request_id = request_id_of(answer.headers) or info.request_id
    return redactor.message(info.message, head=head, request_id=request_id) or "no message"


def not_an_answer(
    answer: HTTPAnswer,
    problem: str,
    *,
    provider: str,
    redactor: Redactor,
    data: JSONObject | None = None,
) -> ProviderError:
    """The ``malformed`` error for a 2xx whose body is not an answer; ``problem`` says why.

    When the body is an error report, its code and cleaned text are kept in the message.
    """
    text = ""
    request_id = request_id_of(answer.headers)
    if data is not None and is_error_object(data):
        info = error_info(data)
        code = redactor.code(info.code) or redactor.code(info.type)
        problem = f"{problem} ({code})" if code else problem
        text = info.message
        request_id = request_id or info.request_id
    message = redactor.message(
        text, head=f"HTTP {answer.status} but not an answer: {problem}", request_id=request_id
    )
    return ProviderError(K.MALFORMED, message, provider=provider, status=answer.status)


def answer_object(
    answer: HTTPAnswer,
    problem_of: Callable[[JSONObject], str | None],
    *,
    error_for: Callable[[HTTPAnswer], ProviderError],
    provider: str,
    redactor: Redactor,
) -> JSONObject:
    """The decoded body of a non-streamed answer, or the error it amounts to: ``error_for``'s
    for a non-2xx, ``malformed`` for a 2xx whose body is not a JSON object or of which
    ``problem_of`` says why it is not an answer."""
    if not 200 <= answer.status < 300:
        raise error_for(answer)
    data = parse_json_object(answer.body)
    problem = "the body is not a JSON object" if data is None else problem_of(data)
    if data is not None and problem is None:
        return data
    raise not_an_answer(answer, problem or "", provider=provider, redactor=redactor, data=data)


def kind_for_status(
    status: int,
    message: str,
    too_long: Pattern[str],
    *,
    overloaded: tuple[int, ...] = (503, 529),
) -> ProviderErrorKind:
    """The kind of an error answer by its status: ``context_length`` for a 400 whose
    ``message`` matches ``too_long``, ``malformed`` below 400 (a 2xx that is no error)."""
    if status == 429:
        return K.RATE_LIMITED
    if status in overloaded:
        return K.OVERLOADED
    if status in (408, 504):
        return K.TIMEOUT
    if status >= 500:
        return K.SERVER
    if status in (401, 403):
        return K.AUTH
    if status == 404:
        return K.NOT_FOUND
    if status == 400 and too_long.search(message):
        return K.CONTEXT_LENGTH
    return K.BAD_REQUEST if status >= 400 else K.MALFORMED


async def post_json(
    session: aiohttp.ClientSession,
    url: str | URL,
    *,
    headers: Mapping[str, str],
    payload: JSONObject,
    timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    provider: str,
    redactor: Redactor = NO_SECRETS,
    observe: HeadersSeen | None = None,
) -> HTTPAnswer:
    """POST ``payload`` as JSON and read the whole answer within ``timeout`` seconds;
    ``observe`` sees the answer's headers (errors' too: a 429 reports headroom as well)."""
    try:
        async with (
            timeout_after(timeout),
            session.post(
                url, data=orjson.dumps(payload), headers=headers, timeout=NO_CLIENT_TIMEOUT
            ) as response,
        ):
            body = await response.read()
            if observe is not None:
                observe(response.headers)
            return HTTPAnswer(response.status, response.headers, body)
    except Exception as exc:
        error = exception_to_error(
            exc,
            provider=provider,
            timeout_message=f"no answer within {timeout:g}s",
            redactor=redactor,
        )
        if error is None or error is exc:
            raise
        raise error from exc


async def stream_events(
    session: aiohttp.ClientSession,
    url: str,
    *,
    headers: Mapping[str, str],
    payload: JSONObject,
    provider: str,
    timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    chunk_timeout: float | None,
    total_timeout: float | None,
    error_for: Callable[[HTTPAnswer], ProviderError],
    redactor: Redactor = NO_SECRETS,
    observe: HeadersSeen | None = None,
) -> AsyncGenerator[SSEEvent, None]:
    """POST ``payload`` and yield the server-sent events of the answer.

    ``timeout`` runs until the first event, ``chunk_timeout`` between two events (measured
    while this generator waits, not while the caller works) and ``total_timeout`` over the
    whole stream. An answer that is not a 2xx event stream is read whole and handed to
    ``error_for``, whose error is raised. ``observe`` sees the answer's headers. Close the
    generator (``contextlib.aclosing``) when leaving early: that releases the connection at
    once.
    """
    decoder = SSEDecoder()
    reads = stream_reads(
        session,
        url,
        headers=headers,
        payload=payload,
        provider=provider,
        timeout=timeout,
        chunk_timeout=chunk_timeout,
        total_timeout=total_timeout,
        error_for=error_for,
        decode=decoder.feed,
        end=decoder.end,
        redactor=redactor,
        observe=observe,
    )
    async with aclosing(reads):
        async for events in reads:
            for event in events:
                yield event


async def stream_reads(
    session: aiohttp.ClientSession,
    url: str,
    *,
    headers: Mapping[str, str],
    payload: JSONObject,
    provider: str,
    timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    chunk_timeout: float | None,
    total_timeout: float | None,
    error_for: Callable[[HTTPAnswer], ProviderError],
    decode: Callable[[bytes], list[T]],
    end: Callable[[], list[T]],
    redactor: Redactor = NO_SECRETS,
    observe: HeadersSeen | None = None,
) -> AsyncGenerator[list[T], None]:
    """POST ``payload`` and yield what ``decode`` makes of each read of the answer's body
    (``end`` of its end), when that is not empty: :func:`stream_events` one event at a time, a
    relay the events of each read together.

    The limits are :func:`stream_events`'s, an event being a non-empty list: ``timeout`` until
    the first, ``chunk_timeout`` between two (from when the caller asks for the next), and
    ``total_timeout`` over the whole stream. The reads share one timer (:class:`_Watchdog`):
    a read costs a clock read, not a timeout of its own.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    total_deadline, total_reason = math.inf, ""
    if total_timeout is not None:
        total_deadline = started + total_timeout
        total_reason = f"the stream ran past {total_timeout:g}s"
    deadline, reason = total_deadline, total_reason
    if started + timeout <= total_deadline:
        deadline, reason = started + timeout, f"no first chunk within {timeout:g}s"
    stall_reason = f"no chunk for {chunk_timeout:g}s" if chunk_timeout is not None else ""
    watchdog = _Watchdog(loop)
    response: aiohttp.ClientResponse | None = None
    try:
        async with timeout_at(deadline):
            response = await session.post(
                url, data=orjson.dumps(payload), headers=headers, timeout=NO_CLIENT_TIMEOUT
            )
            if observe is not None:
                observe(response.headers)
            content_type = response.headers.get("content-type", "")
            if response.status >= 300 or not content_type.startswith("text/event-stream"):
                body = await response.read()
                raise error_for(HTTPAnswer(response.status, response.headers, body))
        content, read, now = response.content, watchdog.read, loop.time
        stall_s = math.inf if chunk_timeout is None else chunk_timeout
        while True:
            data = await read(content, deadline)
            if data:
                items = decode(data)
                if items:
                    yield items
                    # The stall limit from here, the reason named only if it is reached.
                    deadline = min(now() + stall_s, total_deadline)
                    reason = ""
                continue
            items = end()
            if items:
                yield items
            response.release()  # the body is complete: the connection may be reused
            return
    except Exception as exc:
        if not reason:
            reason = total_reason if deadline == total_deadline else stall_reason
        error = exception_to_error(
            exc, provider=provider, timeout_message=reason, redactor=redactor
        )
        if error is None or error is exc:
            raise
        raise error from exc
    finally:
        watchdog.close()
        if response is not None and not response.closed:
            # Anything but a complete body (a cut, a stall, an early exit) drops the connection,
            # so that the rest of this answer is never read as the start of the next one.
            with suppress(Exception):
                response.close()


class _Watchdog:
    """The limit on each read of one stream's body, behind one timer for the whole stream.

    A read only notes its deadline and its task; the timer is armed again only when it fires
    before the deadline of the read under way (or with none under way), or when a read's
    deadline is earlier than the one it is armed for. Past its deadline, a read's task is
    cancelled and the read raises :class:`TimeoutError` in its place, as in ``asyncio.timeout``:
    a cancellation from elsewhere propagates unchanged.
    """

    __slots__ = ("armed_at", "cancelling", "deadline", "expired", "loop", "task", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.deadline = math.inf
        self.task: asyncio.Task[Any] | None = None
        self.cancelling = 0
        self.expired = False
        self.timer: asyncio.TimerHandle | None = None
        self.armed_at = math.inf

    async def read(self, content: aiohttp.StreamReader, deadline: float) -> bytes:
        """``content``'s next bytes (``b""`` at the end), by loop time ``deadline`` (inf: any
        time)."""
        task = self.task = asyncio.current_task(self.loop)
        assert task is not None
        self.deadline = deadline
        self.cancelling = task.cancelling()
        if deadline < self.armed_at:
            self._arm(deadline)
        try:
            return await content.readany()
        except asyncio.CancelledError as cancel:
            if self.expired and task.uncancel() <= self.cancelling:
                raise TimeoutError from cancel
            raise
        finally:
            self.task = None

    def _arm(self, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_at(when, self._fire) if when < math.inf else None
        self.armed_at = when

    def _fire(self) -> None:
        self.timer, self.armed_at = None, math.inf
        task = self.task
        if task is None:
            return  # no read under way: the next one arms the timer
        if self.loop.time() >= self.deadline:
            self.expired = True
            task.cancel()
        else:
            self._arm(self.deadline)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


async def json_events(
    events: AsyncGenerator[SSEEvent, None],
) -> AsyncGenerator[tuple[str, JSONObject] | MalformedChunk, None]:
    """The events of a stream from :func:`stream_events` (closed here), each as its event name
    and its data decoded as a JSON object, or as :class:`MalformedChunk` when the data is not
    one."""
    async with aclosing(events):
        async for event in events:
            data = parse_json_object(event.data)
            yield MalformedChunk(event.data) if data is None else (event.event, data)
