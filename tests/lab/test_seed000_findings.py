"""Seed 000's tables (the scaling and resilience page), each claim over 20 seeds.

A claim holds when it holds in at least 18 of the 20 seeds. A claim the lab does not reproduce
is asserted the other way (it fails in at least 18 of 20), with the reason in its docstring and
in docs/lab.md; no default is changed to make it pass.

The reference's model: a request holds a slot for 15 ms of CPU and 0.8 s of model call, a
worker has 8 slots (9.8 requests a second); the load sweep offers 4, 8, 10 and 14 requests a
second to one worker with 8 places to wait; backpressure offers 14 a second to three admission
shapes with a 3-second deadline; the storm is 12 new requests a second against a provider of
capacity 20 with a 30-second outage; the plan is for 40 requests a second at a spike of 60. The
lab's model call is exponential with that mean (the lab's default), and its CPU part is
deterministic. Where a lab function has these as defaults they are not passed; where it needs
them they are passed as the reference states them.

Scaled down to keep 20 seeds fast: the 40-requests-a-second run of Little's law runs 120 s. The
fleet sizes of the hard exercise whose shed share is far from the 1 % target run 100 s, those
near it 200 s and the nearest (8 workers at 60 req/s, 0.65 %) 600 s (the planner's default
horizon is 300 s), each after a tenth of it as warm-up. The load sweep, backpressure, storm and
game-day runs use the lab's defaults. The ``*_runs`` functions compute what the fixtures hold,
so the figures in docs/lab.md come from the same runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import pairwise
from typing import Literal, TypeVar

import pytest

from tidegate.lab.capacity import PlanSpec, capacity_table, monthly_cost, plan_workers
from tidegate.lab.engine import simulate
from tidegate.lab.gameday import (
    STRATEGIES,
    GamedayScenario,
    ReleaseResult,
    load_scenario,
    run_gameday,
    run_release,
)
from tidegate.lab.load import BACKPRESSURE_SHAPES, LoadPoint, backpressure, load_sweep
from tidegate.lab.placement import PlacementOptions, run_placement
from tidegate.lab.report import Report
from tidegate.lab.storm import StormOptions, StormResult, run_storms
from tidegate.lab.workload import Deterministic, Exponential

SEEDS = range(20)
HOLDS = 18

#: The reference's request: 15 ms on a core, 0.8 s waiting for the model.
CPU_S = 0.015
IO_S = 0.8
CPU = Deterministic(value=CPU_S)
IO = Exponential(mean=IO_S)
#: One worker with 8 slots has a ceiling of 8 / 0.815 requests a second.
CEILING = 8 / (CPU_S + IO_S)
RATES = (4.0, 8.0, 10.0, 14.0)
#: The three retry strategies of the reference's storm table (the lab also has a breaker).
STORM = ("naive", "backoff", "budget")
#: The hard exercise: workers x rate, with each run's horizon (see the module docstring).
FAR, NEAR, NEAREST = 100.0, 200.0, 600.0
Dispatch = Literal["round_robin", "shortest_queue"]
SIZES: dict[Dispatch, dict[tuple[int, float], float]] = {
    "round_robin": {(6, 40.0): FAR, (8, 40.0): NEAR, (8, 60.0): FAR},
    "shortest_queue": {
        (5, 40.0): FAR,
        (6, 40.0): NEAR,
        (6, 60.0): FAR,
        (7, 60.0): FAR,
        (8, 60.0): NEAREST,
    },
}

T = TypeVar("T")


def held(runs: Sequence[T], claim: Callable[[T], bool]) -> int:
    return sum(1 for one in runs if claim(one))


# --------------------------------------------------------------------------- the runs


def saturation_runs() -> list[tuple[list[LoadPoint], Report]]:
    """Per seed: the sweep against one worker (8 slots, 8 waiting), and 40 requests a second
    against the reference's 4 workers x 64 slots (ample room: Little's law as a planner)."""
    sweep_fleet = PlanSpec(slots=8, waiting=8, cpu=CPU, io=IO).fleet(1)
    big = PlanSpec(slots=64, waiting=0, cpu=CPU, io=IO)
    runs = []
    for seed in SEEDS:
        points = load_sweep(RATES, sweep_fleet, seed=seed)
        forty = simulate(big.traffic(40.0), big.fleet(4), horizon=120.0, warmup=12.0, seed=seed)
        runs.append((points, forty))
    return runs


def pressure_runs() -> list[dict[str, Report]]:
    """Per seed: 14 requests a second against the three shapes (the defaults: 8 slots, 8
    waiting, a 3-second deadline, 120 s), and the unbounded shape again with a model call of a
    fixed 0.8 s (``"fixed io"``)."""
    runs = []
    for seed in SEEDS:
        one = backpressure(14.0, io=IO, cpu=CPU, seed=seed)
        fixed = backpressure(14.0, io=Deterministic(value=IO_S), cpu=CPU, seed=seed)
        one["fixed io"] = fixed["unbounded, deadline"]
        runs.append(one)
    return runs


def storm_runs() -> list[dict[str, StormResult]]:
    """Per seed: the three strategies on the same arrivals, with the storm's defaults."""
    return [{r.strategy: r for r in run_storms(seed=seed, strategies=STORM)} for seed in SEEDS]


