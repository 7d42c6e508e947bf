"""Step 8, admission: a bounded queue per priority class and a bulkhead per tenant, in front of
this process's in-flight slots. A request is admitted only if the work ahead of it can clear
before its deadline; a refusal is immediate and typed (503 with a retry hint). The slot is given
back by the settle step."""

from __future__ import annotations

from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.steps import Outcome
from tidegate.policy.admission import Ticket, TicketState

__all__ = ["PRIORITY_HEADER", "admit"]

PRIORITY_HEADER = "x-tidegate-priority"


def admit(request: Request) -> Outcome:
    """A slot in the caller's class (lowered, never raised, by X-Tidegate-Priority), at once or
    once the request's turn comes."""
    rt, identity = request.rt, request.identity
    klass = rt.identity_class(identity, request.headers.get(PRIORITY_HEADER))
    ticket = rt.admission.offer(
        request_id=request.ex.request_id,
        klass=klass,
        tenant=identity.tenant,
        deadline=request.deadline,
    )
    if ticket.state is TicketState.STARTED:
        request.ticket = ticket  # the settle step gives the slot back
        return False
    return _waited(request, ticket)


async def _waited(request: Request, ticket: Ticket) -> bool:
    # A ticket given up while it waits (its deadline, the caller gone) is the gate's to drop.
    await request.rt.admission.wait(ticket, request.deadline)
    request.ticket = ticket
    return False
