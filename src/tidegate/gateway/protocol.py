"""The HTTP/1.1 connection: uvicorn's httptools protocol, with limits on what a client can make it hold.

uvicorn's httptools protocol takes a request head of any size with any number of fields, and waits
for a head or a body for ever. httptools keeps a header until its end has arrived, so a few
connections each sending one endless header grow the process by hundreds of MiB, and thousands
that trickle a byte at a time are held as long as they like. :class:`GuardedHttpToolsProtocol`
adds what the app never sees, all before authentication:

- at most ``server.max_header_count`` header fields and ``server.max_header_bytes`` bytes of
  request line and headers; over either, 431 and the connection is closed. Bytes are counted as
  they are read, so what the parser holds of an unfinished head is at most the limit plus one
  read, whatever the client sends; a finished head is measured exactly before the app starts;
- ``server.header_timeout_s`` from a connection's start (on a kept-alive connection, the next
  request's first byte) to the end of the headers, and ``server.body_timeout_s`` from there to
  the end of the body; past either, 408 and the connection is closed. A connection that never
  sent a byte is closed without an answer: it made no request to answer.

Idle keep-alive is uvicorn's own ``timeout_keep_alive`` (``server.keep_alive_s``). The protocol
also tells the app when uvicorn begins its graceful shutdown (``ConnectionLimits.on_drain``).

It also guards the process itself (:class:`Door`): a model request (``POST /v1/...``) whose head
completes while the process already holds ``server.max_open_requests`` requests, or while
admission would refuse any request (``Door.full``, see :mod:`tidegate.gateway.door`), is
answered at once with a pre-rendered 503 ``queue_full`` (529 ``overloaded_error`` on
``/v1/messages``), before its body is read, without a request task, an ASGI cycle or any of the
app's work; the connection stays open and the body is read past. The busier the process, the
more of its refusals take this way, which costs a fraction of one the app decides: refusing
gets cheaper, not slower, as the process saturates.

The request path pays nothing per header, a clock read at the start of a kept-alive request's
head and at the end of every head, and no task: the one timer of a connection is re-armed when
it fires early, not on every request (a second handle only for a body that takes more than the
read that ended its head). The app hands the limits over in the lifespan state
(:data:`STATE_KEY`), which uvicorn gives every protocol it makes, in every worker process.

This builds on uvicorn's private protocol API (parser callbacks, ``cycle``, ``pipeline``);
``tests/gateway/test_protocol.py`` pins what it relies on, so an upgrade that changes it fails
there instead of silently dropping a limit.
"""

from __future__ import annotations

import asyncio
import http
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NoReturn, Protocol

import httptools
import orjson
from uvicorn.config import Config as UvicornConfig
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from tidegate.errors import HeadersTooLarge, RequestTimeout, TidegateError, http_error
from tidegate.gateway.config import ServerConfig
from tidegate.ids import new_id

__all__ = [
    "ADMIN_STATE_KEY",
    "ADMISSION_FULL",
    "OPEN_REQUESTS",
    "STATE_KEY",
    "ConnectionLimits",
    "Door",
    "FullAdmission",
    "GuardedHttpToolsProtocol",
    "Shed",
]

#: The lifespan-state key under which the app leaves its :class:`ConnectionLimits`.
#: How long a connection between requests stays open once the server shuts down, for a request
#: already on its way (uvicorn's shutdown then waits 0.1 s before it waits for connections).
SHUTDOWN_GRACE_S = 0.05
STATE_KEY = "tidegate.connection_limits"
#: The lifespan-state key under which the app leaves ``(port, app)`` of the admin listener: a
#: connection accepted on that local port is served by that app (``gateway.admin_server``).
ADMIN_STATE_KEY = "tidegate.admin_listener"

