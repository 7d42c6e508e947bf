"""The shortcuts the request path takes for speed behave exactly like what they replace."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
from collections.abc import Callable, Generator, MutableMapping
from typing import Any

import orjson
import pytest
import structlog

from tidegate.clock import ManualClock
from tidegate.gateway.http import DisconnectWatch
from tidegate.gateway.metrics import Metrics
from tidegate.gateway.pipeline import Exchange
from tidegate.gateway.requestlog import RequestLog
from tidegate.policy.routing import SkipReason

Message = MutableMapping[str, Any]


class _Client:
    """An ASGI ``receive`` that answers queued messages, waiting on an asyncio.Event meanwhile."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.arrived = asyncio.Event()
        self.calls = 0

    async def receive(self) -> Message:
        self.calls += 1
        while not self.messages:
            self.arrived.clear()
            await self.arrived.wait()
        return self.messages.pop(0)

    def send(self, message: Message) -> None:
        self.messages.append(message)
        self.arrived.set()


#: Yields to the event loop without any time passing.
CLOCK = ManualClock()


async def _rounds(n: int = 3) -> None:
    """Let the loop run ``n`` rounds of callbacks."""
    for _ in range(n):
        await CLOCK.asleep(0)


@pytest.mark.asyncio
async def test_the_watch_calls_back_on_disconnect_only() -> None:
    """Other messages keep it watching; http.disconnect calls back once."""
    client, seen = _Client(), []
    watch = DisconnectWatch(client.receive, lambda: seen.append("gone"))
    client.send({"type": "http.request", "body": b"", "more_body": False})
    await _rounds()
    assert seen == []
    assert client.calls == 2
    client.send({"type": "http.disconnect"})
    await _rounds()
    assert seen == ["gone"]
    watch.close()
    assert seen == ["gone"]


@pytest.mark.asyncio
async def test_closing_the_watch_leaves_nothing_waiting() -> None:
    """close() drops the pending wait: the receive coroutine ends and no callback follows."""
    client, seen = _Client(), []
    watch = DisconnectWatch(client.receive, lambda: seen.append("gone"))
    await _rounds()
    assert len(client.arrived._waiters) == 1
    watch.close()
    assert not client.arrived._waiters
    client.send({"type": "http.disconnect"})
    await _rounds()
    assert seen == []


@pytest.mark.asyncio
async def test_a_receive_that_yields_bare_steps_is_followed() -> None:
    """A bare yield (``asyncio.sleep(0)``) inside receive() is resumed on the next round."""
    seen: list[str] = []

    async def receive() -> Message:
        await CLOCK.asleep(0)  # a bare yield, as some servers' receive() has
        return {"type": "http.disconnect"}

    DisconnectWatch(receive, lambda: seen.append("gone"))
    assert seen == []
    await _rounds()
    assert seen == ["gone"]


class _Odd:
    """An awaitable that yields something asyncio does not know (a task would reject it)."""

    def __await__(self) -> Generator[Any, None, None]:
        yield "not a future"


@pytest.mark.asyncio
async def test_an_unknown_yield_goes_to_a_task_which_reports_it() -> None:
    """What a task would make of the coroutine, the watch's task makes of it: an error report."""
    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:

        async def receive() -> Message:
            await _Odd()
            return {"type": "http.disconnect"}

        watch = DisconnectWatch(receive, lambda: None)
        await _rounds()
        watch.close()
    finally:
        loop.set_exception_handler(None)
    assert [type(c.get("exception")) for c in reported] == [RuntimeError]


@pytest.mark.asyncio
async def test_a_failing_receive_is_reported_not_raised() -> None:
    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:

        async def receive() -> Message:
            raise OSError("connection reset")

        watch = DisconnectWatch(receive, lambda: None)
        watch.close()
    finally:
        loop.set_exception_handler(None)
    assert [str(c["exception"]) for c in reported] == ["connection reset"]


# --------------------------------------------------------------------------- metrics


def test_labelled_children_are_looked_up_once() -> None:
    """The same label values give the same child; removing or clearing forgets it."""
    metrics = Metrics()
    child = metrics.requests.labels("chat", "m-1", "p", "ok")
    assert metrics.requests.labels("chat", "m-1", "p", "ok") is child
    assert metrics.requests.labels(route="chat", model="m-1", served_by="p", outcome="ok") is child
    child.inc()
    metrics.requests.remove("chat", "m-1", "p", "ok")
    fresh = metrics.requests.labels("chat", "m-1", "p", "ok")
    assert fresh is not child
    metrics.requests.clear()
    assert metrics.requests.labels("chat", "m-1", "p", "ok") is not fresh
    with pytest.raises(ValueError):
        metrics.latency.labels("only-one")


# --------------------------------------------------------------------------- request log

FIELDS: dict[str, Any] = {
    "request_id": "abc",
    "route": "chat",
    "tenant": "t1",
    "user": None,
    "status": 200,
    "cost_usd": 0.00012,
    "ttft_s": None,
    "odd": object(),
}


