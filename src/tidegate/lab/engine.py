"""The virtual-time engine: a heap of events driving the real admission controller.

A run is described by :class:`Traffic` (what arrives: arrivals, class mix, tenants, deadlines,
patience) and :class:`Fleet` (what serves: workers, each with its own
:class:`~tidegate.policy.admission.AdmissionController` of in-flight slots and queues, a number
of cores, and a CPU part and an IO part per request). :class:`Simulation` runs it and returns a
:class:`~tidegate.lab.report.Report`.

How a request moves, with the clock (a :class:`~tidegate.clock.ManualClock`) set to each event's
time before any policy is called:

1. It arrives and is dispatched round-robin to an active worker, whose controller's ``offer()``
   refuses it (shed, by reason) or admits it, started or waiting.
2. When it holds a slot it queues for one of the worker's cores for its CPU part, then waits its
   IO part (the model call) without a core, then ``finish()`` frees the slot and the engine calls
   ``start()`` until it returns ``None``, exactly as the gateway does.
3. Its deadline is passed to the controller. When it passes while the request waits, the caller
   either leaves (``on_deadline="leave"``: the gateway sees the disconnect and cancels the ticket)
   or stays unnoticed (``"stay"``: the ticket remains until the controller drops it at dequeue,
   or it is served late).

The ceiling of a worker is ``min(slots / (cpu + io), cores / cpu)`` requests per second: slots
bound the IO-bound part, cores the CPU-bound part (see :func:`ceiling`).

Determinism: every source of randomness is its own :class:`random.Random` seeded from the run's
seed and a fixed name, so the same seed gives the same report bit for bit, and two fleets run
with the same seed see the same arrivals (common random numbers). Service times are drawn in the
order requests start, so under saturation every queue policy frees its slots at the same instants.

The hot loop keeps to a heap of tuples, locals and counters; open-loop arrivals stay out of the
heap (one pending arrival time compared with the heap's top).
"""

from __future__ import annotations

import gc
import heapq
import math
import random
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Final, Literal

from tidegate.clock import ManualClock
from tidegate.errors import Rejected
from tidegate.lab.report import ClassReport, Latency, Report
from tidegate.lab.workload import (
    Arrivals,
    ClosedLoop,
    Deterministic,
    Distribution,
    Exponential,
    Sampler,
    Stream,
    Trace,
    TraceRecord,
)
from tidegate.policy.admission import (
    AdmissionController,
    AdmissionEvent,
    AdmissionOptions,
    AdmissionSnapshot,
    Ticket,
    TicketExpired,
    TicketState,
)

__all__ = [
    "EventQueue",
    "Fleet",
    "Simulation",
    "Traffic",
    "Worker",
    "ceiling",
    "simulate",
]

# Event kinds, in the third place of every heap tuple.
_COMPLETE: Final = 0
_CPU_DONE: Final = 1
_DEADLINE: Final = 2
_CLIENT: Final = 3
_TICK: Final = 4
_CALL: Final = 5
_WARMUP: Final = 6

_UNIT_EXPONENTIAL: Final = Exponential(mean=1.0)
_STARTED: Final = TicketState.STARTED
_WAITING: Final = TicketState.WAITING


class _NoArrivals(Stream):
    """The open-loop stream of a closed loop or a trace: nothing ever comes from it."""

    __slots__ = ()

    def following(self, previous: float) -> float:
        del previous
        return math.inf


_NEVER: Final = _NoArrivals()
_ZERO: Final = Deterministic(value=0.0).sampler(random.Random(0))


def _live(snapshot: AdmissionSnapshot, klass: str) -> int:
    """Tickets of ``klass`` a controller holds now, waiting or in service, from its counters."""
    return (
        snapshot.admitted[klass]
        - snapshot.finished[klass]
        - snapshot.cancelled[klass]
        - snapshot.expired[klass]
    )


