"""Tests for the admission controller: every rung of the overload ladder, exactly, in virtual time."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tidegate.policy.admission as admission_module
from tidegate.clock import ManualClock, SystemClock
from tidegate.errors import BulkheadFull, DeadlineUnmeetable, QueueFull, Rejected, http_error
from tidegate.policy.admission import (
    AdmissionController,
    AdmissionEvent,
    AdmissionMode,
    AdmissionOptions,
    DequeueOrder,
    RefusalReason,
    Ticket,
    TicketAdmitted,
    TicketCancelled,
    TicketExpired,
    TicketFinished,
    TicketRefused,
    TicketStarted,
    TicketState,
    deadline_admits,
    work_ahead,
)
from tidegate.testing import compiled

TWO = ("critical", "standard")
DOC = Path(__file__).resolve().parents[2] / "docs" / "policies" / "admission.md"


@dataclass
class Rig:
    clock: ManualClock
    controller: AdmissionController
    events: list[AdmissionEvent] = field(default_factory=list)
    counter: int = 0

    def offer(
        self, klass: str, *, tenant: str = "t", deadline: float | None = None, rid: str = ""
    ) -> Ticket:
        self.counter += 1
        return self.controller.offer(
            request_id=rid or f"r{self.counter}", klass=klass, tenant=tenant, deadline_at=deadline
        )


def rig(options: AdmissionOptions | None = None, **fields: Any) -> Rig:
    clock = ManualClock()
    events: list[AdmissionEvent] = []
    controller = AdmissionController(
        options or AdmissionOptions(**fields), clock, on_event=events.append
    )
    return Rig(clock, controller, events)


def next_started(r: Rig) -> Ticket:
    ticket = r.controller.start()
    assert ticket is not None
    return ticket


# --------------------------------------------------------------------------- module and options


def test_the_controller_runs_on_the_gateways_system_clock() -> None:
    """The gateway gives admission its SystemClock: the controller (compiled in the compiled
    build, where it calls the clock through the Clock base class) reads the real time, so a
    deadline a minute ahead starts at once and one just gone is refused."""
    clock = SystemClock()
    controller = AdmissionController(AdmissionOptions(classes=("standard",), slots=1), clock)
    ahead = clock.now() + 60.0
    ticket = controller.offer(request_id="r1", klass="standard", tenant="t", deadline_at=ahead)
    assert ticket.state is TicketState.STARTED
    gone = clock.now() - 1.0
    with pytest.raises(DeadlineUnmeetable):
        controller.offer(request_id="r2", klass="standard", tenant="t", deadline_at=gone)


def test_all_is_sorted_and_exported() -> None:
    """The module's public API is a sorted ``__all__`` whose every name exists."""
    assert admission_module.__all__ == sorted(admission_module.__all__)
    for name in admission_module.__all__:
        assert hasattr(admission_module, name)


def test_option_defaults_are_the_documented_ones() -> None:
    """The defaults are three classes, 64 slots, 256 waiting per class, deadline mode, strict."""
    options = AdmissionOptions()
    assert options.classes == ("critical", "standard", "batch")
    assert options.slots == 64
    assert options.queue_cap == 256
    assert options.tenant_max_in_flight is None
    assert options.tenant_max_waiting is None
    assert options.mode == "deadline"
    assert options.service_rate is None
    assert options.initial_service_time == 1.0
    assert options.service_time_smoothing == 0.1
    assert options.drop_expired_at_dequeue is True
    assert options.priority_at_admission is True
    assert options.dequeue == "strict"
    assert options.weights is None
    assert options.conditional_priority is None
    assert options.overload_window == 10.0
    assert [options.weight_for(k) for k in options.classes] == [4.0, 2.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"classes": ()}, "classes"),
        ({"classes": ("a", "a")}, "classes"),
        ({"classes": ("a", "")}, "classes"),
        ({"slots": 0}, "slots"),
        ({"queue_cap": -1}, "queue_cap"),
        ({"queue_cap": {"critical": 1}}, "queue_cap"),
        ({"queue_cap": {"critical": 1, "standard": 1, "batch": -1}}, "queue_cap"),
        ({"tenant_max_in_flight": 0}, "tenant_max_in_flight"),
        ({"tenant_max_waiting": -1}, "tenant_max_waiting"),
        ({"mode": "lifo"}, "mode"),
        ({"service_rate": 0.0}, "service_rate"),
        ({"service_rate": math.inf}, "service_rate"),
        ({"service_rate": math.nan}, "service_rate"),
        ({"initial_service_time": 0.0}, "initial_service_time"),
        ({"service_time_smoothing": 0.0}, "service_time_smoothing"),
        ({"service_time_smoothing": 1.5}, "service_time_smoothing"),
        ({"dequeue": "random"}, "dequeue"),
        ({"weights": {"critical": 1.0}}, "weights"),
        ({"weights": {"critical": 1.0, "standard": 0.0, "batch": 1.0}}, "weights"),
        ({"conditional_priority": 0.0}, "conditional_priority"),
        ({"conditional_priority": 2.0, "dequeue": "fifo"}, "conditional_priority"),
        ({"overload_window": -1.0}, "overload_window"),
    ],
)
def test_invalid_options_name_the_field(kwargs: dict[str, Any], field_name: str) -> None:
    """Each invalid option raises ValueError naming the offending field."""
    with pytest.raises(ValueError, match=re.escape(field_name)):
        AdmissionOptions(**kwargs)


