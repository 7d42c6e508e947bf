"""The open-loop load test: its schedule in virtual time, its arithmetic, and real runs."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.gateway.harness import KEY, fake, running_gateway
from tidegate.clock import ManualClock
from tidegate.ops.loadtest import (
    GaugeReading,
    LoadOptions,
    LoadRun,
    Outcome,
    arrival_times,
    base_url,
    format_report,
    loadtest_command,
    parse_gauge,
    percentile,
    run_open_loop,
    summarise,
    wait_for_idle,
)


def cli() -> typer.Typer:
    """The command as the `tidegate` app mounts it."""
    app = typer.Typer()
    app.command()(loadtest_command)
    return app


async def settle(clock: ManualClock, until: Any) -> None:
    """Let other tasks run (virtual time does not move) until ``until()`` is true."""
    for _ in range(10_000):
        if until():
            return
        await clock.asleep(0)
    raise AssertionError("the condition never became true")


@pytest.mark.asyncio
async def test_arrivals_keep_their_schedule_while_answers_are_outstanding() -> None:
    """Open loop: arrival i is sent at i / rate even though no earlier request has answered."""
    clock = ManualClock()
    release = asyncio.Event()
    started: list[int] = []

    async def send(index: int) -> Outcome:
        started.append(index)
        await release.wait()
        return Outcome(index, 200, "ok", 0.0)

    options = LoadOptions(rate=4, duration=2)
    run_task = asyncio.ensure_future(run_open_loop(options, send, clock=clock, sleep=clock.asleep))
    await settle(clock, lambda: len(started) == 8)
    assert clock.now() == 1.75
    assert not run_task.done(), "the run must wait for the answers"
    release.set()
    run = await run_task
    assert run.sent_at == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
    assert [o.index for o in run.outcomes] == list(range(8))
    assert (run.not_sent, run.abandoned, run.max_lag_s) == (0, 0, 0.0)


@pytest.mark.asyncio
async def test_arrivals_beyond_the_in_flight_cap_are_not_sent_and_counted() -> None:
    """With three requests open, later arrivals are counted as not sent, never queued."""
    clock = ManualClock()
    release = asyncio.Event()

    async def send(index: int) -> Outcome:
        await release.wait()
        return Outcome(index, 200, "ok", 0.0)

    options = LoadOptions(rate=4, duration=2, max_in_flight=3)
    run_task = asyncio.ensure_future(run_open_loop(options, send, clock=clock, sleep=clock.asleep))
    await settle(clock, lambda: clock.now() == 1.75)
    release.set()
    run = await run_task
    assert run.sent_at == [0.0, 0.25, 0.5]
    assert run.not_sent == 5
    assert len(run.outcomes) == 3


@pytest.mark.asyncio
async def test_requests_still_open_after_the_timeout_are_abandoned() -> None:
    """The run is bounded: what has not answered one timeout after the last arrival is cancelled."""
    clock = ManualClock()
    never = asyncio.Event()

    async def send(index: int) -> Outcome:
        await never.wait()
        return Outcome(index, 200, "ok", 0.0)

    options = LoadOptions(rate=4, duration=1, timeout_s=0.05)
    run = await run_open_loop(options, send, clock=clock, sleep=clock.asleep)
    assert (run.abandoned, run.outcomes) == (4, [])
    assert summarise(run).sent == 4


@pytest.mark.asyncio
async def test_a_late_scheduler_reports_its_lag() -> None:
    """When the client cannot keep the schedule, the report says how late it was."""
    clock = ManualClock()

    async def oversleep(seconds: float) -> None:
        clock.advance(seconds + 0.5)

    async def send(index: int) -> Outcome:
        return Outcome(index, 200, "ok", 0.0)

    run = await run_open_loop(LoadOptions(rate=4, duration=2), send, clock=clock, sleep=oversleep)
    assert run.max_lag_s == 0.5
    assert run.sent_at == [0.0, 0.75, 0.75, 0.75, 1.5, 1.5, 1.5, 2.25]


@pytest.mark.asyncio
async def test_a_sender_that_raises_is_recorded_as_a_client_error() -> None:
    """A bug in the sender shows up in the counts instead of vanishing."""
    clock = ManualClock()

    async def send(index: int) -> Outcome:
        raise RuntimeError("boom")

    run = await run_open_loop(
        LoadOptions(rate=2, duration=1), send, clock=clock, sleep=clock.asleep
    )
    assert [o.code for o in run.outcomes] == ["client_error", "client_error"]


def test_percentiles_are_nearest_rank() -> None:
    """p50/p95/p99 are observed values: the ceil(q% x n)-th smallest."""
    values = [float(v) for v in range(10, 0, -1)]
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 99)) == (
        5.0,
        10.0,
        10.0,
    )
    assert percentile([0.1, 0.2, 0.3], 50) == 0.2
    assert percentile([0.3], 1) == 0.3
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 0)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=50),
    st.floats(0.01, 100),
    st.floats(0.01, 100),
)
def test_a_percentile_is_an_observed_value_and_grows_with_q(
    values: list[float], q1: float, q2: float
) -> None:
    """Whatever the latencies, a percentile is one of them and never shrinks as q grows."""
    low, high = sorted((q1, q2))
    assert percentile(values, low) in values
    assert percentile(values, low) <= percentile(values, high)


@settings(max_examples=50, deadline=None)
@given(st.floats(0.1, 500), st.floats(0.01, 60))
def test_the_schedule_is_evenly_spaced_and_inside_the_duration(
    rate: float, duration: float
) -> None:
    """floor(rate x duration) arrivals, the first at 0, each 1/rate after the last, all before the end."""
    count = int(rate * duration + 1e-9)
    if count < 1:
        with pytest.raises(ValueError):
            arrival_times(rate, duration)
        return
    times = arrival_times(rate, duration)
    assert len(times) == count
    assert times[0] == 0.0
    assert all(b > a for a, b in itertools.pairwise(times))
    assert times[-1] < duration + 1e-6


def test_options_refuse_unbounded_or_empty_runs() -> None:
    """Rate, duration, request count and the in-flight cap are bounded; the error names the field."""
    with pytest.raises(ValueError, match="rate"):
        LoadOptions(rate=0, duration=1)
    with pytest.raises(ValueError, match="duration"):
        LoadOptions(rate=1, duration=10_000)
    with pytest.raises(ValueError, match="schedules 210000 requests"):
        LoadOptions(rate=1_000, duration=210)
    with pytest.raises(ValueError, match="at least one request"):
        LoadOptions(rate=1, duration=0.5)
    with pytest.raises(ValueError, match="max_in_flight"):
        LoadOptions(rate=1, duration=1, max_in_flight=0)
    with pytest.raises(ValueError, match="timeout_s"):
        LoadOptions(rate=1, duration=1, timeout_s=float("inf"))
    assert LoadOptions(rate=0.1, duration=30).requests == 3


def test_the_gauge_is_read_from_prometheus_text() -> None:
    """The unlabelled gauge's value; metrics that merely share its prefix are ignored."""
    text = (
        "# HELP tidegate_in_flight_requests Requests being handled now.\n"
        "# TYPE tidegate_in_flight_requests gauge\n"
        "tidegate_in_flight_requests 3.0\n"
        "tidegate_in_flight_requests_peak 9.0\n"
    )
    assert parse_gauge(text) == 3.0
    assert parse_gauge('x{a="1"} 1\nx{a="2"} 2.5\n', "x") == 3.5
    assert parse_gauge("other_metric 1\n") is None