def ceiling(*, slots: int, cpu: float, io: float, cores: int = 1, workers: int = 1) -> float:
    """Requests per second a fleet can complete: ``workers * min(slots / (cpu + io), cores / cpu)``.

    Slots bound the requests in flight, each holding one for ``cpu + io`` seconds; cores bound the
    CPU part. With ``cpu == 0`` only the slots limit.
    """
    if slots < 1 or cores < 1 or workers < 1:
        raise ValueError("slots, cores and workers must each be at least 1")
    if cpu < 0 or io < 0 or cpu + io <= 0:
        raise ValueError(f"cpu and io must be >= 0 with a positive sum, got {cpu!r} and {io!r}")
    by_slots = slots / (cpu + io)
    by_cores = cores / cpu if cpu > 0 else math.inf
    return workers * min(by_slots, by_cores)


@dataclass(frozen=True, slots=True, kw_only=True)
class Traffic:
    """What arrives.

    ``mix`` maps class names to shares (normalised); ``None`` sends everything to the fleet's
    first class, and a trace brings its own classes. ``deadline`` is seconds after arrival (one
    number, or one per class, ``None`` for none); ``patience``, when given, draws each request's
    deadline instead (exponential patience is the Erlang-A model). ``on_deadline`` says what a
    waiting caller does when its deadline passes: ``"leave"`` (the gateway cancels the ticket)
    or ``"stay"`` (nobody notices; the controller may drop it at dequeue, or serve it late).
    """

    arrivals: Arrivals | ClosedLoop
    mix: Mapping[str, float] | None = None
    tenants: int = 1
    deadline: float | Mapping[str, float | None] | None = None
    patience: Distribution | None = None
    on_deadline: Literal["leave", "stay"] = "stay"

    def __post_init__(self) -> None:
        if self.mix is not None:
            if not self.mix:
                raise ValueError("mix must name at least one class")
            for klass, share in self.mix.items():
                if not math.isfinite(share) or share < 0:
                    raise ValueError(f"mix[{klass!r}] must be a finite share >= 0, got {share!r}")
            if sum(self.mix.values()) <= 0:
                raise ValueError("mix must have a positive total share")
        if isinstance(self.tenants, bool) or self.tenants < 1:
            raise ValueError(f"tenants must be an integer >= 1, got {self.tenants!r}")
        deadlines = (
            self.deadline.values() if isinstance(self.deadline, Mapping) else [self.deadline]
        )
        for value in deadlines:
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise ValueError(f"deadline must be a finite number > 0 or None, got {value!r}")
        if self.on_deadline not in ("leave", "stay"):
            raise ValueError(f"on_deadline must be 'leave' or 'stay', got {self.on_deadline!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Fleet:
    """What serves: ``workers`` processes, each with its own admission controller and cores.

    ``io`` is the part of a request spent waiting for the model (holding a slot, not a core);
    ``None`` takes each request's recorded latency from a trace. ``cpu`` is the part that holds
    a core too; ``None`` means none.

    ``start_margin`` is how much earlier than the caller's deadline the controller is told: the
    latest useful start instead of the deadline itself. With ``drop_expired_at_dequeue`` the
    controller then drops work that can no longer finish in time, not only work already late.
    On-time and late are always judged against the caller's own deadline.
    """

    admission: AdmissionOptions
    io: Distribution | None = _UNIT_EXPONENTIAL
    cpu: Distribution | None = None
    workers: int = 1
    cores: int = 1
    start_margin: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.start_margin) or self.start_margin < 0:
            raise ValueError(
                f"start_margin must be a finite number >= 0, got {self.start_margin!r}"
            )
        if isinstance(self.workers, bool) or self.workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
        if isinstance(self.cores, bool) or self.cores < 1:
            raise ValueError(f"cores must be an integer >= 1, got {self.cores!r}")

    @property
    def ceiling(self) -> float:
        """Requests per second the fleet completes at most, from the mean CPU and IO parts."""
        io = self.io.mean if self.io is not None else 0.0
        cpu = self.cpu.mean if self.cpu is not None else 0.0
        return ceiling(
            slots=self.admission.slots, cpu=cpu, io=io, cores=self.cores, workers=self.workers
        )