def test_a_slot_count_that_is_not_an_int_is_refused() -> None:
    """Plain Python names the field in a ValueError; the compiled build refuses the type itself
    (and stores ``True`` as the int 1, as ``int(True)`` would)."""
    if compiled("tidegate.policy.admission.options"):
        with pytest.raises(TypeError):
            AdmissionOptions(slots=1.5)  # type: ignore[arg-type]
        return
    for slots in (True, 1.5):
        with pytest.raises(ValueError, match="slots"):
            AdmissionOptions(slots=slots)  # type: ignore[arg-type]


def test_per_class_caps_and_weights_are_copied() -> None:
    """Mappings given as options are copied, so mutating the caller's dict changes nothing."""
    caps: dict[str, int | None] = {"critical": 1, "standard": None}
    weights = {"critical": 5.0, "standard": 1.0}
    options = AdmissionOptions(classes=TWO, queue_cap=caps, weights=weights)
    caps["critical"] = 99
    weights["critical"] = 99.0
    assert options.cap_for("critical") == 1
    assert options.cap_for("standard") is None
    assert options.weight_for("critical") == 5.0


# --------------------------------------------------------------------------- helper math


def test_work_ahead_counts_what_each_order_serves_first() -> None:
    """FIFO counts everything, strict the same and higher classes, weighted a weighted share."""
    depths = [2, 10, 30]
    assert work_ahead(depths, 1, order="fifo") == 42.0
    assert work_ahead(depths, 0, order="strict") == 2.0
    assert work_ahead(depths, 2, order="strict") == 42.0
    # standard (weight 2) works through 10 + itself = 5.5 rounds: critical gets min(2, 22),
    # batch min(30, 5.5).
    assert work_ahead(depths, 1, order="weighted", weights=[4.0, 2.0, 1.0]) == 17.5


def test_deadline_admits_only_if_wait_plus_service_fits() -> None:
    """A request is admissible when now + wait + mean service is not past its deadline."""
    assert deadline_admits(now=1.0, estimated_wait=2.0, mean_service_time=0.5, deadline_at=3.5)
    assert not deadline_admits(now=1.0, estimated_wait=2.0, mean_service_time=0.5, deadline_at=3.25)
    assert deadline_admits(now=1.0, estimated_wait=9.0, mean_service_time=9.0, deadline_at=None)


# --------------------------------------------------------------------------- basic protocol


def test_offer_starts_at_once_when_a_slot_is_free() -> None:
    """With a free slot and nothing waiting, offer returns a started ticket."""
    r = rig(classes=TWO, slots=1)
    ticket = r.offer("standard")
    assert ticket.state is TicketState.STARTED
    assert ticket.started_at == 0.0
    assert r.controller.in_flight == 1
    assert [type(e) for e in r.events] == [TicketAdmitted, TicketStarted]


def test_offer_waits_when_slots_are_busy_and_start_takes_it_after_finish() -> None:
    """A ticket offered while every slot is busy waits, and start() hands it the freed slot."""
    r = rig(classes=TWO, slots=1)
    first = r.offer("standard")
    second = r.offer("standard")
    assert second.state is TicketState.WAITING
    assert r.controller.start() is None
    r.clock.advance(2.0)
    assert r.controller.finish(first) == 2.0
    assert r.controller.start() is second
    assert second.started_at == 2.0
    started = [e for e in r.events if isinstance(e, TicketStarted)]
    assert started[-1].waited == 2.0


def test_unknown_class_is_a_programming_error() -> None:
    """Offering a class that is not configured raises ValueError."""
    r = rig(classes=TWO)
    with pytest.raises(ValueError, match="unknown class"):
        r.offer("gold")


def test_finish_needs_a_started_ticket_of_this_controller() -> None:
    """finish() refuses a waiting ticket, a finished one and another controller's ticket."""
    r = rig(classes=TWO, slots=1)
    first = r.offer("standard")
    waiting = r.offer("standard")
    with pytest.raises(ValueError, match="started"):
        r.controller.finish(waiting)
    r.controller.finish(first)
    with pytest.raises(ValueError, match="started"):
        r.controller.finish(first)
    other = rig(classes=TWO, slots=1)
    with pytest.raises(ValueError, match="another"):
        other.controller.finish(waiting)
    with pytest.raises(ValueError, match="another"):
        other.controller.cancel(waiting)