def release_runs() -> list[dict[tuple[str, bool], ReleaseResult]]:
    """Per seed: every strategy, gate off and on, on the built-in game day."""
    scenario = load_scenario()
    return [{(r.strategy, r.gated): r for r in run_gameday(scenario, seed=seed)} for seed in SEEDS]


def costly_scenario() -> GamedayScenario:
    """The medium exercise: the candidate adds no errors (no defect, the baseline's error
    rate) but costs 1.8 times the baseline per request."""
    scenario = load_scenario()
    candidate = replace(
        scenario.candidate,
        error_rate=scenario.baseline.error_rate,
        defect_slope=0.0,
        cost_per_request=1.8 * scenario.baseline.cost_per_request,
    )
    return replace(scenario, candidate=candidate)


def costly_runs() -> list[ReleaseResult]:
    scenario = costly_scenario()
    return [run_release(scenario, "canary", gated=True, seed=seed) for seed in SEEDS]


def fleet_runs() -> list[dict[tuple[Dispatch, int, float], float]]:
    """Per seed: the share refused for each (dispatch, workers, rate) of :data:`SIZES`, with
    8 slots and no waiting room per worker."""
    runs = []
    for seed in SEEDS:
        one = {}
        for dispatch, sizes in SIZES.items():
            spec = PlanSpec(slots=8, waiting=0, cpu=CPU, io=IO, dispatch=dispatch)
            for (workers, rate), horizon in sizes.items():
                report = simulate(
                    spec.traffic(rate),
                    spec.fleet(workers),
                    horizon=horizon,
                    warmup=horizon / 10,
                    seed=seed,
                )
                total = report.total
                one[(dispatch, workers, rate)] = total.shed_total / total.offered
        runs.append(one)
    return runs


def limit_runs() -> list[dict[str, float]]:
    """Per seed: one user's 30 calls against a limit of 5 a day, through 3 workers, per
    process and shared (the easy exercise)."""
    options = PlacementOptions(
        workers=3,
        users=1,
        requests_per_user=30,
        rate=5 / 86_400,
        burst=5.0,
        followup_share=0.0,
        prompts=1,
        repeats=1,
    )
    return [
        {
            placement: run_placement(options, placement=placement, seed=seed).admitted_per_user
            for placement in ("per_process", "shared")
        }
        for seed in SEEDS
    ]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def saturation() -> list[tuple[list[LoadPoint], Report]]:
    return saturation_runs()


@pytest.fixture(scope="module")
def pressure() -> list[dict[str, Report]]:
    return pressure_runs()


@pytest.fixture(scope="module")
def storms() -> list[dict[str, StormResult]]:
    return storm_runs()


@pytest.fixture(scope="module")
def releases() -> list[dict[tuple[str, bool], ReleaseResult]]:
    return release_runs()


@pytest.fixture(scope="module")
def fleets() -> list[dict[tuple[Dispatch, int, float], float]]:
    return fleet_runs()


# --------------------------------------------------------------------------- (a) saturation


def test_a1_slots_bind_before_the_core_and_only_workers_lift_the_core() -> None:
    """(a1) The ceilings: 1 x 8 slots 9.8 req/s (slots bind), 1 x 64 slots 66.7 (the core
    binds), 4 x 64 slots 266.7. Arithmetic, the same for every seed."""
    rows = capacity_table([(1, 8), (1, 64), (4, 64)], cpu=CPU_S, io=IO_S)
    assert [round(r.ceiling, 1) for r in rows] == [9.8, 66.7, 266.7]
    assert [r.binding for r in rows] == ["slots", "cores", "cores"]


