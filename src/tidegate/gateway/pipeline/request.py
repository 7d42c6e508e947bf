"""One request on its way through the steps: what it asked, what the steps decided, what it owes.

A step reads what the steps before it decided here and adds its own; the settle step pays what
is owed (the budget reservation, the idempotency claim, the admission ticket) whatever happened.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidegate.gateway.auth import Identity
from tidegate.gateway.canary import Canary
from tidegate.gateway.http import Send
from tidegate.gateway.pipeline.dialect import OPENAI, Dialect
from tidegate.gateway.pipeline.exchange import Exchange
from tidegate.gateway.runtime import Route, Runtime
from tidegate.policy.admission import Ticket
from tidegate.policy.budget import Reservation
from tidegate.policy.deadline import Deadline
from tidegate.policy.routing import RoutePlan
from tidegate.state.base import StoredResponse

__all__ = ["Request"]


class Request:
    """The request context the steps share; ``ex`` is what the request did, for its answer's
    headers, its log line and its metrics.

    What a step may not have set yet reads as the class's default below, so that making a
    request's context sets only what it is made from."""

    #: Set by the identify step (every later step may read them).
    identity: Identity
    deadline: Deadline
    route: Route
    #: Set by the route step.
    plan: RoutePlan

    #: The API the caller speaks: its answers' and errors' shapes.
    dialect: Dialect = OPENAI
    #: The route alias asked for (a budget degrade may change it to a cheaper one).
    alias: str = ""
    #: Completions asked for (``n``).
    choices: int = 1
    stream: bool = False
    #: The route's canary, and when the request began (its latency counts in the windows).
    canary: Canary | None = None
    started: float = 0.0
    #: The response cache's key; empty when the request is not cacheable.
    cache_key: str = ""
    #: A failure of the call that a degraded answer may stand in for (the degrade step).
    failure: Exception | None = None
    # What the request owes, paid by the settle step.
    reservation: Reservation | None = None
    #: The idempotency key (scoped to the caller) and the claim's token.
    idempotency: tuple[str, str] | None = None
    #: The answer that key replays, once there is one.
    stored: StoredResponse | None = None
    ticket: Ticket | None = None
    #: Something billable was produced: the reservation is settled, not refunded.
    served: bool = False

    def __init__(
        self,
        rt: Runtime,
        ex: Exchange,
        headers: Mapping[str, str],
        body: dict[str, Any],
        send: Send,
    ) -> None:
        self.rt = rt
        self.ex = ex
        self.headers = headers
        self.body = body
        self.send = send
