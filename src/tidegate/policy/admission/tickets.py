"""A ticket: one admitted request's place in an admission controller, and its tenant's load."""

from __future__ import annotations

import math
from enum import StrEnum

__all__ = ["TenantLoad", "Ticket", "TicketState"]


class TicketState(StrEnum):
    """Where a ticket is in its life; only ``WAITING`` and ``STARTED`` are live."""

    WAITING = "waiting"
    STARTED = "started"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class TenantLoad:
    """One tenant's live tickets: started, waiting (parked included), and the parked ones.

    A controller keeps one per tenant with live tickets and each ticket points at its tenant's,
    so the hot paths count without a dictionary lookup. It is dropped when both counts reach
    zero; a ticket that has ended never changes its counts again. Its ``owner`` is the
    controller, which is how a ticket's owner is checked (by identity only, so this module needs
    nothing of the controller's).
    """

    __slots__ = ("in_flight", "owner", "parked", "tenant", "waiting")

    def __init__(self, owner: object, tenant: str) -> None:
        self.owner = owner
        self.tenant = tenant
        self.in_flight = 0
        self.waiting = 0
        #: A heap of (arrival sequence, ticket) that cannot start while the tenant is at its limit.
        self.parked: list[tuple[int, Ticket]] = []


class Ticket:
    """One admitted request's place in the controller. Read its fields; only the controller
    writes them."""

    __slots__ = (
        "_ended",
        "_index",
        "_load",
        "_parked",
        "_seq",
        "_started",
        "deadline_at",
        "klass",
        "offered_at",
        "request_id",
        "state",
        "tenant",
    )

    request_id: str
    klass: str
    tenant: str
    deadline_at: float | None
    offered_at: float
    state: TicketState
    _index: int
    _load: TenantLoad
    _parked: bool
    _seq: int
    # Times as plain floats (nan: not yet), which the compiled build keeps unboxed.
    _started: float
    _ended: float

    def __init__(
        self,
        request_id: str,
        klass: str,
        index: int,
        deadline_at: float | None,
        offered_at: float,
        load: TenantLoad,
    ) -> None:
        # Positional (the controller builds one on every offer) and born WAITING, outside the
        # arrival order (seq 0) until the controller queues it.
        self.request_id = request_id
        self.klass = klass
        self.tenant = load.tenant
        self.deadline_at = deadline_at
        self.offered_at = offered_at
        self._started = math.nan
        self._ended = math.nan
        self.state = TicketState.WAITING
        self._index = index
        self._load = load
        self._parked = False
        self._seq = 0

    @property
    def started_at(self) -> float | None:
        """When it took a slot; ``None`` until then."""
        started = self._started
        return None if math.isnan(started) else started

    @property
    def ended_at(self) -> float | None:
        """When it finished, was cancelled or expired; ``None`` while live."""
        ended = self._ended
        return None if math.isnan(ended) else ended

    def __repr__(self) -> str:
        return (
            f"Ticket({self.request_id!r}, klass={self.klass!r}, tenant={self.tenant!r}, "
            f"state={self.state.value!r}, deadline_at={self.deadline_at!r})"
        )