class _Tally:
    """One class's counters during a run: plain typed attributes, cheap to bump in the loop."""

    __slots__ = (
        "admitted",
        "completed",
        "expired",
        "late",
        "latencies",
        "live_at_t0",
        "offered",
        "on_time",
        "pre_departed",
        "rej_max",
        "rej_sum",
        "shed",
        "started",
        "wait_sum",
        "waited",
    )

    def __init__(self) -> None:
        self.offered = 0
        self.admitted = 0
        self.completed = 0
        self.on_time = 0
        self.late = 0
        self.expired = 0
        self.waited = 0
        self.started = 0
        self.wait_sum = 0.0
        self.rej_sum = 0.0
        self.rej_max = 0.0
        self.shed: dict[str, int] = {}
        self.latencies: list[float] = []
        #: Requests of the class in the system when the warm-up ended.
        self.live_at_t0 = 0
        #: Of those, how many have left since.
        self.pre_departed = 0


class Worker:
    """One process of the fleet: its admission controller, cores and CPU queue."""

    __slots__ = ("active", "controller", "cpu_queue", "free_cores", "held", "in_flight", "index")

    def __init__(self, index: int, controller: AdmissionController, cores: int) -> None:
        self.index = index
        self.controller = controller
        self.free_cores = cores
        #: Requests the worker holds (waiting or in service) and slots it holds, as the engine
        #: counts them: start() can return a ticket only when a slot is free and something waits.
        self.held = 0
        self.in_flight = 0
        self.cpu_queue: deque[tuple[Any, float]] = deque()
        #: New requests are dispatched only to active workers; a retired one drains.
        self.active = True


