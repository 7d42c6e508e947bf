"""The one log line per request, rendered without structlog's processor chain.

:func:`tidegate.gateway.server.configure_logging` sets structlog up for every other line. With
JSON lines (the default) it also points this logger at the same stream, and the request line is
then built here directly: the same keys in the same order as structlog would write them (the
fields, then ``event``, ``level`` and ``timestamp``), rendered by orjson. That skips the bound
logger, the context copy and three processor calls on every request. With any other set-up
(console lines, a level above ``info``, or before ``configure_logging`` ran) it hands the call
to structlog, or drops it as structlog's level filter would.

Deferred flush: on an event loop, the line goes into the stream's buffer and the stream is
flushed once at the end of the loop's current round of callbacks, so the lines of the requests
finished in one round reach the file in one write instead of one write each. A line is never
held longer than that round (outside a loop it is flushed at once, as structlog does).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from typing import Any, BinaryIO

import orjson
import structlog

__all__ = ["RequestLog", "request_log"]

_UTC = dt.UTC


def _fallback(value: Any) -> Any:
    """What structlog's JSON renderer does with a value JSON has no type for."""
    method = getattr(value, "__structlog__", None)
    return method() if method is not None else repr(value)


class RequestLog:
    """``info("request", **fields)``: one JSON line, or structlog's handling of the call."""

    def __init__(self) -> None:
        self._write: Callable[[bytes], Any] | None = None
        self._flush: Callable[[], Any] | None = None
        self._enabled = True
        #: The loop whose next round flushes the stream, if a flush is pending.
        self._flush_pending: asyncio.AbstractEventLoop | None = None
        self._structlog = structlog.get_logger("tidegate")

    def direct(self, stream: BinaryIO, *, enabled: bool) -> None:
        """Write JSON lines to ``stream`` (structlog's ``BytesLogger`` target), or nothing."""
        self._write, self._flush, self._enabled = stream.write, stream.flush, enabled

    def through_structlog(self) -> None:
        """Hand every call to structlog (console lines, or before logging is configured)."""
        self._write = self._flush = None
        self._enabled = True

    def info(self, event: str, **fields: Any) -> None:
        if not self._enabled:
            return
        write, flush = self._write, self._flush
        if write is None or flush is None:
            self._structlog.info(event, **fields)
            return
        fields["event"] = event
        fields["level"] = "info"
        fields["timestamp"] = dt.datetime.now(tz=_UTC).isoformat().replace("+00:00", "Z")
        write(orjson.dumps(fields, default=_fallback) + b"\n")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            flush()
            return
        if self._flush_pending is not loop:  # (a loop that closed first flushes nothing)
            self._flush_pending = loop
            loop.call_soon(self._flush_round)

    def _flush_round(self) -> None:
        self._flush_pending = None
        if self._flush is not None:
            self._flush()


#: The gateway's request logger, set up by ``configure_logging``.
request_log = RequestLog()
