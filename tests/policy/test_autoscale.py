import itertools
import math
import random
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.clock import ClockWentBackwards, ManualClock
from tidegate.policy import autoscale
from tidegate.policy.autoscale import (
    AutoscaleEvent,
    DampedLaw,
    DampedOptions,
    ProportionalLaw,
    ScaledDown,
    ScaleDecision,
    ScaleDownHeld,
    ScaledUp,
    ScaleReason,
    ScaleSignals,
    clamp,
    recommend,
    replicas_for_queue,
    replicas_for_rate,
    step_limit,
    within_tolerance,
)


def signals(
    now: float,
    *,
    current: int,
    rate: float,
    pending: int = 0,
    queue: float = 0.0,
    per_replica: float = 1.0,
) -> ScaleSignals:
    return ScaleSignals(
        now=now,
        current_replicas=current,
        pending_replicas=pending,
        queue_depth=queue,
        arrival_rate=rate,
        per_replica_rate=per_replica,
    )


def test_all_is_sorted_and_complete() -> None:
    """The module's __all__ is sorted and every name in it exists."""
    assert autoscale.__all__ == sorted(autoscale.__all__)
    for name in autoscale.__all__:
        assert hasattr(autoscale, name)


def test_the_usage_example_in_the_docs_runs() -> None:
    """The code block in docs/policies/autoscale.md executes and its assertions hold."""
    page = Path(__file__).parents[2] / "docs" / "policies" / "autoscale.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(page), "exec"), {})


# --------------------------------------------------------------------------- helper math


def test_rate_signal_plans_for_the_target_utilisation() -> None:
    """The rate signal is arrivals over each replica's planned share of its capacity, rounded up."""
    assert replicas_for_rate(10.0, 2.0, 0.5) == 10
    assert replicas_for_rate(10.5, 2.0, 0.5) == 11
    assert replicas_for_rate(0.0, 2.0, 0.5) == 0


def test_float_noise_does_not_buy_a_replica() -> None:
    """2.1 / 0.7 is 3.0000000000000004 in floats; the signal still says 3 replicas."""
    assert 2.1 / (1.0 * 0.7) > 3.0
    assert replicas_for_rate(2.1, 1.0, 0.7) == 3
    assert replicas_for_rate(2.1001, 1.0, 0.7) == 4


def test_queue_signal_drains_the_backlog_on_top_of_arrivals() -> None:
    """The queue signal adds the replicas that clear the backlog within the drain target."""
    assert replicas_for_queue(600.0, 4.0, 1.0, 60.0) == 14
    assert replicas_for_queue(0.0, 4.0, 1.0, 60.0) == 4
    assert replicas_for_queue(30.0, 4.0, 2.0, 60.0) == 3


def test_step_limit_is_the_larger_of_absolute_and_fraction() -> None:
    """A small fleet may move by the absolute step, a large one by its fraction (rounded down)."""
    assert step_limit(2, 4, 1.0) == 4
    assert step_limit(10, 4, 1.0) == 10
    assert step_limit(19, 1, 0.1) == 1
    assert step_limit(40, 1, 0.1) == 4


def test_tolerance_band_is_inclusive_and_symmetric() -> None:
    """A recommendation within ±tolerance of the supply, edges included, is inside the band."""
    assert within_tolerance(21, 20, 0.1)
    assert within_tolerance(22, 20, 0.1)
    assert within_tolerance(18, 20, 0.1)
    assert not within_tolerance(23, 20, 0.1)
    assert not within_tolerance(17, 20, 0.1)
    assert not within_tolerance(1, 0, 0.1)