def _structlog_line(fields: dict[str, Any]) -> dict[str, Any]:
    """What structlog, set up as ``configure_logging`` does, writes for the same call."""
    out = io.BytesIO()
    logger = structlog.wrap_logger(
        structlog.BytesLogger(out),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(serializer=orjson.dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    logger.info("request", **fields)
    parsed: dict[str, Any] = orjson.loads(out.getvalue())
    return parsed


def test_the_request_line_is_the_one_structlog_writes() -> None:
    """Same keys, same order, same values; only the timestamp differs (a later instant)."""
    out = io.BytesIO()
    log = RequestLog()
    log.direct(out, enabled=True)
    log.info("request", **FIELDS)
    ours = orjson.loads(out.getvalue())
    theirs = _structlog_line(dict(FIELDS))
    assert list(ours) == list(theirs)
    assert out.getvalue().endswith(b"}\n")
    assert out.getvalue().count(b"\n") == 1
    for key in theirs:
        if key != "timestamp" and key != "odd":
            assert ours[key] == theirs[key], key
    assert ours["odd"].startswith("<object object at ")
    assert ours["timestamp"].endswith("Z")
    assert len(ours["timestamp"]) == len(theirs["timestamp"])


class _Stream(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1


@pytest.mark.asyncio
async def test_lines_of_one_round_are_flushed_together_at_its_end() -> None:
    stream = _Stream()
    log = RequestLog()
    log.direct(stream, enabled=True)
    log.info("request", request_id="a")
    log.info("request", request_id="b")
    assert stream.flushes == 0
    await _rounds(1)
    assert stream.flushes == 1
    assert stream.getvalue().count(b"\n") == 2


def test_outside_an_event_loop_each_line_is_flushed_at_once() -> None:
    stream = _Stream()
    log = RequestLog()
    log.direct(stream, enabled=True)
    log.info("request", request_id="a")
    assert stream.flushes == 1


def test_a_level_above_info_drops_the_line() -> None:
    stream = _Stream()
    log = RequestLog()
    log.direct(stream, enabled=False)
    log.info("request", request_id="a")
    assert stream.getvalue() == b""


def test_without_direct_output_the_line_goes_through_structlog() -> None:
    saved = structlog.get_config()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=False,
    )
    try:
        log = RequestLog()
        log.through_structlog()
        with structlog.testing.capture_logs() as captured:
            log.info("request", request_id="a")
    finally:
        structlog.configure(**saved)
    assert captured == [{"event": "request", "request_id": "a", "log_level": "info"}]


# --------------------------------------------------------------------------- small memos


def test_the_tried_header_follows_new_attempts() -> None:
    ex = Exchange(request_id="r")
    assert ex.tried_header() == ""
    ex.tried.append(("primary", None))
    assert ex.tried_header() == "primary=ok"
    ex.tried.append(("backup", SkipReason.BREAKER_OPEN))
    assert ex.tried_header() == "primary=ok, backup=skipped:breaker_open"


@pytest.mark.asyncio
async def test_approved_fallbacks_follow_the_eval_gate(
    gateway_client: Callable[..., Any],
) -> None:
    """A new set of blocked providers is taken into account at once."""
    from tests.gateway.harness import fake

    config = {
        "providers": {
            "a": {**fake(), "approved_fallback": False},
            "b": {**fake(), "approved_fallback": True},
            "c": {**fake(), "approved_fallback": True},
        },
        "models": {"chat": {"providers": ["a", "b", "c"]}},
    }
    async with gateway_client(config) as (_, app):
        rt = app.runtime
        assert rt.approved_fallbacks() == {"b", "c"}
        rt.blocked = frozenset({"c"})
        assert rt.approved_fallbacks() == {"b"}
        rt.blocked = frozenset()
        assert rt.approved_fallbacks() == {"b", "c"}


def test_tune_gc_freezes_start_up_objects_and_collects_less_often() -> None:
    from tidegate.gateway.app import GC_YOUNG_THRESHOLD, tune_gc

    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_the_ascii_shortcut_strips_what_the_full_table_strips() -> None:
    """Every ASCII character alone and among others: the shortcut never keeps a hidden one."""
    from tidegate.gateway.redaction import _STRIP_TABLE, INVISIBLE_CHARACTERS, strip_invisible

    for code in range(0x80):
        char = chr(code)
        for text in (char, f"ab{char}cd", f"{char}\n{char}"):
            assert strip_invisible(text) == text.translate(_STRIP_TABLE), repr(text)
    mixed = "plain text, then " + "".join(sorted(INVISIBLE_CHARACTERS)) + " and more\n"
    assert strip_invisible(mixed) == "plain text, then  and more\n"


def test_a_flush_left_pending_by_a_closed_loop_does_not_hold_later_lines() -> None:
    """A loop that ends before its round does not keep the next loop's lines from flushing."""
    stream = _Stream()
    log = RequestLog()
    log.direct(stream, enabled=True)

    async def one_line() -> None:
        log.info("request", request_id="a")

    closing = asyncio.new_event_loop()
    closing.run_until_complete(one_line())  # its flush callback never gets to run
    closing.close()
    flushed = stream.flushes

    async def line_and_round() -> None:
        log.info("request", request_id="b")
        await _rounds(1)

    asyncio.run(line_and_round())
    assert stream.flushes > flushed
