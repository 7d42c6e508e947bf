"""Tests for the virtual-time engine: queueing theory, Little's law, flow balance, determinism."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest

import tidegate.lab.engine as engine_module
from tidegate.clock import ManualClock
from tidegate.lab import theory
from tidegate.lab.engine import EventQueue, Fleet, Simulation, Traffic, ceiling, simulate
from tidegate.lab.report import Report, mean_and_stderr
from tidegate.lab.workload import (
    ClosedLoop,
    Constant,
    Deterministic,
    Exponential,
    LogNormal,
    Piecewise,
    Poisson,
    Trace,
    TraceRecord,
)
from tidegate.policy.admission import AdmissionController, AdmissionOptions
from tidegate.testing import compiled

REPLICATIONS = 10


def fifo(slots: int, queue_cap: int | None = None, **fields: Any) -> AdmissionOptions:
    """A one-class FIFO controller with ``slots`` servers and ``queue_cap`` waiting places."""
    return AdmissionOptions(
        classes=("standard",),
        slots=slots,
        queue_cap=queue_cap,
        mode="queue_cap",
        dequeue="fifo",
        drop_expired_at_dequeue=False,
        service_rate=float(slots),
        **fields,
    )


def replicate(run: Callable[[int], float]) -> tuple[float, float]:
    """Mean and standard error of ``run(seed)`` over the replications."""
    return mean_and_stderr([run(seed) for seed in range(REPLICATIONS)])


def assert_within(values: tuple[float, float], expected: float) -> None:
    mean, stderr = values
    assert abs(mean - expected) <= 4 * stderr, (mean, stderr, expected)
    # A replication spread this wide would make the check toothless.
    assert stderr < 0.1 * max(abs(expected), 0.01), (stderr, expected)


# --------------------------------------------------------------------------- module


def _isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, as ruff's isort-style sort orders them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    assert engine_module.__all__ == sorted(engine_module.__all__, key=_isort_order)
    for name in engine_module.__all__:
        assert hasattr(engine_module, name)


def test_ceiling_is_the_smaller_of_the_slot_and_the_core_limit() -> None:
    """Slots bound IO-heavy work and cores bound CPU-heavy work; workers multiply both."""
    assert ceiling(slots=8, cpu=0.0, io=2.0) == 4.0
    assert ceiling(slots=8, cpu=0.5, io=1.5) == 2.0  # cores: 1 / 0.5 = 2, slots: 8 / 2 = 4
    assert ceiling(slots=8, cpu=0.5, io=1.5, cores=4) == 4.0
    assert ceiling(slots=8, cpu=0.0, io=2.0, workers=3) == 12.0
    with pytest.raises(ValueError):
        ceiling(slots=0, cpu=0.0, io=1.0)
    with pytest.raises(ValueError):
        ceiling(slots=1, cpu=0.0, io=0.0)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Traffic(arrivals=Poisson(rate=1.0), mix={}), "mix"),
        (lambda: Traffic(arrivals=Poisson(rate=1.0), mix={"a": -1.0}), "mix"),
        (lambda: Traffic(arrivals=Poisson(rate=1.0), tenants=0), "tenants"),
        (lambda: Traffic(arrivals=Poisson(rate=1.0), deadline=0.0), "deadline"),
        (lambda: Traffic(arrivals=Poisson(rate=1.0), on_deadline="wait"), "on_deadline"),  # type: ignore[arg-type]
        (lambda: Fleet(admission=fifo(1), workers=0), "workers"),
        (lambda: Fleet(admission=fifo(1), cores=0), "cores"),
    ],
)
def test_bad_descriptions_are_refused_naming_the_field(
    build: Callable[[], object], message: str
) -> None:
    """An invalid traffic or fleet description raises ValueError naming the field."""
    with pytest.raises(ValueError, match=message):
        build()


def test_bad_runs_are_refused() -> None:
    """A run needs a positive horizon, a warm-up inside it, known classes and a service time."""
    traffic = Traffic(arrivals=Poisson(rate=1.0))
    fleet = Fleet(admission=fifo(1))
    with pytest.raises(ValueError, match="horizon"):
        Simulation(traffic, fleet, horizon=0.0)
    with pytest.raises(ValueError, match="warmup"):
        Simulation(traffic, fleet, horizon=10.0, warmup=10.0)
    with pytest.raises(ValueError, match="class"):
        simulate(Traffic(arrivals=Poisson(rate=1.0), mix={"gold": 1.0}), fleet, horizon=1.0)
    with pytest.raises(ValueError, match="trace"):
        simulate(traffic, Fleet(admission=fifo(1), io=None), horizon=1.0)
    simulation = Simulation(traffic, fleet, horizon=1.0)
    simulation.run()
    with pytest.raises(RuntimeError):
        simulation.run()


# --------------------------------------------------------------------------- queueing theory


def test_mm8_waiting_probability_and_mean_wait_match_erlang_c() -> None:
    """M/M/8 at lambda 6.5: P(wait) and the mean wait agree with Erlang C within 4 SE."""
    lam, warmup, horizon = 6.5, 200.0, 2200.0
    expected = theory.mmc(lam, 1.0, 8)
    reports = [
        simulate(
            Traffic(arrivals=Poisson(rate=lam)),
            Fleet(admission=fifo(8), io=Exponential(mean=1.0)),
            horizon=horizon,
            warmup=warmup,
            seed=seed,
        ).total
        for seed in range(REPLICATIONS)
    ]
    assert_within(mean_and_stderr([r.waited / r.offered for r in reports]), expected.p_wait)
    assert_within(mean_and_stderr([r.mean_wait for r in reports]), expected.mean_wait)


def test_mm88_blocking_matches_erlang_b() -> None:
    """M/M/8/8 (no waiting room) sheds the Erlang B share of arrivals."""

    def blocking(seed: int) -> float:
        total = simulate(
            Traffic(arrivals=Poisson(rate=6.5)),
            Fleet(admission=fifo(8, queue_cap=0), io=Exponential(mean=1.0)),
            horizon=2200.0,
            warmup=200.0,
            seed=seed,
        ).total
        assert total.shed == {"queue_full": total.shed_total}
        return total.shed_total / total.offered

    assert_within(replicate(blocking), theory.erlang_b(8, 6.5))


def test_mm8_12_blocking_matches_the_finite_queue() -> None:
    """M/M/8/12 (four waiting places) sheds the M/M/c/K share of arrivals."""

    def blocking(seed: int) -> float:
        total = simulate(
            Traffic(arrivals=Poisson(rate=6.5)),
            Fleet(admission=fifo(8, queue_cap=4), io=Exponential(mean=1.0)),
            horizon=2200.0,
            warmup=200.0,
            seed=seed,
        ).total
        return total.shed_total / total.offered

    assert_within(replicate(blocking), theory.mmck_blocking(6.5, 1.0, 8, 12))


def test_exponential_patience_abandons_as_erlang_a_predicts() -> None:
    """M/M/8+M under overload: the share who give up waiting matches Erlang-A."""
    lam, patience = 9.0, 2.0

    def abandoned(seed: int) -> float:
        total = simulate(
            Traffic(
                arrivals=Poisson(rate=lam),
                patience=Exponential(mean=patience),
                on_deadline="leave",
            ),
            Fleet(admission=fifo(8), io=Exponential(mean=1.0)),
            horizon=1700.0,
            warmup=200.0,
            seed=seed,
        ).total
        assert total.shed_total == 0
        return total.expired / total.offered

    expected = theory.erlang_a(lam, 1.0, 8, 1.0 / patience)
    assert_within(replicate(abandoned), expected.p_abandon)


def test_md1_mean_wait_matches_pollaczek_khinchine() -> None:
    """M/D/1 at load 0.7: the mean wait matches the Pollaczek-Khinchine formula."""

    def mean_wait(seed: int) -> float:
        return simulate(
            Traffic(arrivals=Poisson(rate=0.7)),
            Fleet(admission=fifo(1), io=Deterministic(value=1.0)),
            horizon=15_500.0,
            warmup=500.0,
            seed=seed,
        ).total.mean_wait

    assert_within(replicate(mean_wait), theory.pollaczek_khinchine(0.7, 1.0, 0.0).mean_wait)


# --------------------------------------------------------------------------- invariants on every run

RUNS: dict[str, Callable[[int], Report]] = {
    "mm8": lambda seed: simulate(
        Traffic(arrivals=Poisson(rate=6.5)),
        Fleet(admission=fifo(8)),
        horizon=300.0,
        seed=seed,
    ),
    "warm-up": lambda seed: simulate(
        Traffic(arrivals=Poisson(rate=9.0)),
        Fleet(admission=fifo(8, queue_cap=20)),
        horizon=300.0,
        warmup=50.0,
        seed=seed,
    ),
    "cpu and io, two workers": lambda seed: simulate(
        Traffic(arrivals=Poisson(rate=30.0)),
        Fleet(
            admission=fifo(8, queue_cap=8),
            cpu=Exponential(mean=0.05),
            io=LogNormal(mean=0.5, scv=2.0),
            workers=2,
        ),
        horizon=200.0,
        warmup=20.0,
        seed=seed,
    ),
    "deadline, stay, dropped at dequeue": lambda seed: simulate(
        Traffic(arrivals=Poisson(rate=12.0), deadline=3.0),
        Fleet(
            admission=AdmissionOptions(
                classes=("standard",), slots=8, queue_cap=None, mode="queue_cap", dequeue="fifo"
            )
        ),
        horizon=200.0,
        warmup=30.0,
        seed=seed,
    ),
    "deadline admission, two classes": lambda seed: simulate(
        Traffic(
            arrivals=Piecewise(steps=((0.0, 4.0), (50.0, 30.0), (150.0, 4.0))),
            mix={"critical": 0.2, "standard": 0.8},
            deadline={"critical": 5.0, "standard": 10.0},
            tenants=3,
        ),
        Fleet(
            admission=AdmissionOptions(
                classes=("critical", "standard"), slots=8, queue_cap=None, service_rate=8.0
            )
        ),
        horizon=250.0,
        warmup=10.0,
        seed=seed,
    ),
    "patience, leave": lambda seed: simulate(
        Traffic(arrivals=Poisson(rate=10.0), patience=Exponential(mean=1.0), on_deadline="leave"),
        Fleet(admission=fifo(8)),
        horizon=200.0,
        warmup=20.0,
        seed=seed,
    ),
    "closed loop": lambda seed: simulate(
        Traffic(arrivals=ClosedLoop(clients=20, think=Exponential(mean=1.0)), deadline=2.0),
        Fleet(admission=fifo(4, queue_cap=6)),
        horizon=200.0,
        warmup=20.0,
        seed=seed,
    ),
    "trace": lambda seed: simulate(
        Traffic(
            arrivals=Trace(
                records=tuple(
                    TraceRecord(at=i * 0.1, klass="standard", latency=0.5 + (i % 7) * 0.2)
                    for i in range(1500)
                )
            ),
            deadline=2.0,
            on_deadline="leave",
        ),
        Fleet(admission=fifo(4), io=None),
        horizon=150.0,
        warmup=5.0,
        seed=seed,
    ),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_littles_law_and_flow_balance_hold_on_every_run(name: str) -> None:
    """L (integrated) equals lambda x W (per request), and every class's requests balance."""
    for seed in range(3):
        report = RUNS[name](seed)
        assert report.littles_law_holds(), (report.in_system_mean, report.littles_product)
        for klass in (*report.classes, report.total):
            assert klass.balanced, klass
            assert klass.completed == klass.on_time + klass.late
            assert klass.admitted == klass.offered - klass.shed_total
        assert report.total.offered > 0


