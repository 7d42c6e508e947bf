"""An open-loop load test of a running gateway: ``tidegate loadtest URL --rate R --duration S``.

Arrivals are scheduled at fixed times, ``i / rate`` seconds after the start, whatever happens to
the requests already sent: a slow gateway does not slow the arrivals down, as it would in a
closed loop where each client waits for its answer before asking again. That is how real users
behave, and it is the only way a load test can show a queue building up.

The client protects the machine it runs on: at most ``max_in_flight`` requests are open at once
(an arrival that finds the cap reached is not sent, and is counted), and the whole run is bounded
in count (:data:`MAX_REQUESTS`) and in time (:data:`MAX_DURATION_S`, plus one request timeout to
finish). It talks only to the URL it is given and never follows a redirect.

After the run it reads the gateway's ``tidegate_in_flight_requests`` gauge from ``/metrics``
until it is back to zero. A gauge that stays above zero once every answer has arrived is a leak:
a request whose bookkeeping never ran.

The scheduler (:func:`run_open_loop`) takes a clock, a sleep function and a ``send`` coroutine,
so its timing is tested in virtual time; :func:`http_sender` is the one seam that does HTTP.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any
from urllib.parse import urlsplit

import aiohttp
import typer

from tidegate.clock import Clock, SystemClock

__all__ = [
    "GAUGE",
    "MAX_DURATION_S",
    "MAX_RATE",
    "MAX_REQUESTS",
    "GaugeReading",
    "LoadOptions",
    "LoadReport",
    "LoadRun",
    "Outcome",
    "arrival_times",
    "base_url",
    "format_report",
    "http_sender",
    "loadtest_command",
    "parse_gauge",
    "percentile",
    "read_gauges",
    "run_load",
    "run_open_loop",
    "summarise",
    "wait_for_idle",
]

#: The gauge that must return to zero after the run.
GAUGE = "tidegate_in_flight_requests"
#: Arrivals per second above this are refused: beyond it the client, not the gateway, is measured.
MAX_RATE = 2_000.0
#: Longest run, in seconds of arrivals.
MAX_DURATION_S = 3_600.0
#: Most requests one run may send.
MAX_REQUESTS = 200_000

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOptions:
    """What one run does.

    ``rate`` (arrivals per second, no default) and ``duration`` (seconds, no default) fix the
    schedule; ``max_in_flight`` (256) caps the requests open at once; ``timeout_s`` (60.0) is
    each request's limit; ``settle_s`` (10.0) is how long the gauge may take to read zero after
    the last answer; ``poll_s`` (0.25) is how often it is read meanwhile.
    """

    rate: float
    duration: float
    max_in_flight: int = 256
    timeout_s: float = 60.0
    settle_s: float = 10.0
    poll_s: float = 0.25

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and 0 < self.rate <= MAX_RATE):
            raise ValueError(f"rate must be > 0 and <= {MAX_RATE:g} per second, got {self.rate!r}")
        if not (math.isfinite(self.duration) and 0 < self.duration <= MAX_DURATION_S):
            raise ValueError(
                f"duration must be > 0 and <= {MAX_DURATION_S:g} seconds, got {self.duration!r}"
            )
        if self.requests < 1:
            raise ValueError(
                f"duration x rate must schedule at least one request, got {self.requests}"
            )
        if self.requests > MAX_REQUESTS:
            raise ValueError(
                f"duration x rate schedules {self.requests} requests, more than {MAX_REQUESTS}"
            )
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight!r}")
        for name in ("timeout_s", "settle_s", "poll_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    @property
    def requests(self) -> int:
        """How many arrivals the schedule holds: ``floor(rate x duration)``."""
        # The small epsilon keeps 0.1 x 30 (2.9999999999999996) at the 3 a person expects.
        return math.floor(self.rate * self.duration + 1e-9)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one request.

    ``status`` is the HTTP status, or ``None`` when no response arrived; ``code`` is ``ok`` for a
    complete answer, the error body's ``error.code`` for a refusal, ``stream_incomplete`` for a
    stream that ended without ``data: [DONE]``, ``timeout`` or ``connection_error``.
    """

    index: int
    status: int | None
    code: str
    latency_s: float

    @property
    def ok(self) -> bool:
        return self.code == "ok"


