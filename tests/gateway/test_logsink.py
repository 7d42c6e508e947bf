"""The log sink writes each event-loop round's lines with one write, and never raises."""

from __future__ import annotations

import asyncio
import datetime as dt
import io
from typing import Any

import orjson
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.clock import ManualClock
from tidegate.gateway.logsink import (
    FLUSH_BYTES,
    RequestLines,
    RoundBufferedSink,
    UTCTimestamp,
    flush_all,
)


class Recorder(io.BytesIO):
    """A binary stream that keeps every write() call apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.flushes = 0

    def write(self, data: Any, /) -> int:
        self.writes.append(bytes(data))
        return super().write(data)

    def flush(self) -> None:
        self.flushes += 1


class Broken(Recorder):
    """A stream whose writes fail, as a closed pipe's do."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def write(self, data: Any, /) -> int:
        self.writes.append(bytes(data))
        raise self.error


async def _end_of_round() -> None:
    """Return once every callback already scheduled with call_soon has run."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.call_soon(done.set_result, None)
    await done


@pytest.mark.asyncio
async def test_a_rounds_lines_are_written_together_at_its_end() -> None:
    stream = Recorder()
    sink = RoundBufferedSink(stream)
    sink.msg(b'{"n":1}')
    sink.info(b'{"n":2}')
    sink.error(b'{"n":3}')
    assert stream.writes == []  # nothing before the round ends
    await _end_of_round()
    assert stream.writes == [b'{"n":1}\n{"n":2}\n{"n":3}\n']
    assert stream.flushes == 1
    sink.warning(b'{"n":4}')
    assert stream.writes == [b'{"n":1}\n{"n":2}\n{"n":3}\n']
    await _end_of_round()
    assert stream.writes[1:] == [b'{"n":4}\n']  # the next round: its own write


def test_without_a_loop_each_line_is_written_at_once() -> None:
    stream = Recorder()
    sink = RoundBufferedSink(stream)
    sink.info(b"one")
    assert stream.writes == [b"one\n"]
    sink.critical(b"two")
    assert stream.writes == [b"one\n", b"two\n"]
    assert stream.getvalue() == b"one\ntwo\n"


@pytest.mark.asyncio
async def test_passing_flush_bytes_writes_before_the_round_ends() -> None:
    stream = Recorder()
    sink = RoundBufferedSink(stream)
    big = b"x" * (FLUSH_BYTES - 10)
    sink.info(big)
    assert stream.writes == []
    sink.info(b"y" * 10)  # now exactly FLUSH_BYTES buffered
    assert stream.writes == [big + b"\n" + b"y" * 10 + b"\n"]
    sink.info(b"z")
    await _end_of_round()
    assert stream.writes[1:] == [b"z\n"]  # the rest still goes out at the round's end
    await _end_of_round()
    assert len(stream.writes) == 2


@pytest.mark.asyncio
async def test_a_single_line_over_flush_bytes_is_written_at_once() -> None:
    stream = Recorder()
    sink = RoundBufferedSink(stream)
    line = b"q" * (FLUSH_BYTES + 1)
    sink.info(line)
    assert stream.writes == [line + b"\n"]
    await _end_of_round()
    assert len(stream.writes) == 1  # the scheduled flush finds nothing to write


def test_flushing_an_empty_buffer_writes_nothing() -> None:
    stream = Recorder()
    sink = RoundBufferedSink(stream)
    sink.flush()
    assert stream.writes == []
    assert stream.flushes == 0


@pytest.mark.parametrize("error", [OSError(32, "Broken pipe"), ValueError("closed file")])
def test_a_failing_stream_never_raises(error: Exception) -> None:
    stream = Broken(error)
    sink = RoundBufferedSink(stream)
    sink.info(b"lost")  # no loop: written (and lost) at once
    sink.flush()
    assert stream.writes == [b"lost\n"]
    sink.info(b"also lost")
    assert stream.writes == [b"lost\n", b"also lost\n"]  # the failed line is not kept


@pytest.mark.asyncio
async def test_a_failing_stream_does_not_break_the_loop() -> None:
    stream = Broken(OSError(5, "Input/output error"))
    sink = RoundBufferedSink(stream)
    sink.info(b"a")
    sink.info(b"b")
    await _end_of_round()
    assert stream.writes == [b"a\nb\n"]
    sink.flush()  # the buffer was emptied even though the write failed
    assert stream.writes == [b"a\nb\n"]


def test_a_closed_stream_is_ignored() -> None:
    stream = io.BytesIO()
    stream.close()
    sink = RoundBufferedSink(stream)
    sink.info(b"nowhere")
    sink.flush()


@pytest.mark.asyncio
async def test_it_serves_as_a_structlog_logger() -> None:
    """Every logger the factory makes is the one sink; rendered bytes lines go through it."""
    stream = Recorder()
    sink = RoundBufferedSink(stream)
    assert sink() is sink
    assert sink("any", "name") is sink
    log = structlog.wrap_logger(
        sink(),
        processors=[lambda _logger, _name, event: repr(sorted(event.items())).encode()],
        wrapper_class=structlog.BoundLogger,
    )
    log.info("served", status=200)
    log.warning("slow", ms=900)
    assert stream.writes == []
    await _end_of_round()
    assert stream.writes == [
        b"[('event', 'served'), ('status', 200)]\n[('event', 'slow'), ('ms', 900)]\n"
    ]


# --------------------------------------------------------------------------- the timestamp


@settings(max_examples=500, deadline=None)
@given(
    wall=st.floats(min_value=0.0, max_value=4_102_444_800.0)  # up to 2100
    | st.integers(min_value=0, max_value=4_102_444_800).map(float)  # whole seconds
    | st.integers(min_value=0, max_value=4_102_444_800).map(lambda s: s + 0.9999996)
)
def test_the_timestamp_is_what_structlog_writes(wall: float) -> None:
    """UTCTimestamp writes exactly what TimeStamper(fmt="iso", utc=True) writes for the same
    instant (datetime's own rounding, no fraction at a whole second, a carry into the next
    second), also when the second changes between two lines."""
    expected = dt.datetime.fromtimestamp(wall, tz=dt.UTC).isoformat().replace("+00:00", "Z")
    clock = ManualClock(wall_start=wall)
    stamp = UTCTimestamp(clock)
    assert stamp(None, "info", {})["timestamp"] == expected
    clock.advance(1.5)  # a new second: the cached date and time of day are redone
    later = dt.datetime.fromtimestamp(clock.wall(), tz=dt.UTC)
    assert stamp(None, "info", {})["timestamp"] == later.isoformat().replace("+00:00", "Z")


_FIELD_VALUES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)


@settings(max_examples=200, deadline=None)
@given(fields=st.dictionaries(st.text(min_size=1, max_size=12), _FIELD_VALUES, max_size=16))
def test_the_direct_request_line_is_the_line_structlog_writes(fields: dict[str, Any]) -> None:
    """RequestLines writes, byte for byte, what the structlog chain configured for JSON lines
    writes for ``log.info("request", **fields)``: the same keys in the same order."""
    fields.pop("event", None)  # structlog takes the event positionally, never as a field
    # The chain adds these two (a request's fields never carry them): a field of that name keeps
    # its own place in the line, in either writer alike.
    fields.pop("level", None)
    fields.pop("timestamp", None)
    wall = 1_798_761_600.25
    via_structlog, direct = Recorder(), Recorder()
    structlog_sink, direct_sink = RoundBufferedSink(via_structlog), RoundBufferedSink(direct)
    logger = structlog.wrap_logger(
        structlog_sink,
        processors=[
            structlog.processors.add_log_level,
            UTCTimestamp(ManualClock(wall_start=wall)),
            structlog.processors.JSONRenderer(serializer=orjson.dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(20),
    )
    logger.info("request", **fields)
    RequestLines(direct_sink, UTCTimestamp(ManualClock(wall_start=wall)))(dict(fields))
    assert direct.getvalue() == via_structlog.getvalue()
    assert list(orjson.loads(direct.getvalue()))[-3:] == ["event", "level", "timestamp"]


@pytest.mark.asyncio
async def test_flushing_writes_every_live_sink() -> None:
    """A reconfiguration makes a new sink while an earlier request-line writer may still hold the
    old one: the flush at shutdown and exit writes what each of them holds."""
    older, newer = Recorder(), Recorder()
    first, second = RoundBufferedSink(older), RoundBufferedSink(newer)
    first.msg(b'{"n":1}')
    second.msg(b'{"n":2}')
    assert older.writes == newer.writes == []  # both wait for the end of the round
    flush_all()
    assert older.getvalue() == b'{"n":1}\n'
    assert newer.getvalue() == b'{"n":2}\n'


@pytest.mark.parametrize(
    ("level", "json_lines", "direct"),
    [("info", True, True), ("debug", True, True), ("warning", True, False), ("info", False, False)],
)
def test_the_direct_request_line_only_where_it_writes_what_structlog_would(
    level: str, json_lines: bool, direct: bool
) -> None:
    """configure_logging hands the gateway the direct writer for JSON lines at info or below,
    and structlog's own call otherwise (console lines, or a level that drops the line)."""
    from tidegate.gateway.config import Config
    from tidegate.gateway.logsink import configure_logging, log_request

    config = Config.model_validate(
        {
            "profile": "dev",
            "providers": {"p": {"type": "fake", "model": "p-2026-01"}},
            "models": {"m": {"providers": ["p"]}},
            "logging": {"level": level, "json_lines": json_lines},
        }
    )
    try:
        writer = configure_logging(config)
        assert isinstance(writer, RequestLines) is direct
        assert (writer is log_request) is not direct
    finally:
        structlog.reset_defaults()
