"""Replications on a pool, the MSER-5 warm-up, and the checks that can fail: Little's law from
both sides and stationarity. The oracle cases run through the replication layer too."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tidegate.lab import theory
from tidegate.lab.engine import Fleet, Traffic, simulate
from tidegate.lab.replicate import (
    aggregate,
    littles_check,
    mser5_warmup,
    plain,
    replication_seed,
    run_replications,
    stationarity,
    steady_metrics,
)
from tidegate.lab.stats import Interval
from tidegate.lab.workload import Deterministic, Exponential, Poisson
from tidegate.policy.admission import AdmissionOptions

REPLICATIONS = 10


def fifo(slots: int, queue_cap: int | None = None) -> AdmissionOptions:
    return AdmissionOptions(
        classes=("standard",),
        slots=slots,
        queue_cap=queue_cap,
        mode="queue_cap",
        dequeue="fifo",
        drop_expired_at_dequeue=False,
    )


def one(task: tuple[Traffic, Fleet, float, float], seed: int) -> dict[str, Any]:
    traffic, fleet, horizon, warmup = task
    return steady_metrics(
        simulate(traffic, fleet, horizon=horizon, warmup=warmup, seed=seed, series=100)
    )


def replicated(
    traffic: Traffic, fleet: Fleet, horizon: float, warmup: float | None = None, jobs: int = 1
) -> tuple[float, list[dict[str, Any]]]:
    """The MSER-5 warm-up (unless given) and ten replications' metrics."""
    if warmup is None:
        warmup = mser5_warmup(traffic, fleet, horizon=horizon, seed=0)
    metrics = run_replications(
        one, (traffic, fleet, horizon, warmup), seed=0, replications=REPLICATIONS, workers=jobs
    )
    return warmup, metrics


def within_4_se(metrics: list[dict[str, Any]], key: str, expected: float) -> None:
    values = aggregate([m[key] for m in metrics])
    assert isinstance(values, Interval)
    assert abs(values.mean - expected) <= 4 * values.stderr, (values, expected)
    assert values.stderr < 0.1 * max(abs(expected), 0.01), (values, expected)


# --------------------------------------------------------------------------- replications


def test_replication_seeds_are_distinct_and_fixed() -> None:
    seeds = [replication_seed(0, i) for i in range(100)]
    assert len(set(seeds)) == 100
    assert seeds == [replication_seed(0, i) for i in range(100)]
    assert replication_seed(1, 0) != replication_seed(0, 0)
    with pytest.raises(ValueError):
        replication_seed(0, -1)


def test_one_or_two_pool_workers_give_the_same_results() -> None:
    traffic = Traffic(arrivals=Poisson(rate=6.0))
    fleet = Fleet(admission=fifo(8, 4), io=Exponential(mean=1.0))
    _, serial = replicated(traffic, fleet, 200.0, warmup=20.0, jobs=1)
    _, pooled = replicated(traffic, fleet, 200.0, warmup=20.0, jobs=2)
    assert repr(plain(aggregate(serial))) == repr(plain(aggregate(pooled)))
    assert serial == pooled
    assert len({m["offered"] for m in serial}) > 1  # the replications differ


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="replications"):
        run_replications(one, None, seed=0, replications=0)
    with pytest.raises(ValueError, match="workers"):
        run_replications(one, None, seed=0, replications=2, workers=0)


def test_aggregate_keeps_the_shape() -> None:
    result = aggregate([{"a": 1.0, "b": "x", "c": [1, 2]}, {"a": 3.0, "b": "x", "c": [3, 4]}])
    assert result["a"].mean == 2.0
    assert result["b"] == "x"
    assert result["c"][1].mean == 3.0
    assert aggregate(["x", "y"]) == ["x", "y"]
    assert plain(result)["a"]["n"] == 2


# --------------------------------------------------------------------------- the checks


def test_the_checks_pass_on_a_stable_mmc() -> None:
    """M/M/8 at lambda 6.5: L equals lambda_eff x W within the tolerance, no trend."""
    _, metrics = replicated(
        Traffic(arrivals=Poisson(rate=6.5)),
        Fleet(admission=fifo(8), io=Exponential(mean=1.0)),
        1000.0,
    )
    check = littles_check(metrics)
    assert check.holds, check
    assert check.L.contains(theory.mmc(6.5, 1.0, 8).mean_in_system)
    assert stationarity(metrics).stationary


def test_the_checks_fail_when_arrivals_exceed_capacity() -> None:
    """M/M/8 at lambda 9: the queue grows, so L runs ahead of what departures say, and the
    number in the system trends up across the window."""
    _, metrics = replicated(
        Traffic(arrivals=Poisson(rate=9.0)),
        Fleet(admission=fifo(8), io=Exponential(mean=1.0)),
        600.0,
    )
    check = littles_check(metrics)
    assert not check.holds
    assert check.difference.low > 0
    steady = stationarity(metrics)
    assert not steady.stationary
    assert steady.warning is not None
    assert steady.warning.startswith("not stationary: arrivals exceed capacity")


