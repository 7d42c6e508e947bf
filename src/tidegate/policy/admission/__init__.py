"""Admission control: who waits, who is refused at the door, and who is served next.

One synchronous controller expresses every rung of the overload ladder: an unbounded FIFO, a
bounded queue per priority class, deadline admission (admit only if the work that will be served
first can clear before the request's deadline), dropping expired work at dequeue, priority at
dequeue and at admission, priority made conditional on measured overload, and a weighted share
that keeps lower classes from starving. Per-tenant bulkheads bound what one tenant may hold.

The protocol is three calls and one escape hatch:

- ``offer()`` either refuses at once with a typed :class:`~tidegate.errors.Rejected` or returns a
  :class:`Ticket`. The ticket is already ``STARTED`` when a slot was free and nothing was waiting;
  otherwise it is ``WAITING``.
- ``start()`` takes the next waiting ticket in dequeue order into a free slot (dropping expired
  entries it meets) and returns it, or returns ``None``. Call it until it returns ``None`` after
  every ``finish()`` or ``cancel()``; that is the whole scheduling loop.
- ``finish(ticket)`` frees the slot and records the service time.
- ``cancel(ticket)`` withdraws a waiting ticket or frees a started one without recording a
  service time (the caller went away).

Every operation is O(log n) in the number of waiting tickets and O(k) in the number of classes:
a heap per class and per parked tenant, lazy deletion of cancelled entries, counters instead of
scans. Time is read only from the injected clock.

The modules, one noun each: ``options`` (:class:`AdmissionOptions`), ``tickets``
(:class:`Ticket`, :class:`TicketState`), ``events`` (the ``Ticket...`` events and
:class:`RefusalReason`), ``snapshot``, ``estimates`` (the pure arithmetic), ``shares`` (the
weighted share) and ``controller`` (:class:`AdmissionController`).
"""

from tidegate.policy.admission.controller import AdmissionController
from tidegate.policy.admission.estimates import deadline_admits, work_ahead
from tidegate.policy.admission.events import (
    AdmissionEvent,
    RefusalReason,
    TicketAdmitted,
    TicketCancelled,
    TicketExpired,
    TicketFinished,
    TicketRefused,
    TicketStarted,
)
from tidegate.policy.admission.options import AdmissionMode, AdmissionOptions, DequeueOrder
from tidegate.policy.admission.snapshot import AdmissionSnapshot
from tidegate.policy.admission.tickets import Ticket, TicketState

__all__ = [
    "AdmissionController",
    "AdmissionEvent",
    "AdmissionMode",
    "AdmissionOptions",
    "AdmissionSnapshot",
    "DequeueOrder",
    "RefusalReason",
    "Ticket",
    "TicketAdmitted",
    "TicketCancelled",
    "TicketExpired",
    "TicketFinished",
    "TicketRefused",
    "TicketStarted",
    "TicketState",
    "deadline_admits",
    "work_ahead",
]
