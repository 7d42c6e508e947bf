"""The admission controller: one synchronous object that admits, refuses, orders and counts.

Its state is counters and heaps, never scans: a heap per class and per parked tenant, lazy
deletion of cancelled entries, and a load record per tenant that each ticket points at. Time is
read only from the injected clock. The two optimisations kept here (module-level heap functions,
and one count for a ticket that starts on offer) and what they measured are in
docs/policies/admission.md, "Implementation notes".
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Final

from tidegate.clock import Clock
from tidegate.errors import BulkheadFull, DeadlineUnmeetable, QueueFull, Rejected
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
from tidegate.policy.admission.options import AdmissionOptions, DequeueOrder
from tidegate.policy.admission.shares import WeightedShares
from tidegate.policy.admission.snapshot import AdmissionSnapshot
from tidegate.policy.admission.tickets import TenantLoad, Ticket, TicketState

__all__ = ["AdmissionController"]

_POLICY: Final = "admission"

# One C static each in the compiled build (docs/policies/admission.md).
_heappush: Final = heapq.heappush
_heappop: Final = heapq.heappop
_any: Final = any

# A measured service time of zero would make the estimated service rate infinite and every
# retry hint zero; a millisecond is far below any model call and keeps the arithmetic finite.
_MIN_SERVICE_TIME: Final = 1e-3

#: The error each refusal is raised as.
_REFUSED_AS: Final[Mapping[RefusalReason, type[Rejected]]] = MappingProxyType(
    {
        RefusalReason.QUEUE_FULL: QueueFull,
        RefusalReason.TENANT_WAITING: BulkheadFull,
        RefusalReason.DEADLINE_UNMEETABLE: DeadlineUnmeetable,
        RefusalReason.DEADLINE_PASSED: DeadlineUnmeetable,
    }
)


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
        "_ready",
        "_refused",
        "_seq",
        "_service_time",
        "_shares",
        "_slots",
        "_started",
        "_tenant_limit",
        "_tenants",
        "_total_waiting",
        "_waiting",
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
        self._shares = WeightedShares([options.weight_for(klass) for klass in classes])
        # Per class: a heap of (arrival sequence, ticket); cancelled entries skipped at the top.
        self._heaps: list[list[tuple[int, Ticket]]] = [[] for _ in classes]
        self._waiting = [0] * count  # live waiting tickets per class, parked ones included
        self._total_waiting = 0
        self._ready = 0  # live tickets in the class heaps, i.e. startable now
        self._free = options.slots  # slots not held by a started ticket: never negative
        self._tenants: dict[str, TenantLoad] = {}  # per tenant with live tickets
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
        self._admitted = [0] * count  # tickets admitted to wait, or to start with a hook
        self._started = [0] * count  # tickets started from the queue, or at once with a hook
        self._direct = [0] * count  # started at once with no hook: admitted and started, once
        self._finished = [0] * count
        self._cancelled = [0] * count
        self._expired = [0] * count
        self._refused: list[dict[str, int]] = [{} for _ in classes]

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
        index = self._class_index(klass)
        now = self._clock.now()
        self._count_offer(now)
        if deadline_at is not None and now >= deadline_at:
            raise self._refuse(
                RefusalReason.DEADLINE_PASSED,
                f"the deadline of {klass} request {request_id!r} passed before it was offered",
                request_id=request_id,
                index=index,
                tenant=tenant,
                now=now,
            )
        load = self._tenants.get(tenant)
        limit = self._tenant_limit
        tenant_busy = limit is not None and load is not None and load.in_flight >= limit
        direct = self._free > 0 and self._ready == 0 and not tenant_busy
        wait = 0.0 if direct else self._queue_wait(request_id, index, tenant, load, now)
        if self._deadline_mode and not deadline_admits(
            now=now,
            estimated_wait=wait,
            mean_service_time=self._service_time,
            deadline_at=deadline_at,
        ):
            raise self._refuse(
                RefusalReason.DEADLINE_UNMEETABLE,
                f"{klass} request {request_id!r} would wait about {wait:.3g}s and need "
                f"{self._service_time:.3g}s of service, past its deadline",
                request_id=request_id,
                index=index,
                tenant=tenant,
                now=now,
            )
        if load is None:
            load = self._tenants[tenant] = TenantLoad(self, tenant)
        ticket = Ticket(request_id, klass, index, deadline_at, now, load)
        if direct and self._on_event is None:
            # The one fast path (docs/policies/admission.md): no hook can see the ticket between
            # its admission and its start, so it is counted once, as admitted and as started.
            self._direct[index] += 1
            self._take_slot(ticket, now)
            return ticket
        self._admitted[index] += 1
        if self._on_event is not None:
            self._on_event(TicketAdmitted(ticket=ticket, at=now))
        if direct:
            self._begin(ticket, now)
        else:
            self._enqueue(ticket, parked=tenant_busy)
        return ticket

    def has_room(self) -> bool:
        """Whether a request offered now could start at once (a free slot and nothing startable
        waiting), its tenant's limit aside. Asked before every model request's body is read."""
        return self._free > 0 and self._ready == 0

    def saturated(self, klass: str) -> float | None:
        """The retry hint :meth:`offer` would refuse any ``klass`` request with now, whatever its
        tenant (none can start at once and the class's queue is at its cap); else ``None``."""
        index = self._class_index(klass)
        cap = self._caps[index]
        if self.has_room() or cap is None or self._waiting[index] < cap:
            return None
        return (self._work_ahead(index, self._clock.now()) + 1.0) / self.service_rate

    def count_shed(self, klass: str) -> None:
        """Count a request of ``klass`` refused on :meth:`saturated`'s word, without an offer:
        as an offer and a ``queue_full`` refusal (no event: it had no ticket or request id)."""
        counts = self._refused[self._class_index(klass)]
        counts[RefusalReason.QUEUE_FULL] = counts.get(RefusalReason.QUEUE_FULL, 0) + 1
        self._count_offer(self._clock.now())

    def start(self) -> Ticket | None:
        """Start the next waiting ticket in dequeue order if a slot is free, else ``None``.

        Expired tickets met on the way are dropped (``TicketExpired``) when
        ``drop_expired_at_dequeue``; tickets whose tenant holds all its slots are parked until
        the tenant frees one.
        """
        if not self._free or not _any(self._heaps):
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
                ticket.state = TicketState.EXPIRED
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
                self._shares.served(index)
            self._begin(ticket, now)
            return ticket

    def finish(self, ticket: Ticket) -> float:
        """Free the ticket's slot, record its service time, and return that time in seconds.

        Raises ``ValueError`` unless the ticket is this controller's and ``STARTED``.
        """
        self._check_owner(ticket)
        if ticket.state is not TicketState.STARTED:
            raise ValueError(f"finish() needs a started ticket, got {ticket!r}")
        now = self._clock.now()
        service_time = now - ticket._started
        self._release(ticket)
        ticket.state = TicketState.FINISHED
        ticket._ended = now
        self._finished[ticket._index] += 1
        if self._measured:
            sample = max(service_time, _MIN_SERVICE_TIME)
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
        if state is TicketState.WAITING:
            parked = ticket._parked
            if not parked:
                self._ready -= 1  # its heap entry is skipped when it reaches the top
            self._leave_queue(ticket)
            if not parked:
                self._unpark(ticket._load)
            self._forget_if_idle(ticket)
        elif state is TicketState.STARTED:
            self._release(ticket)
        else:
            return False
        now = self._clock.now()
        ticket.state = TicketState.CANCELLED
        ticket._ended = now
        self._cancelled[ticket._index] += 1
        if self._on_event is not None:
            self._on_event(
                TicketCancelled(ticket=ticket, at=now, was_started=state is TicketState.STARTED)
            )
        return True

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
                self._waiting, index, order=self._options.dequeue, weights=self._shares.weights
            )
        return float(self._total_waiting)

    def _count_offer(self, now: float) -> None:
        """Add one offer to the smoothed offered rate (each is ``1 / overload_window`` of it)."""
        self._offered_rate = self._offered_rate_at(now) + self._offer_weight
        self._offered_at = now

    def _queue_wait(
        self, request_id: str, index: int, tenant: str, load: TenantLoad | None, now: float
    ) -> float:
        """The estimated wait of a request that cannot start at once, unless the tenant's
        waiting bulkhead or its class's queue is full (then it is refused)."""
        limit = self._options.tenant_max_waiting
        waiting = load.waiting if load is not None else 0
        if limit is not None and waiting >= limit:
            raise self._refuse(
                RefusalReason.TENANT_WAITING,
                f"tenant {tenant!r} already has {waiting} requests waiting "
                f"(tenant_max_waiting={limit})",
                request_id=request_id,
                index=index,
                tenant=tenant,
                now=now,
            )
        cap = self._caps[index]
        if cap is not None and self._waiting[index] >= cap:
            raise self._refuse(
                RefusalReason.QUEUE_FULL,
                f"the {self._options.classes[index]} queue is full ({cap} waiting) "
                "and the request cannot start now",
                request_id=request_id,
                index=index,
                tenant=tenant,
                now=now,
            )
        return self._work_ahead(index, now) / self.service_rate

    def _refuse(
        self,
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
        error = _REFUSED_AS[reason]
        return error(message, policy=_POLICY, retry_after=retry_after, reason=reason)

    def _pick(self, order: DequeueOrder) -> int | None:
        """The class whose head is served next, after discarding cancelled heads."""
        best: int | None = None
        best_key = math.inf
        for index, heap in enumerate(self._heaps):
            while heap and heap[0][1].state is not TicketState.WAITING:
                _heappop(heap)
            if not heap:
                continue
            if order == "strict":
                return index
            # fifo: the oldest head wins; weighted: the class owed the most service.
            key = float(heap[0][0]) if order == "fifo" else self._shares.key(index)
            if key < best_key:  # ties go to the higher class, which comes first
                best, best_key = index, key
        return best

    def _enqueue(self, ticket: Ticket, *, parked: bool) -> None:
        """Give a new ticket its place in the arrival order, in its class's heap or parked."""
        ticket._seq = self._seq
        self._seq += 1
        self._waiting[ticket._index] += 1
        self._total_waiting += 1
        ticket._load.waiting += 1
        if parked:
            self._park(ticket)
        else:
            _heappush(self._heaps[ticket._index], (ticket._seq, ticket))
            self._ready += 1

    def _park(self, ticket: Ticket) -> None:
        ticket._parked = True
        _heappush(ticket._load.parked, (ticket._seq, ticket))

    def _unpark(self, load: TenantLoad) -> None:
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
            if ticket.state is TicketState.WAITING:
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

    def _take_slot(self, ticket: Ticket, now: float) -> None:
        ticket.state = TicketState.STARTED
        ticket._started = now
        ticket._parked = False
        self._free -= 1
        ticket._load.in_flight += 1

    def _begin(self, ticket: Ticket, now: float) -> None:
        self._take_slot(ticket, now)
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