def test_a2_past_the_ceiling_shed_and_p95_rise_and_throughput_flattens(
    saturation: list[tuple[list[LoadPoint], Report]],
) -> None:
    """(a2) Next to nothing is shed at 4 req/s (under 0.5 %); the shed share and p95 rise with
    every step of the rate; at 14 req/s over a fifth is shed, the slots are full and
    completions sit within 5 % of the 9.8 ceiling: going from 10 to 14 req/s buys under a
    third of the completions per offered request that going from 4 to 8 does."""

    def claim(one: tuple[list[LoadPoint], Report]) -> bool:
        points = one[0]
        shed = [p.shed_share for p in points]
        p95 = [p.report.total.latency.p95 for p in points]
        done = [p.report.throughput for p in points]
        return (
            shed[0] < 0.005
            and all(a < b for a, b in pairwise(shed))
            and all(a < b for a, b in pairwise(p95))
            and shed[-1] > 0.2
            and points[-1].report.utilisation > 0.98
            and abs(done[-1] - CEILING) < 0.05 * CEILING
            and 3 * (done[3] - done[2]) < done[1] - done[0]
        )

    assert held(saturation, claim) >= HOLDS


def test_a3_littles_law_holds_at_every_rate(
    saturation: list[tuple[list[LoadPoint], Report]],
) -> None:
    """(a3) L, integrated from the event stream, equals lambda_eff x W from the departures
    (each request's whole time in the system) within 2 % at every rate, overload included."""

    def claim(one: tuple[list[LoadPoint], Report]) -> bool:
        for point in one[0]:
            r = point.report
            if abs(r.littles_difference) > 0.02 * r.in_system_mean:
                return False
        return True

    assert held(saturation, claim) >= HOLDS


def test_a4_littles_law_plans_capacity(saturation: list[tuple[list[LoadPoint], Report]]) -> None:
    """(a4) 40 req/s of 0.815 s each keep about 33 in flight: the number in the system is
    within 5 % of 40 x 0.815 on a fleet with room for all of them."""
    planned = 40.0 * (CPU_S + IO_S)
    assert held(saturation, lambda one: abs(one[1].in_system_mean - planned) < 0.05 * planned) >= (
        HOLDS
    )


# --------------------------------------------------------------------------- (b) backpressure


def test_b1_no_waiting_room_refuses_the_most_and_answers_the_rest_fastest(
    pressure: list[dict[str, Report]],
) -> None:
    """(b1) Refusals fall from no waiting room to 8 places to the unbounded queue (none); the
    bounded shapes let nothing expire; p95 rises in the same order."""

    def claim(one: dict[str, Report]) -> bool:
        none, room, unbounded = (one[name].total for name in BACKPRESSURE_SHAPES)
        return (
            none.shed_total > room.shed_total > unbounded.shed_total == 0
            and none.expired == room.expired == 0
            and none.latency.p95 < room.latency.p95 < unbounded.latency.p95
        )

    assert held(pressure, claim) >= HOLDS


def test_b2_a_bounded_room_answers_more_in_time_and_the_unbounded_queue_the_fewest(
    pressure: list[dict[str, Report]],
) -> None:
    """(b2) Eight places to wait answer more requests in time than none; the unbounded queue
    with a deadline answers the fewest in time, and late is its largest outcome (work done
    for nobody, and billed), ahead of the requests that waited out their deadline and of
    those answered in time."""

    def claim(one: dict[str, Report]) -> bool:
        none, room, unbounded = (one[name].total for name in BACKPRESSURE_SHAPES)
        return (
            room.on_time > none.on_time > unbounded.on_time
            and unbounded.late > max(unbounded.expired, unbounded.on_time)
            and unbounded.expired > 0
        )

    assert held(pressure, claim) >= HOLDS


