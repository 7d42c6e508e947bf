"""What arrives and how long it takes: arrival processes, service-time distributions, traces.

Everything here is a plain description (frozen dataclasses). The engine turns a description into
a sampler bound to one seeded :class:`random.Random`, so a description can be shared between runs
and every run with the same seed draws the same numbers.

Arrivals are open-loop (:class:`Poisson`, :class:`Constant`, :class:`Piecewise`, :class:`Trace`:
requests keep coming however slow the service is, as in a campaign) or closed-loop
(:class:`ClosedLoop`: a fixed set of clients, each waiting for its answer and thinking before it
asks again, which slows down with the service and hides overload).

Service times are :class:`Exponential`, :class:`Deterministic`, :class:`LogNormal` or
:class:`Empirical` (drawn from observed values, e.g. the latencies of a trace).
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeAlias

__all__ = [
    "Arrivals",
    "ClosedLoop",
    "Constant",
    "Deterministic",
    "Distribution",
    "Empirical",
    "Exponential",
    "LogNormal",
    "Piecewise",
    "Poisson",
    "Sampler",
    "Stream",
    "Trace",
    "TraceRecord",
    "load_trace",
    "parse_distribution",
]


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_non_negative(name: str, value: float) -> None:
    if isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


# --------------------------------------------------------------------------- samplers


class Sampler:
    """Draws one time per call, from the random stream it was made with.

    Call it (``sampler()``) or call ``draw()``: the engine does the latter, which the compiled
    build turns into a direct call that returns an unboxed float.
    """

    __slots__ = ()

    def draw(self) -> float:
        raise NotImplementedError

    def __call__(self) -> float:
        return self.draw()


class Stream:
    """Gives the next arrival time after the previous one (``stream(previous)`` or
    ``following(previous)``), from the random stream it was made with."""

    __slots__ = ()

    def following(self, previous: float) -> float:
        raise NotImplementedError

    def __call__(self, previous: float) -> float:
        return self.following(previous)


class _ExponentialSampler(Sampler):
    __slots__ = ("_mean", "_rnd")

    def __init__(self, rnd: Callable[[], float], mean: float) -> None:
        self._rnd = rnd
        self._mean = mean

    def draw(self) -> float:
        return -math.log(1.0 - self._rnd()) * self._mean


class _DeterministicSampler(Sampler):
    __slots__ = ("_value",)

    def __init__(self, value: float) -> None:
        self._value = value

    def draw(self) -> float:
        return self._value


class _LogNormalSampler(Sampler):
    __slots__ = ("_gauss", "_mu", "_sigma")

    def __init__(self, gauss: Callable[[float, float], float], mu: float, sigma: float) -> None:
        self._gauss = gauss
        self._mu = mu
        self._sigma = sigma

    def draw(self) -> float:
        return math.exp(self._mu + self._sigma * self._gauss(0.0, 1.0))


class _EmpiricalSampler(Sampler):
    __slots__ = ("_n", "_rnd", "_values")

    def __init__(self, rnd: Callable[[], float], values: tuple[float, ...]) -> None:
        self._rnd = rnd
        self._values = values
        self._n = len(values)

    def draw(self) -> float:
        return self._values[int(self._rnd() * self._n)]


class _PoissonStream(Stream):
    __slots__ = ("_mean_gap", "_rnd")

    def __init__(self, rnd: Callable[[], float], mean_gap: float) -> None:
        self._rnd = rnd
        self._mean_gap = mean_gap

    def following(self, previous: float) -> float:
        return previous - math.log(1.0 - self._rnd()) * self._mean_gap


class _ConstantStream(Stream):
    __slots__ = ("_count", "_gap")

    def __init__(self, gap: float) -> None:
        self._gap = gap
        self._count = 0

    def following(self, previous: float) -> float:
        # Counting avoids the drift of adding the gap again and again.
        del previous
        self._count += 1
        return self._count * self._gap


class _PiecewiseStream(Stream):
    __slots__ = ("_bounds", "_rates", "_rnd")

    def __init__(self, rnd: Callable[[], float], bounds: list[float], rates: list[float]) -> None:
        self._rnd = rnd
        self._bounds = bounds
        self._rates = rates

    def following(self, previous: float) -> float:
        # Exponential gaps are memoryless, so a gap that crosses a boundary is redrawn from the
        # boundary at the new rate: exact for a piecewise-constant rate.
        bounds, rates = self._bounds, self._rates
        now = previous
        index = 0
        while bounds[index] <= now:
            index += 1
        while True:
            rate = rates[index]
            if rate > 0:
                candidate = now - math.log(1.0 - self._rnd()) / rate
                if candidate < bounds[index]:
                    return candidate
            now = bounds[index]
            if now == math.inf:
                return math.inf
            index += 1


# --------------------------------------------------------------------------- distributions


@dataclass(frozen=True, slots=True, kw_only=True)
class Exponential:
    """Exponential times with the given mean (memoryless: the M in M/M/c)."""

    mean: float

    def __post_init__(self) -> None:
        _check_positive("mean", self.mean)

    @property
    def scv(self) -> float:
        """Squared coefficient of variation: variance over squared mean."""
        return 1.0

    def sampler(self, rng: random.Random) -> Sampler:
        """A sampler drawing one time per call from ``rng``."""
        return _ExponentialSampler(rng.random, self.mean)


@dataclass(frozen=True, slots=True, kw_only=True)
class Deterministic:
    """The same time every time (the D in M/D/1)."""

    value: float

    def __post_init__(self) -> None:
        _check_non_negative("value", self.value)

    @property
    def mean(self) -> float:
        return self.value

    @property
    def scv(self) -> float:
        return 0.0

    def sampler(self, rng: random.Random) -> Sampler:
        del rng  # nothing to draw
        return _DeterministicSampler(self.value)


@dataclass(frozen=True, slots=True, kw_only=True)
class LogNormal:
    """Log-normal times with the given mean and squared coefficient of variation.

    Model latencies are skewed: most calls are near the median and a few take much longer. An
    ``scv`` of 1 has the variance of an exponential with a heavier tail.
    """

    mean: float
    scv: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("mean", self.mean)
        _check_positive("scv", self.scv)

    @property
    def sigma(self) -> float:
        """The standard deviation of the underlying normal."""
        return math.sqrt(math.log1p(self.scv))

    @property
    def median(self) -> float:
        return self.mean / math.sqrt(1.0 + self.scv)

    def sampler(self, rng: random.Random) -> Sampler:
        return _LogNormalSampler(rng.gauss, math.log(self.median), self.sigma)


@dataclass(frozen=True, slots=True, kw_only=True)
class Empirical:
    """Times drawn uniformly, with replacement, from observed values."""

    values: tuple[float, ...]

    def __post_init__(self) -> None:
        values = tuple(float(v) for v in self.values)
        if not values:
            raise ValueError("values must hold at least one observed time")
        for value in values:
            _check_non_negative("values", value)
        object.__setattr__(self, "values", values)

    @property
    def mean(self) -> float:
        return math.fsum(self.values) / len(self.values)

    @property
    def scv(self) -> float:
        mean = self.mean
        if mean == 0:
            return 0.0
        variance = math.fsum((v - mean) ** 2 for v in self.values) / len(self.values)
        return variance / (mean * mean)

    def sampler(self, rng: random.Random) -> Sampler:
        return _EmpiricalSampler(rng.random, self.values)


Distribution: TypeAlias = Exponential | Deterministic | LogNormal | Empirical


def parse_distribution(text: str) -> Distribution:
    """A distribution from a short spec: ``exp:0.8``, ``det:1``, ``lognormal:0.8,2``, a number.

    A bare number is deterministic. ``lognormal:MEAN,SCV`` takes the mean and the squared
    coefficient of variation.
    """
    kind, _, args = text.strip().partition(":")
    try:
        if not args:
            return Deterministic(value=float(kind))
        numbers = [float(part) for part in args.split(",")]
    except ValueError:
        raise ValueError(f"cannot read a distribution from {text!r}") from None
    kind = kind.lower()
    if kind in ("exp", "exponential") and len(numbers) == 1:
        return Exponential(mean=numbers[0])
    if kind in ("det", "deterministic", "const") and len(numbers) == 1:
        return Deterministic(value=numbers[0])
    if kind in ("lognormal", "lognorm") and len(numbers) in (1, 2):
        return LogNormal(mean=numbers[0], scv=numbers[1] if len(numbers) == 2 else 1.0)
    raise ValueError(
        f"cannot read a distribution from {text!r}: use exp:MEAN, det:VALUE or lognormal:MEAN,SCV"
    )


# --------------------------------------------------------------------------- arrivals


@dataclass(frozen=True, slots=True, kw_only=True)
class Poisson:
    """Open-loop arrivals at ``rate`` per second with exponential gaps (the first M)."""

    rate: float

    def __post_init__(self) -> None:
        _check_positive("rate", self.rate)

    def mean_rate(self, horizon: float) -> float:
        del horizon
        return self.rate

    def stream(self, rng: random.Random) -> Stream:
        """A stream from the previous arrival time to the next one."""
        return _PoissonStream(rng.random, 1.0 / self.rate)


@dataclass(frozen=True, slots=True, kw_only=True)
class Constant:
    """Open-loop arrivals exactly ``1 / rate`` seconds apart, the first at ``1 / rate``."""

    rate: float

    def __post_init__(self) -> None:
        _check_positive("rate", self.rate)

    def mean_rate(self, horizon: float) -> float:
        del horizon
        return self.rate

    def stream(self, rng: random.Random) -> Stream:
        del rng
        return _ConstantStream(1.0 / self.rate)


@dataclass(frozen=True, slots=True, kw_only=True)
class Piecewise:
    """Poisson arrivals whose rate changes at given times: a surge, a ramp in steps, a lull.

    ``steps`` are ``(start time, rate)`` pairs in increasing time, the first starting at 0; each
    rate holds until the next start. A rate of 0 is a silence.
    """

    steps: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        steps = tuple((float(start), float(rate)) for start, rate in self.steps)
        if not steps or steps[0][0] != 0.0:
            raise ValueError(f"steps must start at time 0, got {self.steps!r}")
        for (start, rate), following in zip(steps, (*steps[1:], None), strict=True):
            _check_non_negative("steps rate", rate)
            if following is not None and following[0] <= start:
                raise ValueError(f"steps must have increasing start times, got {self.steps!r}")
        object.__setattr__(self, "steps", steps)

    def rate_at(self, when: float) -> float:
        """The arrival rate in force at ``when``."""
        current = self.steps[0][1]
        for start, rate in self.steps:
            if start > when:
                break
            current = rate
        return current

    def mean_rate(self, horizon: float) -> float:
        """The average rate over ``[0, horizon]``."""
        total = 0.0
        for (start, rate), following in zip(self.steps, (*self.steps[1:], None), strict=True):
            end = horizon if following is None else min(horizon, following[0])
            if end > start:
                total += rate * (end - start)
        return total / horizon

    def stream(self, rng: random.Random) -> Stream:
        steps = self.steps
        bounds = [start for start, _ in steps[1:]] + [math.inf]
        return _PiecewiseStream(rng.random, bounds, [rate for _, rate in steps])


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRecord:
    """One request of a recorded or scripted trace.

    ``at`` is seconds from the start of the trace. ``latency`` is how long the provider took (the
    service time when the trace drives service); ``outcome`` is ``"ok"`` or the gateway's
    outcome code (``"provider_timeout"``, ``"queue_full"``, ...).
    """

    at: float
    klass: str = "standard"
    tenant: str = "default"
    user: str = ""
    tokens: int = 0
    latency: float | None = None
    outcome: str = "ok"
    request_id: str = ""
    #: Seconds the request could take in all, as its gateway log line recorded it
    #: (``deadline_ms``: the caller's deadline or the configured one); None when not recorded.
    deadline: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """Arrivals replayed from records, in time order."""

    records: tuple[TraceRecord, ...]
    #: Lines of the file read that were not requests (a gateway log's start-up banner,
    #: uvicorn's text lines, other events), skipped.
    skipped: int = 0

    def __post_init__(self) -> None:
        records = tuple(sorted(self.records, key=lambda r: r.at))
        if not records:
            raise ValueError("records must hold at least one request")
        if records[0].at < 0:
            raise ValueError(f"records must not start before 0, got {records[0].at!r}")
        object.__setattr__(self, "records", records)

    def mean_rate(self, horizon: float) -> float:
        return sum(1 for r in self.records if r.at < horizon) / horizon

    def latencies(self) -> Empirical:
        """The recorded latencies, as a distribution for requests the trace did not time."""
        values = tuple(r.latency for r in self.records if r.latency is not None)
        return Empirical(values=values or (0.0,))


Arrivals: TypeAlias = Poisson | Constant | Piecewise | Trace


@dataclass(frozen=True, slots=True, kw_only=True)
class ClosedLoop:
    """``clients`` clients, each asking, waiting for its answer or refusal, thinking, asking again."""

    clients: int
    think: Distribution

    def __post_init__(self) -> None:
        if isinstance(self.clients, bool) or not isinstance(self.clients, int) or self.clients < 1:
            raise ValueError(f"clients must be an integer >= 1, got {self.clients!r}")


# --------------------------------------------------------------------------- trace files

_TIME_KEYS = ("at", "t", "ts", "arrival", "arrival_s", "time")
_LATENCY_KEYS = ("latency", "latency_s", "duration_s", "service_s")


def _pick(row: Mapping[str, Any], keys: Iterable[str]) -> tuple[str, Any]:
    """The first of ``keys`` the row gives a value for, and that value (``("", None)``: none)."""
    for key in keys:
        value = row.get(key)
        if value not in (None, ""):
            return key, value
    return "", None


def _number(value: Any, name: str, where: str, *, minimum: float | None = None) -> float:
    """A finite number (JSON's, or a CSV cell's text), at least ``minimum`` when one is given."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{where}: {name} must be a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{where}: {name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum:g}, got {value!r}")
    return number


