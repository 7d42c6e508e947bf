"""Tests for the lab's arrival processes, service-time distributions and trace files."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tidegate.lab.workload as workload_module
from tidegate.lab.workload import (
    ClosedLoop,
    Constant,
    Deterministic,
    Empirical,
    Exponential,
    LogNormal,
    Piecewise,
    Poisson,
    Trace,
    TraceRecord,
    load_trace,
    parse_distribution,
)


def draws(
    sampler_owner: Exponential | Deterministic | LogNormal | Empirical, n: int
) -> list[float]:
    draw = sampler_owner.sampler(random.Random(1))
    return [draw() for _ in range(n)]


def _isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, as ruff's isort-style sort orders them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    assert workload_module.__all__ == sorted(workload_module.__all__, key=_isort_order)
    for name in workload_module.__all__:
        assert hasattr(workload_module, name)


@pytest.mark.parametrize(
    "distribution",
    [
        Exponential(mean=0.8),
        Deterministic(value=1.5),
        LogNormal(mean=2.0, scv=1.5),
        Empirical(values=(0.5, 1.0, 3.0)),
    ],
)
def test_samples_have_the_declared_mean_and_variability(
    distribution: Exponential | Deterministic | LogNormal | Empirical,
) -> None:
    """Each distribution's draws average to its mean and spread as its scv says."""
    values = draws(distribution, 40_000)
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / len(values)
    assert mean == pytest.approx(distribution.mean, rel=0.03)
    assert variance / mean**2 == pytest.approx(distribution.scv, rel=0.12, abs=1e-9)
    assert min(values) >= 0.0


def test_lognormal_median_and_sigma_follow_from_mean_and_scv() -> None:
    """A log-normal of mean 2 and scv 3 has sigma sqrt(ln 4) and median 2 / 2."""
    shape = LogNormal(mean=2.0, scv=3.0)
    assert shape.sigma == math.sqrt(math.log(4.0))
    assert shape.median == 1.0


def test_the_same_rng_seed_draws_the_same_numbers() -> None:
    """Samplers read only the rng they are given: the same seed, the same sequence."""
    first = Exponential(mean=1.0).sampler(random.Random(7))
    second = Exponential(mean=1.0).sampler(random.Random(7))
    assert [first() for _ in range(5)] == [second() for _ in range(5)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("exp:0.8", Exponential(mean=0.8)),
        ("exponential:2", Exponential(mean=2.0)),
        ("det:1", Deterministic(value=1.0)),
        ("1.5", Deterministic(value=1.5)),
        ("lognormal:0.8,2", LogNormal(mean=0.8, scv=2.0)),
        ("lognormal:0.8", LogNormal(mean=0.8, scv=1.0)),
    ],
)
def test_distributions_parse_from_short_specs(text: str, expected: object) -> None:
    """The CLI's distribution specs name a kind and its parameters."""
    assert parse_distribution(text) == expected


@pytest.mark.parametrize("text", ["", "exp", "exp:a", "gamma:1", "exp:1,2", "exp:-1"])
def test_bad_distribution_specs_are_refused(text: str) -> None:
    """An unreadable or invalid spec raises ValueError."""
    with pytest.raises(ValueError):
        parse_distribution(text)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Exponential(mean=0.0),
        lambda: Deterministic(value=-1.0),
        lambda: LogNormal(mean=1.0, scv=0.0),
        lambda: Empirical(values=()),
        lambda: Poisson(rate=0.0),
        lambda: Constant(rate=math.inf),
        lambda: Piecewise(steps=((1.0, 2.0),)),
        lambda: Piecewise(steps=((0.0, 2.0), (0.0, 3.0))),
        lambda: Piecewise(steps=((0.0, -2.0),)),
        lambda: ClosedLoop(clients=0, think=Exponential(mean=1.0)),
        lambda: Trace(records=()),
    ],
)
def test_invalid_descriptions_are_refused(build: object) -> None:
    """Every description validates its fields on construction."""
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]


def test_poisson_and_constant_streams_have_their_rate() -> None:
    """Poisson gaps average 1 / rate; constant arrivals are exactly 1 / rate apart."""
    following = Poisson(rate=4.0).stream(random.Random(3))
    t, count = 0.0, 0
    while (t := following(t)) < 1000.0:
        count += 1
    assert count == pytest.approx(4000, rel=0.05)
    constant = Constant(rate=4.0).stream(random.Random(3))
    times = [constant(0.0) for _ in range(8)]
    assert times == [0.25 * k for k in range(1, 9)]


