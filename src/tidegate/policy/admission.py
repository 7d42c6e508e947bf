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
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final, Literal, TypeAlias

from tidegate.clock import Clock
from tidegate.errors import BulkheadFull, DeadlineUnmeetable, QueueFull, Rejected

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

_POLICY: Final = "admission"

# Bound once: the compiled build reads a module-level Final directly, not through the module.
_heappush: Final = heapq.heappush
_heappop: Final = heapq.heappop
_NAN: Final = math.nan

AdmissionMode: TypeAlias = Literal["queue_cap", "deadline"]
DequeueOrder: TypeAlias = Literal["fifo", "strict", "weighted"]

_MODES: Final[frozenset[str]] = frozenset({"queue_cap", "deadline"})
_ORDERS: Final[frozenset[str]] = frozenset({"fifo", "strict", "weighted"})

# A measured service time of zero would make the estimated service rate infinite and every
# retry hint zero; a millisecond is far below any model call and keeps the arithmetic finite.
_MIN_SERVICE_TIME: Final = 1e-3

# Stride passes grow without bound; rebasing them keeps float spacing fine over long lab runs.
_REBASE_PASSES_AT: Final = float(2**20)


# --------------------------------------------------------------------------- options


def _check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_positive(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionOptions:
    """How the admission controller bounds, admits and orders work.

    ``classes`` are priority classes, highest first. ``queue_cap`` bounds each class's waiting
    tickets in every mode (an int applies to every class; ``None`` means unbounded). ``mode``
    ``"deadline"`` additionally refuses a request whose deadline the work ahead of it would miss.
    ``service_rate`` is completions per second for the whole controller; ``None`` measures it as
    ``slots / mean service time``, the mean being an exponentially weighted moving average of
    finished tickets' service times that starts at ``initial_service_time``.
    ``conditional_priority`` is a threshold on the offered load factor (offered requests per
    second, smoothed over ``overload_window`` seconds, divided by the service rate): above it the
    configured priority applies; at or below it admission is class-blind and dequeue is FIFO.
    """

    #: Priority classes, highest first.
    classes: tuple[str, ...] = ("critical", "standard", "batch")
    #: Global in-flight slots: tickets started and not yet finished or cancelled.
    slots: int = 64
    #: Waiting tickets allowed per class: one int for all, a mapping per class, ``None`` unbounded.
    queue_cap: Mapping[str, int | None] | int | None = 256
    #: Started tickets one tenant may hold; further tickets of the tenant wait parked.
    tenant_max_in_flight: int | None = None
    #: Waiting tickets one tenant may hold; more are refused with ``BulkheadFull``.
    tenant_max_waiting: int | None = None
    #: ``"queue_cap"``: caps only. ``"deadline"``: caps plus the deadline admission test.
    mode: AdmissionMode = "deadline"
    #: Completions per second for the whole controller; ``None`` measures it from completions.
    service_rate: float | None = None
    #: Starting guess for the measured mean service time, in seconds.
    initial_service_time: float = 1.0
    #: Weight of each new service time in the moving average, in (0, 1].
    service_time_smoothing: float = 0.1
    #: Drop tickets whose deadline has passed when ``start()`` meets them.
    drop_expired_at_dequeue: bool = True
    #: Count only the work that will be served first when judging a request (class-aware).
    priority_at_admission: bool = True
    #: Order of service across classes: ``"fifo"``, ``"strict"`` priority, or ``"weighted"`` share.
    dequeue: DequeueOrder = "strict"
    #: Per-class weights for ``"weighted"``; ``None`` means halving per class (4, 2, 1 for three).
    weights: Mapping[str, float] | None = None
    #: Offered load factor above which priority applies; ``None`` means always.
    conditional_priority: float | None = None
    #: Smoothing time constant of the offered-rate estimate, in seconds.
    overload_window: float = 10.0

    def __post_init__(self) -> None:
        classes = tuple(self.classes)
        if not classes:
            raise ValueError("classes must name at least one class")
        for klass in classes:
            if not isinstance(klass, str) or not klass:
                raise ValueError(f"classes must be non-empty strings, got {klass!r}")
        if len(set(classes)) != len(classes):
            raise ValueError(f"classes must be distinct, got {classes!r}")
        object.__setattr__(self, "classes", classes)
        _check_count("slots", self.slots, minimum=1)
        if isinstance(self.queue_cap, Mapping):
            caps = dict(self.queue_cap)
            if set(caps) != set(classes):
                raise ValueError(
                    f"queue_cap must name exactly the classes {classes!r}, got {sorted(caps)!r}"
                )
            for klass, cap in caps.items():
                if cap is not None:
                    _check_count(f"queue_cap[{klass!r}]", cap, minimum=0)
            object.__setattr__(self, "queue_cap", MappingProxyType(caps))
        elif self.queue_cap is not None:
            _check_count("queue_cap", self.queue_cap, minimum=0)
        if self.tenant_max_in_flight is not None:
            _check_count("tenant_max_in_flight", self.tenant_max_in_flight, minimum=1)
        if self.tenant_max_waiting is not None:
            _check_count("tenant_max_waiting", self.tenant_max_waiting, minimum=0)
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}, got {self.mode!r}")
        if self.service_rate is not None:
            _check_positive("service_rate", self.service_rate)
        _check_positive("initial_service_time", self.initial_service_time)
        _check_positive("service_time_smoothing", self.service_time_smoothing)
        if self.service_time_smoothing > 1:
            raise ValueError(
                f"service_time_smoothing must be in (0, 1], got {self.service_time_smoothing!r}"
            )
        if self.dequeue not in _ORDERS:
            raise ValueError(f"dequeue must be one of {sorted(_ORDERS)}, got {self.dequeue!r}")
        if self.weights is not None:
            weights = dict(self.weights)
            if set(weights) != set(classes):
                raise ValueError(
                    f"weights must name exactly the classes {classes!r}, got {sorted(weights)!r}"
                )
            for klass, weight in weights.items():
                _check_positive(f"weights[{klass!r}]", weight)
            object.__setattr__(self, "weights", MappingProxyType(weights))
        if self.conditional_priority is not None:
            _check_positive("conditional_priority", self.conditional_priority)
            if self.dequeue == "fifo":
                raise ValueError(
                    "conditional_priority needs dequeue 'strict' or 'weighted': "
                    "with 'fifo' there is no priority to make conditional"
                )
        _check_positive("overload_window", self.overload_window)

    def cap_for(self, klass: str) -> int | None:
        """The waiting cap of ``klass`` (``None``: unbounded)."""
        if isinstance(self.queue_cap, Mapping):
            return self.queue_cap[klass]
        return self.queue_cap

    def weight_for(self, klass: str) -> float:
        """The share weight of ``klass`` under ``dequeue="weighted"``."""
        if self.weights is not None:
            return float(self.weights[klass])
        return float(2 ** (len(self.classes) - 1 - self.classes.index(klass)))