def test_service_time_feeds_the_measured_rate() -> None:
    """finish() folds the service time into the moving average that sets the service rate."""
    r = rig(classes=TWO, slots=2, initial_service_time=1.0, service_time_smoothing=0.5)
    assert r.controller.service_rate == 2.0
    ticket = r.offer("standard")
    r.clock.advance(3.0)
    assert r.controller.finish(ticket) == 3.0
    assert r.controller.mean_service_time == 2.0
    assert r.controller.service_rate == 1.0
    finished = [e for e in r.events if isinstance(e, TicketFinished)]
    assert finished == [TicketFinished(ticket=ticket, at=3.0, service_time=3.0)]


def test_configured_service_rate_sets_the_mean_service_time() -> None:
    """A fixed service rate implies mean service time slots / rate and ignores measurements."""
    r = rig(classes=TWO, slots=4, service_rate=8.0)
    ticket = r.offer("standard")
    r.clock.advance(5.0)
    r.controller.finish(ticket)
    assert r.controller.service_rate == 8.0
    assert r.controller.mean_service_time == 0.5


def test_cancel_withdraws_waiting_and_frees_started_without_a_service_time() -> None:
    """cancel() removes a waiting ticket, frees a started one unmeasured, and is then a no-op."""
    r = rig(classes=TWO, slots=1, initial_service_time=1.0, service_time_smoothing=0.5)
    running = r.offer("standard")
    gone = r.offer("standard")
    kept = r.offer("standard")
    assert r.controller.cancel(gone) is True
    assert gone.state is TicketState.CANCELLED
    assert r.controller.depth("standard") == 1
    r.clock.advance(7.0)
    assert r.controller.cancel(running) is True
    assert r.controller.mean_service_time == 1.0
    assert r.controller.in_flight == 0
    assert r.controller.start() is kept
    assert r.controller.cancel(gone) is False
    r.controller.finish(kept)
    assert r.controller.cancel(kept) is False
    cancels = [e for e in r.events if isinstance(e, TicketCancelled)]
    assert [(e.ticket, e.was_started) for e in cancels] == [(gone, False), (running, True)]
    assert r.controller.snapshot().cancelled == {"critical": 0, "standard": 2}


# --------------------------------------------------------------------------- bounded queue


def test_class_queue_at_cap_refuses_with_a_drain_based_retry_hint() -> None:
    """A full class queue refuses at once with QueueFull and retry_after = (ahead + 1) / rate."""
    r = rig(classes=TWO, slots=1, service_rate=4.0, queue_cap=5, mode="queue_cap")
    r.offer("standard")
    for _ in range(5):
        r.offer("standard")
    assert r.controller.estimated_wait("standard") == 1.25
    with pytest.raises(QueueFull) as caught:
        r.offer("standard", rid="late")
    error = caught.value
    assert error.policy == "admission"
    assert error.reason == RefusalReason.QUEUE_FULL
    assert error.retry_after == 1.5
    status, _, headers = http_error(error)
    assert (status, headers) == (503, {"Retry-After": "2"})
    refused = [e for e in r.events if isinstance(e, TicketRefused)]
    assert refused == [
        TicketRefused(
            request_id="late",
            klass="standard",
            tenant="t",
            reason=RefusalReason.QUEUE_FULL,
            retry_after=1.5,
            at=0.0,
        )
    ]
    # Caps are per class: critical still has room.
    assert r.offer("critical").state is TicketState.WAITING
    assert r.controller.snapshot().refused == {"critical": {}, "standard": {"queue_full": 1}}


def test_retry_after_is_positive_and_grows_with_the_queue_ahead() -> None:
    """The retry hint is positive even with nothing ahead and grows with the drain estimate."""
    r = rig(classes=TWO, slots=1, service_rate=2.0, queue_cap={"critical": 0, "standard": 3})
    r.offer("standard")
    with pytest.raises(QueueFull) as empty:
        r.offer("critical")
    assert empty.value.retry_after == 0.5
    for _ in range(3):
        r.offer("standard")
    with pytest.raises(QueueFull) as full:
        r.offer("standard")
    assert full.value.retry_after == 2.0
    assert full.value.retry_after > empty.value.retry_after > 0


def test_zero_cap_means_no_waiting_room() -> None:
    """With queue_cap 0 a request is admitted only into a free slot."""
    r = rig(classes=TWO, slots=2, queue_cap=0)
    assert r.offer("standard").state is TicketState.STARTED
    assert r.offer("standard").state is TicketState.STARTED
    with pytest.raises(QueueFull):
        r.offer("standard")