def test_b3_disagreement_the_unbounded_queue_serves_more_than_almost_nobody(
    pressure: list[dict[str, Report]],
) -> None:
    """(b3) Disagreement: the reference's unbounded queue answers almost nobody in time (63 of
    about 1,720, under 4 %; here: under 10 % of those offered). With the lab's exponential
    model call about a fifth are on time: a run of short calls drains the queue fast enough
    that requests start young enough to finish, throughout the run. With a fixed 0.8 s call
    only the start-up transient (before the queue holds a deadline's worth) is on time, under
    10 %, as in the reference, whose call times vary far less than an exponential's (its p95
    at 4 req/s is 1.5 times the mean; an exponential's is 3 times)."""

    def almost_nobody(report: Report) -> bool:
        total = report.total
        return total.on_time < 0.1 * total.offered

    assert held(pressure, lambda one: almost_nobody(one["unbounded, deadline"])) <= 20 - HOLDS
    assert held(pressure, lambda one: almost_nobody(one["fixed io"])) >= HOLDS


# --------------------------------------------------------------------------- (c) the storm


def test_c0_defaults_are_the_reference_storm() -> None:
    """The storm's defaults are the reference's: 12 new req/s, capacity 20, a 30 s outage,
    four tries, a 10 % retry budget. (Its 120 s of arrivals are the lab's; the reference's
    counts suggest about 90.)"""
    options = StormOptions()
    assert (options.rate, options.capacity, options.outage_length) == (12.0, 20, 30.0)
    assert (options.attempts, options.budget_ratio) == (4, 0.1)


def test_c1_retrying_at_once_multiplies_the_load(storms: list[dict[str, StormResult]]) -> None:
    """(c1) Retrying at once peaks at more than three times the new requests a second, well
    over capacity, and keeps the provider over capacity for at least 20 seconds."""

    def claim(one: dict[str, StormResult]) -> bool:
        naive = one["naive"]
        return naive.peak > 3 * StormOptions().rate and naive.seconds_over_capacity >= 20

    assert held(storms, claim) >= HOLDS


def test_c2_jitter_lowers_the_peak(storms: list[dict[str, StormResult]]) -> None:
    """(c2) Backoff with full jitter peaks lower than retrying at once."""
    assert held(storms, lambda one: one["backoff"].peak < one["naive"].peak) >= HOLDS


def test_c2b_disagreement_jitter_does_not_cut_the_calls(
    storms: list[dict[str, StormResult]],
) -> None:
    """(c2b) Disagreement: in the reference backoff with jitter also sends fewer calls (1,814
    against 2,188, 17 % fewer; here: at least 5 % fewer). Here it sends as many: the
    deadline (10 s) outlasts the backoff of all four tries (at most 0.5 + 1 + 2 s), and during
    the outage every try fails, so each request caught by it makes all four tries under either
    strategy; jitter moves retries in time, it does not remove them."""
    assert held(storms, lambda one: one["backoff"].calls < 0.95 * one["naive"].calls) <= (
        20 - HOLDS
    )


def test_c3_the_retry_budget_cuts_calls_peak_and_seconds_over_capacity(
    storms: list[dict[str, StormResult]],
) -> None:
    """(c3) The 10 % retry budget sends fewer calls and peaks lower than backoff alone, and cuts
    the seconds over capacity by at least three quarters, at the price of giving up on more
    requests."""

    def claim(one: dict[str, StormResult]) -> bool:
        budget, backoff = one["budget"], one["backoff"]
        return (
            budget.calls < backoff.calls
            and budget.peak < backoff.peak
            and budget.seconds_over_capacity <= 0.25 * backoff.seconds_over_capacity
            and budget.gave_up > backoff.gave_up
        )

    assert held(storms, claim) >= HOLDS


def test_c3b_disagreement_the_budget_does_not_hold_capacity_to_within_a_second(
    storms: list[dict[str, StormResult]],
) -> None:
    """(c3b) Disagreement: the reference's budget keeps the provider within capacity for all
    but one second (here: at most two). The gateway's ``RetryBudget`` counts over a sliding
    10-second window with a floor of one retry a second, so its allowance (10 % of ten seconds
    of first tries plus ten) can be spent within one second; the excess seconds fall mostly
    inside the outage, where those retries arrive together."""
    assert held(storms, lambda one: one["budget"].seconds_over_capacity <= 2) <= 20 - HOLDS


def test_c4_retries_cannot_create_capacity(storms: list[dict[str, StormResult]]) -> None:
    """(c4) Served stays within 5 % across the three strategies: the outage limits it."""

    def claim(one: dict[str, StormResult]) -> bool:
        served = [one[name].served for name in STORM]
        return max(served) <= 1.05 * min(served)

    assert held(storms, claim) >= HOLDS