@dataclass(slots=True)
class LoadRun:
    """The raw result of :func:`run_open_loop`."""

    planned: int
    outcomes: list[Outcome] = field(default_factory=list)
    #: Arrivals not sent because ``max_in_flight`` requests were already open.
    not_sent: int = 0
    #: Requests still open when the run's time was up (cancelled, without an outcome).
    abandoned: int = 0
    #: How late the scheduler sent its most delayed arrival (the client's own lag).
    max_lag_s: float = 0.0
    #: Seconds from the first arrival to the last answer.
    elapsed_s: float = 0.0
    #: Each arrival's send time relative to the start, in order (sent arrivals only).
    sent_at: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class GaugeReading:
    """The in-flight gauge of one ``/metrics`` URL: ``None`` if it could not be read."""

    url: str
    value: float | None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """The summary a person reads, and the verdict."""

    planned: int
    sent: int
    not_sent: int
    abandoned: int
    answered: int
    by_status: dict[str, int]
    refusals: dict[str, int]
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    max_lag_s: float
    elapsed_s: float
    gauges: tuple[GaugeReading, ...] = ()

    @property
    def idle(self) -> bool:
        """Every gauge was read and is zero."""
        return bool(self.gauges) and all(g.value == 0 for g in self.gauges)

    @property
    def passed(self) -> bool:
        """The gauge returned to zero and at least one request was answered."""
        return self.idle and self.answered > 0


def arrival_times(rate: float, duration: float) -> list[float]:
    """The schedule: ``i / rate`` seconds after the start, for every arrival before ``duration``."""
    count = LoadOptions(rate=rate, duration=duration).requests
    return [i / rate for i in range(count)]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values`` (not empty).

    Nearest rank returns a value that was observed, never an interpolation between two.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"q must be in (0, 100], got {q!r}")
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[max(rank, 1) - 1]


def _status_key(outcome: Outcome) -> str:
    return str(outcome.status) if outcome.status is not None else outcome.code


def summarise(run: LoadRun, gauges: Iterable[GaugeReading] = ()) -> LoadReport:
    """Counts by status, refusals by status and code, and latency percentiles of answers."""
    by_status = Counter(_status_key(o) for o in run.outcomes)
    refusals = Counter(f"{_status_key(o)} {o.code}" for o in run.outcomes if not o.ok)
    answered = [o.latency_s for o in run.outcomes if o.ok]
    return LoadReport(
        planned=run.planned,
        sent=len(run.outcomes) + run.abandoned,
        not_sent=run.not_sent,
        abandoned=run.abandoned,
        answered=len(answered),
        by_status=dict(sorted(by_status.items())),
        refusals=dict(sorted(refusals.items())),
        p50_s=percentile(answered, 50) if answered else None,
        p95_s=percentile(answered, 95) if answered else None,
        p99_s=percentile(answered, 99) if answered else None,
        max_lag_s=run.max_lag_s,
        elapsed_s=run.elapsed_s,
        gauges=tuple(gauges),
    )