def test_unbounded_fifo_admits_everything_and_serves_late_work() -> None:
    """The unbounded FIFO rung admits all, serves by arrival across classes and runs late work."""
    r = rig(
        classes=TWO,
        slots=1,
        queue_cap=None,
        mode="queue_cap",
        dequeue="fifo",
        drop_expired_at_dequeue=False,
    )
    first = r.offer("standard", deadline=1.0)
    tickets = [r.offer(k, deadline=1.0) for k in ("standard", "critical") * 500]
    assert r.controller.depth() == 1000
    r.clock.advance(5.0)
    r.controller.finish(first)
    late = r.controller.start()
    assert late is tickets[0]
    assert late.deadline_at is not None
    assert late.deadline_at < r.clock.now()
    r.controller.finish(late)
    assert r.controller.start() is tickets[1]
    assert tickets[1].klass == "critical"


# --------------------------------------------------------------------------- deadlines


def test_deadline_admission_refuses_the_unmeetable_and_admits_the_meetable() -> None:
    """Deadline mode admits iff now + work_ahead / rate + mean service <= deadline."""
    r = rig(classes=TWO, slots=2, service_rate=4.0, queue_cap=None, mode="deadline")
    r.offer("standard")
    r.offer("standard")
    for _ in range(5):
        r.offer("standard")  # no deadline: always admissible
    r.clock.advance(1.0)
    # 5 ahead at 4/s is 1.25 s of waiting, plus 0.5 s of service (2 slots / 4 per s).
    assert r.controller.estimated_wait("standard") == 1.25
    with pytest.raises(DeadlineUnmeetable) as caught:
        r.offer("standard", deadline=2.74)
    assert caught.value.reason == RefusalReason.DEADLINE_UNMEETABLE
    assert caught.value.retry_after == 1.5
    assert r.offer("standard", deadline=2.75).state is TicketState.WAITING


def test_deadline_mode_judges_even_an_idle_system_by_mean_service_time() -> None:
    """With a free slot the wait is zero, but a deadline shorter than service is still refused."""
    r = rig(classes=TWO, slots=2, service_rate=4.0)
    with pytest.raises(DeadlineUnmeetable):
        r.offer("standard", deadline=0.25)
    assert r.offer("standard", deadline=0.5).state is TicketState.STARTED


def test_queue_cap_mode_does_not_judge_deadlines() -> None:
    """In queue_cap mode a request whose deadline cannot be met is still admitted."""
    r = rig(classes=TWO, slots=1, service_rate=1.0, queue_cap=None, mode="queue_cap")
    r.offer("standard")
    for _ in range(10):
        r.offer("standard")
    assert r.offer("standard", deadline=0.5).state is TicketState.WAITING


def test_a_deadline_already_past_is_refused_in_every_mode() -> None:
    """A request whose deadline has already passed is refused as deadline_passed."""
    r = rig(classes=TWO, mode="queue_cap")
    r.clock.advance(3.0)
    with pytest.raises(DeadlineUnmeetable) as caught:
        r.offer("standard", deadline=3.0)
    assert caught.value.reason == RefusalReason.DEADLINE_PASSED
    assert r.controller.snapshot().refused["standard"] == {"deadline_passed": 1}


def test_expired_tickets_are_dropped_at_dequeue_and_counted_by_class() -> None:
    """start() drops tickets whose deadline passed, emits TicketExpired and serves the next."""
    r = rig(classes=TWO, slots=1, mode="queue_cap")
    running = r.offer("standard")
    stale = r.offer("standard", deadline=2.0)
    fresh = r.offer("standard", deadline=10.0)
    r.clock.advance(3.0)
    r.controller.finish(running)
    assert r.controller.start() is fresh
    assert stale.state is TicketState.EXPIRED
    assert stale.ended_at == 3.0
    assert TicketExpired(ticket=stale, at=3.0, waited=3.0) in r.events
    snapshot = r.controller.snapshot()
    assert snapshot.expired == {"critical": 0, "standard": 1}
    assert snapshot.depth == {"critical": 0, "standard": 0}


def test_a_ticket_at_its_deadline_instant_is_expired() -> None:
    """A ticket whose deadline equals now has no time left and is not started."""
    r = rig(classes=TWO, slots=1, mode="queue_cap")
    running = r.offer("standard")
    edge = r.offer("standard", deadline=2.0)
    r.clock.advance(2.0)
    r.controller.finish(running)
    assert r.controller.start() is None
    assert edge.state is TicketState.EXPIRED


# --------------------------------------------------------------------------- priority


def test_strict_dequeue_serves_higher_classes_first_and_fifo_by_arrival() -> None:
    """Strict dequeue takes the highest class first; FIFO dequeue takes the oldest ticket."""
    for dequeue, expected in (("strict", ["c", "s1", "s2"]), ("fifo", ["s1", "c", "s2"])):
        r = rig(classes=TWO, slots=1, queue_cap=None, dequeue=dequeue)
        running = r.offer("standard")
        r.offer("standard", rid="s1")
        r.offer("critical", rid="c")
        r.offer("standard", rid="s2")
        served = []
        r.controller.finish(running)
        while (ticket := r.controller.start()) is not None:
            served.append(ticket.request_id)
            r.controller.finish(ticket)
        assert served == expected