# --------------------------------------------------------------------------- (d) the game day


def test_d1_the_gate_exposes_fewer_and_rolls_back_sooner(
    releases: list[dict[tuple[str, bool], ReleaseResult]],
) -> None:
    """(d1) Every release is rolled back, and for each strategy the gate exposes fewer requests
    to the candidate and rolls back no later than the alert and a person do."""

    def claim(one: dict[tuple[str, bool], ReleaseResult]) -> bool:
        if any(r.outcome != "rolled_back" or r.rolled_back_at is None for r in one.values()):
            return False
        return all(
            one[(s, True)].exposed < one[(s, False)].exposed
            and (one[(s, True)].rolled_back_at or 0.0) <= (one[(s, False)].rolled_back_at or 0.0)
            for s in STRATEGIES
        )

    assert held(releases, claim) >= HOLDS


def test_d2_without_the_gate_rolling_is_found_last(
    releases: list[dict[tuple[str, bool], ReleaseResult]],
) -> None:
    """(d2) Without the gate the alert rolls back the rolling release last, after canary and
    blue-green."""

    def claim(one: dict[tuple[str, bool], ReleaseResult]) -> bool:
        at = {s: one[(s, False)].rolled_back_at or 0.0 for s in STRATEGIES}
        return at["rolling"] > max(at["canary"], at["blue_green"])

    assert held(releases, claim) >= HOLDS


def test_d2b_disagreement_ungated_rolling_does_not_expose_twice_the_canary(
    releases: list[dict[tuple[str, bool], ReleaseResult]],
) -> None:
    """(d2b) Disagreement: without the gate the reference's rolling release reaches about
    twice the requests its canary does (4,714 against 2,551; here: at least 1.75 times). Here
    the alert (fleet error rate over 5 %) fires near a candidate share of one half for both,
    where the fleet's expected error rate is exactly 5 % (2 % + 0.12 x 0.5 x 0.5), so
    whether each is found at that step or the next is a coin flip per run, and which of the
    two exposes more is too (rolling more in about half the seeds)."""

    def claim(one: dict[tuple[str, bool], ReleaseResult]) -> bool:
        return one[("rolling", False)].exposed >= 1.75 * one[("canary", False)].exposed

    assert held(releases, claim) <= 20 - HOLDS


def test_d3_blue_green_exposes_everyone_at_once_and_rolls_back_fastest(
    releases: list[dict[tuple[str, bool], ReleaseResult]],
) -> None:
    """(d3) Gated blue-green sends a whole window's traffic to the candidate, more than gated
    rolling or canary expose, and rolls back at the end of its first window, before them."""
    scenario = load_scenario()
    window = scenario.rate * scenario.window

    def claim(one: dict[tuple[str, bool], ReleaseResult]) -> bool:
        flip = one[("blue_green", True)]
        others = [one[(s, True)] for s in ("rolling", "canary")]
        return (
            flip.exposed > 0.95 * window
            and flip.exposed > max(r.exposed for r in others)
            and flip.rolled_back_at == scenario.window
            and all((r.rolled_back_at or 0.0) > scenario.window for r in others)
        )

    assert held(releases, claim) >= HOLDS


def test_d4_a_defect_that_grows_with_traffic_passes_the_first_stage(
    releases: list[dict[tuple[str, bool], ReleaseResult]],
) -> None:
    """(d4) The gated canary proceeds at its first stage (5 %) and is rolled back at a later
    one; so is the gated rolling release (first stage 10 %)."""

    def claim(one: dict[tuple[str, bool], ReleaseResult]) -> bool:
        for strategy in ("canary", "rolling"):
            steps = one[(strategy, True)].steps
            if not (
                len(steps) >= 2 and steps[0].action == "proceed" and steps[-1].action == "rollback"
            ):
                return False
        return True

    assert held(releases, claim) >= HOLDS


# --------------------------------------------------------------------------- (e) the plan


def test_e1_the_mean_value_plan_for_40_requests_a_second() -> None:
    """(e1) 40 req/s at 8 slots, 60 % target and one spare: 8 workers, 51 % used at the peak
    and 58 % with one lost (slot limit 78.5, core limit 533.3); with 64 slots the core binds
    and 2 workers do. Arithmetic, the same for every seed."""
    plan = plan_workers(40.0, cpu=CPU_S, io=IO_S, slots=8)
    assert plan.workers == 8
    assert (round(plan.slot_limit_rps, 1), round(plan.core_limit_rps, 1)) == (78.5, 533.3)
    assert round(plan.utilisation_at_peak, 3) == 0.509
    assert round(plan.utilisation_one_down, 3) == 0.582
    assert plan_workers(40.0, cpu=CPU_S, io=IO_S, slots=64).workers == 2


