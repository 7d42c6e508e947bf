"""An incremental decoder for ``text/event-stream`` bodies (server-sent events).

Bytes arrive in pieces that ignore line boundaries; :class:`SSEDecoder` buffers them and hands
back whole events. It follows the WHATWG event-stream rules that matter to model APIs: lines end
in LF, CRLF or CR; ``:`` starts a comment; ``data:`` lines of one event are joined with LF; an
empty line ends the event. One leniency: an event still pending when the body ends is delivered
rather than dropped, because some servers omit the final blank line.

:meth:`SSEDecoder.feed_data` is the relay's way in: only each event's data, as bytes, and for
the shape nearly every model API writes (``data: ...`` lines ending in LF, one per event) a split
at the blank lines with nothing decoded; anything else in a read (a CR, a comment, an ``event:``
line, an event of several lines) goes through the line-by-line rules, so the data is the same
either way.
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
        return self._lines()

    def feed_data(self, chunk: bytes) -> list[bytes]:
        """The data of the events completed by ``chunk``, in order, as bytes (UTF-8 as
        received; the event names are not kept)."""
        if (
            not self._buffer
            and chunk.startswith(b"data: ")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and b"\r" not in chunk
            and not self._has_data
            and not self._event
        ):
            return [chunk[6:-2]]  # one event of one line, alone in its read: the usual read
        buffer = self._buffer + chunk
        if b"\r" in buffer or self._has_data or self._event:
            self._buffer = buffer
            return [event.data.encode() for event in self._lines()]
        blocks = buffer.split(b"\n\n")
        rest = blocks.pop()
        data: list[bytes] = []
        for block in blocks:
            if block.startswith(b"data: ") and b"\n" not in block:
                data.append(block[6:])
            elif block:  # several lines, comments, an event name: the line-by-line rules
                self._buffer = block + b"\n\n"
                data += [event.data.encode() for event in self._lines()]
        self._buffer = rest
        if len(rest) - rest.rfind(b"\n") - 1 > self._max_line:
            raise SSELineTooLong(f"an event-stream line is longer than {self._max_line} bytes")
        return data

    def _lines(self) -> list[SSEEvent]:
        """The events completed by the whole lines in the buffer (the rest stays in it)."""
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
        events = self._lines()  # feed_data may leave whole lines in the buffer
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