def test_the_summary_counts_statuses_and_refusals_and_times_only_answers() -> None:
    """Refusals are listed by status and code; latency percentiles cover answered requests."""
    run = LoadRun(
        planned=6,
        outcomes=[
            Outcome(0, 200, "ok", 0.2),
            Outcome(1, 200, "ok", 0.4),
            Outcome(2, 429, "rate_limited", 0.001),
            Outcome(3, 503, "queue_full", 0.001),
            Outcome(4, None, "timeout", 60.0),
        ],
        not_sent=1,
    )
    report = summarise(run, [GaugeReading("http://g/metrics", 0.0)])
    assert report.by_status == {"200": 2, "429": 1, "503": 1, "timeout": 1}
    assert report.refusals == {"429 rate_limited": 1, "503 queue_full": 1, "timeout timeout": 1}
    assert (report.p50_s, report.p95_s, report.p99_s) == (0.2, 0.4, 0.4)
    assert (report.sent, report.answered, report.not_sent) == (5, 2, 1)
    assert report.passed
    lines = format_report("http://g", LoadOptions(rate=6, duration=1), report)
    assert lines[-1] == "RESULT: PASS"
    assert "refused 429 rate_limited" in "\n".join(lines)


def test_a_gauge_above_zero_or_unreadable_fails_the_run() -> None:
    """Exit status follows the gauge: stuck above zero or missing is a failure."""
    run = LoadRun(planned=1, outcomes=[Outcome(0, 200, "ok", 0.1)])
    stuck = summarise(run, [GaugeReading("http://g/metrics", 1.0)])
    missing = summarise(run, [GaugeReading("http://g/metrics", None, "no gauge")])
    nothing = summarise(LoadRun(planned=1), [GaugeReading("http://g/metrics", 0.0)])
    assert not stuck.passed
    assert not missing.passed
    assert not nothing.passed
    options = LoadOptions(rate=1, duration=1)
    assert "did not return to 0" in format_report("http://g", options, stuck)[-1]
    assert "no request was answered" in format_report("http://g", options, nothing)[-1]