def test_priority_at_dequeue_only_sheds_critical_at_the_door() -> None:
    """strict priority applied only at dequeue lets critical requests be shed at the door while
    admission-time priority protects them."""
    outcomes: dict[bool, str] = {}
    for at_admission in (False, True):
        r = rig(
            classes=TWO,
            slots=1,
            service_rate=1.0,
            queue_cap=None,
            mode="deadline",
            dequeue="strict",
            priority_at_admission=at_admission,
        )
        running = r.offer("standard", deadline=100.0)
        admitted = 0
        while True:
            try:
                r.offer("standard", deadline=10.0)
            except DeadlineUnmeetable:
                break
            admitted += 1
        assert admitted == 10  # the k-th waits k s and needs 1 s: k + 1 <= 10
        refusal: DeadlineUnmeetable | None = None
        try:
            critical = r.offer("critical", deadline=10.0, rid="vip")
        except DeadlineUnmeetable as error:
            refusal = error
        if refusal is not None:
            assert refusal.retry_after == 11.0  # the ten standard tickets ahead, plus one
            outcomes[at_admission] = "shed"
            continue
        r.clock.advance(1.0)
        r.controller.finish(running)
        assert r.controller.start() is critical
        outcomes[at_admission] = "served first"
    assert outcomes == {False: "shed", True: "served first"}


def test_weighted_share_serves_the_lower_class_while_strict_starves_it() -> None:
    """Under sustained critical load, weighted share gives standard about its weight; strict none."""
    served_standard: dict[str, int] = {}
    for dequeue in ("strict", "weighted"):
        r = rig(
            classes=TWO,
            slots=1,
            service_rate=1.0,
            queue_cap=None,
            mode="queue_cap",
            dequeue=dequeue,
            weights={"critical": 3.0, "standard": 1.0},
        )
        running = r.offer("critical")
        for _ in range(5):
            r.offer("critical")
        for _ in range(400):
            r.offer("standard")
        counts = {"critical": 0, "standard": 0}
        for _ in range(400):
            r.clock.advance(1.0)
            r.controller.finish(running)
            ticket = r.controller.start()
            assert ticket is not None
            counts[ticket.klass] += 1
            if ticket.klass == "critical":
                r.offer("critical")  # critical demand never lets up
            running = ticket
        served_standard[dequeue] = counts["standard"]
    assert served_standard["strict"] == 0
    assert served_standard["weighted"] == 100


def test_conditional_priority_applies_only_above_the_load_threshold() -> None:
    """Below the offered-load threshold dequeue is FIFO and admission class-blind; above, strict."""
    r = rig(
        classes=TWO,
        slots=1,
        service_rate=1.0,
        queue_cap=None,
        mode="queue_cap",
        dequeue="strict",
        conditional_priority=5.0,
        overload_window=1.0,
    )
    running = r.offer("standard", rid="s0")
    r.offer("standard", rid="s1")
    r.offer("standard", rid="s2")
    r.offer("critical", rid="c1")
    assert r.controller.offered_rate == 4.0
    assert r.controller.load == 4.0
    assert r.controller.priority_active is False
    assert r.controller.estimated_wait("critical") == 3.0  # class-blind: everything is ahead
    r.controller.finish(running)
    running = next_started(r)
    assert running.request_id == "s1"  # FIFO
    r.offer("standard", rid="s3")
    r.offer("critical", rid="c2")
    assert r.controller.load == 6.0
    assert r.controller.snapshot().priority_active is True
    assert r.controller.estimated_wait("critical") == 2.0  # only critical is ahead
    r.controller.finish(running)
    running = next_started(r)
    assert running.request_id == "c1"  # strict
    r.clock.advance(10.0)
    assert r.controller.offered_rate == 6.0 * math.exp(-10.0)
    assert r.controller.snapshot().priority_active is False
    r.controller.finish(running)
    running = next_started(r)
    assert running.request_id == "s2"  # FIFO again


# --------------------------------------------------------------------------- tenant bulkheads


def test_tenant_in_flight_bulkhead_parks_its_extra_work_and_lets_others_through() -> None:
    """A tenant at its in-flight limit waits parked while another tenant starts at once."""
    r = rig(classes=TWO, slots=3, tenant_max_in_flight=1)
    a1 = r.offer("standard", tenant="a")
    a2 = r.offer("standard", tenant="a")
    b1 = r.offer("standard", tenant="b")
    assert (a1.state, a2.state, b1.state) == (
        TicketState.STARTED,
        TicketState.WAITING,
        TicketState.STARTED,
    )
    assert r.controller.start() is None
    assert r.controller.tenant_in_flight("a") == 1
    assert r.controller.tenant_waiting("a") == 1
    r.controller.finish(a1)
    assert r.controller.start() is a2
    assert r.controller.tenant_waiting("a") == 0