def test_a_window_that_starts_after_the_warm_up_still_balances() -> None:
    """Requests present when the window opens count for Little's law but not as offered."""
    report = RUNS["warm-up"](7)
    assert report.warmup == 50.0
    assert report.passage_rate * report.window > report.total.admitted
    assert report.littles_law_holds()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_same_seed_gives_the_identical_report(name: str) -> None:
    """Two runs with the same seed give equal reports, bit for bit; another seed differs."""
    first, second, other = RUNS[name](11), RUNS[name](11), RUNS[name](12)
    # Compared as text: a nan field is equal to itself there (and only by identity otherwise).
    assert repr(first) == repr(second)
    assert repr(first.as_dict()) == repr(second.as_dict())
    assert repr(first) != repr(other)


# --------------------------------------------------------------------------- behaviour


@pytest.mark.skipif(
    compiled("tidegate.policy.admission.controller"),
    reason="a compiled class cannot be patched with a spy",
)
def test_the_engine_drives_the_real_admission_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every arrival goes through AdmissionController.offer of tidegate.policy, not a copy."""
    calls: list[str] = []
    original = AdmissionController.offer

    def spy(self: AdmissionController, **kwargs: Any) -> Any:
        calls.append(kwargs["klass"])
        return original(self, **kwargs)

    monkeypatch.setattr(AdmissionController, "offer", spy)
    simulation = Simulation(
        Traffic(arrivals=Poisson(rate=5.0)), Fleet(admission=fifo(2, queue_cap=1)), horizon=50.0
    )
    report = simulation.run()
    assert vars(engine_module)["AdmissionController"] is AdmissionController
    assert all(type(w.controller) is AdmissionController for w in simulation.workers)
    assert len(calls) == report.total.offered > 0
    assert simulation.clock.now() == 50.0


def test_saturated_throughput_reaches_the_ceiling() -> None:
    """Overloaded past its ceiling, a CPU-bound and an IO-bound fleet complete their ceiling."""
    io_bound = Fleet(
        admission=fifo(8, queue_cap=50), cpu=Deterministic(value=0.01), io=Exponential(mean=0.8)
    )
    cpu_bound = Fleet(
        admission=fifo(64, queue_cap=50), cpu=Exponential(mean=0.04), io=Deterministic(value=0.8)
    )
    for fleet in (io_bound, cpu_bound):
        report = simulate(
            Traffic(arrivals=Poisson(rate=2 * fleet.ceiling)), fleet, horizon=400.0, warmup=50.0
        )
        assert report.throughput == pytest.approx(fleet.ceiling, rel=0.05)
    assert io_bound.ceiling == 8 / 0.81
    assert cpu_bound.ceiling == 1 / 0.04


def test_constant_arrivals_below_capacity_never_wait() -> None:
    """Evenly spaced requests that each finish before the next arrives never queue."""
    report = simulate(
        Traffic(arrivals=Constant(rate=2.0)),
        Fleet(admission=fifo(1, queue_cap=0), io=Deterministic(value=0.4)),
        horizon=100.0,
    )
    total = report.total
    assert total.offered == 200
    assert total.waited == 0
    assert total.shed_total == 0
    assert total.latency.p99 == pytest.approx(0.4)
    # 199 services of 0.4 s finish inside 100 s; the one arriving at 100.0 has not run yet.
    assert total.completed == 199
    assert total.in_system == 1
    assert report.utilisation == pytest.approx(199 * 0.4 / 100.0)


def test_deadline_outcomes_separate_late_from_on_time() -> None:
    """A deadline shorter than the service makes every completion late; no deadline, none."""
    fleet = Fleet(admission=fifo(1, queue_cap=0), io=Deterministic(value=1.0))
    arrivals = Constant(rate=0.5)
    tight = simulate(Traffic(arrivals=arrivals, deadline=0.5), fleet, horizon=21.0).total
    loose = simulate(Traffic(arrivals=arrivals), fleet, horizon=21.0).total
    assert tight.completed == tight.late == 10
    assert tight.on_time == 0
    assert loose.completed == loose.on_time == 10


def test_leaving_callers_are_cancelled_and_staying_ones_are_served_late() -> None:
    """With 'leave' expired waiters are cancelled; with 'stay' and no dequeue drop they pile up."""
    options = fifo(1)
    fleet = Fleet(admission=options, io=Deterministic(value=1.0))
    arrivals = Constant(rate=4.0)
    left = simulate(
        Traffic(arrivals=arrivals, deadline=2.0, on_deadline="leave"), fleet, horizon=30.0
    ).total
    stayed = simulate(
        Traffic(arrivals=arrivals, deadline=2.0, on_deadline="stay"), fleet, horizon=30.0
    ).total
    # A leaving caller gives up only while it waits; one started in time may still finish late.
    assert left.expired > 0
    assert left.rejection_time_max == 2.0
    assert left.latency.max <= 2.0 + 1.0
    # Nobody notices the callers who stay: the backlog grows and answers arrive long after.
    assert stayed.expired == 0
    assert stayed.latency.max > 5 * 2.0
    assert stayed.in_system > left.in_system + 50


def test_closed_loop_clients_slow_down_with_the_service() -> None:
    """A closed loop never offers more than its clients can: X = N / (think + response)."""
    report = simulate(
        Traffic(arrivals=ClosedLoop(clients=10, think=Exponential(mean=2.0))),
        Fleet(admission=fifo(2), io=Exponential(mean=1.0)),
        horizon=2000.0,
        warmup=100.0,
    )
    total = report.total
    assert total.shed_total == 0
    expected = 10 / (2.0 + total.latency.mean)
    assert report.throughput == pytest.approx(expected, rel=0.05)
    assert report.utilisation <= 1.0


def test_trace_arrivals_keep_their_classes_tenants_and_latencies() -> None:
    """A trace drives arrival times, classes and (with io=None) each request's service time."""
    records = (
        TraceRecord(at=0.0, klass="critical", tenant="a", latency=1.0),
        TraceRecord(at=0.5, klass="standard", tenant="b", latency=2.0),
        TraceRecord(at=0.75, klass="standard", tenant="b", latency=None),
    )
    report = simulate(
        Traffic(arrivals=Trace(records=records)),
        Fleet(
            admission=AdmissionOptions(
                classes=("critical", "standard"), slots=1, queue_cap=None, dequeue="fifo"
            ),
            io=None,
        ),
        horizon=10.0,
    )
    critical, standard = report.classes
    assert critical.completed == 1
    assert critical.latency.max == 1.0
    assert standard.completed == 2
    # The second waits 0.5 s behind the first and takes its recorded 2 s (2.5 s in all); the
    # untimed third waits until 3.0 and draws one of the recorded latencies, 1 s or 2 s.
    assert standard.latency.max in (3.25, 4.25)
    assert standard.latency.p50 == (2.5 + standard.latency.max) / 2
    assert report.total.offered == 3