class EventQueue:
    """A small callback scheduler in virtual time, for scenarios that are not a queue of slots.

    ``at(when, fn, *args)`` schedules a call; ``run(until)`` sets the clock to each event's time
    and calls it, in time order, ties in scheduling order.
    """

    __slots__ = ("_heap", "_seq", "clock")

    def __init__(self, clock: ManualClock | None = None) -> None:
        self.clock = clock if clock is not None else ManualClock()
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` at virtual time ``when`` (not before now)."""
        if when < self.clock.now():
            raise ValueError(f"cannot schedule at {when!r}: it is already {self.clock.now()!r}")
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn, args))

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` ``delay`` seconds from now."""
        self.at(self.clock.now() + delay, fn, *args)

    def run(self, until: float = math.inf) -> None:
        """Run every event up to and including time ``until``; the clock ends at ``until``."""
        heap, clock = self._heap, self.clock
        while heap and heap[0][0] <= until:
            when, _, fn, args = heapq.heappop(heap)
            clock.set(when)
            fn(*args)
        if math.isfinite(until) and until > clock.now():
            clock.set(until)

    def __len__(self) -> int:
        return len(self._heap)


class Simulation:
    """One run of ``traffic`` against ``fleet`` from time 0 to ``horizon``.

    The window ``[warmup, horizon]`` is measured; what happens before it only fills the system.
    ``tick=(every, hook)`` calls ``hook(simulation)`` every ``every`` seconds (an autoscaler,
    a sampler); ``call_at`` schedules one call. Hooks may read the gauges below and add or retire
    workers.
    """

    def __init__(
        self,
        traffic: Traffic,
        fleet: Fleet,
        *,
        horizon: float,
        seed: int = 0,
        warmup: float = 0.0,
        tick: tuple[float, Callable[[Simulation], None]] | None = None,
    ) -> None:
        if not math.isfinite(horizon) or horizon <= 0:
            raise ValueError(f"horizon must be a finite number > 0, got {horizon!r}")
        if not 0.0 <= warmup < horizon:
            raise ValueError(f"warmup must be in [0, horizon), got {warmup!r}")
        if tick is not None and (not math.isfinite(tick[0]) or tick[0] <= 0):
            raise ValueError(f"tick interval must be a finite number > 0, got {tick[0]!r}")
        self.traffic = traffic
        self.fleet = fleet
        self.horizon = float(horizon)
        self.warmup = float(warmup)
        self.seed = seed
        self.clock = ManualClock()
        self._tick = tick
        self._heap: list[tuple[float, int, int, Any, int, float]] = []
        self._seq = 0
        options = fleet.admission
        self.classes: tuple[str, ...] = options.classes
        self._class_index = {name: i for i, name in enumerate(self.classes)}
        self._expired: list[Ticket] = []
        self._watch_expiry = options.drop_expired_at_dequeue and (
            traffic.deadline is not None or traffic.patience is not None
        )
        self.workers: list[Worker] = []
        self._active: list[int] = []
        self._slot_seconds = 0.0
        self._slots_since = 0.0
        for _ in range(fleet.workers):
            self.add_worker()
        #: Gauges a hook may read: requests offered so far, and in the system now.
        self.offered = 0
        self.in_system = 0
        self._ran = False

    # ----------------------------------------------------------------------- control

    def _rng(self, name: str) -> random.Random:
        return random.Random(f"tidegate-lab/{self.seed}/{name}")

    def _on_event(self, event: AdmissionEvent) -> None:
        if type(event) is TicketExpired:
            self._expired.append(event.ticket)

    def add_worker(self) -> Worker:
        """Start one more worker (with a fresh controller) and dispatch to it from now on."""
        self._account_slots()
        controller = AdmissionController(
            self.fleet.admission,
            self.clock,
            on_event=self._on_event if self._watch_expiry else None,
        )
        worker = Worker(len(self.workers), controller, self.fleet.cores)
        self.workers.append(worker)
        self._active.append(worker.index)
        return worker

    def retire_worker(self) -> Worker | None:
        """Stop dispatching to the newest active worker; it drains what it holds. ``None`` if
        only one is left (a fleet never goes to zero here)."""
        if len(self._active) <= 1:
            return None
        self._account_slots()
        index = self._active.pop()
        worker = self.workers[index]
        worker.active = False
        return worker

    @property
    def active_workers(self) -> int:
        return len(self._active)

    def queue_depth(self) -> int:
        """Requests waiting for a slot, all workers together."""
        return sum(w.controller.depth() for w in self.workers)

    def call_at(self, when: float, fn: Callable[[Simulation], None]) -> None:
        """Call ``fn(self)`` at virtual time ``when``."""
        self._push(when, _CALL, fn, 0, 0.0)

    def _push(self, when: float, kind: int, obj: Any, worker: int, value: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, kind, obj, worker, value))

    def _account_slots(self) -> None:
        now = self.clock.now()
        start = max(self._slots_since, self.warmup)
        if now > start:
            self._slot_seconds += len(self._active) * self.fleet.admission.slots * (now - start)
        self._slots_since = max(now, self._slots_since)

    # ----------------------------------------------------------------------- the loop

    def run(self) -> Report:
        """Run to the horizon and report on the window. A simulation runs once.

        The cyclic garbage collector is paused for the run: the loop allocates a ticket and an
        event per request and builds no cycles, so its passes would find nothing to free (plain
        reference counting frees all of it). It is restored on the way out, whatever happens.
        """
        if self._ran:
            raise RuntimeError("a Simulation runs once; build a new one to run again")
        self._ran = True
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if collecting:
                gc.enable()

    def _run(self) -> Report:
        traffic, fleet = self.traffic, self.fleet
        classes = self.classes
        nclass = len(classes)
        class_index = self._class_index
        horizon, t0 = self.horizon, self.warmup
        heap = self._heap
        push, pop = heapq.heappush, heapq.heappop
        clock = self.clock
        workers = self.workers
        active = self._active
        expired_buffer = self._expired

        # --- traffic
        arrivals = traffic.arrivals
        closed = isinstance(arrivals, ClosedLoop)
        trace: tuple[TraceRecord, ...] = arrivals.records if isinstance(arrivals, Trace) else ()
        trace_len = len(trace)
        trace_pos = 0
        following: Stream = _NEVER
        think: Sampler = _ZERO
        if isinstance(arrivals, ClosedLoop):
            think = arrivals.think.sampler(self._rng("think"))
            next_arrival = math.inf
        elif isinstance(arrivals, Trace):
            next_arrival = trace[0].at
        else:
            following = arrivals.stream(self._rng("arrivals"))
            next_arrival = following.following(0.0)

        mix_rnd = self._rng("mix").random
        if traffic.mix is not None and not trace:
            for klass in traffic.mix:
                if klass not in class_index:
                    raise ValueError(f"mix names class {klass!r}, not one of {classes!r}")
            shares = [float(traffic.mix.get(name, 0.0)) for name in classes]
            total_share = sum(shares)
            cumulative = [c / total_share for c in accumulate(shares)]
            cumulative[-1] = 1.0
        else:
            cumulative = [1.0] + [1.0] * (nclass - 1)
        pick_class = nclass > 1 and traffic.mix is not None and not trace
        tenant_names = (
            ["default"] if traffic.tenants == 1 else [f"t{i}" for i in range(traffic.tenants)]
        )
        ntenants = len(tenant_names)

        deadline = traffic.deadline
        if isinstance(deadline, Mapping):
            for klass in deadline:
                if klass not in class_index:
                    raise ValueError(f"deadline names class {klass!r}, not one of {classes!r}")
            deadlines: list[float | None] = [deadline.get(name) for name in classes]
        else:
            deadlines = [deadline] * nclass
        patience = (
            traffic.patience.sampler(self._rng("patience"))
            if traffic.patience is not None
            else None
        )
        has_deadline = patience is not None or any(d is not None for d in deadlines)
        leave = traffic.on_deadline == "leave" and has_deadline

        # --- service
        io_from_records = fleet.io is None
        if io_from_records and not isinstance(arrivals, Trace):
            raise ValueError("fleet.io is None (service from a trace) but the arrivals are not")
        if fleet.io is not None:
            draw_io = fleet.io.sampler(self._rng("io"))
        elif isinstance(arrivals, Trace):
            # Requests the trace did not time are given one of the recorded latencies.
            draw_io = arrivals.latencies().sampler(self._rng("io"))
        trace_io: dict[Any, float] = {}
        has_cpu = fleet.cpu is not None
        draw_cpu = fleet.cpu.sampler(self._rng("cpu")) if fleet.cpu is not None else _ZERO

        # --- bookkeeping
        tallies = [_Tally() for _ in classes]
        tally0 = tallies[0]
        clients: dict[Any, int] = {}
        measuring = t0 <= 0.0
        n = 0  # requests in the system (admitted, not yet gone)
        busy = 0  # slots held
        cpu_busy = 0  # cores held
        area_n = area_busy = area_cpu = 0.0
        last = 0.0
        overlap_sum = 0.0  # per-request time inside the window, summed at each departure
        live_start_sum = 0.0  # sum over requests inside of max(arrival, warmup)
        passages = 0  # requests present at the warmup plus those admitted after it
        done_in_window = 0
        good_in_window = 0
        seq = self._seq
        rr = 0
        request_id = "lab"
        offered_total = 0
        deadline_at: float | None = None
        margin = fleet.start_margin
        io = 0.0
        ci = 0

        if t0 > 0.0:
            self._push(t0, _WARMUP, None, 0, 0.0)
        if self._tick is not None:
            self._push(min(self._tick[0], horizon), _TICK, None, 0, 0.0)
        if isinstance(arrivals, ClosedLoop):
            for client in range(arrivals.clients):
                self._push(think.draw(), _CLIENT, client, 0, 0.0)
        seq = self._seq

        slots = fleet.admission.slots

        # Locals, not globals, in the loop.
        COMPLETE, CPU_DONE, DEADLINE, CLIENT, TICK, WARMUP = (
            _COMPLETE,
            _CPU_DONE,
            _DEADLINE,
            _CLIENT,
            _TICK,
            _WARMUP,
        )
        STARTED, WAITING = _STARTED, _WAITING
        multi_class = nclass > 1
        inf = math.inf
        # Typed once, so the compiled build reads tickets' fields and does their arithmetic
        # natively (an event tuple's payload is Any).
        ticket: Ticket
        started: Ticket | None
        arrived = 0.0

        while True:
            # ---- next event: the pending open-loop arrival or the heap's top
            if heap and heap[0][0] <= next_arrival:
                event = pop(heap)
                t = event[0]
                if t > horizon:
                    push(heap, event)
                    break
                kind = event[2]
            else:
                t = next_arrival
                if t > horizon:
                    break
                kind = -1
            clock.set(t)
            dt = t - last
            if dt:
                area_n += n * dt
                area_busy += busy * dt
                if has_cpu:
                    area_cpu += cpu_busy * dt
                last = t

            if kind == COMPLETE:
                ticket = event[3]
                w = event[4]
                worker = workers[w]
                worker.controller.finish(ticket)
                busy -= 1
                n -= 1
                worker.held -= 1
                worker.in_flight -= 1
                arrived = ticket.offered_at
                deadline_at = ticket.deadline_at
                if margin and deadline_at is not None:
                    deadline_at += margin
                tally = tallies[class_index[ticket.klass]] if multi_class else tally0
                if arrived >= t0:
                    tally.completed += 1
                    tally.latencies.append(t - arrived)
                    if deadline_at is None or t <= deadline_at:
                        tally.on_time += 1
                    else:
                        tally.late += 1
                elif measuring:
                    tally.pre_departed += 1
                if measuring:
                    begin = arrived if arrived > t0 else t0
                    overlap_sum += t - begin
                    live_start_sum -= begin
                    done_in_window += 1
                    if deadline_at is None or t <= deadline_at:
                        good_in_window += 1
                if closed:
                    seq += 1
                    push(heap, (t + think.draw(), seq, CLIENT, clients.pop(ticket), 0, 0.0))
                # ---- the scheduling loop: fill every free slot, in the controller's order
                if worker.held > worker.in_flight:
                    controller = worker.controller
                    while worker.in_flight < slots and (started := controller.start()) is not None:
                        ticket = started
                        busy += 1
                        worker.in_flight += 1
                        arrived = ticket.offered_at
                        if arrived >= t0:
                            tally = tallies[class_index[ticket.klass]] if multi_class else tally0
                            tally.started += 1
                            tally.wait_sum += t - arrived
                        io = trace_io.pop(ticket) if io_from_records else draw_io.draw()
                        if has_cpu:
                            if worker.free_cores:
                                worker.free_cores -= 1
                                cpu_busy += 1
                                seq += 1
                                push(heap, (t + draw_cpu.draw(), seq, CPU_DONE, ticket, w, io))
                            else:
                                worker.cpu_queue.append((ticket, io))
                        else:
                            seq += 1
                            push(heap, (t + io, seq, COMPLETE, ticket, w, 0.0))
                    if expired_buffer:
                        for ticket in expired_buffer:
                            n -= 1
                            workers[w].held -= 1
                            arrived = ticket.offered_at
                            ci = class_index[ticket.klass] if multi_class else 0
                            if io_from_records:
                                del trace_io[ticket]
                            if arrived >= t0:
                                tallies[ci].expired += 1
                                waited_for = t - arrived
                                tallies[ci].rej_sum += waited_for
                                if waited_for > tallies[ci].rej_max:
                                    tallies[ci].rej_max = waited_for
                            elif measuring:
                                tallies[ci].pre_departed += 1
                            if measuring:
                                begin = arrived if arrived > t0 else t0
                                overlap_sum += t - begin
                                live_start_sum -= begin
                            if closed:
                                seq += 1
                                push(
                                    heap,
                                    (t + think.draw(), seq, CLIENT, clients.pop(ticket), 0, 0.0),
                                )
                        expired_buffer.clear()
                continue

            if kind < 0 or kind == CLIENT:
                # ---- an arrival: open-loop, or a closed-loop client's next request
                if trace:
                    record = trace[trace_pos]
                    trace_pos += 1
                    next_arrival = trace[trace_pos].at if trace_pos < trace_len else inf
                    try:
                        ci = class_index[record.klass]
                    except KeyError:
                        raise ValueError(
                            f"the trace has class {record.klass!r}, not one of {classes!r}"
                        ) from None
                    tenant = record.tenant
                    if io_from_records:
                        io = record.latency if record.latency is not None else draw_io.draw()
                else:
                    if kind < 0:
                        next_arrival = following.following(t)
                    if pick_class:
                        ci = bisect_right(cumulative, mix_rnd())
                        if ci >= nclass:
                            ci = nclass - 1
                    else:
                        ci = 0
                    tenant = tenant_names[int(mix_rnd() * ntenants)] if ntenants > 1 else "default"
                if patience is not None:
                    deadline_at = t + patience.draw()
                elif has_deadline:
                    relative = deadlines[ci]
                    deadline_at = None if relative is None else t + relative
                else:
                    deadline_at = None
                if len(active) == 1:
                    w = active[0]
                else:
                    rr += 1
                    if rr >= len(active):
                        rr = 0
                    w = active[rr]
                offered_total += 1
                counted = t >= t0
                tally = tallies[ci]
                worker = workers[w]
                if counted:
                    tally.offered += 1
                try:
                    ticket = worker.controller.offer(
                        request_id=request_id,
                        klass=classes[ci],
                        tenant=tenant,
                        deadline_at=deadline_at - margin
                        if margin and deadline_at is not None
                        else deadline_at,
                    )
                except Rejected as refusal:
                    if counted:
                        reasons = tally.shed
                        reasons[refusal.reason] = reasons.get(refusal.reason, 0) + 1
                    if closed:
                        seq += 1
                        push(heap, (t + think.draw(), seq, CLIENT, event[3], 0, 0.0))
                    continue
                n += 1
                worker.held += 1
                if counted:
                    tally.admitted += 1
                if measuring:
                    passages += 1
                    live_start_sum += t
                if closed:
                    clients[ticket] = event[3]
                if ticket.state is STARTED:
                    busy += 1
                    worker.in_flight += 1
                    if counted:
                        tally.started += 1
                    if not io_from_records:
                        io = draw_io.draw()
                    if has_cpu:
                        if worker.free_cores:
                            worker.free_cores -= 1
                            cpu_busy += 1
                            seq += 1
                            push(heap, (t + draw_cpu.draw(), seq, CPU_DONE, ticket, w, io))
                        else:
                            worker.cpu_queue.append((ticket, io))
                    else:
                        seq += 1
                        push(heap, (t + io, seq, COMPLETE, ticket, w, 0.0))
                else:
                    if counted:
                        tally.waited += 1
                    if io_from_records:
                        trace_io[ticket] = io
                    if leave and deadline_at is not None:
                        seq += 1
                        push(heap, (deadline_at, seq, DEADLINE, ticket, w, 0.0))
                continue

            if kind == CPU_DONE:
                ticket, w, io = event[3], event[4], event[5]
                seq += 1
                push(heap, (t + io, seq, COMPLETE, ticket, w, 0.0))
                worker = workers[w]
                if worker.cpu_queue:
                    queued_ticket, queued_io = worker.cpu_queue.popleft()
                    seq += 1
                    push(heap, (t + draw_cpu.draw(), seq, CPU_DONE, queued_ticket, w, queued_io))
                else:
                    worker.free_cores += 1
                    cpu_busy -= 1
                continue

            if kind == DEADLINE:
                ticket = event[3]
                if ticket.state is not WAITING:
                    continue  # started, or already dropped at dequeue
                w = event[4]
                workers[w].controller.cancel(ticket)
                n -= 1
                workers[w].held -= 1
                arrived = ticket.offered_at
                ci = class_index[ticket.klass] if multi_class else 0
                if io_from_records:
                    del trace_io[ticket]
                if arrived >= t0:
                    tallies[ci].expired += 1
                    waited_for = t - arrived
                    tallies[ci].rej_sum += waited_for
                    if waited_for > tallies[ci].rej_max:
                        tallies[ci].rej_max = waited_for
                elif measuring:
                    tallies[ci].pre_departed += 1
                if measuring:
                    begin = arrived if arrived > t0 else t0
                    overlap_sum += t - begin
                    live_start_sum -= begin
                if closed:
                    seq += 1
                    push(heap, (t + think.draw(), seq, CLIENT, clients.pop(ticket), 0, 0.0))
                continue

            # ---- a tick, a scheduled call, or the end of the warm-up
            self._seq = seq
            self.offered = offered_total
            self.in_system = n
            if kind == WARMUP:
                measuring = True
                area_n = area_busy = area_cpu = 0.0
                live_start_sum = n * t0
                passages = n
                self._slot_seconds = 0.0
                self._slots_since = t0
                for worker in workers:
                    snap = worker.controller.snapshot()
                    for index, name in enumerate(classes):
                        tallies[index].live_at_t0 += _live(snap, name)
            elif kind == TICK:
                assert self._tick is not None
                every, hook = self._tick
                hook(self)
                if t + every <= horizon:
                    self._push(t + every, TICK, None, 0, 0.0)
            else:
                event[3](self)
            seq = self._seq

        # ---- close the window at the horizon
        self._seq = seq
        self.clock.set(max(self.clock.now(), horizon))
        dt = horizon - last
        if dt > 0:
            area_n += n * dt
            area_busy += busy * dt
            area_cpu += cpu_busy * dt
        self.in_system = n
        self._account_slots()
        window = horizon - t0
        overlap_sum += n * horizon - live_start_sum

        live_end = [0] * nclass
        for worker in workers:
            snap = worker.controller.snapshot()
            for ci, name in enumerate(classes):
                live_end[ci] += _live(snap, name)
        if sum(live_end) != n:
            raise AssertionError(
                f"bookkeeping drift: the controllers hold {sum(live_end)} requests, the engine {n}"
            )

        reports = []
        pooled: list[float] = []
        for ci, name in enumerate(classes):
            if nclass > 1:
                pooled.extend(tallies[ci].latencies)
            rejected = sum(tallies[ci].shed.values()) + tallies[ci].expired
            reports.append(
                ClassReport(
                    klass=name,
                    offered=tallies[ci].offered,
                    admitted=tallies[ci].admitted,
                    shed=tallies[ci].shed,
                    expired=tallies[ci].expired,
                    completed=tallies[ci].completed,
                    on_time=tallies[ci].on_time,
                    late=tallies[ci].late,
                    in_system=live_end[ci] - (tallies[ci].live_at_t0 - tallies[ci].pre_departed),
                    waited=tallies[ci].waited,
                    started=tallies[ci].started,
                    mean_wait=tallies[ci].wait_sum / tallies[ci].started
                    if tallies[ci].started
                    else math.nan,
                    latency=Latency.of(tallies[ci].latencies),
                    rejection_time_mean=tallies[ci].rej_sum / rejected if rejected else math.nan,
                    rejection_time_max=tallies[ci].rej_max if rejected else math.nan,
                )
            )
        cores_total = fleet.cores * len(workers)
        return Report(
            seed=self.seed,
            warmup=t0,
            horizon=horizon,
            classes=tuple(reports),
            latency=reports[0].latency if nclass == 1 else Latency.of(pooled),
            throughput=done_in_window / window,
            goodput=good_in_window / window,
            utilisation=area_busy / self._slot_seconds if self._slot_seconds else math.nan,
            cpu_utilisation=area_cpu / (cores_total * window) if has_cpu else math.nan,
            in_system_mean=area_n / window,
            passage_rate=passages / window,
            time_in_system_mean=overlap_sum / passages if passages else 0.0,
        )


def simulate(
    traffic: Traffic,
    fleet: Fleet,
    *,
    horizon: float,
    seed: int = 0,
    warmup: float = 0.0,
) -> Report:
    """Run ``traffic`` against ``fleet`` once and report on ``[warmup, horizon]``."""
    return Simulation(traffic, fleet, horizon=horizon, seed=seed, warmup=warmup).run()
