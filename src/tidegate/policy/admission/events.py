"""What an admission controller reports as it happens: one past-tense event per step of a ticket,
and the reason of a refusal."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TypeAlias

from tidegate.policy.admission.tickets import Ticket

__all__ = [
    "AdmissionEvent",
    "RefusalReason",
    "TicketAdmitted",
    "TicketCancelled",
    "TicketExpired",
    "TicketFinished",
    "TicketRefused",
    "TicketStarted",
]


class RefusalReason(StrEnum):
    """Why ``offer()`` refused; the ``reason`` of the raised error and a counter label."""

    QUEUE_FULL = "queue_full"
    TENANT_WAITING = "tenant_waiting"
    DEADLINE_UNMEETABLE = "deadline_unmeetable"
    DEADLINE_PASSED = "deadline_passed"


@dataclass(frozen=True, slots=True, kw_only=True)
class TicketAdmitted:
    """A request was accepted; it waits, or starts at once (then ``TicketStarted`` follows)."""

    ticket: Ticket
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TicketRefused:
    """A request was refused at the door; ``retry_after`` is the hint the caller was given."""

    request_id: str
    klass: str
    tenant: str
    reason: RefusalReason
    retry_after: float
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TicketStarted:
    """A ticket took a slot after waiting ``waited`` seconds."""

    ticket: Ticket
    at: float
    waited: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TicketExpired:
    """``start()`` met a ticket whose deadline had passed and dropped it unserved."""

    ticket: Ticket
    at: float
    waited: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TicketFinished:
    """A started ticket completed after ``service_time`` seconds in its slot."""

    ticket: Ticket
    at: float
    service_time: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TicketCancelled:
    """The caller withdrew a ticket; ``was_started`` says whether it held a slot."""

    ticket: Ticket
    at: float
    was_started: bool


AdmissionEvent: TypeAlias = (
    TicketAdmitted
    | TicketRefused
    | TicketStarted
    | TicketExpired
    | TicketFinished
    | TicketCancelled
)