def test_clamp_keeps_a_count_inside_the_bounds() -> None:
    """clamp() returns the nearest count inside [min, max]."""
    assert clamp(0, 1, 10) == 1
    assert clamp(5, 1, 10) == 5
    assert clamp(11, 1, 10) == 10


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"target_utilisation": 0.0}, "target_utilisation"),
        ({"target_utilisation": 1.5}, "target_utilisation"),
        ({"queue_drain_seconds": 0.0}, "queue_drain_seconds"),
        ({"max_step_up": 0}, "max_step_up"),
        ({"max_step_up_fraction": -0.5}, "max_step_up_fraction"),
        ({"max_step_down": 0}, "max_step_down"),
        ({"max_step_down_fraction": 1.5}, "max_step_down_fraction"),
        ({"stabilisation_seconds": -1.0}, "stabilisation_seconds"),
        ({"stabilisation_seconds": math.inf}, "stabilisation_seconds"),
        ({"tolerance": 1.0}, "tolerance"),
        ({"min_replicas": -1}, "min_replicas"),
        ({"min_replicas": 5, "max_replicas": 4}, "max_replicas"),
        ({"min_replicas": 0, "max_replicas": 0}, "max_replicas"),
    ],
)
def test_damped_options_reject_bad_values_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    """Each invalid setting raises ValueError that names the offending field."""
    with pytest.raises(ValueError, match=field):
        DampedOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"target_utilisation": 0.0}, "target_utilisation"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"min_replicas": -1}, "min_replicas"),
    ],
)
def test_proportional_law_rejects_bad_values_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    """The baseline law validates its settings like the damped one."""
    with pytest.raises(ValueError, match=field):
        ProportionalLaw(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"current_replicas": -1}, "current_replicas"),
        ({"pending_replicas": -1}, "pending_replicas"),
        ({"queue_depth": -1.0}, "queue_depth"),
        ({"arrival_rate": -0.1}, "arrival_rate"),
        ({"arrival_rate": math.nan}, "arrival_rate"),
        ({"per_replica_rate": 0.0}, "per_replica_rate"),
        ({"now": math.inf}, "now"),
    ],
)
def test_signals_reject_impossible_readings_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    """A negative count, a non-finite reading or a zero service rate is refused by name."""
    values: dict[str, Any] = {
        "now": 0.0,
        "current_replicas": 1,
        "pending_replicas": 0,
        "queue_depth": 0.0,
        "arrival_rate": 1.0,
        "per_replica_rate": 1.0,
    }
    values.update(kwargs)
    with pytest.raises(ValueError, match=field):
        ScaleSignals(**values)


def test_damped_law_refuses_time_going_backwards() -> None:
    """The stabilisation window needs monotonic time, so an earlier now is an error."""
    law = DampedLaw()
    law.decide(signals(10.0, current=1, rate=0.5))
    with pytest.raises(ClockWentBackwards):
        law.decide(signals(9.0, current=1, rate=0.5))


# --------------------------------------------------------------------------- the rules, one at a time


def test_tolerance_band_ignores_a_five_percent_change() -> None:
    """A recommendation 5% above or below the supply leaves the fleet as it is."""
    law = DampedLaw(DampedOptions(stabilisation_seconds=0.0))
    up = law.decide(signals(0.0, current=20, rate=14.7))  # 21 replicas at 0.7
    assert recommend(signals(0.0, current=20, rate=14.7), law.options) == 21
    assert up == ScaleDecision(20, 0, ScaleReason.WITHIN_TOLERANCE)
    down = law.decide(signals(1.0, current=20, rate=13.3))  # 19 replicas
    assert down == ScaleDecision(20, 0, ScaleReason.WITHIN_TOLERANCE)


def test_a_change_outside_the_band_is_acted_on() -> None:
    """A recommendation 15% above the supply is ordered in full."""
    law = DampedLaw()
    assert law.decide(signals(0.0, current=20, rate=16.1)) == ScaleDecision(
        23, 3, ScaleReason.SCALE_UP
    )


def test_scale_up_is_capped_by_the_absolute_step_for_a_small_fleet() -> None:
    """From 2 replicas a recommendation of 20 adds only the absolute step of 4."""
    events: list[AutoscaleEvent] = []
    law = DampedLaw(on_event=events.append)
    assert law.decide(signals(0.0, current=2, rate=14.0)) == ScaleDecision(
        6, 4, ScaleReason.SCALE_UP_CAPPED
    )
    assert events == [ScaledUp(0.0, 2, 6, 20, True)]


def test_scale_up_is_capped_by_the_fraction_for_a_large_fleet() -> None:
    """From 10 replicas a recommendation of 30 adds 100% of the fleet, not more."""
    law = DampedLaw()
    assert law.decide(signals(0.0, current=10, rate=21.0)) == ScaleDecision(
        20, 10, ScaleReason.SCALE_UP_CAPPED
    )


def test_scale_down_is_capped_per_step() -> None:
    """With no stabilisation window, 40 replicas recommended down to 10 retire 10% per step."""
    events: list[AutoscaleEvent] = []
    law = DampedLaw(DampedOptions(stabilisation_seconds=0.0), on_event=events.append)
    assert law.decide(signals(0.0, current=40, rate=7.0)) == ScaleDecision(
        36, -4, ScaleReason.SCALE_DOWN_CAPPED
    )
    assert events == [ScaledDown(0.0, 40, 36, 10, True)]