def test_tenant_in_flight_bulkhead_holds_for_tickets_queued_before_it_filled() -> None:
    """Tickets queued while their tenant had room are parked at start() once it is full."""
    r = rig(classes=TWO, slots=2, tenant_max_in_flight=1)
    b1 = r.offer("standard", tenant="b")
    c1 = r.offer("standard", tenant="c")
    a1 = r.offer("standard", tenant="a")
    a2 = r.offer("standard", tenant="a")
    assert (a1.state, a2.state) == (TicketState.WAITING, TicketState.WAITING)
    r.controller.finish(b1)
    assert r.controller.start() is a1
    r.controller.finish(c1)
    assert r.controller.start() is None
    assert a2.state is TicketState.WAITING
    assert r.controller.tenant_in_flight("a") == 1
    r.controller.finish(a1)
    assert r.controller.start() is a2


def test_tenant_waiting_bulkhead_refuses_with_bulkhead_full() -> None:
    """A tenant with tenant_max_waiting tickets waiting is refused; other tenants are not."""
    r = rig(classes=TWO, slots=1, tenant_max_waiting=1, service_rate=1.0)
    r.offer("standard", tenant="a")
    r.offer("standard", tenant="a")
    with pytest.raises(BulkheadFull) as caught:
        r.offer("standard", tenant="a")
    assert caught.value.reason == RefusalReason.TENANT_WAITING
    assert caught.value.policy == "admission"
    assert caught.value.retry_after == 2.0
    assert r.offer("standard", tenant="b").state is TicketState.WAITING


def test_parked_work_is_not_stranded_when_its_unparked_sibling_expires() -> None:
    """When an unparked ticket is dropped as expired, the tenant's next parked ticket runs."""
    r = rig(classes=TWO, slots=2, tenant_max_in_flight=1, mode="queue_cap")
    a1 = r.offer("standard", tenant="a", deadline=100.0)
    a2 = r.offer("standard", tenant="a", deadline=1.0)
    a3 = r.offer("standard", tenant="a", deadline=100.0)
    r.clock.advance(2.0)
    r.controller.finish(a1)
    assert r.controller.start() is a3
    assert a2.state is TicketState.EXPIRED


def test_parked_work_is_not_stranded_when_its_unparked_sibling_is_cancelled() -> None:
    """Cancelling an unparked ticket before it starts releases the tenant's next parked one."""
    r = rig(classes=TWO, slots=2, tenant_max_in_flight=1)
    a1 = r.offer("standard", tenant="a")
    a2 = r.offer("standard", tenant="a")
    a3 = r.offer("standard", tenant="a")
    r.controller.finish(a1)
    r.controller.cancel(a2)
    assert r.controller.start() is a3


# --------------------------------------------------------------------------- properties


CLASSES = ("critical", "standard", "batch")
TENANTS = ("a", "b", "c")
ORDERS: tuple[DequeueOrder, ...] = ("fifo", "strict", "weighted")
MODES: tuple[AdmissionMode, ...] = ("queue_cap", "deadline")


@st.composite
def any_options(draw: st.DrawFn) -> AdmissionOptions:
    dequeue = draw(st.sampled_from(ORDERS))
    caps = st.one_of(st.none(), st.integers(0, 4))
    return AdmissionOptions(
        classes=CLASSES,
        slots=draw(st.integers(1, 4)),
        queue_cap=draw(st.one_of(caps, st.fixed_dictionaries(dict.fromkeys(CLASSES, caps)))),
        tenant_max_in_flight=draw(st.one_of(st.none(), st.integers(1, 3))),
        tenant_max_waiting=draw(st.one_of(st.none(), st.integers(0, 3))),
        mode=draw(st.sampled_from(MODES)),
        service_rate=draw(st.one_of(st.none(), st.sampled_from([0.5, 2.0, 8.0]))),
        service_time_smoothing=0.5,
        drop_expired_at_dequeue=draw(st.booleans()),
        priority_at_admission=draw(st.booleans()),
        dequeue=dequeue,
        conditional_priority=(
            None if dequeue == "fifo" else draw(st.one_of(st.none(), st.just(1.5)))
        ),
        overload_window=1.0,
    )


OPERATIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("offer"),
            st.sampled_from(CLASSES),
            st.sampled_from(TENANTS),
            st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0])),
        ),
        st.tuples(st.just("start")),
        st.tuples(st.just("pump")),
        st.tuples(st.just("finish"), st.integers(0, 40)),
        st.tuples(st.just("cancel"), st.integers(0, 40)),
        st.tuples(st.just("advance"), st.sampled_from([0.0, 0.25, 1.0, 3.0])),
    ),
    max_size=80,
)


