"""``AdmissionController.saturated``: the door's question, answered without an offer. Whatever
the state, it says a class is saturated exactly when every offer of that class would be refused,
with the retry hint that refusal carries."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings

from tests.policy.test_admission import CLASSES, OPERATIONS, Rig, any_options, apply_operation, rig
from tidegate.errors import QueueFull, Rejected
from tidegate.policy.admission import AdmissionOptions, Ticket, TicketState


def _probe(r: Rig, klass: str) -> Rejected | None:
    """Offer one request of ``klass`` from a new tenant with no deadline, and take it back: the
    refusal, or None once the admitted ticket is withdrawn (the state is as it was)."""
    try:
        ticket = r.offer(klass, tenant="probe")
    except Rejected as refusal:
        return refusal
    assert r.controller.cancel(ticket)
    return None


def _check(r: Rig, options: AdmissionOptions) -> None:
    controller = r.controller
    for klass in CLASSES:
        hint = controller.saturated(klass)
        refusal = _probe(r, klass)
        if hint is not None:
            assert not controller.has_room()
            assert refusal is not None, f"{klass} said saturated, yet an offer got in"
            if options.conditional_priority is None:  # else the probe's offer moves the load
                assert refusal.retry_after == pytest.approx(hint)
        elif options.tenant_max_waiting != 0:  # 0: a new tenant may only take a free slot
            assert refusal is None, f"{klass} said not saturated, yet {refusal!r}"


@settings(max_examples=300, deadline=None)
@given(options=any_options(), operations=OPERATIONS)
def test_saturated_says_exactly_when_every_offer_of_the_class_is_refused(
    options: AdmissionOptions, operations: list[tuple[Any, ...]]
) -> None:
    r = rig(options)
    tickets: list[Ticket] = []
    for operation in operations:
        apply_operation(r, tickets, operation)
        _check(r, options)


def test_a_full_class_is_saturated_and_others_are_not() -> None:
    r = rig(slots=1, queue_cap=1, classes=("critical", "standard"), service_rate=2.0)
    assert r.controller.has_room()
    assert r.controller.saturated("standard") is None
    held = r.offer("standard")
    assert held.state is TicketState.STARTED
    assert not r.controller.has_room()
    assert r.controller.saturated("standard") is None  # one waiting place left
    r.offer("standard")
    # (1 waiting + 1) / 2 per second: what a refusal of the class says
    assert r.controller.saturated("standard") == pytest.approx(1.0)
    assert r.controller.saturated("critical") is None
    with pytest.raises(QueueFull):
        r.offer("standard")
    r.controller.finish(held)
    # A slot is free, but the waiting ticket is ahead of any new one: still refused...
    assert r.controller.saturated("standard") is not None
    with pytest.raises(QueueFull):
        r.offer("standard")
    assert r.controller.start() is not None  # ... until the scheduler starts it
    assert r.controller.saturated("standard") is None


def test_count_shed_counts_an_offer_and_a_queue_full_refusal() -> None:
    r = rig(slots=1, queue_cap=1, classes=("critical", "standard"), overload_window=1.0)
    before = r.controller.offered_rate
    r.controller.count_shed("standard")
    snapshot = r.controller.snapshot()
    assert snapshot.refused["standard"] == {"queue_full": 1}
    assert snapshot.refused["critical"] == {}
    assert r.controller.offered_rate == pytest.approx(before + 1.0)
    assert r.events == []  # no ticket, no request id: no event
    with pytest.raises(ValueError):
        r.controller.count_shed("nobody")