def test_pending_supply_is_counted_so_nothing_is_ordered_twice() -> None:
    """Four serving and six pending cover a need of ten: the damped law orders nothing more."""
    s = signals(0.0, current=4, pending=6, rate=7.0)
    assert DampedLaw().decide(s) == ScaleDecision(10, 0, ScaleReason.STEADY)
    assert ProportionalLaw().decide(s) == ScaleDecision(10, 6, ScaleReason.SCALE_UP)


def test_pending_supply_only_tops_up_the_difference() -> None:
    """With four serving and four pending, a need of ten orders the missing two."""
    s = signals(0.0, current=4, pending=4, rate=7.0)
    assert DampedLaw().decide(s) == ScaleDecision(10, 2, ScaleReason.SCALE_UP)


def test_scale_down_is_held_within_the_window_then_allowed() -> None:
    """A lower recommendation waits until the higher one is stabilisation_seconds old."""
    clock = ManualClock()
    events: list[AutoscaleEvent] = []
    law = DampedLaw(DampedOptions(max_step_down_fraction=1.0), on_event=events.append)
    assert law.decide(signals(clock.now(), current=10, rate=7.0)) == ScaleDecision(
        10, 0, ScaleReason.STEADY
    )
    clock.advance(100.0)
    assert law.decide(signals(clock.now(), current=10, rate=3.5)) == ScaleDecision(
        10, 0, ScaleReason.SCALE_DOWN_HELD
    )
    clock.set(299.0)
    assert law.decide(signals(clock.now(), current=10, rate=3.5)) == ScaleDecision(
        10, 0, ScaleReason.SCALE_DOWN_HELD
    )
    clock.set(300.0)
    assert law.decide(signals(clock.now(), current=10, rate=3.5)) == ScaleDecision(
        5, -5, ScaleReason.SCALE_DOWN
    )
    assert events == [
        ScaleDownHeld(100.0, 10, 5, 10),
        ScaleDownHeld(299.0, 10, 5, 10),
        ScaledDown(300.0, 10, 5, 5, False),
    ]


def test_scale_down_goes_only_to_the_highest_recommendation_in_the_window() -> None:
    """When the oldest high reading expires, the fleet drops to the next highest, not the latest."""
    clock = ManualClock()
    law = DampedLaw(DampedOptions(max_step_down_fraction=1.0))
    law.decide(signals(clock.now(), current=10, rate=7.0))  # 10
    clock.set(100.0)
    law.decide(signals(clock.now(), current=10, rate=5.6))  # 8, held
    clock.set(200.0)
    law.decide(signals(clock.now(), current=10, rate=3.5))  # 5, held
    clock.set(300.0)
    assert law.decide(signals(clock.now(), current=10, rate=3.5)) == ScaleDecision(
        8, -2, ScaleReason.SCALE_DOWN
    )
    clock.set(400.0)
    assert law.decide(signals(clock.now(), current=8, rate=3.5)) == ScaleDecision(
        5, -3, ScaleReason.SCALE_DOWN
    )


def test_scale_up_is_not_held_by_the_window() -> None:
    """The stabilisation window slows only scale-down; a rise is acted on at once."""
    law = DampedLaw()
    law.decide(signals(0.0, current=10, rate=3.5))
    assert law.decide(signals(1.0, current=10, rate=9.1)) == ScaleDecision(
        13, 3, ScaleReason.SCALE_UP
    )


def test_queue_signal_dominates_when_a_backlog_exists() -> None:
    """A backlog of 600 with a 60 s drain target needs 17 replicas where the rate alone needs 10."""
    law = DampedLaw()
    assert law.decide(signals(0.0, current=10, rate=7.0)) == ScaleDecision(
        10, 0, ScaleReason.STEADY
    )
    assert law.decide(signals(1.0, current=10, rate=7.0, queue=600.0)) == ScaleDecision(
        17, 7, ScaleReason.SCALE_UP
    )


def test_rate_signal_wins_over_a_small_queue() -> None:
    """A queue of 60 needs only 8 replicas at full use, fewer than the rate signal's 10."""
    s = signals(0.0, current=10, rate=7.0, queue=60.0)
    assert replicas_for_queue(60.0, 7.0, 1.0, 60.0) == 8
    assert DampedLaw().decide(s) == ScaleDecision(10, 0, ScaleReason.STEADY)


def test_min_replicas_is_a_floor_even_with_no_traffic() -> None:
    """With no arrivals the damped and proportional laws both keep the warm floor."""
    options = DampedOptions(min_replicas=2)
    s = signals(0.0, current=2, rate=0.0)
    assert DampedLaw(options).decide(s) == ScaleDecision(2, 0, ScaleReason.STEADY)
    assert ProportionalLaw(min_replicas=2).decide(s) == ScaleDecision(2, 0, ScaleReason.STEADY)


