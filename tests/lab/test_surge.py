"""The surge runbook's findings, checked over ten seeds on the real admission controller.

The lab reproduces the findings (shapes, orderings, invariants), not the runbook's numbers: the
fleet here is two slots with exponential service (2 requests per second), so ten seeds of every
finding run in seconds.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import tidegate.lab.surge as surge_module
from tidegate.lab.surge import (
    RUNGS,
    SurgeOptions,
    SurgeResult,
    ladder,
    run_rung,
    run_surge,
    sweep,
)
from tidegate.lab.workload import Exponential
from tidegate.policy.admission import AdmissionController, AdmissionOptions
from tidegate.testing import compiled

SEEDS = range(10)
#: The old, smaller model: exponential service, a 5 % critical share, and the dequeue check told
#: each deadline one mean service time early (the runbook's own model is in
#: test_surge_findings.py).
BASE = SurgeOptions(
    slots=2,
    service=Exponential(mean=1.0),
    critical_share=0.05,
    deadline=5.0,
    duration=600.0,
    dequeue_margin=None,
)


def by_rung(results: list[SurgeResult]) -> dict[str, SurgeResult]:
    return {r.rung: r for r in results}


@pytest.fixture(scope="module")
def collapse() -> list[dict[str, SurgeResult]]:
    """Ten minutes at 10x, per seed: FIFO, deadline admission and deadline at dequeue."""
    rungs = ("unbounded_fifo", "deadline_admission", "deadline_at_dequeue")
    return [by_rung(run_surge(BASE, seed=seed, rungs=rungs)) for seed in SEEDS]


@pytest.fixture(scope="module")
def ladder_runs() -> list[dict[str, SurgeResult]]:
    """Every rung for two and a half minutes at 10x, per seed."""
    return [by_rung(run_surge(replace(BASE, duration=150.0), seed=seed)) for seed in SEEDS]


def _isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, as ruff's isort-style sort orders them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    assert surge_module.__all__ == sorted(surge_module.__all__, key=_isort_order)
    for name in surge_module.__all__:
        assert hasattr(surge_module, name)


def test_every_rung_is_an_admission_options_combination() -> None:
    """The ladder is eight option sets of the real controller, as the admission docs list."""
    rungs = ladder(BASE)
    assert tuple(rungs) == RUNGS
    assert all(type(options) is AdmissionOptions for options in rungs.values())
    assert rungs["unbounded_fifo"].queue_cap is None
    assert rungs["bounded_queue"].queue_cap is None  # its cap is on the whole queue, the fleet's
    assert BASE.bounded_cap == round(BASE.capacity * BASE.deadline)
    assert rungs["deadline_admission"].mode == "deadline"
    assert rungs["deadline_at_dequeue"].drop_expired_at_dequeue is True
    assert rungs["priority_at_dequeue"].priority_at_admission is False
    assert rungs["priority_at_admission"].dequeue == "strict"
    assert rungs["conditional_priority"].conditional_priority == BASE.conditional_threshold
    assert rungs["weighted_share"].dequeue == "weighted"


@pytest.mark.skipif(
    compiled("tidegate.policy.admission.controller"),
    reason="a compiled class cannot be patched with a spy",
)
def test_the_rungs_run_the_controller_from_tidegate_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A surge run constructs tidegate.policy's AdmissionController with the rung's options."""
    built: list[AdmissionOptions] = []
    original = AdmissionController.__init__

    def spy(
        self: AdmissionController, options: AdmissionOptions, *args: object, **kw: object
    ) -> None:
        built.append(options)
        original(self, options, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(AdmissionController, "__init__", spy)
    result = run_rung("weighted_share", replace(BASE, duration=20.0))
    assert built == [ladder(BASE)["weighted_share"]]
    assert result.served > 0


def test_options_are_validated() -> None:
    """Bad surge options raise ValueError naming the field; an unknown rung is refused."""
    fields: tuple[tuple[str, object], ...] = (
        ("slots", 0),
        ("multiplier", 0.0),
        ("deadline", -1.0),
        ("critical_share", 1.5),
        ("queue_cap", -1),
        ("dequeue_margin", -0.5),
    )
    for field, value in fields:
        with pytest.raises(ValueError, match=field):
            replace(BASE, **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rung"):
        run_surge(BASE, rungs=("lifo",))


# --------------------------------------------------------------------------- the findings


def test_every_policy_serves_the_same_number_when_overloaded(
    ladder_runs: list[dict[str, SurgeResult]],
) -> None:
    """Queueing does not create capacity: all eight rungs complete exactly as many requests."""
    for runs in ladder_runs:
        served = {r.served for r in runs.values()}
        assert len(served) == 1, served
        assert served.pop() > 0.9 * BASE.capacity * 150.0


def test_unbounded_fifo_collapses_goodput_and_leaves_a_backlog_that_outlives_the_surge(
    collapse: list[dict[str, SurgeResult]],
) -> None:
    """FIFO's goodput is over 10x below deadline admission's and its backlog takes longer to
    drain than the surge lasted; deadline admission's backlog stays within one deadline."""
    for runs in collapse:
        fifo, admission = runs["unbounded_fifo"], runs["deadline_admission"]
        assert fifo.goodput * 10 < admission.goodput, (fifo.goodput, admission.goodput)
        assert fifo.backlog / BASE.capacity > BASE.duration
        assert admission.backlog <= 2 * BASE.capacity * BASE.deadline
        assert fifo.shed == 0
        assert math.isnan(fifo.rejection_time_mean)


def test_deadline_at_dequeue_recovers_goodput_but_answers_no_only_after_the_deadline(
    collapse: list[dict[str, SurgeResult]],
) -> None:
    """Dropping stale work at dequeue recovers goodput; a doomed caller waits about its whole
    deadline for the no, while deadline admission answers at once."""
    for runs in collapse:
        dequeue, admission = runs["deadline_at_dequeue"], runs["deadline_admission"]
        assert dequeue.goodput >= admission.goodput
        assert dequeue.shed == 0
        assert dequeue.expired > 0
        assert 0.7 * BASE.deadline <= dequeue.rejection_time_mean <= 1.3 * BASE.deadline
        assert admission.rejection_time_mean == 0.0


def test_the_dequeue_backlog_plateaus_near_arrival_rate_times_deadline(
    collapse: list[dict[str, SurgeResult]],
) -> None:
    """Deadline at dequeue holds about lambda x deadline in the system however long the surge
    lasts, while FIFO's backlog keeps growing."""
    plateau = BASE.arrival_rate * BASE.deadline
    half, end = BASE.duration / 2, BASE.duration
    for runs in collapse:
        dequeue, fifo = runs["deadline_at_dequeue"], runs["unbounded_fifo"]
        early = dequeue.mean_backlog(half / 2, half)
        late = dequeue.mean_backlog(half, end)
        assert 0.7 * plateau <= early <= 1.3 * plateau, (early, plateau)
        assert abs(late - early) <= 0.1 * plateau, (early, late)
        assert fifo.mean_backlog(half, end) > 1.5 * fifo.mean_backlog(half / 2, half)


def test_priority_at_dequeue_alone_does_not_protect_the_critical_class() -> None:
    """With critical demand at half the capacity, priority applied only at dequeue answers
    few critical requests in time; applied at admission too, over 95%."""
    options = replace(BASE, deadline=10.0, duration=300.0)
    for seed in SEEDS:
        runs = by_rung(
            run_surge(options, seed=seed, rungs=("priority_at_dequeue", "priority_at_admission"))
        )
        assert runs["priority_at_dequeue"].critical_goodput_share < 0.3
        assert runs["priority_at_admission"].critical_goodput_share > 0.95


def test_strict_priority_starves_the_lower_class_and_a_weighted_share_does_not() -> None:
    """With critical demand over capacity, strict priority answers almost no standard request
    in time; a weighted share still gives standard about its share of the slots."""
    options = replace(BASE, deadline=10.0, duration=300.0, critical_share=0.12)
    share = 1.0 / (1.0 + options.critical_weight)
    for seed in SEEDS:
        runs = by_rung(
            run_surge(options, seed=seed, rungs=("priority_at_admission", "weighted_share"))
        )
        strict, weighted = runs["priority_at_admission"], runs["weighted_share"]
        assert strict.standard_goodput < 0.03 * strict.served
        assert weighted.standard_served > 0.75 * share * weighted.served
        assert weighted.standard_served > strict.standard_served


def test_strict_priority_costs_total_goodput_at_moderate_overload() -> None:
    """At 1.5x, protecting the critical class costs total goodput in every seed; conditional
    priority above 2x leaves moderate overload alone."""
    options = replace(BASE, duration=300.0, multiplier=1.5, critical_share=0.1)
    fifo_total = strict_total = 0
    for seed in SEEDS:
        runs = by_rung(
            run_surge(
                options,
                seed=seed,
                rungs=("deadline_admission", "priority_at_admission", "conditional_priority"),
            )
        )
        fifo = runs["deadline_admission"].goodput
        strict = runs["priority_at_admission"].goodput
        assert strict < fifo
        assert runs["conditional_priority"].goodput >= 0.98 * fifo
        fifo_total += fifo
        strict_total += strict
    assert strict_total < 0.97 * fifo_total


def test_conditional_priority_still_protects_under_a_severe_surge(
    ladder_runs: list[dict[str, SurgeResult]],
) -> None:
    """At 10x the overload is over the threshold, so conditional priority protects like strict."""
    for runs in ladder_runs:
        conditional = runs["conditional_priority"].critical_goodput_share
        assert conditional >= runs["priority_at_admission"].critical_goodput_share - 0.05
        assert conditional > 3 * runs["deadline_admission"].critical_goodput_share


def test_below_capacity_every_policy_sheds_nothing_and_gives_the_same_goodput() -> None:
    """At 0.7x capacity the ladder is free: no refusals, no drops, identical goodput."""
    options = replace(BASE, duration=300.0, multiplier=0.7, deadline=20.0)
    for seed in SEEDS:
        results = run_surge(options, seed=seed)
        assert all(r.shed == 0 and r.expired == 0 for r in results)
        assert len({r.goodput for r in results}) == 1
        assert len({r.served for r in results}) == 1


def test_a_short_window_at_1_05x_hides_shedding_that_a_long_one_shows() -> None:
    """Slightly over capacity the queue fills slowly: a minute sheds nothing, an hour does."""
    options = replace(BASE, multiplier=1.05, deadline=60.0)
    for seed in SEEDS:
        short = run_rung("deadline_admission", replace(options, duration=60.0), seed=seed)
        long = run_rung("deadline_admission", replace(options, duration=4000.0), seed=seed)
        assert short.shed == 0
        assert long.shed > 0.01 * long.offered


# --------------------------------------------------------------------------- reports


def test_every_surge_report_balances_and_obeys_littles_law(
    ladder_runs: list[dict[str, SurgeResult]],
) -> None:
    """Each rung's report passes flow balance and Little's law."""
    for runs in ladder_runs[:3]:
        for result in runs.values():
            report = result.report
            assert report.littles_law_holds()
            assert all(r.balanced for r in report.classes)
            assert result.offered == result.served + result.shed + result.expired + result.backlog
            assert result.as_dict()["rung"] == result.rung


def test_the_same_seed_gives_the_same_surge() -> None:
    """Two runs of the ladder with one seed agree exactly."""
    options = replace(BASE, duration=60.0)
    first = [r.as_dict() for r in run_surge(options, seed=3)]
    second = [r.as_dict() for r in run_surge(options, seed=3)]
    assert first == second


def test_a_sweep_covers_every_point_and_reports_progress() -> None:
    """sweep() runs the ladder at each (multiplier, share) point and ticks once per point."""
    ticks: list[int] = []
    results = sweep(
        replace(BASE, duration=30.0),
        multipliers=(2.0, 4.0),
        critical_shares=(0.1,),
        rungs=("unbounded_fifo", "deadline_admission"),
        progress=lambda: ticks.append(1),
    )
    assert list(results) == [(2.0, 0.1), (4.0, 0.1)]
    assert len(ticks) == 2
    assert [r.rung for r in results[(4.0, 0.1)]] == ["unbounded_fifo", "deadline_admission"]
    assert results[(4.0, 0.1)][0].multiplier == 4.0