# --------------------------------------------------------------------------- tickets and events


class TicketState(StrEnum):
    """Where a ticket is in its life; only ``WAITING`` and ``STARTED`` are live."""

    WAITING = "waiting"
    STARTED = "started"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class RefusalReason(StrEnum):
    """Why ``offer()`` refused; the ``reason`` of the raised error and a counter label."""

    QUEUE_FULL = "queue_full"
    TENANT_WAITING = "tenant_waiting"
    DEADLINE_UNMEETABLE = "deadline_unmeetable"
    DEADLINE_PASSED = "deadline_passed"


# The states as module constants: the hot paths compare against these (one load, not a class
# attribute lookup each time).
_WAITING: Final = TicketState.WAITING
_STARTED: Final = TicketState.STARTED
_FINISHED: Final = TicketState.FINISHED
_CANCELLED: Final = TicketState.CANCELLED
_EXPIRED: Final = TicketState.EXPIRED


class _TenantLoad:
    """One tenant's live tickets: started, waiting (parked included), and the parked ones.

    A controller keeps one per tenant with live tickets and each ticket points at its tenant's,
    so the hot paths count without a dictionary lookup. It is dropped when both counts reach
    zero; a ticket that has ended never changes its counts again. Its ``owner`` is the
    controller, which is how a ticket's owner is checked.
    """

    __slots__ = ("in_flight", "owner", "parked", "waiting")

    def __init__(self, owner: AdmissionController) -> None:
        self.owner = owner
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
    _load: _TenantLoad
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
        tenant: str,
        deadline_at: float | None,
        offered_at: float,
        seq: int,
        load: _TenantLoad,
        state: TicketState,
        started: float,
    ) -> None:
        # Positional, and born in its first state (``WAITING`` with ``started`` nan, or
        # ``STARTED``): the controller builds one on every offer.
        self.request_id = request_id
        self.klass = klass
        self.tenant = tenant
        self.deadline_at = deadline_at
        self.offered_at = offered_at
        self._started = started
        self._ended = _NAN
        self.state = state
        self._index = index
        self._load = load
        self._parked = False
        self._seq = seq

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


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionSnapshot:
    """Counters (since construction) and gauges (now) of one controller, keyed by class."""

    at: float
    in_flight: int
    depth: Mapping[str, int]
    admitted: Mapping[str, int]
    started: Mapping[str, int]
    finished: Mapping[str, int]
    cancelled: Mapping[str, int]
    expired: Mapping[str, int]
    refused: Mapping[str, Mapping[str, int]]
    service_rate: float
    mean_service_time: float
    offered_rate: float
    load: float
    priority_active: bool


