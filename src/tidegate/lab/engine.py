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

The loop is a run object with one method per event kind over a heap of named event records;
open-loop arrivals stay out of the heap (one pending arrival time compared with the heap's top).
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
from typing import Any, Final, Literal, TypeAlias, final

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
    "DISPATCH_RULES",
    "EventQueue",
    "Fleet",
    "Simulation",
    "Traffic",
    "Worker",
    "ceiling",
    "simulate",
]

# Event kinds (an event's ``kind``).
_COMPLETE: Final = 0
_CPU_DONE: Final = 1
_DEADLINE: Final = 2
_CLIENT: Final = 3
_TICK: Final = 4
_CALL: Final = 5
_WARMUP: Final = 6
_SLICE: Final = 7
#: The refusal reason of the fleet's total waiting cap, as the controller names its own cap's.
_QUEUE_FULL: Final = "queue_full"

#: How a fleet dispatches a new request to its workers.
DISPATCH_RULES: Final = ("round_robin", "shortest_queue")

_UNIT_EXPONENTIAL: Final = Exponential(mean=1.0)


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

    ``total_queue_cap`` bounds a worker's waiting requests over all classes together (the
    controller's ``queue_cap`` bounds each class): a request that cannot start at once while
    that many wait is refused as ``queue_full`` before it reaches the controller. ``None`` (the
    default) leaves the bounding to the controller alone.
    """

    admission: AdmissionOptions
    io: Distribution | None = _UNIT_EXPONENTIAL
    cpu: Distribution | None = None
    workers: int = 1
    cores: int = 1
    start_margin: float = 0.0
    total_queue_cap: int | None = None
    #: ``"round_robin"`` (each new request to the next active worker, as a load balancer with no
    #: feedback does) or ``"shortest_queue"`` (to the active worker holding the fewest requests,
    #: waiting or in service; ties go round-robin).
    dispatch: Literal["round_robin", "shortest_queue"] = "round_robin"

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCH_RULES:
            raise ValueError(f"dispatch must be one of {DISPATCH_RULES!r}, got {self.dispatch!r}")
        if not math.isfinite(self.start_margin) or self.start_margin < 0:
            raise ValueError(
                f"start_margin must be a finite number >= 0, got {self.start_margin!r}"
            )
        if isinstance(self.workers, bool) or self.workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
        if self.total_queue_cap is not None and (
            isinstance(self.total_queue_cap, bool) or self.total_queue_cap < 0
        ):
            raise ValueError(
                f"total_queue_cap must be an integer >= 0 or None, got {self.total_queue_cap!r}"
            )
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
    ``series`` cuts ``[0, horizon]`` into that many equal slices and reports the time-average
    number in the system in each (for a warm-up rule and a stationarity check).
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
        series: int = 0,
    ) -> None:
        if isinstance(series, bool) or series < 0:
            raise ValueError(f"series must be an int >= 0, got {series!r}")
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
        self.series = series
        self._heap: list[_Scheduled] = []
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

    def _push(self, when: float, kind: int, subject: Any, worker: int, io: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, _Event(kind, subject, worker, io)))

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
        run = _Run(self)
        run.loop()
        return run.report()


# Bound once: the compiled loop would otherwise look them up on the module at every event.
_heappush: Final = heapq.heappush
_heappop: Final = heapq.heappop


@final
class _Event:
    """One scheduled event. ``kind`` is one of the event kinds above; ``subject`` the ticket
    (complete, CPU done, deadline), the client (client) or the hook (call); ``worker`` the worker
    holding the ticket; ``io`` the IO part still to wait (CPU done).

    A plain slotted class, which the compiled build makes a native struct: a named tuple's
    constructor would cost the compiled loop about a quarter of its speed."""

    __slots__ = ("io", "kind", "subject", "worker")

    def __init__(self, kind: int, subject: Any, worker: int, io: float) -> None:
        self.kind = kind
        self.subject = subject
        self.worker = worker
        self.io = io


#: The heap's entries, ``(when, seq, event)``: ordered by time, then by scheduling order (``seq``
#: is unique, so the event itself is never compared).
_Scheduled: TypeAlias = tuple[float, int, _Event]


class _Run:
    """One simulation's loop: its state as the fields of one object, one method per event kind.

    The compiled build turns the fields into struct members and the methods into C functions,
    so the loop costs what it did as one function of locals; the plain Python pays a little
    for the attribute reads.
    """

    def __init__(self, sim: Simulation) -> None:
        traffic, fleet = sim.traffic, sim.fleet
        self.sim = sim
        self.classes = sim.classes
        self.nclass = len(self.classes)
        self.multi_class = self.nclass > 1
        self.class_index = sim._class_index
        self.horizon = sim.horizon
        self.t0 = sim.warmup
        self.heap = sim._heap
        self.clock = sim.clock
        self.workers = sim.workers
        self.active = sim._active
        self.expired_buffer = sim._expired
        self.slots = fleet.admission.slots
        self.margin = fleet.start_margin
        self.total_cap = -1 if fleet.total_queue_cap is None else fleet.total_queue_cap
        self.rr = 0
        self.jsq = fleet.dispatch == "shortest_queue"
        self._traffic(sim, traffic)
        self._service(sim, fleet, traffic.arrivals)
        # --- bookkeeping
        self.tallies = [_Tally() for _ in self.classes]
        self.tally0 = self.tallies[0]
        self.clients: dict[Ticket, int] = {}
        self.measuring = self.t0 <= 0.0
        self.n = 0  # requests in the system (admitted, not yet gone)
        self.busy = 0  # slots held
        self.cpu_busy = 0  # cores held
        self.area_n = self.area_busy = self.area_cpu = 0.0
        self.area_pre = 0.0  # the area of n over time before the warm-up ended
        self.last = 0.0
        self.departed = 0  # requests that left the system inside the window
        self.sojourn_sum = 0.0  # their whole times in the system, arrival to departure
        self.slices: list[float] = []  # the area of n over time at each slice's end
        self.overlap_sum = 0.0  # per-request time inside the window, summed at each departure
        self.live_start_sum = 0.0  # sum over requests inside of max(arrival, warmup)
        self.passages = 0  # requests present at the warmup plus those admitted after it
        self.done_in_window = 0
        self.good_in_window = 0
        self.offered_total = 0
        if self.t0 > 0.0:
            sim._push(self.t0, _WARMUP, None, 0, 0.0)
        if sim._tick is not None:
            sim._push(min(sim._tick[0], self.horizon), _TICK, None, 0, 0.0)
        if sim.series:
            sim._push(self.horizon / sim.series, _SLICE, None, 0, 0.0)
        if self.closed:
            for client in range(self.clients_count):
                sim._push(self.think.draw(), _CLIENT, client, 0, 0.0)
        self.seq = sim._seq

    def _traffic(self, sim: Simulation, traffic: Traffic) -> None:
        """What arrives: the arrival stream, the class mix, tenants, deadlines and patience."""
        classes, class_index = self.classes, self.class_index
        arrivals = traffic.arrivals
        self.closed = isinstance(arrivals, ClosedLoop)
        self.clients_count = arrivals.clients if isinstance(arrivals, ClosedLoop) else 0
        self.trace: tuple[TraceRecord, ...] = (
            arrivals.records if isinstance(arrivals, Trace) else ()
        )
        self.trace_pos = 0
        self.following: Stream = _NEVER
        self.think: Sampler = _ZERO
        if isinstance(arrivals, ClosedLoop):
            self.think = arrivals.think.sampler(sim._rng("think"))
            self.next_arrival = math.inf
        elif isinstance(arrivals, Trace):
            self.next_arrival = self.trace[0].at
        else:
            self.following = arrivals.stream(sim._rng("arrivals"))
            self.next_arrival = self.following.following(0.0)
        self.mix_rnd = sim._rng("mix").random
        if traffic.mix is not None and not self.trace:
            for klass in traffic.mix:
                if klass not in class_index:
                    raise ValueError(f"mix names class {klass!r}, not one of {classes!r}")
            shares = [float(traffic.mix.get(name, 0.0)) for name in classes]
            total_share = sum(shares)
            self.cumulative = [c / total_share for c in accumulate(shares)]
            self.cumulative[-1] = 1.0
        else:
            self.cumulative = [1.0] * self.nclass
        self.pick_class = self.nclass > 1 and traffic.mix is not None and not self.trace
        self.tenant_names = (
            ["default"] if traffic.tenants == 1 else [f"t{i}" for i in range(traffic.tenants)]
        )
        deadline = traffic.deadline
        if isinstance(deadline, Mapping):
            for klass in deadline:
                if klass not in class_index:
                    raise ValueError(f"deadline names class {klass!r}, not one of {classes!r}")
            self.deadlines: list[float | None] = [deadline.get(name) for name in classes]
        else:
            self.deadlines = [deadline] * self.nclass
        self.patience: Sampler | None = (
            traffic.patience.sampler(sim._rng("patience")) if traffic.patience is not None else None
        )
        self.has_deadline = self.patience is not None or any(d is not None for d in self.deadlines)
        self.leave = traffic.on_deadline == "leave" and self.has_deadline

    def _service(self, sim: Simulation, fleet: Fleet, arrivals: Arrivals | ClosedLoop) -> None:
        """What serving a request takes: its IO part, and a CPU part when the fleet has one."""
        self.io_from_records = fleet.io is None
        if self.io_from_records and not isinstance(arrivals, Trace):
            raise ValueError("fleet.io is None (service from a trace) but the arrivals are not")
        if fleet.io is not None:
            self.draw_io = fleet.io.sampler(sim._rng("io"))
        else:
            assert isinstance(arrivals, Trace)
            # Requests the trace did not time are given one of the recorded latencies.
            self.draw_io = arrivals.latencies().sampler(sim._rng("io"))
        self.trace_io: dict[Ticket, float] = {}
        self.has_cpu = fleet.cpu is not None
        self.draw_cpu = fleet.cpu.sampler(sim._rng("cpu")) if fleet.cpu is not None else _ZERO

    # ----------------------------------------------------------------------- the loop

    def push(self, when: float, kind: int, subject: Any, worker: int, io: float) -> None:
        self.seq += 1
        _heappush(self.heap, (when, self.seq, _Event(kind, subject, worker, io)))

    def loop(self) -> None:
        """Every event up to the horizon, in time order: the pending open-loop arrival or the
        heap's top, whichever is first. Before it, the clock moves to its time, and the
        time-weighted areas grow by what held since the last event."""
        heap, horizon, clock = self.heap, self.horizon, self.clock
        event: _Event | None = None
        while True:
            if heap and heap[0][0] <= self.next_arrival:
                scheduled = _heappop(heap)
                t = scheduled[0]
                if t > horizon:
                    _heappush(heap, scheduled)
                    return
                event = scheduled[2]
            else:  # the pending open-loop arrival comes first
                t = self.next_arrival
                if t > horizon:
                    return
                event = None
            clock.set(t)
            dt = t - self.last
            if dt:
                self.area_n += self.n * dt
                self.area_busy += self.busy * dt
                if self.has_cpu:
                    self.area_cpu += self.cpu_busy * dt
                self.last = t
            if event is None:
                self.arrive(t, -1)
                continue
            kind = event.kind
            if kind == _COMPLETE:
                self.complete(t, event.subject, event.worker)
            elif kind == _CLIENT:
                self.arrive(t, event.subject)
            elif kind == _CPU_DONE:
                self.cpu_done(t, event.subject, event.worker, event.io)
            elif kind == _DEADLINE:
                self.deadline(t, event.subject, event.worker)
            else:
                self.control(t, kind, event.subject)

    def tally_of(self, ticket: Ticket) -> _Tally:
        return self.tallies[self.class_index[ticket.klass]] if self.multi_class else self.tally0

    def arrive(self, t: float, client: int) -> None:
        """An arrival (``client`` -1: open-loop), dispatched round-robin to an active worker and
        offered to its controller: refused, into service at once, or waiting."""
        io = 0.0
        if self.trace:
            record = self.trace[self.trace_pos]
            self.trace_pos += 1
            self.next_arrival = (
                self.trace[self.trace_pos].at if self.trace_pos < len(self.trace) else math.inf
            )
            try:
                ci = self.class_index[record.klass]
            except KeyError:
                raise ValueError(
                    f"the trace has class {record.klass!r}, not one of {self.classes!r}"
                ) from None
            tenant = record.tenant
            if self.io_from_records:
                io = record.latency if record.latency is not None else self.draw_io.draw()
        else:
            if client < 0:
                self.next_arrival = self.following.following(t)
            ci = 0
            if self.pick_class:
                ci = min(bisect_right(self.cumulative, self.mix_rnd()), self.nclass - 1)
            names = self.tenant_names
            tenant = names[int(self.mix_rnd() * len(names))] if len(names) > 1 else "default"
        deadline_at: float | None = None
        if self.patience is not None:
            deadline_at = t + self.patience.draw()
        elif self.has_deadline:
            relative = self.deadlines[ci]
            deadline_at = None if relative is None else t + relative
        active = self.active
        w = active[0] if len(active) == 1 else self.dispatch(active)
        self.offered_total += 1
        counted = t >= self.t0
        tally = self.tallies[ci]
        worker = self.workers[w]
        if counted:
            tally.offered += 1
        margin = self.margin
        cap = self.total_cap
        if cap >= 0 and worker.in_flight >= self.slots and worker.held - worker.in_flight >= cap:
            if counted:
                reasons = tally.shed
                reasons[_QUEUE_FULL] = reasons.get(_QUEUE_FULL, 0) + 1
            if self.closed:
                self.push(t + self.think.draw(), _CLIENT, client, 0, 0.0)
            return
        try:
            ticket = worker.controller.offer(
                request_id="lab",
                klass=self.classes[ci],
                tenant=tenant,
                deadline_at=deadline_at - margin
                if margin and deadline_at is not None
                else deadline_at,
            )
        except Rejected as refusal:
            if counted:
                reasons = tally.shed
                reasons[refusal.reason] = reasons.get(refusal.reason, 0) + 1
            if self.closed:
                self.push(t + self.think.draw(), _CLIENT, client, 0, 0.0)
            return
        self.n += 1
        worker.held += 1
        if counted:
            tally.admitted += 1
        if self.measuring:
            self.passages += 1
            self.live_start_sum += t
        if self.closed:
            self.clients[ticket] = client
        if ticket.state is TicketState.STARTED:
            self.busy += 1
            worker.in_flight += 1
            if counted:
                tally.started += 1
            if not self.io_from_records:
                io = self.draw_io.draw()
            self.serve(t, ticket, worker, w, io)
            return
        if counted:
            tally.waited += 1
        if self.io_from_records:
            self.trace_io[ticket] = io
        if self.leave and deadline_at is not None:
            self.push(deadline_at, _DEADLINE, ticket, w, 0.0)

    def dispatch(self, active: list[int]) -> int:
        """The worker a new request goes to: the next one round-robin, or with ``shortest_queue``
        the one holding the fewest requests, looking from the next one round-robin."""
        self.rr += 1
        count = len(active)
        if self.rr >= count:
            self.rr = 0
        best = active[self.rr]
        if not self.jsq:
            return best
        workers = self.workers
        fewest = workers[best].held
        for offset in range(1, count):
            position = self.rr + offset
            if position >= count:
                position -= count
            candidate = active[position]
            held = workers[candidate].held
            if held < fewest:
                best, fewest = candidate, held
        return best

    def serve(self, t: float, ticket: Ticket, worker: Worker, w: int, io: float) -> None:
        """A request that holds a slot: its CPU part first (on a free core, or queued for one),
        then its IO part."""
        if not self.has_cpu:
            self.push(t + io, _COMPLETE, ticket, w, 0.0)
        elif worker.free_cores:
            worker.free_cores -= 1
            self.cpu_busy += 1
            self.push(t + self.draw_cpu.draw(), _CPU_DONE, ticket, w, io)
        else:
            worker.cpu_queue.append((ticket, io))

    def cpu_done(self, t: float, ticket: Ticket, w: int, io: float) -> None:
        """A CPU part ended: the IO part begins, and the core takes the next queued request."""
        self.push(t + io, _COMPLETE, ticket, w, 0.0)
        worker = self.workers[w]
        if worker.cpu_queue:
            queued_ticket, queued_io = worker.cpu_queue.popleft()
            self.push(t + self.draw_cpu.draw(), _CPU_DONE, queued_ticket, w, queued_io)
        else:
            worker.free_cores += 1
            self.cpu_busy -= 1

    def complete(self, t: float, ticket: Ticket, w: int) -> None:
        """A request was answered: counted on time or late, and its slot goes to waiting work."""
        worker = self.workers[w]
        worker.controller.finish(ticket)
        self.busy -= 1
        self.n -= 1
        worker.held -= 1
        worker.in_flight -= 1
        arrived = ticket.offered_at
        deadline_at = ticket.deadline_at
        if self.margin and deadline_at is not None:
            deadline_at += self.margin
        on_time = deadline_at is None or t <= deadline_at
        tally = self.tally_of(ticket)
        if arrived >= self.t0:
            tally.completed += 1
            tally.latencies.append(t - arrived)
            if on_time:
                tally.on_time += 1
            else:
                tally.late += 1
        elif self.measuring:
            tally.pre_departed += 1
        if self.measuring:
            self.left_window(t, arrived)
            self.done_in_window += 1
            if on_time:
                self.good_in_window += 1
        if self.closed:
            self.push(t + self.think.draw(), _CLIENT, self.clients.pop(ticket), 0, 0.0)
        if worker.held > worker.in_flight:
            self.fill(t, worker, w)

    def fill(self, t: float, worker: Worker, w: int) -> None:
        """Fill every free slot of ``worker``, in its controller's order; the work it dropped
        at dequeue (expired) leaves unserved."""
        controller = worker.controller
        while worker.in_flight < self.slots and (started := controller.start()) is not None:
            self.busy += 1
            worker.in_flight += 1
            arrived = started.offered_at
            if arrived >= self.t0:
                tally = self.tally_of(started)
                tally.started += 1
                tally.wait_sum += t - arrived
            io = self.trace_io.pop(started) if self.io_from_records else self.draw_io.draw()
            self.serve(t, started, worker, w, io)
        if self.expired_buffer:
            for ticket in self.expired_buffer:
                self.unserved(t, ticket, w)
            self.expired_buffer.clear()

    def deadline(self, t: float, ticket: Ticket, w: int) -> None:
        """A waiting request's caller gave up at its deadline (``on_deadline="leave"``)."""
        if ticket.state is not TicketState.WAITING:
            return  # started, or already dropped at dequeue
        self.workers[w].controller.cancel(ticket)
        self.unserved(t, ticket, w)

    def unserved(self, t: float, ticket: Ticket, w: int) -> None:
        """A request that leaves without service (expired at dequeue, or its caller gone)."""
        self.n -= 1
        self.workers[w].held -= 1
        arrived = ticket.offered_at
        tally = self.tally_of(ticket)
        if self.io_from_records:
            del self.trace_io[ticket]
        if arrived >= self.t0:
            tally.expired += 1
            waited_for = t - arrived
            tally.rej_sum += waited_for
            if waited_for > tally.rej_max:
                tally.rej_max = waited_for
        elif self.measuring:
            tally.pre_departed += 1
        if self.measuring:
            self.left_window(t, arrived)
        if self.closed:
            self.push(t + self.think.draw(), _CLIENT, self.clients.pop(ticket), 0, 0.0)

    def left_window(self, t: float, arrived: float) -> None:
        """A request leaves while the window is measured: its time inside the window counts."""
        begin = arrived if arrived > self.t0 else self.t0
        self.overlap_sum += t - begin
        self.live_start_sum -= begin
        self.departed += 1
        self.sojourn_sum += t - arrived

    def control(self, t: float, kind: int, subject: Any) -> None:
        """A tick, a scheduled call, or the end of the warm-up: the gauges a hook may read are
        brought up to date, and what the hook schedules joins the heap."""
        sim = self.sim
        sim._seq = self.seq
        sim.offered = self.offered_total
        sim.in_system = self.n
        if kind == _SLICE:
            self.slices.append(self.area_pre + self.area_n)
            following = self.horizon * (len(self.slices) + 1) / sim.series
            if len(self.slices) < sim.series:
                sim._push(following, _SLICE, None, 0, 0.0)
        elif kind == _WARMUP:
            self.measuring = True
            self.area_pre += self.area_n
            self.area_n = self.area_busy = self.area_cpu = 0.0
            self.live_start_sum = self.n * self.t0
            self.passages = self.n
            sim._slot_seconds = 0.0
            sim._slots_since = self.t0
            for worker in self.workers:
                snap = worker.controller.snapshot()
                for index, name in enumerate(self.classes):
                    self.tallies[index].live_at_t0 += _live(snap, name)
        elif kind == _TICK:
            assert sim._tick is not None
            every, hook = sim._tick
            hook(sim)
            if t + every <= self.horizon:
                sim._push(t + every, _TICK, None, 0, 0.0)
        else:
            subject(sim)
        self.seq = sim._seq

    # ----------------------------------------------------------------------- the report

    def report(self) -> Report:
        """Close the window at the horizon and report on it."""
        sim, horizon, t0 = self.sim, self.horizon, self.t0
        sim._seq = self.seq
        self.clock.set(max(self.clock.now(), horizon))
        dt = horizon - self.last
        if dt > 0:
            self.area_n += self.n * dt
            self.area_busy += self.busy * dt
            self.area_cpu += self.cpu_busy * dt
        sim.in_system = self.n
        sim._account_slots()
        window = horizon - t0
        self.overlap_sum += self.n * horizon - self.live_start_sum
        live_end = [0] * self.nclass
        for worker in self.workers:
            snap = worker.controller.snapshot()
            for ci, name in enumerate(self.classes):
                live_end[ci] += _live(snap, name)
        if sum(live_end) != self.n:
            raise AssertionError(
                f"bookkeeping drift: the controllers hold {sum(live_end)} requests,"
                f" the engine {self.n}"
            )
        reports = [self.class_report(ci, live_end[ci]) for ci in range(self.nclass)]
        pooled: list[float] = []
        if self.nclass > 1:
            for tally in self.tallies:
                pooled.extend(tally.latencies)
        fleet = sim.fleet
        cores_total = fleet.cores * len(self.workers)
        return Report(
            seed=sim.seed,
            warmup=t0,
            horizon=horizon,
            classes=tuple(reports),
            latency=reports[0].latency if self.nclass == 1 else Latency.of(pooled),
            throughput=self.done_in_window / window,
            goodput=self.good_in_window / window,
            utilisation=self.area_busy / sim._slot_seconds if sim._slot_seconds else math.nan,
            cpu_utilisation=self.area_cpu / (cores_total * window) if self.has_cpu else math.nan,
            in_system_mean=self.area_n / window,
            passage_rate=self.passages / window,
            time_in_system_mean=self.overlap_sum / self.passages if self.passages else 0.0,
            departure_rate=self.departed / window,
            sojourn_mean=self.sojourn_sum / self.departed if self.departed else math.nan,
            in_system_series=self.series_means(),
        )

    def series_means(self) -> tuple[float, ...]:
        """The time-average number in the system in each slice of ``[0, horizon]``."""
        count = self.sim.series
        if not count:
            return ()
        area = self.area_pre + self.area_n
        ends = [*self.slices[: count - 1], area]  # the last slice ends at the horizon
        step = self.horizon / count
        means = []
        previous = 0.0
        for end in ends:
            means.append((end - previous) / step)
            previous = end
        return tuple(means)

    def class_report(self, ci: int, live_end: int) -> ClassReport:
        tally = self.tallies[ci]
        rejected = sum(tally.shed.values()) + tally.expired
        return ClassReport(
            klass=self.classes[ci],
            offered=tally.offered,
            admitted=tally.admitted,
            shed=tally.shed,
            expired=tally.expired,
            completed=tally.completed,
            on_time=tally.on_time,
            late=tally.late,
            in_system=live_end - (tally.live_at_t0 - tally.pre_departed),
            waited=tally.waited,
            started=tally.started,
            mean_wait=tally.wait_sum / tally.started if tally.started else math.nan,
            latency=Latency.of(tally.latencies),
            rejection_time_mean=tally.rej_sum / rejected if rejected else math.nan,
            rejection_time_max=tally.rej_max if rejected else math.nan,
        )


def simulate(
    traffic: Traffic,
    fleet: Fleet,
    *,
    horizon: float,
    seed: int = 0,
    warmup: float = 0.0,
    series: int = 0,
) -> Report:
    """Run ``traffic`` against ``fleet`` once and report on ``[warmup, horizon]``; ``series``
    slices of ``[0, horizon]`` report the number in the system over time."""
    return Simulation(
        traffic, fleet, horizon=horizon, seed=seed, warmup=warmup, series=series
    ).run()
