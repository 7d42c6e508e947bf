"""Tests for run reports: percentiles, standard errors, flow balance and the JSON shape."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tidegate.lab.report as report_module
from tidegate.lab.report import ClassReport, Latency, Report, mean_and_stderr, percentile


def class_report(klass: str, **fields: object) -> ClassReport:
    values: dict[str, object] = {
        "klass": klass,
        "offered": 10,
        "admitted": 8,
        "shed": {"queue_full": 2},
        "expired": 1,
        "completed": 6,
        "on_time": 5,
        "late": 1,
        "in_system": 1,
        "waited": 3,
        "started": 7,
        "mean_wait": 0.5,
        "latency": Latency.of([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        "rejection_time_mean": 1.0,
        "rejection_time_max": 3.0,
    }
    values.update(fields)
    return ClassReport(**values)  # type: ignore[arg-type]


def _isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, as ruff's isort-style sort orders them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    assert report_module.__all__ == sorted(report_module.__all__, key=_isort_order)
    for name in report_module.__all__:
        assert hasattr(report_module, name)


def test_percentile_interpolates_between_ranks() -> None:
    """Quantiles interpolate linearly between the ordered values; empty input gives nan."""
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 0.5) == 3.0
    assert percentile(values, 0.95) == pytest.approx(4.8)
    assert percentile(values, 1.0) == 5.0
    assert math.isnan(percentile([], 0.5))
    with pytest.raises(ValueError):
        percentile(values, 1.5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=50), st.floats(0, 1))
def test_percentile_lies_within_the_data(values: list[float], q: float) -> None:
    """Every quantile lies between the smallest and the largest value."""
    ordered = sorted(values)
    assert ordered[0] <= percentile(ordered, q) <= ordered[-1]


def test_mean_and_stderr() -> None:
    """The standard error is the sample standard deviation over the square root of n."""
    mean, stderr = mean_and_stderr([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert stderr == pytest.approx(math.sqrt((1.25 * 4 / 3) / 4))
    with pytest.raises(ValueError):
        mean_and_stderr([1.0])


def test_latency_summary() -> None:
    """A latency summary counts, averages and ranks its values; none gives nans."""
    latency = Latency.of([3.0, 1.0, 2.0])
    assert (latency.count, latency.mean, latency.p50, latency.max) == (3, 2.0, 2.0, 3.0)
    empty = Latency.of([])
    assert empty.count == 0
    assert math.isnan(empty.p95)


@pytest.mark.parametrize("size", [2047, 2048, 5000, 20001])
def test_large_latency_summaries_partition_to_exactly_what_a_sort_gives(size: int) -> None:
    """Above the partition threshold the summary equals the sorted one, bit for bit."""
    rng = random.Random(size)
    values = [rng.expovariate(1.0) for _ in range(size)] + [0.5] * 7  # ties too
    assert Latency.of(values) == Latency.of_sorted(sorted(values))


def test_class_reports_balance_and_total_adds_up() -> None:
    """A class balances when offered = completed + shed + expired + inside; totals add up."""
    a = class_report("critical")
    b = class_report("standard", shed={"deadline_unmeetable": 2}, mean_wait=1.5, started=3)
    assert a.balanced
    assert not class_report("x", offered=11).balanced
    report = Report(
        seed=1,
        warmup=0.0,
        horizon=10.0,
        classes=(a, b),
        latency=Latency.of([1.0, 2.0]),
        throughput=1.2,
        goodput=1.0,
        utilisation=0.5,
        cpu_utilisation=math.nan,
        in_system_mean=2.0,
        passage_rate=1.0,
        time_in_system_mean=2.0,
    )
    total = report.total
    assert total.offered == 20
    assert total.shed == {"deadline_unmeetable": 2, "queue_full": 2}
    assert total.mean_wait == pytest.approx((0.5 * 7 + 1.5 * 3) / 10)
    assert total.balanced
    assert total.latency is report.latency
    assert report.by_class("standard") is b
    with pytest.raises(KeyError):
        report.by_class("batch")
    assert report.littles_law_holds()
    assert report.window == 10.0


def test_reports_turn_into_plain_json() -> None:
    """as_dict() holds only JSON values: nan becomes null, shed reasons are sorted."""
    a = class_report("standard", shed={"z": 1, "a": 1}, offered=10, mean_wait=math.nan)
    report = Report(
        seed=0,
        warmup=0.0,
        horizon=1.0,
        classes=(a,),
        latency=a.latency,
        throughput=0.0,
        goodput=0.0,
        utilisation=0.0,
        cpu_utilisation=math.nan,
        in_system_mean=0.0,
        passage_rate=0.0,
        time_in_system_mean=0.0,
        extra={"note": "x"},
    )
    data = report.as_dict()
    text = json.dumps(data, allow_nan=False)
    assert '"mean_wait": null' in text
    assert list(data["classes"][0]["shed"]) == ["a", "z"]
    assert data["extra"] == {"note": "x"}