# --------------------------------------------------------------------------- helper math


def work_ahead(
    depths: Sequence[int], index: int, *, order: DequeueOrder, weights: Sequence[float] = ()
) -> float:
    """How many waiting entries will be served before a new arrival of class ``index``.

    ``"fifo"``: all of them. ``"strict"``: those of the same or a higher class. ``"weighted"``:
    its own class, plus what each other class is served while the new arrival's class works
    through its backlog and the arrival itself, in proportion to the weights, capped at that
    class's backlog. Later arrivals of higher classes are not foreseen.
    """
    if order == "fifo":
        return float(sum(depths))
    if order == "strict":
        return float(sum(depths[: index + 1]))
    own = depths[index]
    rounds = (own + 1) / weights[index]
    total = float(own)
    for other, depth in enumerate(depths):
        if other != index:
            total += min(float(depth), rounds * weights[other])
    return total


def deadline_admits(
    *, now: float, estimated_wait: float, mean_service_time: float, deadline_at: float | None
) -> bool:
    """Whether a request can start after the estimated wait and finish by its deadline."""
    return deadline_at is None or now + estimated_wait + mean_service_time <= deadline_at


# --------------------------------------------------------------------------- the controller


class AdmissionController:
    """The admission policy: bounded per-class queues, tenant bulkheads, deadline admission,
    priority and weighted share, as one synchronous object driven by ``offer``/``start``/
    ``finish``/``cancel``.

    ``on_event`` receives every event as it happens; it is called synchronously, so keep it cheap.
    """

    __slots__ = (
        "_admitted",
        "_alpha",
        "_cancelled",
        "_caps",
        "_clock",
        "_deadline_mode",
        "_direct",
        "_expired",
        "_finished",
        "_free",
        "_heaps",
        "_index",
        "_measured",
        "_offer_weight",
        "_offered_at",
        "_offered_rate",
        "_on_event",
        "_options",
        "_passes",
        "_ready",
        "_refused",
        "_seq",
        "_service_time",
        "_slots",
        "_started",
        "_strides",
        "_tenant_limit",
        "_tenants",
        "_total_waiting",
        "_vtime",
        "_waiting",
        "_weights",
        "_window",
    )

    def __init__(
        self,
        options: AdmissionOptions,
        clock: Clock,
        *,
        on_event: Callable[[AdmissionEvent], None] | None = None,
    ) -> None:
        self._options = options
        self._clock = clock
        self._on_event = on_event
        classes = options.classes
        count = len(classes)
        self._index = {klass: i for i, klass in enumerate(classes)}
        self._caps = [options.cap_for(klass) for klass in classes]
        self._weights = [options.weight_for(klass) for klass in classes]
        self._strides = [1.0 / weight for weight in self._weights]
        self._passes = [0.0] * count
        self._vtime = 0.0
        # Per class: a heap of (arrival sequence, ticket); cancelled entries are left in place
        # and skipped when they reach the top.
        self._heaps: list[list[tuple[int, Ticket]]] = [[] for _ in classes]
        self._waiting = [0] * count  # live waiting tickets per class, parked ones included
        self._total_waiting = 0
        self._ready = 0  # live tickets in the class heaps, i.e. startable now
        self._free = options.slots  # slots not held by a started ticket: never negative
        # Per tenant with live tickets: its counts and parked tickets.
        self._tenants: dict[str, _TenantLoad] = {}
        self._seq = 0
        # The options the hot paths read, as plain fields (options are frozen).
        self._slots = options.slots
        self._tenant_limit = options.tenant_max_in_flight
        self._deadline_mode = options.mode == "deadline"
        self._measured = options.service_rate is None
        self._alpha = float(options.service_time_smoothing)
        self._window = float(options.overload_window)
        self._offer_weight = 1.0 / options.overload_window  # one offer's share of the rate
        # Mean seconds a ticket holds a slot: measured (a moving average of finished tickets'
        # service times), or fixed at ``slots / service_rate`` when the rate is configured.
        self._service_time = (
            float(options.initial_service_time)
            if options.service_rate is None
            else options.slots / options.service_rate
        )
        self._offered_rate = 0.0
        self._offered_at: float | None = None
        self._admitted = [0] * count  # tickets admitted to wait (or started with an event hook)
        self._started = [0] * count  # tickets started from the queue (or with an event hook)
        # Tickets that started at once on offer with no event hook: each counts as admitted and
        # as started (see ``snapshot``), at one increment instead of two.
        self._direct = [0] * count
        self._finished = [0] * count
        self._cancelled = [0] * count
        self._expired = [0] * count
        self._refused: list[dict[str, int]] = [{} for _ in classes]

    # ----------------------------------------------------------------------- the protocol

    def offer(
        self, *, request_id: str, klass: str, tenant: str, deadline_at: float | None
    ) -> Ticket:
        """Admit a request or refuse it at once.

        Returns a ticket that is ``STARTED`` when a slot was free, nothing startable was waiting
        and the tenant had a slot left; otherwise ``WAITING``. Raises ``DeadlineUnmeetable``
        (deadline already passed, or in deadline mode the work ahead cannot clear in time),
        ``BulkheadFull`` (the tenant's waiting bulkhead is full) or ``QueueFull`` (the class
        queue is at its cap and the request cannot start at once). ``ValueError`` for an unknown class.
        """
        try:
            index = self._index[klass]
        except KeyError:
            raise self._unknown_class(klass) from None
        now = self._clock.now()
        if self._offered_at is None:
            self._offered_rate = self._offer_weight  # the first offer: 0.0 + one share, exactly
        else:  # _offered_rate_at(now) plus one share, inlined
            self._offered_rate = (
                self._offered_rate * math.exp(-(now - self._offered_at) / self._window)
                + self._offer_weight
            )
        self._offered_at = now
        if deadline_at is not None and now >= deadline_at:
            raise self._refuse(
                DeadlineUnmeetable,
                RefusalReason.DEADLINE_PASSED,
                f"the deadline of {klass} request {request_id!r} passed before it was offered",
                request_id=request_id,
                index=index,
                tenant=tenant,
                now=now,
            )
        load = self._tenants.get(tenant)
        if (
            self._free
            and not self._ready
            and self._on_event is None
            and (self._tenant_limit is None or load is None or load.in_flight < self._tenant_limit)
            and (
                deadline_at is None
                or not self._deadline_mode
                or now + self._service_time <= deadline_at
            )
        ):
            # Fast path: a slot is free, nothing startable waits, the tenant has room (so no
            # wait: now + 0.0 + service time is now + service time) and the deadline admits.
            # No hook can see the ticket between admission and start, so it is born STARTED
            # with _begin's counts (admitted and started in one), and as it never enters a heap
            # it takes no place in the arrival order (seq 0).
            if load is None:
                load = self._tenants[tenant] = _TenantLoad(self)
            ticket = Ticket(
                request_id,
                klass,
                index,
                tenant,
                deadline_at,
                now,  # offered_at
                0,  # seq
                load,
                _STARTED,
                now,  # started
            )
            self._direct[index] += 1
            self._free -= 1
            load.in_flight += 1
            return ticket
        limit = self._tenant_limit
        tenant_busy = limit is not None and load is not None and load.in_flight >= limit
        direct = self._free > 0 and self._ready == 0 and not tenant_busy
        if direct:
            wait = 0.0
        else:
            options = self._options
            waiting = load.waiting if load is not None else 0
            if options.tenant_max_waiting is not None and waiting >= options.tenant_max_waiting:
                raise self._refuse(
                    BulkheadFull,
                    RefusalReason.TENANT_WAITING,
                    f"tenant {tenant!r} already has {waiting} requests waiting "
                    f"(tenant_max_waiting={options.tenant_max_waiting})",
                    request_id=request_id,
                    index=index,
                    tenant=tenant,
                    now=now,
                )
            cap = self._caps[index]
            if cap is not None and self._waiting[index] >= cap:
                raise self._refuse(
                    QueueFull,
                    RefusalReason.QUEUE_FULL,
                    f"the {klass} queue is full ({cap} waiting) and the request cannot start now",
                    request_id=request_id,
                    index=index,
                    tenant=tenant,
                    now=now,
                )
            wait = self._work_ahead(index, now) / self.service_rate
        if (  # not deadline_admits(...), inlined
            self._deadline_mode
            and deadline_at is not None
            and not now + wait + self._service_time <= deadline_at
        ):
            raise self._refuse(
                DeadlineUnmeetable,
                RefusalReason.DEADLINE_UNMEETABLE,
                f"{klass} request {request_id!r} would wait about {wait:.3g}s and need "
                f"{self._service_time:.3g}s of service, past its deadline",
                request_id=request_id,
                index=index,
                tenant=tenant,
                now=now,
            )
        if load is None:
            load = self._tenants[tenant] = _TenantLoad(self)
        ticket = Ticket(
            request_id,
            klass,
            index,
            tenant,
            deadline_at,
            now,  # offered_at
            self._seq,
            load,
            _WAITING,
            _NAN,  # not started
        )
        self._seq += 1
        self._admitted[index] += 1
        if self._on_event is not None:
            self._on_event(TicketAdmitted(ticket=ticket, at=now))
        if direct:
            self._begin(ticket, now)
            return ticket
        self._waiting[index] += 1
        self._total_waiting += 1
        load.waiting += 1
        if tenant_busy:
            self._park(ticket)
        else:
            _heappush(self._heaps[index], (ticket._seq, ticket))
            self._ready += 1
        return ticket

    def start(self) -> Ticket | None:
        """Start the next waiting ticket in dequeue order if a slot is free, else ``None``.

        Expired tickets met on the way are dropped (``TicketExpired``) when
        ``drop_expired_at_dequeue``; tickets whose tenant holds all its slots are parked until
        the tenant frees one.
        """
        if not self._free or not any(self._heaps):
            return None  # no slot, or nothing queued (every request that finishes asks)
        options = self._options
        now = self._clock.now()
        active = self._priority_active(now)
        order: DequeueOrder = options.dequeue if active else "fifo"
        while True:
            index = self._pick(order)
            if index is None:
                return None
            _, ticket = _heappop(self._heaps[index])
            self._ready -= 1
            deadline_at = ticket.deadline_at
            if options.drop_expired_at_dequeue and deadline_at is not None and now >= deadline_at:
                self._leave_queue(ticket)
                ticket.state = _EXPIRED
                ticket._ended = now
                self._expired[index] += 1
                if self._on_event is not None:
                    self._on_event(
                        TicketExpired(ticket=ticket, at=now, waited=now - ticket.offered_at)
                    )
                self._unpark(ticket._load)
                self._forget_if_idle(ticket)
                continue
            limit = options.tenant_max_in_flight
            if limit is not None and ticket._load.in_flight >= limit:
                self._park(ticket)
                continue
            self._leave_queue(ticket)
            if order == "weighted":
                self._advance_pass(index)
            self._begin(ticket, now)
            return ticket

    def finish(self, ticket: Ticket) -> float:
        """Free the ticket's slot, record its service time, and return that time in seconds.

        Raises ``ValueError`` unless the ticket is this controller's and ``STARTED``.
        """
        load = ticket._load
        if load.owner is not self:  # _check_owner(ticket), inlined
            raise ValueError(f"{ticket!r} belongs to another admission controller")
        if ticket.state is not _STARTED:
            raise ValueError(f"finish() needs a started ticket, got {ticket!r}")
        now = self._clock.now()
        service_time = now - ticket._started
        # _release(ticket), inlined
        self._free += 1
        load.in_flight -= 1
        if load.parked:
            self._unpark(load)
        if not load.in_flight and not load.waiting:  # _forget_if_idle(ticket)
            del self._tenants[ticket.tenant]
        ticket.state = _FINISHED
        ticket._ended = now
        self._finished[ticket._index] += 1
        if self._measured:
            # max(service_time, _MIN_SERVICE_TIME), without the call
            sample = _MIN_SERVICE_TIME if service_time < _MIN_SERVICE_TIME else service_time
            self._service_time += self._alpha * (sample - self._service_time)
        if self._on_event is not None:
            self._on_event(TicketFinished(ticket=ticket, at=now, service_time=service_time))
        return service_time

    def cancel(self, ticket: Ticket) -> bool:
        """Withdraw a waiting ticket or free a started one without recording a service time.

        Returns ``False`` (and does nothing) if the ticket had already ended, so it is safe in a
        cleanup path that may run after ``finish``.
        """
        self._check_owner(ticket)
        state = ticket.state
        if state is _WAITING:
            parked = ticket._parked
            if not parked:
                self._ready -= 1  # its heap entry is skipped when it reaches the top
            self._leave_queue(ticket)
            if not parked:
                self._unpark(ticket._load)
            self._forget_if_idle(ticket)
        elif state is _STARTED:
            self._release(ticket)
        else:
            return False
        now = self._clock.now()
        ticket.state = _CANCELLED
        ticket._ended = now
        self._cancelled[ticket._index] += 1
        if self._on_event is not None:
            self._on_event(TicketCancelled(ticket=ticket, at=now, was_started=state is _STARTED))
        return True

    # ----------------------------------------------------------------------- gauges

    @property
    def options(self) -> AdmissionOptions:
        return self._options

    @property
    def in_flight(self) -> int:
        """Tickets holding a slot now."""
        return self._slots - self._free

    def depth(self, klass: str | None = None) -> int:
        """Waiting tickets of ``klass`` (all classes when ``None``), parked ones included."""
        if klass is None:
            return self._total_waiting
        return self._waiting[self._class_index(klass)]

    def tenant_in_flight(self, tenant: str) -> int:
        """Tickets of ``tenant`` holding a slot now."""
        load = self._tenants.get(tenant)
        return load.in_flight if load is not None else 0

    def tenant_waiting(self, tenant: str) -> int:
        """Tickets of ``tenant`` waiting now."""
        load = self._tenants.get(tenant)
        return load.waiting if load is not None else 0

    @property
    def mean_service_time(self) -> float:
        """Seconds a ticket holds a slot on average: measured, or ``slots / service_rate``."""
        return self._service_time

    @property
    def service_rate(self) -> float:
        """Completions per second with every slot busy: configured, or measured."""
        rate = self._options.service_rate
        if rate is not None:
            return rate
        return self._options.slots / self._service_time

    @property
    def offered_rate(self) -> float:
        """Offers per second (admitted or refused), smoothed over ``overload_window``."""
        return self._offered_rate_at(self._clock.now())

    @property
    def load(self) -> float:
        """The offered load factor: ``offered_rate / service_rate``; above 1 is overload."""
        return self.offered_rate / self.service_rate

    @property
    def priority_active(self) -> bool:
        """Whether class priority applies now (always, unless made conditional)."""
        return self._priority_active(self._clock.now())

    def estimated_wait(self, klass: str) -> float:
        """Seconds a request of ``klass`` offered now would wait before starting (estimate)."""
        index = self._class_index(klass)
        now = self._clock.now()
        if self._free > 0 and self._ready == 0:
            return 0.0
        return self._work_ahead(index, now) / self.service_rate

    def snapshot(self) -> AdmissionSnapshot:
        """All counters and gauges at this instant, keyed by class."""
        now = self._clock.now()
        classes = self._options.classes
        service_rate = self.service_rate
        offered_rate = self._offered_rate_at(now)

        def by_class(values: Sequence[int]) -> Mapping[str, int]:
            return MappingProxyType(dict(zip(classes, values, strict=True)))

        return AdmissionSnapshot(
            at=now,
            in_flight=self._slots - self._free,
            depth=by_class(self._waiting),
            admitted=by_class([n + d for n, d in zip(self._admitted, self._direct, strict=True)]),
            started=by_class([n + d for n, d in zip(self._started, self._direct, strict=True)]),
            finished=by_class(self._finished),
            cancelled=by_class(self._cancelled),
            expired=by_class(self._expired),
            refused=MappingProxyType(
                {
                    klass: MappingProxyType(dict(counts))
                    for klass, counts in zip(classes, self._refused, strict=True)
                }
            ),
            service_rate=service_rate,
            mean_service_time=self.mean_service_time,
            offered_rate=offered_rate,
            load=offered_rate / service_rate,
            priority_active=self._priority_active(now),
        )

    # ----------------------------------------------------------------------- internals

    def _class_index(self, klass: str) -> int:
        try:
            return self._index[klass]
        except KeyError:
            raise self._unknown_class(klass) from None

    def _unknown_class(self, klass: str) -> ValueError:
        return ValueError(f"unknown class {klass!r}; expected one of {self._options.classes!r}")

    def _check_owner(self, ticket: Ticket) -> None:
        if ticket._load.owner is not self:
            raise ValueError(f"{ticket!r} belongs to another admission controller")

    def _offered_rate_at(self, now: float) -> float:
        if self._offered_at is None:
            return 0.0
        elapsed = now - self._offered_at
        return self._offered_rate * math.exp(-elapsed / self._window)

    def _priority_active(self, now: float) -> bool:
        options = self._options
        if options.dequeue == "fifo":
            return False
        if options.conditional_priority is None:
            return True
        load = self._offered_rate_at(now) / self.service_rate
        return load > options.conditional_priority

    def _work_ahead(self, index: int, now: float) -> float:
        if self._options.priority_at_admission and self._priority_active(now):
            return work_ahead(
                self._waiting, index, order=self._options.dequeue, weights=self._weights
            )
        return float(self._total_waiting)

    def _refuse(
        self,
        error: type[Rejected],
        reason: RefusalReason,
        message: str,
        *,
        request_id: str,
        index: int,
        tenant: str,
        now: float,
    ) -> Rejected:
        # The hint is the time for the work ahead plus one more place to clear.
        retry_after = (self._work_ahead(index, now) + 1.0) / self.service_rate
        counts = self._refused[index]
        counts[reason] = counts.get(reason, 0) + 1
        if self._on_event is not None:
            self._on_event(
                TicketRefused(
                    request_id=request_id,
                    klass=self._options.classes[index],
                    tenant=tenant,
                    reason=reason,
                    retry_after=retry_after,
                    at=now,
                )
            )
        return error(message, policy=_POLICY, retry_after=retry_after, reason=reason)

    def _pick(self, order: DequeueOrder) -> int | None:
        """The class whose head is served next, after discarding cancelled heads."""
        best: int | None = None
        best_key = math.inf
        for index, heap in enumerate(self._heaps):
            while heap and heap[0][1].state is not _WAITING:
                _heappop(heap)
            if not heap:
                continue
            if order == "strict":
                return index
            # fifo: the oldest head wins; weighted: the lowest stride pass (idle classes rejoin
            # at the current virtual time instead of spending banked credit).
            key = float(heap[0][0]) if order == "fifo" else max(self._passes[index], self._vtime)
            if key < best_key:  # ties go to the higher class, which comes first
                best, best_key = index, key
        return best

    def _advance_pass(self, index: int) -> None:
        # Stride scheduling: a class that sat idle does not bank credit, it rejoins at vtime.
        start = max(self._passes[index], self._vtime)
        self._vtime = start
        self._passes[index] = start + self._strides[index]
        if self._vtime > _REBASE_PASSES_AT:
            base = self._vtime
            self._passes = [p - base for p in self._passes]
            self._vtime = 0.0

    def _park(self, ticket: Ticket) -> None:
        ticket._parked = True
        _heappush(ticket._load.parked, (ticket._seq, ticket))

    def _unpark(self, load: _TenantLoad) -> None:
        # Called whenever a tenant's slot frees or one of its startable tickets leaves the heap
        # unstarted, so a parked ticket always has a started or startable sibling whose end
        # will release it: parked work is never stranded.
        parked = load.parked
        if not parked:
            return
        limit = self._options.tenant_max_in_flight
        if limit is not None and load.in_flight >= limit:
            return
        while parked:
            _, ticket = _heappop(parked)
            if ticket.state is _WAITING:
                ticket._parked = False
                _heappush(self._heaps[ticket._index], (ticket._seq, ticket))
                self._ready += 1
                break

    def _forget_if_idle(self, ticket: Ticket) -> None:
        # Called after a ticket ends; its tenant's counts then say whether anything is left.
        load = ticket._load
        if load.in_flight == 0 and load.waiting == 0:
            del self._tenants[ticket.tenant]

    def _leave_queue(self, ticket: Ticket) -> None:
        self._waiting[ticket._index] -= 1
        self._total_waiting -= 1
        load = ticket._load
        load.waiting -= 1
        if load.waiting == 0 and load.parked:
            load.parked.clear()  # anything still parked there is cancelled

    def _begin(self, ticket: Ticket, now: float) -> None:
        ticket.state = _STARTED
        ticket._started = now
        ticket._parked = False
        self._free -= 1
        ticket._load.in_flight += 1
        self._started[ticket._index] += 1
        if self._on_event is not None:
            self._on_event(TicketStarted(ticket=ticket, at=now, waited=now - ticket.offered_at))

    def _release(self, ticket: Ticket) -> None:
        self._free += 1
        load = ticket._load
        load.in_flight -= 1
        if load.parked:
            self._unpark(load)
        self._forget_if_idle(ticket)