def _count(value: Any, name: str, where: str) -> int:
    """A whole number >= 0 (JSON's, or a CSV cell's text)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {name} must be a whole number >= 0, got {value!r}")
    return value


def _text(row: Mapping[str, Any], keys: Iterable[str], default: str, where: str) -> str:
    name, value = _pick(row, keys)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ValueError(f"{where}: {name} must be a string, got {value!r}")
    return value


def _arrival(row: Mapping[str, Any], latency: float | None, where: str) -> float:
    name, at = _pick(row, _TIME_KEYS)
    if at is not None:
        return _number(at, name, where)
    stamp = row.get("timestamp")
    if isinstance(stamp, str) and stamp:
        # A gateway log line is written when the request ends: it arrived duration_s earlier.
        try:
            ended = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise ValueError(f"{where}: timestamp {stamp!r} is not ISO 8601") from None
        return ended - (latency or 0.0)
    raise ValueError(f"{where}: no arrival time (one of {', '.join(_TIME_KEYS)}, or timestamp)")


def _tokens(row: Mapping[str, Any], where: str) -> int:
    tokens = row.get("tokens")
    if tokens not in (None, ""):
        return _count(tokens, "tokens", where)
    parts = ("prompt_tokens", "completion_tokens")
    return sum(_count(row[p], p, where) for p in parts if row.get(p) not in (None, ""))


def _record(row: Mapping[str, Any], where: str) -> TraceRecord:
    """One request of a trace, every field checked: a bad one raises ``ValueError`` naming
    ``where`` (the file and line) and the field."""
    name, raw = _pick(row, _LATENCY_KEYS)
    latency = None if raw is None else _number(raw, name, where, minimum=0.0)
    deadline_ms = row.get("deadline_ms")
    deadline = None
    if deadline_ms not in (None, ""):
        deadline = _number(deadline_ms, "deadline_ms", where, minimum=0.0) / 1000.0
    return TraceRecord(
        at=_arrival(row, latency, where),
        klass=_text(row, ("class", "klass", "priority"), "standard", where),
        tenant=_text(row, ("tenant",), "default", where),
        user=_text(row, ("user",), "", where),
        tokens=_tokens(row, where),
        latency=latency,
        outcome=_text(row, ("outcome",), "ok", where),
        request_id=_text(row, ("request_id",), "", where),
        deadline=deadline,
    )


def _log_rows(path: Path, lines: Iterable[str]) -> tuple[list[tuple[str, Mapping[str, Any]]], int]:
    """The request rows of JSON lines, each with its ``file:line``, and how many lines were
    skipped: those that are not a JSON object (a start-up banner, uvicorn's text lines) and the
    objects whose ``event`` is not ``request``. Blank lines are neither."""
    rows: list[tuple[str, Mapping[str, Any]]] = []
    skipped = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            parsed: Any = json.loads(line)
        except ValueError:  # not JSON (JSONDecodeError), or JSON too deep to read
            parsed = None
        if not isinstance(parsed, dict) or parsed.get("event", "request") != "request":
            skipped += 1
            continue
        rows.append((f"{path}:{number}", parsed))
    return rows, skipped


def load_trace(path: str | Path) -> Trace:
    """Read a trace from JSON lines (``.jsonl``, or a raw gateway log) or CSV (``.csv``) with a
    header row.

    Each request needs an arrival time (``at``, ``t``, ``ts`` or ``arrival``, seconds; or the
    ISO ``timestamp`` of a gateway log line, which marks the end, less ``duration_s``) and may
    give ``class`` (or the gateway log's ``priority``; standard without one), ``tenant``,
    ``user``, ``tokens`` (or ``prompt_tokens`` and ``completion_tokens``), ``latency`` (or
    ``duration_s``), ``outcome``, ``request_id`` and ``deadline_ms`` (the gateway log's: the
    request's deadline; without one a replay uses the config's). Of JSON lines, those that are
    not a JSON object and those whose ``event`` is not ``request`` are skipped and counted
    (:attr:`Trace.skipped`). A request with a bad field (a negative, nan or infinite latency, a
    number that is not one, a missing arrival time) raises ``ValueError`` naming the file, the
    line and the field. Times are shifted so that the first request arrives at 0.
    """
    path = Path(path)
    skipped = 0
    with path.open(encoding="utf-8", newline="") as handle:
        if path.suffix.lower() == ".csv":
            rows: list[tuple[str, Mapping[str, Any]]] = [
                (f"{path}:{number}", row)
                for number, row in enumerate(csv.DictReader(handle), start=2)
            ]
        else:
            rows, skipped = _log_rows(path, handle)
    records = [_record(row, where) for where, row in rows]
    if not records:
        why = f" ({skipped} lines skipped: not JSON objects or not requests)" if skipped else ""
        raise ValueError(f"{path}: no requests{why}")
    return _shifted(records, skipped)


def _shifted(records: Sequence[TraceRecord], skipped: int = 0) -> Trace:
    start = min(r.at for r in records)
    return Trace(
        records=tuple(
            TraceRecord(
                at=r.at - start,
                klass=r.klass,
                tenant=r.tenant,
                user=r.user,
                tokens=r.tokens,
                latency=r.latency,
                outcome=r.outcome,
                request_id=r.request_id,
                deadline=r.deadline,
            )
            for r in records
        ),
        skipped=skipped,
    )