#: What a header line adds to its name and value: ": " and CRLF.
_LINE_OVERHEAD = 4


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one connection may make the server hold, and whom to tell that the drain began."""

    max_header_count: int
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    #: Called (from the event loop) each time uvicorn asks a connection to close at shutdown.
    on_drain: Callable[[], None] | None = None
    #: The open-requests guard (None: off).
    door: Door | None = None

    @classmethod
    def from_config(
        cls,
        server: ServerConfig,
        on_drain: Callable[[], None] | None = None,
        door: Door | None = None,
    ) -> ConnectionLimits:
        return cls(
            server.max_header_count,
            server.max_header_bytes,
            server.header_timeout_s,
            server.body_timeout_s,
            on_drain,
            door,
        )


def _head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    # As uvicorn writes a status line: no phrase for a code http.HTTPStatus lacks (529).
    try:
        phrase = http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        phrase = b""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, phrase)]
    lines += [name + b": " + value + b"\r\n" for name, value in headers]
    return b"".join(lines)


@dataclass(frozen=True, slots=True)
class Shed:
    """One pre-rendered refusal: everything but the date and the request id."""

    head: bytes
    body: bytes

    @classmethod
    def of(cls, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> Shed:
        fixed = [
            *headers,
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
        ]
        return cls(_head(status, fixed), body)


#: Why the door refused (what ``Door.counted`` is told).
OPEN_REQUESTS: Final = "open_requests"
ADMISSION_FULL: Final = "admission_full"


class FullAdmission(Protocol):
    """The door's second reason (:class:`tidegate.gateway.door.AdmissionDoor`)."""

    def has_room(self) -> bool:
        """Whether a request could start at once (then nothing is refused for this reason)."""
        ...

    def refusal(self, path: bytes, pairs: list[tuple[bytes, bytes]]) -> tuple[Shed, str] | None:
        """The answer to send and the caller's class, or None when the app is to answer."""
        ...


@dataclass(frozen=True, slots=True)
class Door:
    """The process's guard: past ``limit`` requests held by the process, a model request is
    answered with ``openai`` (``messages`` on Anthropic's paths) at the connection; while
    ``full`` says admission would refuse the request, it is answered with that refusal.
    ``counted`` is told why and the caller's class (``-`` past the limit) each time: the app
    counts it in its metrics and its aggregated log line."""

    limit: int
    openai: Shed
    messages: Shed
    counted: Callable[[str, str], None] | None = None
    full: FullAdmission | None = None


class _NoEvent:
    def set(self) -> None:
        return None


class _ShedCycle:
    """Stands in for the cycle of a request answered at the door: complete, so uvicorn's
    parser callbacks read its body past and start the next request as usual."""

    response_started = True
    response_complete = True
    keep_alive = True
    disconnected = False
    message_event = _NoEvent()


_SHED_CYCLE: Any = _ShedCycle()
_MESSAGES_PATH = b"/v1/messages"
#: What ends the path of Anthropic's endpoints (``/v1/messages``, ``/v1/messages/count_tokens``).
_MESSAGES_END = (b"", b"?", b"/")


#: uvicorn's default headers (the date, once a second) rendered, and the list they came from.
_rendered_defaults: list[Any] = [None, b""]


def _defaults(state: ServerState) -> bytes:
    """``state.default_headers`` as header lines; uvicorn replaces the list once a second (the
    date), so they are rendered once per list."""
    headers = state.default_headers
    if _rendered_defaults[0] is not headers:
        lines = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        _rendered_defaults[:] = [headers, lines]
    rendered: bytes = _rendered_defaults[1]
    return rendered


def _printable(value: bytes) -> bool:
    """A caller's ``X-Request-ID`` the app would keep: 1-128 printable characters."""
    return 0 < len(value) <= 128 and value.decode("latin-1").isprintable()


#: Used when the app left no limits (it is not a Gateway, or the lifespan is off).
DEFAULT_LIMITS = ConnectionLimits.from_config(ServerConfig())