def test_max_replicas_caps_the_recommendation() -> None:
    """A need of 100 replicas is clamped to the ceiling of 12."""
    s = signals(0.0, current=10, rate=70.0)
    assert DampedLaw(DampedOptions(max_replicas=12)).decide(s) == ScaleDecision(
        12, 2, ScaleReason.SCALE_UP
    )
    assert ProportionalLaw(max_replicas=12).decide(s) == ScaleDecision(12, 2, ScaleReason.SCALE_UP)


def test_supply_outside_the_bounds_is_brought_back_to_the_edge() -> None:
    """A fleet above the ceiling or below the floor is moved to the bound, whatever the steps."""
    law = DampedLaw(DampedOptions(min_replicas=3, max_replicas=12))
    assert law.decide(signals(0.0, current=15, rate=70.0)) == ScaleDecision(
        12, -3, ScaleReason.BOUNDS
    )
    assert law.decide(signals(1.0, current=0, rate=0.0)) == ScaleDecision(3, 3, ScaleReason.BOUNDS)


def test_proportional_law_follows_the_rate_both_ways() -> None:
    """The baseline orders or retires the whole difference from the serving count at once."""
    law = ProportionalLaw()
    assert law.decide(signals(0.0, current=2, rate=14.0)) == ScaleDecision(
        20, 18, ScaleReason.SCALE_UP
    )
    assert law.decide(signals(1.0, current=20, rate=13.3)) == ScaleDecision(
        19, -1, ScaleReason.SCALE_DOWN
    )


# --------------------------------------------------------------------------- a surge with a lead time


@dataclass(frozen=True, slots=True)
class Tick:
    step: int
    serving: int
    pending: int
    queue: float
    decision: ScaleDecision


def surge(
    law: DampedLaw | ProportionalLaw, *, seed: int = 7, steps: int = 80, lead_steps: int = 5
) -> list[Tick]:
    """Run a fleet through a step surge; replicas ordered at step s start serving at s + lead."""
    rng = random.Random(seed)
    step_seconds = 15.0
    per_replica = 1.0
    serving, queue = 2, 0.0
    orders: deque[tuple[int, int]] = deque()
    ticks: list[Tick] = []
    for step in range(steps):
        level = 2.0 if step < 4 else 10.0
        arrival = level * (1.0 + rng.uniform(-0.04, 0.04))  # a little measurement noise
        while orders and orders[0][0] <= step:
            serving += orders.popleft()[1]
        pending = sum(n for _, n in orders)
        decision = law.decide(
            ScaleSignals(
                now=step * step_seconds,
                current_replicas=serving,
                pending_replicas=pending,
                queue_depth=queue,
                arrival_rate=arrival,
                per_replica_rate=per_replica,
            )
        )
        if decision.delta > 0:
            orders.append((step + lead_steps, decision.delta))
        elif decision.delta < 0:
            serving = max(0, serving + decision.delta)
        queue += arrival * step_seconds
        queue -= min(queue, serving * per_replica * step_seconds)
        ticks.append(Tick(step, serving, pending, queue, decision))
    return ticks


def direction_changes(ticks: list[Tick]) -> int:
    signs = [1 if t.decision.delta > 0 else -1 for t in ticks if t.decision.delta != 0]
    return sum(a != b for a, b in itertools.pairwise(signs))


def test_damped_law_converges_where_the_proportional_law_oscillates() -> None:
    """Under a lead time the baseline over-orders and flips direction; the damped law settles."""
    proportional = surge(ProportionalLaw())
    damped = surge(DampedLaw())

    assert direction_changes(damped) <= direction_changes(proportional)
    assert direction_changes(damped) <= 1
    assert direction_changes(proportional) >= 5
    peak = {
        name: max(t.serving + t.pending for t in ticks)
        for name, ticks in (("proportional", proportional), ("damped", damped))
    }
    assert peak["proportional"] > 2 * peak["damped"]

    # Enough capacity: the backlog clears and the fleet then serves the surge at no more than
    # the target utilisation plus the tolerance band, without another order.
    cleared = next(t.step for t in damped if t.queue == 0.0 and t.step > 4)
    after = damped[cleared:]
    assert all(t.queue == 0.0 for t in after)
    assert all(t.decision.delta <= 0 for t in after)
    assert damped[-1].serving * 0.7 * 1.1 >= 10.0 * 1.04


def test_surge_runs_repeat_bit_for_bit() -> None:
    """The same seed gives the same trace, for both laws."""
    assert surge(DampedLaw(), seed=3) == surge(DampedLaw(), seed=3)
    assert surge(ProportionalLaw(), seed=3) == surge(ProportionalLaw(), seed=3)


