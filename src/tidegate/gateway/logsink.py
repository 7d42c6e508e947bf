"""Where structlog's rendered lines go (one write for all the lines of an event-loop round), and
the timestamp they carry.

Writing each request's log line on its own cost a ``write`` system call per request, more than
rendering the line. :class:`RoundBufferedSink` is a structlog logger for rendered ``bytes``:
inside a running event loop it keeps the round's lines and writes them together at the end of
the round (``loop.call_soon``), or at once when they pass :data:`FLUSH_BYTES`; outside a loop it
writes each line at once. A line is therefore written within the round that logged it, before
any new network input is read, and :meth:`RoundBufferedSink.flush` (called at shutdown and at
exit) writes whatever is left.

:class:`RequestLines` renders the one line every request logs straight into the sink: the same
bytes the configured structlog chain writes for ``log.info("request", **fields)``, without the
bound logger's per-call work in between.

:func:`configure_logging` sets structlog up once per process (``tidegate serve`` and each of
uvicorn's workers, and the app's start-up) and hands back what writes the request's line; the
app and the server both call it, and neither imports the other for it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import time
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any, BinaryIO

import orjson
import structlog
from structlog.tracebacks import ExceptionDictTransformer

from tidegate.clock import Clock, SystemClock
from tidegate.gateway.config import Config

__all__ = [
    "FLUSH_BYTES",
    "RequestLines",
    "RoundBufferedSink",
    "UTCTimestamp",
    "configure_logging",
    "flush_all",
    "flush_logs",
    "log_request",
]

log = structlog.get_logger("tidegate")

#: Buffered bytes that trigger a write before the round ends.
FLUSH_BYTES = 64 * 1024
#: Every sink not yet collected (see :func:`flush_all`).
_LIVE: weakref.WeakSet[RoundBufferedSink] = weakref.WeakSet()


def flush_all() -> None:
    """Write the lines every live sink still holds: a reconfiguration makes a new sink, and a
    request-line writer made earlier may still hold the one before."""
    for sink in list(_LIVE):
        sink.flush()


class RoundBufferedSink:
    """A structlog logger writing rendered lines (bytes) to ``stream``, batched per loop round.

    Every log-level method takes the rendered line; the level was decided before rendering.
    """

    def __init__(self, stream: BinaryIO) -> None:
        _LIVE.add(self)
        self._stream = stream
        self._lines: list[bytes] = []
        self._size = 0
        #: The loop whose next round writes the buffered lines, if one was asked to.
        self._scheduled: asyncio.AbstractEventLoop | None = None

    def msg(self, message: bytes) -> None:
        self._lines.append(message)
        self._size += len(message)
        if self._size >= FLUSH_BYTES:
            self.flush()
            return
        loop = self._scheduled
        if loop is not None and loop.is_running():
            return  # this round's write is already scheduled (the loop is asked only once)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: start-up, shutdown, the CLI
            self.flush()
            return
        self._scheduled = loop
        loop.call_soon(self.flush)

    log = debug = info = warn = warning = msg
    error = err = critical = exception = fatal = failure = msg

    def flush(self) -> None:
        """Write every buffered line now."""
        self._scheduled = None
        if not self._lines:
            return
        lines, self._lines, self._size = self._lines, [], 0
        lines.append(b"")
        try:
            self._stream.write(b"\n".join(lines))
            self._stream.flush()
        except (OSError, ValueError):  # a closed or broken stdout: logs cannot go anywhere
            pass

    def __call__(self, *args: Any) -> RoundBufferedSink:
        """As a structlog logger factory: every logger writes through this one sink."""
        return self


class UTCTimestamp:
    """A structlog processor that adds ``timestamp``: exactly what ``TimeStamper(fmt="iso",
    utc=True)`` writes (``2026-11-30T02:07:09.945081Z``; no fraction at a whole second), with
    the date and the time of day formatted once per second instead of on every line, which cost
    more than rendering the rest of the request's line.
    """

    __slots__ = ("_fraction", "_second", "_time", "_whole")

    def __init__(self, clock: Clock | None = None) -> None:
        self._time = (clock or SystemClock()).wall
        self._second = -1
        #: This second's stamp: with a fraction (a %-template of the microseconds), and whole.
        self._fraction = ""
        self._whole = ""

    def __call__(
        self, logger: Any, method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        now = self._time()
        second = int(now // 1)
        # As datetime.fromtimestamp() does: the fraction rounded half-even to microseconds.
        micros = round((now - second) * 1_000_000)
        if micros >= 1_000_000:
            second += 1
            micros -= 1_000_000
        if second != self._second:
            self._second = second
            prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._fraction = prefix + ".%06dZ"
            self._whole = prefix + "Z"
        event_dict["timestamp"] = self._fraction % micros if micros else self._whole
        return event_dict


class RequestLines:
    """Writes the request log line as ``log.info("request", **fields)`` would, more cheaply.

    With JSON lines at level ``info`` or below, structlog runs ``add_log_level``, the
    :class:`UTCTimestamp` and an orjson renderer, and hands the bytes to the sink. This does the
    same three steps in the same order (the keys come out in the same order too) without the
    bound logger's dispatch, which cost about as much as the rendering itself on a line written
    for every request. ``fields`` is consumed: the line's keys are added to it.
    """

    __slots__ = ("_sink", "_stamp")

    def __init__(self, sink: RoundBufferedSink, stamp: UTCTimestamp) -> None:
        self._sink = sink
        self._stamp = stamp

    def __call__(self, fields: dict[str, Any]) -> None:
        fields["event"] = "request"
        fields["level"] = "info"
        self._sink.msg(orjson.dumps(self._stamp(None, "info", fields)))


# --------------------------------------------------------------------------- configuration


def log_request(fields: dict[str, Any]) -> None:
    """The request's log line through structlog (see :func:`configure_logging` for the direct
    writer used when the line is JSON)."""
    log.info("request", **fields)


#: Where the JSON log lines go, once logging is configured.
_sink: RoundBufferedSink | None = None


def flush_logs() -> None:
    """Write the log lines still buffered (at shutdown and at exit), in every sink."""
    flush_all()


atexit.register(flush_logs)


def configure_logging(config: Config) -> Callable[[dict[str, Any]], None]:
    """One JSON object per line on stdout (or readable key=value lines when json_lines is off).

    Returns what writes the request log line: ``log.info("request", **fields)``, or the
    :class:`RequestLines` that writes the same bytes directly when the line is JSON and ``info``
    is logged.
    """
    level = getattr(logging, config.logging.level.upper())
    stamp = UTCTimestamp()  # as TimeStamper(fmt="iso", utc=True) writes it, at less cost
    processors: list[structlog.typing.Processor] = [structlog.processors.add_log_level, stamp]
    factory: structlog.typing.WrappedLogger
    direct: Callable[[dict[str, Any]], None] | None = None
    if config.logging.json_lines:
        # log.exception()'s traceback, as a list of frames in the line: without this the JSON
        # line says only exc_info=true. Frames without their locals: those hold API keys
        # (the request's headers) and prompts. The console renderer formats tracebacks itself.
        processors.append(
            structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))
        )
        # orjson renders bytes straight to the stream: the log line is on every request's path.
        processors.append(structlog.processors.JSONRenderer(serializer=orjson.dumps))
        # The lines of one event-loop round leave in one write (flushed at exit too).
        global _sink
        flush_logs()
        factory = _sink = RoundBufferedSink(sys.stdout.buffer)
        if level <= logging.INFO:
            direct = RequestLines(_sink, stamp)
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
        factory = structlog.PrintLoggerFactory(sys.stdout)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    return direct or log_request