def test_class_mix_and_tenants_spread_the_arrivals() -> None:
    """The class mix is honoured in proportion and tenants are drawn uniformly."""
    report = simulate(
        Traffic(arrivals=Poisson(rate=50.0), mix={"critical": 1.0, "standard": 3.0}, tenants=4),
        Fleet(
            admission=AdmissionOptions(
                classes=("critical", "standard"), slots=64, queue_cap=None, dequeue="fifo"
            ),
            io=Deterministic(value=0.1),
        ),
        horizon=200.0,
    )
    critical, standard = report.classes
    share = critical.offered / report.total.offered
    assert share == pytest.approx(0.25, abs=0.02)
    assert standard.offered > critical.offered


def test_a_tick_hook_can_grow_and_shrink_the_fleet() -> None:
    """Hooks run on their interval, see the gauges, and add or retire workers."""
    seen: list[tuple[float, int, int]] = []

    def hook(simulation: Simulation) -> None:
        now = simulation.clock.now()
        seen.append((now, simulation.active_workers, simulation.offered))
        if now == 10.0:
            simulation.add_worker()
        if now == 30.0:
            assert simulation.retire_worker() is not None

    simulation = Simulation(
        Traffic(arrivals=Poisson(rate=6.0)),
        Fleet(admission=fifo(2, queue_cap=4), io=Exponential(mean=0.5)),
        horizon=40.0,
        tick=(10.0, hook),
    )
    later: list[float] = []
    simulation.call_at(25.0, lambda s: later.append(s.clock.now()))
    report = simulation.run()
    assert [(t, active) for t, active, _ in seen] == [(10.0, 1), (20.0, 2), (30.0, 2), (40.0, 1)]
    assert [offered for _, _, offered in seen] == sorted(offered for _, _, offered in seen)
    assert later == [25.0]
    assert len(simulation.workers) == 2
    assert simulation.retire_worker() is None  # the last active worker stays
    assert report.littles_law_holds()
    assert all(r.balanced for r in report.classes)