# --------------------------------------------------------------------------- properties


@st.composite
def damped_options(draw: st.DrawFn) -> DampedOptions:
    min_replicas = draw(st.integers(0, 10))
    return DampedOptions(
        target_utilisation=draw(st.floats(0.1, 1.0)),
        queue_drain_seconds=draw(st.floats(1.0, 600.0)),
        max_step_up=draw(st.integers(1, 10)),
        max_step_up_fraction=draw(st.floats(0.0, 2.0)),
        max_step_down=draw(st.integers(1, 10)),
        max_step_down_fraction=draw(st.floats(0.0, 1.0)),
        stabilisation_seconds=draw(st.floats(0.0, 600.0)),
        tolerance=draw(st.floats(0.0, 0.5)),
        min_replicas=min_replicas,
        max_replicas=draw(st.integers(max(1, min_replicas), min_replicas + 60)),
    )


@st.composite
def signal_runs(draw: st.DrawFn) -> list[ScaleSignals]:
    now = 0.0
    run: list[ScaleSignals] = []
    for _ in range(draw(st.integers(1, 25))):
        now += draw(st.sampled_from([0.0, 1.0, 15.0, 60.0, 299.0, 300.0, 301.0]))
        run.append(
            ScaleSignals(
                now=now,
                current_replicas=draw(st.integers(0, 80)),
                pending_replicas=draw(st.integers(0, 40)),
                queue_depth=draw(st.floats(0.0, 5000.0)),
                arrival_rate=draw(st.floats(0.0, 200.0)),
                per_replica_rate=draw(st.floats(0.1, 20.0)),
            )
        )
    return run


@settings(max_examples=150, deadline=None)
@given(options=damped_options(), run=signal_runs())
def test_damped_decisions_stay_in_bounds_steps_and_band(
    options: DampedOptions, run: list[ScaleSignals]
) -> None:
    """Every decision is within [min, max], moves no more than a step cap, and holds in the band."""
    law = DampedLaw(options)
    for s in run:
        decision = law.decide(s)
        base = clamp(s.supply, options.min_replicas, options.max_replicas)
        assert options.min_replicas <= decision.desired <= options.max_replicas
        assert decision.delta == decision.desired - s.supply
        up = step_limit(base, options.max_step_up, options.max_step_up_fraction)
        down = step_limit(base, options.max_step_down, options.max_step_down_fraction)
        assert -down <= decision.desired - base <= up
        if within_tolerance(recommend(s, options), base, options.tolerance):
            assert decision.desired == base


@settings(max_examples=150, deadline=None)
@given(
    target=st.floats(0.1, 1.0),
    min_replicas=st.integers(0, 10),
    span=st.integers(0, 60),
    run=signal_runs(),
)
def test_proportional_decisions_stay_in_bounds(
    target: float, min_replicas: int, span: int, run: list[ScaleSignals]
) -> None:
    """The baseline never recommends outside [min, max] either."""
    max_replicas = max(1, min_replicas + span)
    law = ProportionalLaw(
        target_utilisation=target, min_replicas=min_replicas, max_replicas=max_replicas
    )
    for s in run:
        decision = law.decide(s)
        assert min_replicas <= decision.desired <= max_replicas
        assert decision.delta == decision.desired - s.current_replicas


@settings(max_examples=150, deadline=None)
@given(options=damped_options(), history=signal_runs(), data=st.data())
def test_inside_the_band_the_fleet_never_changes(
    options: DampedOptions, history: list[ScaleSignals], data: st.DataObject
) -> None:
    """Whatever came before, a recommendation inside the tolerance band leaves the supply as is."""
    law = DampedLaw(options)
    for s in history:
        law.decide(s)
    lo, hi = options.min_replicas, options.max_replicas
    supply = data.draw(st.integers(lo, hi), label="supply")
    in_band = [r for r in range(lo, hi + 1) if within_tolerance(r, supply, options.tolerance)]
    recommended = data.draw(st.sampled_from(in_band), label="recommended")
    per_replica = data.draw(st.floats(0.1, 20.0), label="per_replica")
    pending = data.draw(st.integers(0, supply), label="pending")
    s = ScaleSignals(
        now=history[-1].now + 1.0,
        current_replicas=supply - pending,
        pending_replicas=pending,
        arrival_rate=recommended * per_replica * options.target_utilisation,
        per_replica_rate=per_replica,
    )
    assert recommend(s, options) == recommended
    assert law.decide(s).delta == 0
