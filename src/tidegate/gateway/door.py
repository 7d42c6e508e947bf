"""What the process's door refuses with (:class:`~tidegate.gateway.protocol.Door`): its answers
rendered once, in each API's shape, and its second reason to refuse, full admission.

A model request is refused at the door, before its body is read and without a request task, for
one of two reasons:

- the process already holds ``server.max_open_requests`` requests;
- admission would refuse any request of the caller's class now, whatever its tenant
  (:meth:`AdmissionController.saturated`): no request can start and the class's queue is at its
  cap. The app would have refused it too, with the same 503 ``queue_full``, after reading and
  parsing its body, taking its rate-limit token and reserving its budget (all given back again):
  under overload, that work is most of what the process does.

The caller's class is its key's (lowered by ``X-Tidegate-Priority``, as admission does), so the
door identifies the caller first, from the head alone, and only once no request can start at
once (``has_room()``, two fields, is all a request pays while there is room). A caller without
a valid key is left to the app, which answers 401 and its kin as usual. Full admission refuses
only on the endpoints whose every answer takes an admission slot (chat, embeddings, messages,
responses; not ``count_tokens``), only with the answer cache off (a hit is served without a
slot), never a request with an ``Idempotency-Key`` (its stored answer is replayed without one),
and only while the kill switch is at ``full`` (``degraded`` answers without a slot). A request
that the app would have refused for what only its body says (its JSON, its model, the key's
right to it), or for its rate limit or budget, hears ``queue_full`` instead while its class is
full (docs/errors.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final

import orjson
import structlog

from tidegate.errors import QueueFull, TidegateError
from tidegate.gateway.http import request_headers
from tidegate.gateway.pipeline import Endpoint
from tidegate.gateway.pipeline.admission import PRIORITY_HEADER
from tidegate.gateway.pipeline.dialect import Dialect, render_error
from tidegate.gateway.pipeline.idempotency import HEADER as IDEMPOTENCY_HEADER
from tidegate.gateway.pipeline.identify import identify
from tidegate.gateway.protocol import ADMISSION_FULL, OPEN_REQUESTS, Shed
from tidegate.gateway.runtime import Runtime
from tidegate.policy.flags import KillSwitchMode, check_answering

__all__ = [
    "MAX_HINT_S",
    "SHED_LOG_EVERY_S",
    "AdmissionDoor",
    "ShedCounter",
    "admission_paths",
    "render_shed",
]

log = structlog.get_logger("tidegate")

#: The door's refusals are logged in one line a second at most, with how many there were.
SHED_LOG_EVERY_S = 1.0

#: The largest ``Retry-After`` the door renders for full admission (a longer hint says this):
#: one rendering is kept per whole second and dialect, so what the door keeps stays bounded.
MAX_HINT_S: Final = 600


def render_shed(dialect: Dialect, error: QueueFull) -> Shed:
    """``error`` in ``dialect``, rendered once, as the door sends it."""
    status, body, extra, _ = render_error(dialect, error)
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    return Shed.of(status, orjson.dumps(body), headers)


def admission_paths(endpoints: Iterable[tuple[str, Endpoint]]) -> dict[bytes, Dialect]:
    """The paths whose every answer, as the runtime serves them, takes an admission slot (their
    steps include admission and not the answer cache), with the API each speaks. Idempotent
    replays are told apart at the door by their header."""
    paths: dict[bytes, Dialect] = {}
    for path, endpoint in endpoints:
        steps = endpoint.pipeline.names()
        if "admission" in steps and "cache" not in steps:
            paths[path.encode("ascii")] = endpoint.dialect
    return paths


class AdmissionDoor:
    """The door's full-admission reason, for one runtime (``Door.full``)."""

    __slots__ = ("_controller", "_paths", "_rt", "_sheds", "has_room")

    def __init__(self, rt: Runtime, paths: dict[bytes, Dialect]) -> None:
        self._rt = rt
        self._controller = rt.admission.controller
        #: Whether a request could start at once: asked before every model request's body is
        #: read, so it is the controller's own method.
        self.has_room = self._controller.has_room
        self._paths = paths
        #: One rendering per (dialect, Retry-After seconds), made on first use.
        self._sheds: dict[tuple[str, int], Shed] = {}

    def refusal(self, path: bytes, pairs: list[tuple[bytes, bytes]]) -> tuple[Shed, str] | None:
        """The answer to send and the caller's class, when admission would refuse the request
        whose path and header fields these are; else None: the app answers it."""
        dialect = self._paths.get(path)
        if dialect is None:
            return None
        headers = request_headers({"headers": pairs})  # as the app decodes them
        if IDEMPOTENCY_HEADER in headers:
            return None
        if dialect.key_header is not None:
            given = dialect.authorization(headers)
            if given is not None:
                headers["authorization"] = given
        rt = self._rt
        try:
            identity = identify(rt, headers)
        except TidegateError:
            return None
        klass = rt.identity_class(identity, headers.get(PRIORITY_HEADER))
        retry_after = self._controller.saturated(klass)
        if retry_after is None or check_answering(rt.flags) is not KillSwitchMode.FULL:
            return None
        return self._shed(dialect, retry_after), klass

    def _shed(self, dialect: Dialect, retry_after: float) -> Shed:
        seconds = min(max(1, math.ceil(retry_after)), MAX_HINT_S)
        shed = self._sheds.get((dialect.name, seconds))
        if shed is None:
            error = QueueFull(
                "the queue of the caller's class is full and no request can start now",
                policy="admission",
                retry_after=float(seconds),
            )
            shed = self._sheds[(dialect.name, seconds)] = render_shed(dialect, error)
        return shed


class ShedCounter:
    """Counts the door's refusals (``Door.counted``): in the metrics as the app counts a refusal
    (route ``-``; the caller's class, or ``-`` past the open-requests limit), by admission too
    when it was full, and in one aggregated ``requests_shed_at_door`` warning a second at most
    (the first at once; :meth:`flush` writes the rest at shutdown)."""

    __slots__ = ("_clock", "_controller", "_limit", "_log_at", "_refusals", "_requests", "unlogged")

    def __init__(self, rt: Runtime, limit: int) -> None:
        self._clock = rt.clock
        self._controller = rt.admission.controller
        self._limit = limit
        self._requests = rt.metrics.requests.labels("-", "-", "-", QueueFull.code)
        self._refusals = rt.metrics.refusals
        #: Refusals since the last line, by reason.
        self.unlogged = {OPEN_REQUESTS: 0, ADMISSION_FULL: 0}
        self._log_at = 0.0

    def __call__(self, reason: str, klass: str) -> None:
        if reason == ADMISSION_FULL:
            self._controller.count_shed(klass)
        self._requests.inc()
        self._refusals.labels(klass, QueueFull.code).inc()
        self.unlogged[reason] += 1
        if self._clock.now() >= self._log_at:
            self.flush()

    def flush(self) -> None:
        """The aggregated line, if anything was refused since the last one."""
        unlogged = self.unlogged
        refused = sum(unlogged.values())
        if not refused:
            return
        log.warning(
            "requests_shed_at_door",
            refused=refused,
            **unlogged,
            outcome=QueueFull.code,
            status=503,
            max_open_requests=self._limit,
        )
        self.unlogged = dict.fromkeys(unlogged, 0)
        self._log_at = self._clock.now() + SHED_LOG_EVERY_S