def test_e2_tokens_cost_far_more_than_compute() -> None:
    """(e2) 20 million requests a month of 1,200 tokens on 8 workers (0.05 a worker-hour, 0.002
    per 1,000 tokens): compute 292, tokens 48,000, 0.002415 a request; tokens cost over 150
    times the compute."""
    bill = monthly_cost(
        8,
        requests_per_month=20_000_000,
        tokens_per_request=1200,
        worker_hour_price=0.05,
        price_per_1k_tokens=0.002,
    )
    assert (round(bill.compute, 2), round(bill.tokens, 2)) == (292.0, 48_000.0)
    assert round(bill.per_request(20_000_000), 6) == 0.002415
    assert bill.tokens > 150 * bill.compute


def test_e3_the_planned_fleet_holds_the_peak(
    fleets: list[dict[tuple[Dispatch, int, float], float]],
) -> None:
    """(e3) The planner's 8 workers shed under 1 % at 40 req/s (no waiting room, round-robin:
    the lab's default dispatch)."""
    assert held(fleets, lambda one: one[("round_robin", 8, 40.0)] < 0.01) >= HOLDS


# --------------------------------------------------------------------------- (f) the exercises


def test_f1_easy_a_limit_per_worker_multiplies_by_the_workers() -> None:
    """(f1) Easy: a limit of 5 calls a day kept by each of 3 workers lets 15 of 30 calls
    through; one shared limit lets 5."""
    runs = limit_runs()
    assert held(runs, lambda one: one == {"per_process": 15.0, "shared": 5.0}) >= HOLDS


def test_f2_medium_a_costlier_candidate_stops_at_the_first_stage_on_cost() -> None:
    """(f2) Medium: a candidate with no new errors at 1.8 times the cost is rolled back at 5 %,
    its first stage, by the cost rule alone."""

    def claim(result: ReleaseResult) -> bool:
        if result.outcome != "rolled_back" or len(result.steps) != 1:
            return False
        step = result.steps[0]
        return (
            step.share == 0.05
            and step.action == "rollback"
            and any("cost per request" in reason for reason in step.reasons)
            and not any("error rate" in reason for reason in step.reasons)
        )

    assert held(costly_runs(), claim) >= HOLDS


def test_f3_hard_one_queue_for_the_fleet_needs_6_for_the_peak_and_8_for_the_spike(
    fleets: list[dict[tuple[Dispatch, int, float], float]],
) -> None:
    """(f3) Hard, with the reference's one queue for the fleet (a request is refused only when
    every slot is busy: ``shortest_queue`` dispatch): 5 workers miss 1 % at 40 req/s and 6 hold
    it; 6 miss it at 60 and 7 miss it; the planner's 8 hold 60."""

    def claim(one: dict[tuple[Dispatch, int, float], float]) -> bool:
        def shed(workers: int, rate: float) -> float:
            return one[("shortest_queue", workers, rate)]

        return (
            shed(5, 40.0) >= 0.01
            and shed(6, 40.0) < 0.01
            and shed(6, 60.0) >= 0.01
            and shed(7, 60.0) >= 0.01
            and shed(8, 60.0) < 0.01
        )

    assert held(fleets, claim) >= HOLDS


def test_f3b_disagreement_behind_round_robin_6_do_not_hold_the_peak_nor_8_the_spike(
    fleets: list[dict[tuple[Dispatch, int, float], float]],
) -> None:
    """(f3b) Disagreement with the lab's default dispatch (round-robin, a queue per worker):
    6 workers do not hold 40 req/s under 1 %, and the planner's 8 do not hold 60. A request
    is refused by its own full worker while another has free slots (E_k/M/8/8 per worker
    rather than Erlang B for the fleet), so round-robin needs 8 and 11."""

    def claim(one: dict[tuple[Dispatch, int, float], float]) -> bool:
        return one[("round_robin", 6, 40.0)] < 0.01 or one[("round_robin", 8, 60.0)] < 0.01

    assert held(fleets, claim) <= 20 - HOLDS