async def run_open_loop(
    options: LoadOptions,
    send: Callable[[int], Awaitable[Outcome]],
    *,
    clock: Clock,
    sleep: Sleep,
) -> LoadRun:
    """Send arrival ``i`` at ``start + i / rate`` whatever the earlier ones are doing.

    ``send`` should turn every failure into an :class:`Outcome`; an exception it raises anyway
    is recorded as the code ``client_error``. An arrival that finds ``max_in_flight`` requests
    open is counted in ``not_sent``; requests still open one ``timeout_s`` after the last
    arrival are cancelled and counted in ``abandoned``.
    """
    run = LoadRun(planned=options.requests)
    open_tasks: set[asyncio.Task[Outcome]] = set()

    async def guarded(index: int) -> Outcome:
        sent = clock.now()
        try:
            return await send(index)
        except Exception:
            return Outcome(index, None, "client_error", clock.now() - sent)

    def finished(task: asyncio.Task[Outcome]) -> None:
        open_tasks.discard(task)
        if not task.cancelled():
            run.outcomes.append(task.result())

    start = clock.now()
    for index, offset in enumerate(arrival_times(options.rate, options.duration)):
        delay = start + offset - clock.now()
        if delay > 0:
            await sleep(delay)
        run.max_lag_s = max(run.max_lag_s, clock.now() - (start + offset))
        if len(open_tasks) >= options.max_in_flight:
            run.not_sent += 1
            continue
        run.sent_at.append(clock.now() - start)
        task = asyncio.ensure_future(guarded(index))
        open_tasks.add(task)
        task.add_done_callback(finished)
    if open_tasks:
        _, pending = await asyncio.wait(set(open_tasks), timeout=options.timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        run.abandoned = len(pending)
    run.elapsed_s = clock.now() - start
    run.outcomes.sort(key=lambda o: o.index)
    return run


def base_url(url: str) -> str:
    """``url`` without a trailing slash; only ``http``/``https`` URLs naming a host are accepted."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL with a host, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"expected a base URL without a query or fragment, got {url!r}")
    return url.rstrip("/")


def _error_code(payload: bytes) -> str | None:
    """The ``error.code`` of a JSON error body, or of the last SSE event that carries one."""
    candidates = [payload]
    if b"data: " in payload:
        candidates = [
            line[len(b"data: ") :] for line in payload.splitlines() if line.startswith(b"data: ")
        ][::-1]
    for candidate in candidates:
        try:
            parsed = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            code = parsed["error"].get("code")
            if isinstance(code, str) and code:
                return code
    return None


def http_sender(
    session: aiohttp.ClientSession,
    url: str,
    *,
    key: str,
    model: str,
    stream: bool,
    timeout_s: float,
    clock: Clock,
    run_id: str,
) -> Callable[[int], Awaitable[Outcome]]:
    """A ``send`` for :func:`run_open_loop` that posts chat completions to ``url``.

    Each request has its own prompt (so the response cache and single-flight do not answer it)
    and the request id ``loadtest-<run_id>-<index>``, so its log line can be found.
    """
    endpoint = f"{base_url(url)}/v1/chat/completions"
    limit = aiohttp.ClientTimeout(total=timeout_s)

    async def send(index: int) -> Outcome:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": f"load test {run_id} request {index}"}],
            "stream": stream,
        }
        headers = {"Authorization": f"Bearer {key}", "X-Request-ID": f"loadtest-{run_id}-{index}"}
        started = clock.now()
        try:
            async with session.post(
                endpoint, json=body, headers=headers, timeout=limit, allow_redirects=False
            ) as response:
                payload = await response.read()
                status = response.status
        except TimeoutError:
            return Outcome(index, None, "timeout", clock.now() - started)
        except aiohttp.ClientError:
            return Outcome(index, None, "connection_error", clock.now() - started)
        latency = clock.now() - started
        if 200 <= status < 300:
            if not stream or b"data: [DONE]" in payload:
                return Outcome(index, status, "ok", latency)
            return Outcome(index, status, _error_code(payload) or "stream_incomplete", latency)
        return Outcome(index, status, _error_code(payload) or f"http_{status}", latency)

    return send


def parse_gauge(text: str, name: str = GAUGE) -> float | None:
    """The value of an unlabelled sample ``name`` in Prometheus text, summed over label sets."""
    total: float | None = None
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if not rest or rest[0] not in " {":
            continue  # another metric whose name starts with this one
        value = rest.rsplit("}", 1)[-1].split()
        if not value:
            continue
        try:
            number = float(value[0])
        except ValueError:
            continue
        total = number if total is None else total + number
    return total


async def read_gauges(
    session: aiohttp.ClientSession, metrics_urls: Sequence[str], *, timeout_s: float = 5.0
) -> list[GaugeReading]:
    """Read :data:`GAUGE` from each ``/metrics`` URL."""
    readings = []
    for url in metrics_urls:
        try:
            async with session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout_s), allow_redirects=False
            ) as response:
                text = await response.text()
                status = response.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            readings.append(GaugeReading(url, None, f"unreachable: {type(exc).__name__}"))
            continue
        if status != 200:
            readings.append(GaugeReading(url, None, f"HTTP {status}"))
            continue
        value = parse_gauge(text)
        readings.append(GaugeReading(url, value, "" if value is not None else f"no {GAUGE}"))
    return readings


async def wait_for_idle(
    read: Callable[[], Awaitable[list[GaugeReading]]],
    *,
    settle_s: float,
    poll_s: float,
    clock: Clock,
    sleep: Sleep,
) -> list[GaugeReading]:
    """Read the gauges until every one is zero or ``settle_s`` has passed; the last readings."""
    deadline = clock.now() + settle_s
    while True:
        readings = await read()
        if all(r.value == 0 for r in readings) or clock.now() >= deadline:
            return readings
        await sleep(min(poll_s, max(0.0, deadline - clock.now())))


async def run_load(
    url: str,
    options: LoadOptions,
    *,
    key: str,
    model: str,
    stream: bool = False,
    metrics_urls: Sequence[str] = (),
    clock: SystemClock | None = None,
) -> LoadReport:
    """Run the load against ``url``, then wait for the in-flight gauge; the report."""
    clock = clock or SystemClock()
    root = base_url(url)
    metrics = list(metrics_urls) or [f"{root}/metrics"]
    connector = aiohttp.TCPConnector(limit=options.max_in_flight)
    async with aiohttp.ClientSession(connector=connector) as session:
        send = http_sender(
            session,
            root,
            key=key,
            model=model,
            stream=stream,
            timeout_s=options.timeout_s,
            clock=clock,
            run_id=secrets.token_hex(4),
        )
        run = await run_open_loop(options, send, clock=clock, sleep=clock.asleep)
        gauges = await wait_for_idle(
            lambda: read_gauges(session, metrics),
            settle_s=options.settle_s,
            poll_s=options.poll_s,
            clock=clock,
            sleep=clock.asleep,
        )
    return summarise(run, gauges)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def format_report(url: str, options: LoadOptions, report: LoadReport) -> list[str]:
    """The report as lines of text, ending with ``RESULT: PASS`` or ``RESULT: FAIL``."""
    lines = [
        f"load test of {base_url(url)}: {options.rate:g} requests/s for {options.duration:g}s "
        f"(open loop, {report.planned} planned, at most {options.max_in_flight} in flight)",
        f"sent          {report.sent}  (not sent at the in-flight cap: {report.not_sent}; "
        f"abandoned: {report.abandoned}; client lag at most {_seconds(report.max_lag_s)})",
        f"answered      {report.answered}  in {_seconds(report.elapsed_s)}",
        f"latency       p50 {_seconds(report.p50_s)}  p95 {_seconds(report.p95_s)}  "
        f"p99 {_seconds(report.p99_s)}  (answered requests)",
    ]
    lines += [f"status {status:<7}{count}" for status, count in report.by_status.items()]
    lines += [f"refused {what:<30}{count}" for what, count in report.refusals.items()]
    for gauge in report.gauges:
        shown = f"{gauge.value:g}" if gauge.value is not None else gauge.detail
        lines.append(f"in-flight gauge {shown} at {gauge.url}")
    if report.passed:
        lines.append("RESULT: PASS")
    elif report.answered == 0:
        lines.append("RESULT: FAIL (no request was answered)")
    else:
        lines.append(f"RESULT: FAIL ({GAUGE} did not return to 0 within {options.settle_s:g}s)")
    return lines


def loadtest_command(
    url: Annotated[str, typer.Argument(help="The gateway's base URL, e.g. http://127.0.0.1:8080.")],
    rate: Annotated[float, typer.Option("--rate", help="Arrivals per second (open loop).")],
    duration: Annotated[float, typer.Option("--duration", help="Seconds of arrivals.")],
    key: Annotated[str, typer.Option("--key", help="The API key to call with.")],
    model: Annotated[str, typer.Option("--model", help="The model alias to ask for.")],
    stream: Annotated[bool, typer.Option("--stream", help="Ask for streamed answers.")] = False,
    max_in_flight: Annotated[
        int, typer.Option("--max-in-flight", help="Most requests open at once.")
    ] = 256,
    timeout: Annotated[float, typer.Option("--timeout", help="Each request's limit (s).")] = 60.0,
    settle: Annotated[
        float, typer.Option("--settle", help="How long the in-flight gauge may take to read 0 (s).")
    ] = 10.0,
    metrics_url: Annotated[
        list[str] | None,
        typer.Option(
            "--metrics-url",
            help="A /metrics URL to read the gauge from (repeat for each replica); "
            "default URL/metrics.",
        ),
    ] = None,
) -> None:
    """Open-loop load at a constant rate: latency percentiles, refusals by status, and a check
    that the gateway's in-flight gauge returns to 0 (exit 1 if it does not)."""
    try:
        options = LoadOptions(
            rate=rate,
            duration=duration,
            max_in_flight=max_in_flight,
            timeout_s=timeout,
            settle_s=settle,
        )
        root = base_url(url)
        metrics = [base_url(m) for m in metrics_url or ()]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    report = asyncio.run(
        run_load(root, options, key=key, model=model, stream=stream, metrics_urls=metrics)
    )
    for line in format_report(root, options, report):
        typer.echo(line)
    if not report.passed:
        raise typer.Exit(1)