@pytest.mark.asyncio
async def test_waiting_for_idle_polls_until_every_gauge_reads_zero() -> None:
    """The gauge is read again every poll_s until it is 0, and no longer than settle_s."""
    clock = ManualClock()
    values = iter([2.0, 1.0, 0.0])

    async def read() -> list[GaugeReading]:
        return [GaugeReading("u", next(values))]

    readings = await wait_for_idle(read, settle_s=5, poll_s=0.25, clock=clock, sleep=clock.asleep)
    assert (readings, clock.now()) == ([GaugeReading("u", 0.0)], 0.5)

    async def stuck() -> list[GaugeReading]:
        return [GaugeReading("u", 1.0)]

    readings = await wait_for_idle(stuck, settle_s=1, poll_s=0.25, clock=clock, sleep=clock.asleep)
    assert (readings, clock.now()) == ([GaugeReading("u", 1.0)], 1.5)


def test_only_http_base_urls_are_accepted() -> None:
    """The target is the URL given: http(s) with a host, no query; a trailing slash is dropped."""
    assert base_url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080"
    for bad in ("ftp://host", "http://", "127.0.0.1:8080", "http://h/?x=1"):
        with pytest.raises(ValueError):
            base_url(bad)


@pytest.mark.slow
def test_a_run_against_a_live_gateway_passes(tmp_path: Path) -> None:
    """Against a real gateway: answers, percentiles, and the in-flight gauge back at 0."""
    config = {
        "providers": {"main": fake("ok", model="m-1", latency=0.02)},
        "models": {"chat": {"providers": ["main"]}},
        "rate_limits": {"per_user": {"rate_per_s": 1000, "burst": 1000}},
    }
    with running_gateway(tmp_path, config) as (base, app):
        args = [base, "--rate", "40", "--duration", "1", "--key", KEY, "--model", "chat"]
        result = CliRunner().invoke(cli(), args)
        streamed = CliRunner().invoke(cli(), [*args, "--stream"])
        assert app.runtime is not None
        assert app.runtime.in_flight == 0
    assert result.exit_code == 0, result.output
    assert "status 200    40" in result.output
    assert "p50" in result.output
    assert f"in-flight gauge 0 at {base}/metrics" in result.output
    assert result.output.rstrip().endswith("RESULT: PASS")
    assert streamed.exit_code == 0, streamed.output


class _LeakyGateway(BaseHTTPRequestHandler):
    """Answers every chat request, and reports one request in flight for ever."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._send(200, b'{"choices": []}', "application/json")

    def do_GET(self) -> None:
        self._send(200, b"tidegate_in_flight_requests 1.0\n", "text/plain")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@contextlib.contextmanager
def leaky_gateway() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _LeakyGateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.slow
def test_a_gauge_that_stays_above_zero_exits_1() -> None:
    """A leaked request (the gauge never returns to 0) fails the run with exit status 1."""
    with leaky_gateway() as base:
        args = [
            "--rate",
            "10",
            "--duration",
            "0.5",
            "--key",
            "k",
            "--model",
            "m",
            "--settle",
            "0.3",
        ]
        result = CliRunner().invoke(cli(), [base, *args])
    assert result.exit_code == 1, result.output
    assert f"in-flight gauge 1 at {base}/metrics" in result.output
    assert "did not return to 0" in result.output


def test_bad_arguments_exit_2_before_any_request() -> None:
    """A zero rate or a non-http URL is a usage error."""
    zero = CliRunner().invoke(
        cli(),
        ["http://127.0.0.1:9", "--rate", "0", "--duration", "1", "--key", "k", "--model", "m"],
    )
    assert zero.exit_code == 2
    url = CliRunner().invoke(
        cli(), ["file:///etc", "--rate", "1", "--duration", "1", "--key", "k", "--model", "m"]
    )
    assert url.exit_code == 2