def check_invariants(r: Rig, tickets: list[Ticket]) -> None:
    options = r.controller.options
    started = [t for t in tickets if t.state is TicketState.STARTED]
    waiting = [t for t in tickets if t.state is TicketState.WAITING]
    assert r.controller.in_flight == len(started) <= options.slots
    assert r.controller.depth() == len(waiting)
    for klass in CLASSES:
        depth = sum(t.klass == klass for t in waiting)
        assert r.controller.depth(klass) == depth
        cap = options.cap_for(klass)
        assert cap is None or depth <= cap
    for tenant in TENANTS:
        running = sum(t.tenant == tenant for t in started)
        queued = sum(t.tenant == tenant for t in waiting)
        assert r.controller.tenant_in_flight(tenant) == running
        assert r.controller.tenant_waiting(tenant) == queued
        assert options.tenant_max_in_flight is None or running <= options.tenant_max_in_flight
        assert options.tenant_max_waiting is None or queued <= options.tenant_max_waiting
    # The controller keeps per-tenant state for exactly the tenants with live tickets.
    live_tenants = {t.tenant for t in started + waiting}
    assert set(r.controller._tenants) == live_tenants


def apply_operation(r: Rig, tickets: list[Ticket], operation: tuple[Any, ...]) -> None:
    """Apply one operation, asserting what must hold of its immediate result."""
    options = r.controller.options
    kind = operation[0]
    if kind == "offer":
        _, klass, tenant, budget = operation
        deadline = None if budget is None else r.clock.now() + budget
        refusal: Rejected | None = None
        try:
            tickets.append(r.offer(klass, tenant=tenant, deadline=deadline))
        except Rejected as error:
            refusal = error
        if refusal is not None:
            assert refusal.policy == "admission"
            assert refusal.retry_after is not None
            assert refusal.retry_after > 0
    elif kind in ("start", "pump"):
        while (ticket := r.controller.start()) is not None:
            assert ticket.state is TicketState.STARTED
            if options.drop_expired_at_dequeue and ticket.deadline_at is not None:
                assert ticket.deadline_at > r.clock.now()
            if kind == "start":
                break
        else:
            if r.controller.in_flight < options.slots:
                # Nothing startable is left beside a free slot: only tenant-parked work waits.
                for t in tickets:
                    if t.state is TicketState.WAITING:
                        limit = options.tenant_max_in_flight
                        assert limit is not None
                        assert r.controller.tenant_in_flight(t.tenant) == limit
    elif kind == "finish":
        running = [t for t in tickets if t.state is TicketState.STARTED]
        if running:
            r.controller.finish(running[operation[1] % len(running)])
    elif kind == "cancel":
        if tickets:
            ticket = tickets[operation[1] % len(tickets)]
            live = ticket.state in (TicketState.WAITING, TicketState.STARTED)
            assert r.controller.cancel(ticket) is live
    else:
        r.clock.advance(operation[1])
    check_invariants(r, tickets)


def check_history(r: Rig, tickets: list[Ticket]) -> None:
    for event in r.events:
        if isinstance(event, TicketExpired):
            assert event.ticket.deadline_at is not None
            assert event.ticket.deadline_at <= event.at
    snapshot = r.controller.snapshot()
    assert sum(snapshot.admitted.values()) == len(tickets)
    assert sum(snapshot.started.values()) == sum(t.started_at is not None for t in tickets)


@settings(max_examples=300, deadline=None)
@given(options=any_options(), operations=OPERATIONS)
def test_bounds_hold_under_any_sequence_of_operations(
    options: AdmissionOptions, operations: list[tuple[Any, ...]]
) -> None:
    """Slots, class caps and tenant bulkheads always hold, nothing expired starts, and a pump
    leaves no startable work waiting beside a free slot."""
    r = rig(options)
    tickets: list[Ticket] = []
    for operation in operations:
        apply_operation(r, tickets, operation)
    check_history(r, tickets)


def random_operation(rng: random.Random) -> tuple[Any, ...]:
    roll = rng.random()
    if roll < 0.45:
        budget = rng.choice([None, 0.0, 0.5, 1.0, 2.0, 5.0])
        return ("offer", rng.choice(CLASSES), rng.choice(TENANTS), budget)
    if roll < 0.55:
        return ("start",)
    if roll < 0.7:
        return ("pump",)
    if roll < 0.85:
        return ("finish", rng.randrange(40))
    if roll < 0.9:
        return ("cancel", rng.randrange(40))
    return ("advance", rng.choice([0.0, 0.25, 1.0, 3.0]))


@settings(max_examples=60, deadline=None)
@given(options=any_options(), seed=st.integers(0, 2**32 - 1))
def test_bounds_hold_on_long_random_walks(options: AdmissionOptions, seed: int) -> None:
    """The same bounds hold over long seeded walks, which reach states short sequences miss."""
    rng = random.Random(seed)
    r = rig(options)
    tickets: list[Ticket] = []
    for _ in range(400):
        apply_operation(r, tickets, random_operation(rng))
    check_history(r, tickets)


def observe(r: Rig, tickets: list[Ticket]) -> tuple[object, ...]:
    """Everything a caller can see of a controller and its tickets, floats exact."""
    controller = r.controller
    return (
        [
            (t.request_id, t.klass, t.tenant, t.state, t.offered_at, t.started_at, t.ended_at)
            for t in tickets
        ],
        controller.snapshot(),
        controller.in_flight,
        controller.depth(),
        [controller.estimated_wait(klass) for klass in CLASSES],
        [(controller.tenant_in_flight(t), controller.tenant_waiting(t)) for t in TENANTS],
    )