def test_event_queue_runs_callbacks_in_time_order_on_its_clock() -> None:
    """EventQueue calls back in time order (ties in scheduling order) with the clock set."""
    clock = ManualClock()
    queue = EventQueue(clock)
    seen: list[tuple[str, float]] = []

    def note(name: str) -> None:
        seen.append((name, clock.now()))
        if name == "a":
            queue.after(1.5, note, "c")

    queue.at(2.0, note, "b")
    queue.at(1.0, note, "a")
    queue.at(2.0, note, "b2")
    assert len(queue) == 3
    queue.run(until=2.0)
    assert seen == [("a", 1.0), ("b", 2.0), ("b2", 2.0)]
    queue.run(until=10.0)
    assert seen[-1] == ("c", 2.5)
    assert clock.now() == 10.0
    with pytest.raises(ValueError):
        queue.at(5.0, note, "late")


def latencies(report: Report) -> Sequence[float]:
    return [report.total.latency.p50, report.total.latency.p95]


def test_percentiles_grow_with_load() -> None:
    """Heavier load gives a higher p95 on the same fleet: the saturation curve's shape."""
    fleet = Fleet(admission=fifo(8))
    low = simulate(Traffic(arrivals=Poisson(rate=3.0)), fleet, horizon=500.0)
    high = simulate(Traffic(arrivals=Poisson(rate=7.5)), fleet, horizon=500.0)
    assert latencies(high)[1] > latencies(low)[1]
    assert not math.isnan(latencies(low)[0])