class _Refused(Exception):
    """Raised in a parser callback: the only way to stop httptools in the middle of a read."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header limits and head and body timeouts."""

    def __init__(
        self,
        config: UvicornConfig,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits: ConnectionLimits = app_state.get(STATE_KEY, DEFAULT_LIMITS)
        self.limits = limits
        self._admin: tuple[int, Any] | None = app_state.get(ADMIN_STATE_KEY)
        self._door = limits.door
        self._max_count = limits.max_header_count
        self._max_bytes = limits.max_header_bytes
        #: From the end of one request (or the connection's start) to the end of the next head.
        self._in_head = True
        #: Bytes read since the head began, whole reads: the head is no larger, and what
        #: httptools holds of an unfinished header is no larger either. 0: no byte of it yet.
        self._head_read = 0
        self._head_started = 0.0
        self._body_deadline = 0.0
        #: The body outlived the read that ended the head: the timer follows its deadline.
        self._body_timed = False
        self._refusal: TidegateError | None = None
        #: The server is shutting down: the request that arrives is the connection's last.
        self._draining = False
        self._grace: asyncio.TimerHandle | None = None
        #: One per connection: re-armed when it fires early, not moved on every request (a
        #: request only notes the time its head and its body began).
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Once per connection, never per request: the admin port's connections get its app.
        if self._admin is not None and self.server is not None and self.server[1] == self._admin[0]:
            self.app = self._admin[1]
        self._head_started = self.loop.time()
        self._timer = self.loop.call_at(
            self._head_started + self.limits.header_timeout_s, self._timed_out
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's own, with the limits around the parser (and 431 instead of its 400 when the
        # parser was stopped on purpose, below).
        if self._in_head:
            if self._head_read == 0 and self.cycle is not None:
                # A kept-alive connection's next request: its head's time starts now.
                self._head_started = self.loop.time()
                if self._timer is None:
                    self._timer = self.loop.call_at(
                        self._head_started + self.limits.header_timeout_s, self._timed_out
                    )
            self._head_read += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(431, self._refusal)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade:
            self._cancel_timer()  # another protocol, or none, has the connection from here
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._in_head:
            if self._head_read > self._max_bytes:  # unfinished, and already over
                self._refuse(431, self._too_large())
        elif not self._body_timed:
            self._body_timed = True
            timer = self._timer
            if timer is None or timer.when() > self._body_deadline:
                self._cancel_timer()
                self._timer = self.loop.call_at(self._body_deadline, self._timed_out)

    def shutdown(self) -> None:
        on_drain = self.limits.on_drain
        if on_drain is not None:
            on_drain()
        cycle: RequestResponseCycle | None = self.cycle
        if cycle is not None and not cycle.response_complete:
            super().shutdown()  # an answer being written: its connection closes after it
            return
        # Between requests (just accepted, or kept alive): uvicorn closes at once, and a request
        # already on its way is reset unread. Its head has begun, or it may arrive within
        # SHUTDOWN_GRACE_S: it is answered, with Connection: close; else the connection closes.
        self._draining = True
        if self._head_read == 0:
            self._grace = self.loop.call_later(SHUTDOWN_GRACE_S, self._close_if_idle)

    def _close_if_idle(self) -> None:
        if self._head_read == 0 and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()

    # ------------------------------------------------------------------ parser callbacks

    def on_headers_complete(self) -> None:
        # Before uvicorn starts the app: a head over a limit never reaches it. Headers are not
        # counted one by one: the limit on bytes read bounds what a head can hold meanwhile.
        if len(self.headers) > self._max_count:
            self._stop(HeadersTooLarge(f"more than {self._max_count} header fields"))
        if self._head_read > self._max_bytes and self._head_size() > self._max_bytes:
            self._stop(self._too_large())
        self._in_head = False
        self._body_timed = False
        self._body_deadline = self.loop.time() + self.limits.body_timeout_s
        door = self._door
        if door is not None and self._at_door(door):
            return
        super().on_headers_complete()
        if self._draining and self.cycle is not None:
            self.cycle.keep_alive = False  # the last request of a connection being drained

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._head_read = 0
        if self.cycle is _SHED_CYCLE and not self.transport.is_closing():
            self.on_response_complete()  # the body is read past: keep-alive as after an answer

    # ------------------------------------------------------------------ the door

    def _at_door(self, door: Door) -> bool:
        """Whether the request was answered at the door: one over the open-requests limit, or
        one admission would refuse (asked only once no request can start at once); not another
        method or path, an upgrade, or one behind an answer still being written."""
        over = len(self.tasks) >= door.limit
        full = door.full
        if not over and (full is None or full.has_room()):
            return False
        answer = self._door_answer(door, over) if self._sheddable() else None
        if answer is None:
            return False
        shed, klass, reason = answer
        parser = self.parser
        keep_alive = (  # a connection being drained closes after this answer, as after any
            not self._draining and parser.get_http_version() != "1.0" and parser.should_keep_alive()
        )
        self.cycle = _SHED_CYCLE
        self.transport.write(self._shed_answer(shed, keep_alive))
        if not keep_alive:
            self._cancel_timer()
            self.transport.close()
        if door.counted is not None:
            door.counted(reason, klass)
        return True

    def _sheddable(self) -> bool:
        cycle: RequestResponseCycle | None = self.cycle
        parser = self.parser
        return (
            self.url.startswith(b"/v1/")
            and parser.get_method() == b"POST"
            and (cycle is None or cycle.response_complete)
            and not self.pipeline
            and not parser.should_upgrade()
        )

    def _door_answer(self, door: Door, over: bool) -> tuple[Shed, str, str] | None:
        """What the door answers, the caller's class and why; None: the app is to answer (one
        admission would let in, or one that is not for the door to decide)."""
        url = self.url
        if over:
            messages = url.startswith(_MESSAGES_PATH) and url[12:13] in _MESSAGES_END
            return (door.messages if messages else door.openai), "-", OPEN_REQUESTS
        assert door.full is not None
        refused = door.full.refusal(url.partition(b"?")[0], self.headers)
        return None if refused is None else (*refused, ADMISSION_FULL)

    def _shed_answer(self, shed: Shed, keep_alive: bool) -> bytes:
        # The last X-Request-ID, as the app's header mapping keeps it.
        request_id = dict(self.headers).get(b"x-request-id", b"")
        if not _printable(request_id):
            request_id = new_id().encode("ascii")
        close = b"\r\n" if keep_alive else b"connection: close\r\n\r\n"
        defaults = _defaults(self.server_state)
        return b"".join(
            (shed.head, defaults, b"x-request-id: ", request_id, b"\r\n", close, shed.body)
        )

    # ------------------------------------------------------------------ limits

    def _head_size(self) -> int:
        """The request line and headers, exactly (asked only when a read went past the limit:
        the head may have been a small part of it, with the body)."""
        size = len(self.url)
        for name, value in self.headers:
            size += len(name) + len(value) + _LINE_OVERHEAD
        return size

    def _too_large(self) -> HeadersTooLarge:
        return HeadersTooLarge(f"the request line and headers are over {self._max_bytes} bytes")

    def _stop(self, error: TidegateError) -> NoReturn:
        self._refusal = error
        raise _Refused

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        # None until the connection's first head is complete (uvicorn's annotation omits it).
        cycle: RequestResponseCycle | None = self.cycle
        if self._in_head:
            if self._head_read == 0:
                if cycle is None:  # a new connection that never sent a byte: nothing to answer
                    self.transport.close()
                # Else between requests: uvicorn's keep-alive timer, or the app's own work.
                return
            due = self._head_started + self.limits.header_timeout_s
            if now < due:
                self._timer = self.loop.call_at(due, self._timed_out)
            elif cycle is not None and not cycle.response_complete:
                # The answer to the previous request is still being sent: no answer fits.
                self.transport.close()
            else:
                self._refuse(408, RequestTimeout(self._late("headers", "header_timeout_s")))
            return
        if self.pipeline:
            # Queued behind the answer in progress, with reading paused by uvicorn: its body
            # cannot arrive yet. Looked at again a body's time later.
            self._timer = self.loop.call_at(now + self.limits.body_timeout_s, self._timed_out)
            return
        if now < self._body_deadline:
            self._timer = self.loop.call_at(self._body_deadline, self._timed_out)
            return
        assert cycle is not None  # the body phase follows a complete head
        if cycle.response_started:  # answered without the body: the rest is not wanted
            self.transport.close()
            return
        # The app is waiting for the body: it sees a disconnect, and its own answer goes nowhere.
        cycle.disconnected = True
        cycle.message_event.set()
        self._refuse(408, RequestTimeout(self._late("body", "body_timeout_s")))

    def _late(self, part: str, key: str) -> str:
        seconds = getattr(self.limits, key)
        return f"the request {part} did not arrive within {seconds:g}s"

    def _refuse(self, status: int, error: TidegateError) -> None:
        """Answer ``error`` in the project's JSON shape, and close: the rest is not read."""
        self._cancel_timer()
        _, body, extra = http_error(error)
        payload = orjson.dumps(body)
        phrase = http.HTTPStatus(status).phrase.encode("ascii")
        content = [b"HTTP/1.1 %d %s\r\n" % (status, phrase)]
        for name, value in self.server_state.default_headers:
            content += [name, b": ", value, b"\r\n"]
        for key, text in extra.items():
            content += [key.lower().encode("latin-1"), b": ", text.encode("latin-1"), b"\r\n"]
        content += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(payload),
            b"connection: close\r\n\r\n",
            payload,
        ]
        self.transport.write(b"".join(content))
        self.transport.close()