def replay(r: Rig, operations: list[tuple[Any, ...]]) -> list[object]:
    """Apply the operations, recording each one's outcome and what the controller shows after."""
    tickets: list[Ticket] = []
    outcomes: list[object] = []
    for operation in operations:
        kind = operation[0]
        if kind == "offer":
            _, klass, tenant, budget = operation
            deadline = None if budget is None else r.clock.now() + budget
            try:
                tickets.append(r.offer(klass, tenant=tenant, deadline=deadline))
            except Rejected as error:
                outcomes.append((type(error), error.reason, str(error), error.retry_after))
        elif kind == "finish":
            running = [t for t in tickets if t.state is TicketState.STARTED]
            if running:
                outcomes.append(r.controller.finish(running[operation[1] % len(running)]))
        else:
            apply_operation(r, tickets, operation)
        check_invariants(r, tickets)
        outcomes.append(observe(r, tickets))
    return outcomes


@settings(max_examples=300, deadline=None)
@given(options=any_options(), operations=OPERATIONS)
def test_without_an_event_hook_every_outcome_is_the_same(
    options: AdmissionOptions, operations: list[tuple[Any, ...]]
) -> None:
    """A controller with no event hook (whose offer and finish take their fast paths) gives the
    same tickets, times, refusals, service times, counters and gauges as one with a hook."""
    clock = ManualClock()
    plain = Rig(clock, AdmissionController(options, clock))
    assert replay(rig(options), operations) == replay(plain, operations)


def test_tickets_started_at_once_count_as_admitted_and_started() -> None:
    """Without a hook, a ticket that starts on offer is counted once as admitted and once as
    started, beside the tickets admitted to wait and started from the queue."""
    clock = ManualClock()
    controller = AdmissionController(AdmissionOptions(classes=TWO, slots=1), clock)
    first = controller.offer(request_id="a", klass="critical", tenant="t", deadline_at=None)
    second = controller.offer(request_id="b", klass="critical", tenant="t", deadline_at=None)
    assert (first.state, second.state) == (TicketState.STARTED, TicketState.WAITING)
    assert first.started_at == first.offered_at == 0.0
    clock.advance(2.0)
    assert controller.finish(first) == 2.0
    assert controller.start() is second
    snapshot = controller.snapshot()
    assert dict(snapshot.admitted) == {"critical": 2, "standard": 0}
    assert dict(snapshot.started) == {"critical": 2, "standard": 0}
    assert dict(snapshot.finished) == {"critical": 1, "standard": 0}
    assert snapshot.in_flight == controller.in_flight == 1
    assert controller.mean_service_time == 1.0 + 0.1 * (2.0 - 1.0)


def simulate(seed: int) -> list[tuple[object, ...]]:
    """A seeded surge through the controller, traced event by event."""
    rng = random.Random(seed)
    clock = ManualClock()
    trace: list[tuple[object, ...]] = []

    def record(event: AdmissionEvent) -> None:
        if isinstance(event, TicketRefused):
            trace.append(("refused", event.request_id, event.reason, event.retry_after, event.at))
        else:
            trace.append((type(event).__name__, event.ticket.request_id, event.at))

    controller = AdmissionController(
        AdmissionOptions(classes=TWO, slots=4, queue_cap=20, tenant_max_in_flight=3),
        clock,
        on_event=record,
    )
    running: list[tuple[float, Ticket]] = []
    for n in range(600):
        clock.advance(rng.expovariate(12.0))
        for done_at, ticket in sorted(running, key=lambda pair: pair[0]):
            if done_at <= clock.now():
                controller.finish(ticket)
                running.remove((done_at, ticket))
        while (started := controller.start()) is not None:
            running.append((clock.now() + rng.expovariate(2.0), started))
        try:
            ticket = controller.offer(
                request_id=str(n),
                klass=rng.choice(TWO),
                tenant=rng.choice(TENANTS),
                deadline_at=clock.now() + rng.uniform(0.5, 5.0),
            )
        except Rejected:
            continue
        if ticket.state is TicketState.STARTED:
            running.append((clock.now() + rng.expovariate(2.0), ticket))
    return trace


def test_a_seeded_simulation_repeats_bit_for_bit() -> None:
    """The same seed gives the identical event trace, refusals and expiries included."""
    first, second = simulate(7), simulate(7)
    assert first == second
    kinds = {entry[0] for entry in first}
    assert {"refused", "TicketExpired", "TicketFinished"} <= kinds
    assert simulate(8) != first


# --------------------------------------------------------------------------- docs


def test_the_docs_example_runs() -> None:
    """Every python block in docs/policies/admission.md executes as written."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    assert blocks
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})