def test_the_check_fails_when_the_warm_up_is_not_deleted() -> None:
    """Many long services: the system takes a few service times to fill. Measured from an
    empty start, the window holds the transient and Little's law from the departures fails;
    with the warm-up MSER-5 chooses on a long enough run it holds."""
    traffic = Traffic(arrivals=Poisson(rate=7.5))
    fleet = Fleet(admission=fifo(200), io=Exponential(mean=20.0))
    _, wrong = replicated(traffic, fleet, 400.0, warmup=0.0)
    assert not littles_check(wrong).holds
    warmup, right = replicated(traffic, fleet, 1000.0)
    assert warmup > 0
    assert littles_check(right).holds


# --------------------------------------------------------------------------- oracles


def test_erlang_b_and_c_through_the_replication_layer() -> None:
    """M/M/8/8 blocking (Erlang B) and M/M/8 P(wait) and mean wait (Erlang C)."""
    _, loss = replicated(
        Traffic(arrivals=Poisson(rate=6.5)),
        Fleet(admission=fifo(8, 0), io=Exponential(mean=1.0)),
        1200.0,
    )
    within_4_se(loss, "shed_share", theory.erlang_b(8, 6.5))
    _, wait = replicated(
        Traffic(arrivals=Poisson(rate=6.5)),
        Fleet(admission=fifo(8), io=Exponential(mean=1.0)),
        1500.0,
    )
    expected = theory.mmc(6.5, 1.0, 8)
    within_4_se(wait, "p_wait", expected.p_wait)
    within_4_se(wait, "mean_wait", expected.mean_wait)


def test_mmck_erlang_a_and_md1_through_the_replication_layer() -> None:
    _, finite = replicated(
        Traffic(arrivals=Poisson(rate=6.5)),
        Fleet(admission=fifo(8, 4), io=Exponential(mean=1.0)),
        1200.0,
    )
    within_4_se(finite, "shed_share", theory.mmck_blocking(6.5, 1.0, 8, 12))
    _, patient = replicated(
        Traffic(arrivals=Poisson(rate=9.0), patience=Exponential(mean=2.0), on_deadline="leave"),
        Fleet(admission=fifo(8), io=Exponential(mean=1.0)),
        1000.0,
    )
    within_4_se(patient, "expired_share", theory.erlang_a(9.0, 1.0, 8, 0.5).p_abandon)
    _, constant = replicated(
        Traffic(arrivals=Poisson(rate=0.7)),
        Fleet(admission=fifo(1), io=Deterministic(value=1.0)),
        6000.0,
    )
    within_4_se(constant, "mean_wait", theory.pollaczek_khinchine(0.7, 1.0, 0.0).mean_wait)


def test_round_robin_matches_ekmck_and_shortest_queue_the_pooled_loss() -> None:
    """Four workers of 8 slots and no waiting room at 26 req/s: round-robin gives each worker
    Erlang-4 gaps (E_4/M/8/8); shortest-queue dispatch is one loss system of 32 servers."""
    traffic = Traffic(arrivals=Poisson(rate=26.0))
    for dispatch, expected in (
        ("round_robin", theory.ekmck(26.0 / 4, 1.0, 8, 4, 8).p_block),
        ("shortest_queue", theory.erlang_b(32, 26.0)),
    ):
        fleet = Fleet(admission=fifo(8, 0), io=Exponential(mean=1.0), workers=4, dispatch=dispatch)  # type: ignore[arg-type]
        _, metrics = replicated(traffic, fleet, 400.0)
        within_4_se(metrics, "shed_share", expected)
    assert theory.ekmck(6.5, 1.0, 8, 4, 8).p_block < theory.erlang_b(8, 6.5)
    assert theory.erlang_b(32, 26.0) < theory.ekmck(6.5, 1.0, 8, 4, 8).p_block


def test_sojourn_and_departures_are_reported() -> None:
    report = simulate(
        Traffic(arrivals=Poisson(rate=5.0)),
        Fleet(admission=fifo(8), io=Exponential(mean=1.0)),
        horizon=300.0,
        warmup=30.0,
        series=30,
    )
    assert report.departure_rate == pytest.approx(5.0, rel=0.15)
    assert report.sojourn_mean == pytest.approx(1.0, rel=0.15)
    assert len(report.in_system_series) == 30
    assert len(report.window_series()) == 27
    area = math.fsum(report.window_series()) * report.series_step / report.window
    assert area == pytest.approx(report.in_system_mean)
    assert report.as_dict()["littles_law"]["difference"] == report.littles_difference
