"""An incremental decoder for ``text/event-stream`` bodies (server-sent events).

Bytes arrive in pieces that ignore line boundaries; :class:`SSEDecoder` buffers them and hands
back whole events. It follows the WHATWG event-stream rules that matter to model APIs: lines end
in LF, CRLF or CR; ``:`` starts a comment; ``data:`` lines of one event are joined with LF; an
empty line ends the event. One leniency: an event still pending when the body ends is delivered
rather than dropped, because some servers omit the final blank line.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_LINE", "SSEDecoder", "SSEEvent", "SSELineTooLong"]

#: Longest line the decoder buffers before giving up (bytes).
DEFAULT_MAX_LINE = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event: its type (``message`` unless an ``event:`` line said otherwise)."""

    event: str
    data: str


class SSELineTooLong(ValueError):
    """A line grew past the decoder's limit without ending."""


class SSEDecoder:
    """Feed it bytes, get back complete events."""

    __slots__ = ("_buffer", "_data", "_event", "_has_data", "_max_line")

    def __init__(self, *, max_line: int = DEFAULT_MAX_LINE) -> None:
        if max_line < 1:
            raise ValueError(f"max_line must be >= 1, got {max_line!r}")
        self._max_line = max_line
        self._buffer = b""
        self._event = ""
        self._data: list[str] = []
        self._has_data = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """The events completed by ``chunk``, in order."""
        self._buffer += chunk
        events: list[SSEEvent] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                break
            end, width = cut
            line = self._buffer[:end]
            self._buffer = self._buffer[end + width :]
            event = self._line(line.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        if len(self._buffer) > self._max_line:
            raise SSELineTooLong(f"an event-stream line is longer than {self._max_line} bytes")
        return events

    def end(self) -> list[SSEEvent]:
        """The body has ended: deliver whatever is still pending."""
        events: list[SSEEvent] = []
        if self._buffer:
            # A lone trailing CR was held back in case an LF followed; the body is over now.
            line = self._buffer.removesuffix(b"\r")
            self._buffer = b""
            event = self._line(line.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        event = self._dispatch()
        if event is not None:
            events.append(event)
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
            self._has_data = True
        elif field == "event":
            self._event = value
        # "id" and "retry" only matter to a browser that reconnects; model APIs never resume.
        return None

    def _dispatch(self) -> SSEEvent | None:
        event = SSEEvent(self._event or "message", "\n".join(self._data))
        has_data = self._has_data
        self._event = ""
        self._data = []
        self._has_data = False
        return event if has_data else None


def _line_end(buffer: bytes) -> tuple[int, int] | None:
    """Where the first complete line ends and how wide its terminator is, if there is one."""
    lf = buffer.find(b"\n")
    cr = buffer.find(b"\r")
    if cr == -1 or (lf != -1 and lf < cr):
        return None if lf == -1 else (lf, 1)
    if cr + 1 == len(buffer):
        return None  # a CR at the very end may be the first half of a CRLF
    return (cr, 2) if buffer[cr + 1 : cr + 2] == b"\n" else (cr, 1)
