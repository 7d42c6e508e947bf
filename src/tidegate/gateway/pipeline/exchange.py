"""What one request did: the record its response headers, its log line and its metrics read."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from tidegate.gateway.auth import Identity
from tidegate.ids import new_id
from tidegate.policy.attempts import Tried
from tidegate.policy.deadline import Deadline
from tidegate.policy.routing import Skip, describe_attempts

__all__ = ["Exchange", "new_request_id"]

_NO_USAGE: Mapping[str, int] = MappingProxyType({})


class Exchange:
    """What one request did, for its response headers, its log line and its metrics.

    What nothing has set yet reads as the class's default below (as on
    :class:`~tidegate.gateway.pipeline.request.Request`): making one, once a request, sets only
    its id and its list of attempts."""

    route: str = "-"
    identity: Identity | None = None
    served_by: str = "-"
    served_model: str = "-"
    outcome: str = "ok"
    status: int = 200
    cache: str = ""
    budget: str = ""
    skipped: tuple[Skip, ...] = ()
    cost: float = 0.0
    first_token_s: float | None = None
    #: The request's deadline (the caller's, or the configured one), once the identify step has
    #: worked it out: the log line's ``deadline_ms`` counts from the request's start to it.
    deadline: Deadline | None = None
    #: Set once the request is settling: a disconnect from then on cancels nothing.
    settling: bool = False
    #: Set as it settles: its budget reservation is settled, not refunded (the spend ledger).
    billed: bool = False
    #: The canary version that served (``baseline`` or ``candidate``), when the route has one.
    version: str = ""
    #: A truncated answer, or not the JSON the request asked for (judged by the canary gate).
    validation_failed: bool = False
    #: The task handling the request, when the caller knows it (saves looking it up again).
    task: asyncio.Task[Any] | None = None
    #: The answer's token counts, once known (replaced whole, never changed in place).
    usage: Mapping[str, int] = _NO_USAGE

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        #: Every attempt in order, then the plan's skips: the ``X-Tidegate-Tried`` header.
        self.tried: Tried = []

    def __repr__(self) -> str:
        return f"Exchange({self.request_id!r}, route={self.route!r}, outcome={self.outcome!r})"

    def tried_header(self) -> str:
        """The ``X-Tidegate-Tried`` header: every attempt in order, then the plan's skips."""
        return describe_attempts(self.tried, self.skipped)

    def raw_answer_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers every answer carries, as ASGI takes them (names lower-case)."""
        headers = [(b"x-request-id", self.request_id.encode("latin-1"))]
        if self.served_by != "-":
            headers.append((b"x-tidegate-served-by", self.served_by.encode("latin-1")))
        tried = self.tried_header()
        if tried:
            headers.append((b"x-tidegate-tried", tried.encode("latin-1")))
        if self.cache:
            headers.append((b"x-tidegate-cache", self.cache.encode("latin-1")))
        if self.budget:
            headers.append((b"x-tidegate-budget", self.budget.encode("latin-1")))
        if self.version:
            headers.append((b"x-tidegate-version", self.version.encode("latin-1")))
        return headers

    def answer_headers(self) -> list[tuple[str, str]]:
        """:meth:`raw_answer_headers` as text, for adding more headers to."""
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw_answer_headers()]


def new_request_id(headers: Mapping[str, str]) -> str:
    """The caller's ``X-Request-ID`` when it is 1-128 printable characters, else a new id."""
    given = headers.get("x-request-id", "")
    if 0 < len(given) <= 128 and given.isprintable():
        return given
    return new_id()