@settings(max_examples=40, deadline=None)
@given(
    rates=st.lists(
        st.one_of(st.just(0.0), st.floats(min_value=0.01, max_value=20.0)), min_size=1, max_size=4
    ),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_piecewise_arrivals_increase_and_never_fall_in_a_silent_step(
    rates: list[float], seed: int
) -> None:
    """Piecewise arrivals are increasing, and none falls in a step whose rate is zero."""
    steps = tuple((10.0 * i, rate) for i, rate in enumerate(rates))
    process = Piecewise(steps=steps)
    following = process.stream(random.Random(seed))
    t, previous = 0.0, -1.0
    for _ in range(200):
        t = following(t)
        if math.isinf(t):
            break
        assert t > previous
        assert process.rate_at(t) > 0
        previous = t
    if rates[-1] > 0:
        assert not math.isinf(t)


def test_piecewise_mean_rate_weights_each_step_by_its_length() -> None:
    """Ten seconds at 2 and thirty at 6 average 5 per second over forty seconds."""
    process = Piecewise(steps=((0.0, 2.0), (10.0, 6.0)))
    assert process.mean_rate(40.0) == 5.0
    assert process.rate_at(9.999) == 2.0
    assert process.rate_at(10.0) == 6.0


def test_a_trace_is_sorted_and_offers_its_latencies() -> None:
    """Trace records are kept in time order; their latencies form an empirical distribution."""
    trace = Trace(
        records=(
            TraceRecord(at=2.0, latency=3.0),
            TraceRecord(at=1.0, latency=1.0),
            TraceRecord(at=3.0),
        )
    )
    assert [r.at for r in trace.records] == [1.0, 2.0, 3.0]
    assert trace.latencies() == Empirical(values=(1.0, 3.0))
    assert trace.mean_rate(10.0) == 0.3


def test_load_trace_reads_jsonl_and_shifts_to_zero(tmp_path: Path) -> None:
    """A JSONL trace gives one record per line, times shifted so the first arrives at 0."""
    path = tmp_path / "trace.jsonl"
    rows = [
        {"t": 100.5, "class": "critical", "tenant": "acme", "tokens": 30, "latency": 1.2},
        {"at": 100.0, "priority": "batch", "prompt_tokens": 10, "completion_tokens": 5},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    trace = load_trace(path)
    first, second = trace.records
    assert (first.at, first.klass, first.tokens, first.latency) == (0.0, "batch", 15, None)
    assert (second.at, second.klass, second.tenant, second.latency) == (
        0.5,
        "critical",
        "acme",
        1.2,
    )


def test_load_trace_reads_gateway_log_lines(tmp_path: Path) -> None:
    """A gateway log line's arrival is its end timestamp less its duration; other lines skip."""
    path = tmp_path / "gateway.log"
    lines = [
        {"event": "startup", "timestamp": "2026-01-01T00:00:00Z"},
        {
            "event": "request",
            "timestamp": "2026-01-01T00:00:10Z",
            "duration_s": 2.0,
            "outcome": "provider_timeout",
            "tenant": "acme",
            "request_id": "r1",
        },
        {"event": "request", "timestamp": "2026-01-01T00:00:09+00:00", "duration_s": 0.5},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines), encoding="utf-8")
    records = load_trace(path).records
    assert [(r.at, r.outcome, r.latency) for r in records] == [
        (0.0, "provider_timeout", 2.0),
        (0.5, "ok", 0.5),
    ]
    assert records[0].request_id == "r1"


def test_load_trace_reads_csv(tmp_path: Path) -> None:
    """A CSV trace with a header row reads the same fields."""
    path = tmp_path / "trace.csv"
    path.write_text("at,class,tenant,latency,outcome\n5,standard,a,0.4,ok\n6,critical,b,,ok\n")
    records = load_trace(path).records
    assert [(r.at, r.klass, r.latency) for r in records] == [
        (0.0, "standard", 0.4),
        (1.0, "critical", None),
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json\n", r"no requests \(1 lines skipped"),
        ("[1, 2]\n", r"no requests \(1 lines skipped"),
        ('{"class": "standard"}\n', "trace.jsonl:1: no arrival time"),
        ('{"timestamp": "yesterday"}\n', "ISO 8601"),
        ('{"at": "soon"}\n', "trace.jsonl:1: at must be a number, got 'soon'"),
        ("\n", "no requests$"),
    ],
)
def test_bad_trace_files_name_the_line(tmp_path: Path, content: str, message: str) -> None:
    """A trace that cannot be read raises ValueError naming the file and line."""
    path = tmp_path / "trace.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        load_trace(path)


def _request_line(**fields: object) -> dict[str, object]:
    line: dict[str, object] = {
        "event": "request",
        "timestamp": "2026-01-01T00:00:10Z",
        "duration_s": 1.0,
        "outcome": "ok",
    }
    line.update(fields)
    return line


def test_a_raw_gateway_log_skips_and_counts_what_is_not_a_request(tmp_path: Path) -> None:
    """The start-up banner, uvicorn's text lines and JSON lines of other events are skipped and
    counted; the request lines give their class (priority) and deadline (deadline_ms)."""
    path = tmp_path / "gateway.log"
    lines = [
        "tidegate listening on http://0.0.0.0:8080 (profile production, state sqlite:///x.db)",
        "INFO:     Started server process [7]",
        json.dumps({"event": "startup", "timestamp": "2026-01-01T00:00:00Z"}),
        json.dumps(_request_line(priority="critical", deadline_ms=2500, tenant="acme")),
        "",
        json.dumps(["not", "an", "object"]),
        json.dumps({"event": "internal_error", "request_id": "r9"}),
        json.dumps(_request_line(timestamp="2026-01-01T00:00:12Z", priority=None)),
        "INFO:     Shutting down",
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    trace = load_trace(path)
    assert trace.skipped == 6
    first, second = trace.records
    assert (first.at, first.klass, first.deadline, first.tenant) == (0.0, "critical", 2.5, "acme")
    assert (second.at, second.klass, second.deadline) == (2.0, "standard", None)


def test_an_older_log_without_priority_or_deadline_reads_as_standard(tmp_path: Path) -> None:
    """A line written before the log had priority and deadline_ms: standard, no deadline."""
    path = tmp_path / "old.log"
    path.write_text(json.dumps(_request_line()) + "\n", encoding="utf-8")
    (record,) = load_trace(path).records
    assert (record.klass, record.deadline, record.latency) == ("standard", None, 1.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"duration_s": -0.5}, "duration_s must be >= 0, got -0.5"),
        ({"duration_s": float("nan")}, "duration_s must be a finite number, got nan"),
        ({"duration_s": float("inf")}, "duration_s must be a finite number, got inf"),
        ({"duration_s": "1e999"}, "duration_s must be a finite number, got '1e999'"),
        ({"duration_s": True}, "duration_s must be a number, got True"),
        ({"duration_s": [1]}, "duration_s must be a number, got [1]"),
        ({"deadline_ms": -1}, "deadline_ms must be >= 0, got -1"),
        ({"deadline_ms": "soon"}, "deadline_ms must be a number, got 'soon'"),
        ({"priority": 3}, "priority must be a string, got 3"),
        ({"tenant": {"id": 1}}, "tenant must be a string"),
        ({"prompt_tokens": -3}, "prompt_tokens must be a whole number >= 0, got -3"),
        ({"tokens": "many"}, "tokens must be a whole number >= 0, got 'many'"),
        ({"timestamp": None}, "no arrival time"),
    ],
)
def test_a_bad_request_line_names_the_file_the_line_and_the_field(
    tmp_path: Path, fields: dict[str, object], message: str
) -> None:
    """A negative, nan or infinite latency, a wrong type or a missing arrival is a ValueError
    naming ``file:line`` and the field, not a traceback from inside the replay."""
    path = tmp_path / "gateway.log"
    lines = ["tidegate listening on http://0.0.0.0:8080", json.dumps(_request_line())]
    lines.append(json.dumps(_request_line(**fields)))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: {message}")):
        load_trace(path)


def test_a_bad_csv_cell_names_the_row(tmp_path: Path) -> None:
    """A CSV trace's rows are checked the same way, named by their line in the file."""
    path = tmp_path / "trace.csv"
    path.write_text("at,latency\n0,0.5\n1,-2\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: latency must be >= 0")):
        load_trace(path)
