"""Tune a live config: search its admission, retry, breaker and fleet settings for the one that
answers the most requests within their deadlines, subject to constraints.

The starting point is a tidegate YAML file read by the gateway's own loader (through
:func:`~tidegate.lab.replay.load_replay_config`, so a config the gateway refuses is refused here
with the gateway's message, naming the key). Seven knobs are searched (:data:`KNOBS`):
``admission.queue_cap``, ``admission.mode`` (deadline admission on or off), ``retry.attempts``,
``retry.budget_ratio``, ``breaker.consecutive_failures``, ``breaker.recovery_s`` and
``server.workers``; everything else of the config stays as it is.

A candidate is run on a workload in virtual time through the real policy objects: each worker
process of the fleet has its own :class:`~tidegate.policy.admission.AdmissionController` and its
own combination of retries, retry budget and breaker
(:meth:`~tidegate.lab.replay.ReplayConfig.attempt_policy`, driven by
:func:`~tidegate.lab.calls.run_call`), in front of one shared provider. The workload is a
:class:`Profile` (Poisson arrivals, a model-call time distribution, a provider that accepts so
many calls a second and fails every call during an outage) or a recorded :class:`Trace` (its
arrivals, classes, deadlines and latencies; the provider's health over time read from its
outcomes, as ``lab replay`` reads it).

The search is coordinate descent over a declared :class:`Space`: knob by knob, every value is run
with the others held, on the same replication seeds (common random numbers), and the knob moves
to the value with the best objective among those that are feasible and beat the current one by
more than their paired 95 % interval. Passes repeat until one changes nothing. The winner and the
start are then run again on fresh seeds, and the report says whether the winner's interval lies
wholly above the start's; if not, the starting config is already on the frontier.

Replications run on :func:`~tidegate.lab.replicate.run_replications`' process pool, or on a Dask
cluster (:class:`DaskBackend`, the optional ``tidegate[cluster]`` extra); each replication is a
pure function of its seed, so both give the same bytes.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import math
import random
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import yaml

from tidegate.errors import DeadlineExceeded, ProviderError, ProviderErrorKind, Rejected
from tidegate.lab.calls import run_call
from tidegate.lab.engine import EventQueue
from tidegate.lab.replay import ReplayConfig, load_replay_config
from tidegate.lab.replicate import replication_seed, run_replications
from tidegate.lab.report import percentile
from tidegate.lab.stats import Interval, interval
from tidegate.lab.workload import Distribution, Trace, TraceRecord, parse_distribution
from tidegate.policy.admission import AdmissionController, AdmissionOptions, Ticket, TicketState
from tidegate.policy.attempts import AttemptPolicy, Call, Stop
from tidegate.policy.deadline import Deadline
from tidegate.policy.routing import ProviderSpec, RoutePlan

__all__ = [
    "FIGURES",
    "KEYS",
    "KNOBS",
    "OBJECTIVES",
    "Backend",
    "Constraints",
    "DaskBackend",
    "Evaluated",
    "PoolBackend",
    "Prices",
    "Profile",
    "Setting",
    "Space",
    "Start",
    "TuneOptions",
    "TuneResult",
    "Workload",
    "config_diff",
    "dask_backend",
    "load_start",
    "run_setting",
    "tune",
]

#: What the search maximises: ``goodput`` (answered within deadline per second) or ``cost``
#: (the cost per request, minimised).
OBJECTIVES: Final = ("goodput", "cost")
#: The knobs searched, in the order coordinate descent visits them, and each one's YAML key.
KNOBS: Final = (
    "queue_cap",
    "mode",
    "attempts",
    "budget_ratio",
    "breaker_failures",
    "breaker_recovery",
    "workers",
)
KEYS: Final[Mapping[str, tuple[str, str]]] = {
    "queue_cap": ("admission", "queue_cap"),
    "mode": ("admission", "mode"),
    "attempts": ("retry", "attempts"),
    "budget_ratio": ("retry", "budget_ratio"),
    "breaker_failures": ("breaker", "consecutive_failures"),
    "breaker_recovery": ("breaker", "recovery_s"),
    "workers": ("server", "workers"),
}
#: The figures of one replication, each reported as a mean with its interval.
FIGURES: Final = (
    "goodput",
    "shed_share",
    "expired_share",
    "failed_share",
    "p95",
    "calls_per_request",
    "cost_per_request",
)
_PROVIDER: Final = ProviderSpec("provider", frozenset({"internal"}))
_PLAN: Final = RoutePlan((_PROVIDER,), ())


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """One point of the search: the seven knobs' values."""

    queue_cap: int
    mode: str
    attempts: int
    budget_ratio: float
    breaker_failures: int
    breaker_recovery: float
    workers: int

    def with_knob(self, knob: str, value: Any) -> Setting:
        return dataclasses.replace(self, **{knob: value})

    def as_dict(self) -> dict[str, Any]:
        return {knob: getattr(self, knob) for knob in KNOBS}

    def yaml_keys(self) -> dict[str, Any]:
        """``section.key -> value`` for each knob."""
        return {".".join(KEYS[knob]): getattr(self, knob) for knob in KNOBS}

    def config(self, base: ReplayConfig) -> ReplayConfig:
        """``base`` with this setting's knobs."""
        return dataclasses.replace(
            base,
            admission=dataclasses.replace(
                base.admission,
                queue_cap=self.queue_cap,
                mode=self.mode,  # type: ignore[arg-type]
            ),
            retry=dataclasses.replace(base.retry, attempts=self.attempts),
            budget_ratio=self.budget_ratio,
            breaker=dataclasses.replace(
                base.breaker,
                consecutive_failures=self.breaker_failures,
                recovery=self.breaker_recovery,
            ),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Space:
    """The values each knob may take; the starting config's own value is always added."""

    queue_cap: tuple[int, ...] = (8, 32, 128, 512)
    mode: tuple[str, ...] = ("queue_cap", "deadline")
    attempts: tuple[int, ...] = (1, 2, 3, 5)
    budget_ratio: tuple[float, ...] = (0.05, 0.1, 0.2, 0.5)
    breaker_failures: tuple[int, ...] = (3, 5, 10, 20)
    breaker_recovery: tuple[float, ...] = (5.0, 10.0, 30.0, 60.0)
    workers: tuple[int, ...] = (1, 2, 3, 4, 6, 8)

    def __post_init__(self) -> None:
        for knob in ("queue_cap", "attempts", "breaker_failures", "workers"):
            for value in getattr(self, knob):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"space: {knob} values must be integers >= 1, got {value!r}")
        for seconds in self.breaker_recovery:
            if not math.isfinite(seconds) or seconds <= 0:
                raise ValueError(f"space: breaker_recovery values must be > 0, got {seconds!r}")
        for ratio in self.budget_ratio:
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"space: budget_ratio values must be in [0, 1], got {ratio!r}")
        for mode in self.mode:
            if mode not in ("queue_cap", "deadline"):
                raise ValueError(f"space: mode values are queue_cap or deadline, got {mode!r}")

    def values(self, knob: str, start: Setting) -> tuple[Any, ...]:
        """The values of ``knob`` to try, the start's included, in a fixed order."""
        values = {*getattr(self, knob), getattr(start, knob)}
        return tuple(sorted(values))


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """A synthetic workload: Poisson arrivals in front of a provider with a capacity and an
    outage."""

    #: New requests per second, for ``duration`` seconds.
    rate: float = 30.0
    duration: float = 120.0
    #: Model-call time: ``exp:MEAN``, ``det:S`` or ``lognormal:MEAN,SCV``.
    io: str = "lognormal:0.8,1"
    #: Seconds a caller waits for its answer (the config's ``server.request_timeout_s`` caps it).
    deadline: float = 10.0
    #: Calls the provider accepts in any one second; more fail as overloaded.
    capacity: float = 80.0
    #: Every call fails from ``outage_start`` for ``outage_length`` seconds (0: no outage).
    outage_start: float = 40.0
    outage_length: float = 20.0
    #: Seconds a failed call takes to come back.
    failure_latency: float = 0.1
    #: Tokens a call bills.
    tokens: int = 1200

    def __post_init__(self) -> None:
        for name in ("rate", "duration", "deadline", "capacity", "failure_latency"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("outage_start", "outage_length"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {self.tokens!r}")
        self.distribution()  # a bad spec is refused here, not in a worker

    def distribution(self) -> Distribution:
        return parse_distribution(self.io)

    def describe(self) -> str:
        outage = (
            f", outage {self.outage_start:g}-{self.outage_start + self.outage_length:g} s"
            if self.outage_length > 0
            else ""
        )
        return (
            f"{self.rate:g} req/s for {self.duration:g} s, io {self.io}, deadline "
            f"{self.deadline:g} s, provider {self.capacity:g} calls/s{outage}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What a candidate is run on: a :class:`Profile`, or a recorded trace."""

    profile: Profile = field(default_factory=Profile)
    trace: Trace | None = None
    #: The trace's name for the report.
    name: str = ""

    def describe(self) -> str:
        if self.trace is None:
            return self.profile.describe()
        return f"{len(self.trace.records)} requests from {self.name or 'a trace'}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Prices:
    """What a request costs: the tokens of every call that reached the provider, and the fleet's
    worker-hours over the run, divided by the requests offered."""

    per_1k_tokens: float = 0.002
    worker_hour: float = 0.05
    #: Where ``per_1k_tokens`` came from.
    source: str = "default"

    def __post_init__(self) -> None:
        for name in ("per_1k_tokens", "worker_hour"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Constraints:
    """Limits a setting must meet (on the replications' mean) to be feasible; None: no limit."""

    max_shed: float | None = None
    max_p95: float | None = None
    max_cost_per_request: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_shed", "max_p95", "max_cost_per_request"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(
                    f"--{name.replace('_', '-')} must be a finite number >= 0, got {value!r}"
                )
        if self.max_shed is not None and self.max_shed > 1:
            raise ValueError(f"--max-shed is a share in [0, 1], got {self.max_shed!r}")

    def violations(self, figures: Mapping[str, Interval]) -> list[str]:
        """The limits ``figures`` break, each named."""
        broken = []
        limits = (
            ("shed_share", self.max_shed, "shed share"),
            ("p95", self.max_p95, "p95"),
            ("cost_per_request", self.max_cost_per_request, "cost per request"),
        )
        for name, limit, label in limits:
            mean = figures[name].mean
            if limit is not None and (math.isnan(mean) or mean > limit):
                broken.append(f"{label} {mean:.4g} > {limit:g}")
        return broken

    def as_dict(self) -> dict[str, float | None]:
        return {
            "max_shed": self.max_shed,
            "max_p95": self.max_p95,
            "max_cost_per_request": self.max_cost_per_request,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class TuneOptions:
    """How the search runs."""

    objective: str = "goodput"
    constraints: Constraints = field(default_factory=Constraints)
    space: Space = field(default_factory=Space)
    replications: int = 5
    seed: int = 0
    #: Coordinate-descent passes at most (a pass that changes nothing ends the search).
    passes: int = 3

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"unknown objective {self.objective!r}; choose from {', '.join(OBJECTIVES)}"
            )
        if self.replications < 1:
            raise ValueError(f"replications must be >= 1, got {self.replications!r}")
        if self.passes < 1:
            raise ValueError(f"passes must be >= 1, got {self.passes!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Start:
    """The starting config: its policies as the gateway builds them, its knobs, its text."""

    path: Path
    config: ReplayConfig
    setting: Setting
    text: str
    prices: Prices


def _first_model_price(data: Mapping[str, Any]) -> tuple[str, float] | None:
    """The first route's primary provider's model and its mean of input and output price per
    1,000 tokens, when the config's ``prices`` lists it."""
    models = data.get("models") or {}
    providers = data.get("providers") or {}
    for route in models.values():
        names = (route.get("providers") or []) if isinstance(route, dict) else []
        provider = providers.get(names[0]) if names else None
        if not isinstance(provider, dict):
            return None
        model = provider.get("model") or next(iter(provider.get("models") or []), None)
        price = (data.get("prices") or {}).get(model)
        if not isinstance(price, dict):
            return None
        mean = (float(price.get("input_per_1k", 0.0)) + float(price.get("output_per_1k", 0.0))) / 2
        return str(model), mean
    return None


def load_start(
    path: str | Path, *, per_1k_tokens: float | None = None, worker_hour: float = 0.05
) -> Start:
    """The starting config at ``path``, read by the gateway's loader (a refusal raises
    ``ValueError`` naming the file and the key). ``server.workers`` is the fleet size (the
    gateway's default of 1 without it). Without ``per_1k_tokens``, tokens are priced from the
    config's ``prices`` entry for the first route's primary model (the mean of its input and
    output prices) when it has one, else at 0.002 per 1,000."""
    path = Path(path)
    config = load_replay_config(path)
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    server = data.get("server") or {}
    cap = config.admission.queue_cap
    if not isinstance(cap, int):
        raise ValueError(f"{path}: admission.queue_cap must be one number to be tuned")
    setting = Setting(
        queue_cap=cap,
        mode=config.admission.mode,
        attempts=config.retry.attempts,
        budget_ratio=config.budget_ratio,
        breaker_failures=config.breaker.consecutive_failures,
        breaker_recovery=config.breaker.recovery,
        workers=int(server.get("workers", 1)),
    )
    found = _first_model_price(data)
    if per_1k_tokens is not None:
        prices = Prices(per_1k_tokens=per_1k_tokens, worker_hour=worker_hour, source="given")
    elif found is not None:
        source = f"prices.{found[0]} in {path.name}"
        prices = Prices(per_1k_tokens=found[1], worker_hour=worker_hour, source=source)
    else:
        prices = Prices(worker_hour=worker_hour)
    return Start(path=path, config=config, setting=setting, text=text, prices=prices)


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True, slots=True)
class _Request:
    at: float
    klass: str
    tenant: str
    budget: float
    first_latency: float
    #: The first attempt's failure as recorded (a trace), or None.
    first_failure: ProviderErrorKind | None
    tokens: int
    #: Whether the first attempt replays a recorded answer or failure (a trace's).
    recorded: bool = False


def _provider_kind(outcome: str) -> ProviderErrorKind | None:
    if not outcome.startswith("provider_"):
        return None
    try:
        return ProviderErrorKind(outcome.removeprefix("provider_"))
    except ValueError:
        return ProviderErrorKind.SERVER


class _Health:
    """A provider's state over time: a profile's outage, or a trace's answered and failed
    requests (the latest evidence before a moment says how it was doing)."""

    def __init__(self, times: list[float], kinds: list[ProviderErrorKind | None]) -> None:
        self.times = times
        self.kinds = kinds

    def at(self, when: float) -> ProviderErrorKind | None:
        index = bisect.bisect_right(self.times, when) - 1
        return None if index < 0 else self.kinds[index]


def _profile_requests(
    profile: Profile, classes: tuple[str, ...], budget: float, seed: int
) -> tuple[list[_Request], _Health, list[float]]:
    arrivals = random.Random(f"tidegate-lab/tune/{seed}/arrivals")
    service = profile.distribution().sampler(random.Random(f"tidegate-lab/tune/{seed}/service"))
    requests, now = [], 0.0
    while True:
        now += -math.log(1.0 - arrivals.random()) / profile.rate
        if now >= profile.duration:
            break
        klass = classes[int(arrivals.random() * len(classes))]
        requests.append(
            _Request(now, klass, "default", budget, service.draw(), None, profile.tokens)
        )
    end = profile.outage_start + profile.outage_length
    health = (
        _Health([profile.outage_start, end], [ProviderErrorKind.SERVER, None])
        if profile.outage_length > 0
        else _Health([], [])
    )
    latencies = sorted(r.first_latency for r in requests) or [profile.failure_latency]
    return requests, health, latencies


def _recorded(outcome: str) -> bool:
    """Whether an outcome says how the provider answered (an answer or a provider failure)."""
    return outcome == "ok" or _provider_kind(outcome) is not None


def _trace_health(trace: Trace) -> _Health:
    evidence = sorted(
        (r.at + (r.latency or 0.0), _provider_kind(r.outcome))
        for r in trace.records
        if _recorded(r.outcome)
    )
    return _Health([t for t, _ in evidence], [k for _, k in evidence])


def _trace_request(record: TraceRecord, config: ReplayConfig) -> _Request:
    classes = config.admission.classes
    replayed = _recorded(record.outcome) and record.latency is not None
    return _Request(
        record.at,
        record.klass if record.klass in classes else classes[-1],
        record.tenant,
        config.deadline if record.deadline is None else min(record.deadline, config.deadline),
        record.latency if replayed and record.latency is not None else math.nan,
        _provider_kind(record.outcome) if replayed else None,
        record.tokens,
        replayed,
    )


def _trace_requests(
    trace: Trace, config: ReplayConfig
) -> tuple[list[_Request], _Health, list[float]]:
    ok = sorted(r.latency for r in trace.records if r.outcome == "ok" and r.latency is not None)
    requests = [_trace_request(r, config) for r in trace.records]
    return requests, _trace_health(trace), ok or [1.0]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Case:
    """Everything one replication of one setting needs, picklable (for a Dask worker)."""

    base: ReplayConfig
    admission: dict[str, Any]
    setting: Setting
    workload: Workload
    prices: Prices


def _portable(config: ReplayConfig) -> tuple[ReplayConfig, dict[str, Any]]:
    """``config`` with plain admission options beside it: the options' read-only mappings do
    not pickle, so the fields travel as a dict and the options are rebuilt where they run."""
    fields = {}
    for one in dataclasses.fields(config.admission):
        value = getattr(config.admission, one.name)
        fields[one.name] = dict(value) if isinstance(value, Mapping) else value
    placeholder = AdmissionOptions(classes=config.admission.classes)
    return dataclasses.replace(config, admission=placeholder), fields


class _TuneRun:
    """One replication of one setting; every method is an event on the queue."""

    def __init__(self, case: _Case, seed: int) -> None:
        base = dataclasses.replace(case.base, admission=AdmissionOptions(**case.admission))
        config = case.setting.config(base)
        self.case = case
        self.config = config
        self.queue = EventQueue()
        clock = self.queue.clock
        self.clock = clock
        workers = case.setting.workers
        self.controllers = [AdmissionController(config.admission, clock) for _ in range(workers)]
        self.policies: list[AttemptPolicy] = [
            config.attempt_policy(
                clock,
                (_PROVIDER.name,),
                rng=random.Random(f"tidegate-lab/tune/{seed}/jitter/{w}"),
                breaker_rng=random.Random(f"tidegate-lab/tune/{seed}/breaker/{w}"),
            )
            for w in range(workers)
        ]
        profile = case.workload.profile
        if case.workload.trace is None:
            budget = min(profile.deadline, config.deadline)
            made = _profile_requests(profile, config.admission.classes, budget, seed)
            self.capacity = profile.capacity
            self.span = profile.duration
        else:
            made = _trace_requests(case.workload.trace, config)
            self.capacity = math.inf
            self.span = max(made[0][-1].at, 1.0) if made[0] else 1.0
        self.requests, self.health, self.latencies = made
        self.failure_latency = profile.failure_latency
        self.retry_latency = random.Random(f"tidegate-lab/tune/{seed}/retries")
        self.per_second: dict[int, int] = {}
        self.outcome = ["other"] * len(self.requests)
        self.latency = [math.nan] * len(self.requests)
        self.tickets: dict[Ticket, int] = {}
        self.draining = [False] * workers
        self.calls = 0
        self.tokens = 0

    def arrive(self, index: int) -> None:
        request = self.requests[index]
        worker = index % len(self.controllers)
        now = self.clock.now()
        try:
            ticket = self.controllers[worker].offer(
                request_id=str(index),
                klass=request.klass,
                tenant=request.tenant,
                deadline_at=now + request.budget,
            )
        except Rejected:
            self.outcome[index] = "shed"
            return
        self.tickets[ticket] = index
        if ticket.state is TicketState.STARTED:
            self.call(ticket, index, worker)
        else:
            self.queue.at(now + request.budget, self.give_up_waiting, ticket)

    def give_up_waiting(self, ticket: Ticket) -> None:
        if ticket.state is TicketState.WAITING:
            self.controllers[self.worker_of(ticket)].cancel(ticket)
        elif ticket.state is not TicketState.EXPIRED:
            return
        self.outcome[self.tickets.pop(ticket)] = "expired"

    def worker_of(self, ticket: Ticket) -> int:
        return self.tickets[ticket] % len(self.controllers)

    def call(self, ticket: Ticket, index: int, worker: int) -> None:
        request = self.requests[index]
        deadline = Deadline.at_time(self.clock, request.at + request.budget)
        attempts = self.policies[worker].start(_PLAN, deadline, self._per_try, [])

        def provider(call: Call) -> tuple[float, ProviderError | None]:
            return self.provider(index, call)

        def ended(stop: Stop | None) -> None:
            self.done(ticket, index, worker, "ok" if stop is None else _stopped(stop))

        run_call(self.queue, attempts, provider, ended)

    def _per_try(self, spec: ProviderSpec) -> float:
        return self.config.per_try

    def provider(self, index: int, call: Call) -> tuple[float, ProviderError | None]:
        """The shared provider: the request's own latency on its first try, a draw from the
        workload's latencies on a retry; failing as its health says, or as overloaded beyond
        its calls per second."""
        request = self.requests[index]
        now = self.clock.now()
        self.calls += 1
        self.tokens += request.tokens
        second = int(now)
        self.per_second[second] = self.per_second.get(second, 0) + 1
        first = call.attempt == 1
        replayed = first and request.recorded
        kind = request.first_failure if replayed else self.health.at(now)
        if first and not math.isnan(request.first_latency):
            latency = request.first_latency
        else:
            latency = self.latencies[int(self.retry_latency.random() * len(self.latencies))]
        if kind is None and self.per_second[second] > self.capacity:
            kind = ProviderErrorKind.OVERLOADED
        if kind is None:
            return latency, None
        failed = latency if replayed else self.failure_latency
        return failed, ProviderError(kind, "simulated failure", provider=_PROVIDER.name)

    def done(self, ticket: Ticket, index: int, worker: int, outcome: str) -> None:
        request = self.requests[index]
        elapsed = self.clock.now() - request.at
        on_time = outcome == "ok" and elapsed <= request.budget + 1e-9
        self.outcome[index] = outcome if on_time or outcome != "ok" else "late"
        self.latency[index] = elapsed
        self.tickets.pop(ticket, None)
        controller = self.controllers[worker]
        controller.finish(ticket)
        # A call can end at once (its breaker open, its deadline gone), which ends here again:
        # the outermost end of a worker starts the next tickets, so the stack stays flat.
        if self.draining[worker]:
            return
        self.draining[worker] = True
        while (started := controller.start()) is not None:
            self.call(started, self.tickets[started], worker)
        self.draining[worker] = False

    def run(self) -> dict[str, float]:
        for index, request in enumerate(self.requests):
            self.queue.at(request.at, self.arrive, index)
        self.queue.run()
        offered = len(self.requests) or 1
        count = {name: self.outcome.count(name) for name in ("ok", "shed", "expired")}
        answered = sorted(
            lat for lat, out in zip(self.latency, self.outcome, strict=True) if out == "ok"
        )
        prices = self.case.prices
        cost = (
            self.tokens / 1000.0 * prices.per_1k_tokens
            + self.case.setting.workers * prices.worker_hour * self.span / 3600.0
        )
        return {
            "goodput": count["ok"] / self.span,
            "shed_share": count["shed"] / offered,
            "expired_share": count["expired"] / offered,
            "failed_share": (offered - sum(count.values())) / offered,
            "p95": percentile(answered, 0.95) if answered else math.nan,
            "calls_per_request": self.calls / offered,
            "cost_per_request": cost / offered,
        }


def _stopped(stop: Stop) -> str:
    if stop.reason == "circuit_open":
        return "circuit_open"
    if isinstance(stop.error, DeadlineExceeded):
        return "expired"
    return "provider_error"


def run_setting(
    start: Start, setting: Setting, workload: Workload, *, seed: int
) -> dict[str, float]:
    """One replication of ``setting`` (on ``start``'s other settings) on ``workload``: goodput
    (answered within deadline per second), the shares shed at the door, expired and failed,
    the p95 of the answered, calls and cost per request offered."""
    base, admission = _portable(start.config)
    case = _Case(
        base=base, admission=admission, setting=setting, workload=workload, prices=start.prices
    )
    return _TuneRun(case, seed).run()


def _batch(cases: tuple[_Case, ...], seed: int) -> list[dict[str, float]]:
    """One replication of every case, all on the same seed (common random numbers)."""
    return [_TuneRun(case, seed).run() for case in cases]


# --------------------------------------------------------------------------- backends


class Backend(Protocol):
    """Where replications run: ``function(spec, replication_seed(seed, i))`` for each
    replication ``i``, results in replication order."""

    def map(
        self, function: Callable[[Any, int], Any], spec: Any, seed: int, replications: int
    ) -> list[Any]: ...


@dataclass(frozen=True, slots=True)
class PoolBackend:
    """The lab's process pool (:func:`~tidegate.lab.replicate.run_replications`)."""

    jobs: int = 1

    def map(
        self, function: Callable[[Any, int], Any], spec: Any, seed: int, replications: int
    ) -> list[Any]:
        return run_replications(
            function, spec, seed=seed, replications=replications, workers=self.jobs
        )


@dataclass(frozen=True, slots=True)
class DaskBackend:
    """A ``dask.distributed`` client: each replication a task, gathered in order."""

    client: Any

    def map(
        self, function: Callable[[Any, int], Any], spec: Any, seed: int, replications: int
    ) -> list[Any]:
        seeds = [replication_seed(seed, i) for i in range(replications)]
        packed = [(function, _plain(spec))] * replications
        futures = self.client.map(_run_plain, packed, seeds, pure=False)
        return [_built(result) for result in self.client.gather(futures)]


@dataclass(frozen=True, slots=True)
class _Rebuild:
    """A dataclass instance as its class and its fields, for pickling: the compiled build's
    frozen classes (the admission options, the lab's distributions and traces) cannot be
    unpickled, their fields can."""

    cls: type
    fields: dict[str, Any]


def _plain(value: Any) -> Any:
    """``value`` with every dataclass instance in it replaced by a :class:`_Rebuild`."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            one.name: _plain(getattr(value, one.name))
            for one in dataclasses.fields(value)
            if one.init
        }
        return _Rebuild(type(value), fields)
    if type(value) is tuple:
        return tuple(_plain(item) for item in value)
    if type(value) is list:
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _built(value: Any) -> Any:
    """What :func:`_plain` was given, built again."""
    if isinstance(value, _Rebuild):
        return value.cls(**{name: _built(item) for name, item in value.fields.items()})
    if type(value) is tuple:
        return tuple(_built(item) for item in value)
    if type(value) is list:
        return [_built(item) for item in value]
    if type(value) is dict:
        return {key: _built(item) for key, item in value.items()}
    return value


def _run_plain(packed: tuple[Callable[[Any, int], Any], Any], seed: int) -> Any:
    """One replication on a Dask worker, its spec and its result carried by :func:`_plain`."""
    function, spec = packed
    return _plain(function(_built(spec), seed))


def _distributed() -> Any:
    try:
        import dask.distributed as distributed
    except ImportError:
        raise ValueError(
            "a Dask cluster needs the optional extra: pip install 'tidegate[cluster]'"
        ) from None
    return distributed


@contextmanager
def dask_backend(*, scheduler: str | None = None, workers: int = 1) -> Iterator[DaskBackend]:
    """A :class:`DaskBackend` on the scheduler at ``scheduler``, or on a local cluster of
    ``workers`` processes (one thread each) started and stopped around the block."""
    distributed = _distributed()
    if scheduler is not None:
        with distributed.Client(scheduler) as client:
            yield DaskBackend(client)
        return
    with (
        distributed.LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield DaskBackend(client)


# --------------------------------------------------------------------------- the search


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluated:
    """A setting over the replications: each figure's mean and interval, and its feasibility."""

    setting: Setting
    figures: Mapping[str, Interval]
    violations: tuple[str, ...]
    runs: tuple[Mapping[str, float], ...]

    @property
    def feasible(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {
            "setting": self.setting.yaml_keys(),
            "figures": {name: self.figures[name].as_dict() for name in FIGURES},
            "feasible": self.feasible,
            "violations": list(self.violations),
        }


def _objective(objective: str, run: Mapping[str, float]) -> float:
    return run["goodput"] if objective == "goodput" else -run["cost_per_request"]


def _gain(objective: str, better: Evaluated, worse: Evaluated) -> Interval:
    """The paired difference of the objective, replication by replication (same seeds)."""
    return interval(
        [
            _objective(objective, b) - _objective(objective, w)
            for b, w in zip(better.runs, worse.runs, strict=True)
        ]
    )


def _beats(objective: str, candidate: Evaluated, current: Evaluated) -> bool:
    """Whether ``candidate`` should replace ``current``: feasible where the current is not, or
    both feasible and better by more than the paired interval's half-width."""
    if not candidate.feasible:
        return False
    if not current.feasible:
        return True
    gain = _gain(objective, candidate, current)
    if math.isnan(gain.half_width):
        return gain.mean > 0
    return gain.low > 0


class _Search:
    def __init__(
        self, start: Start, workload: Workload, options: TuneOptions, backend: Backend
    ) -> None:
        self.start = start
        self.workload = workload
        self.options = options
        self.backend = backend
        self.base, self.admission = _portable(start.config)
        self.cache: dict[Setting, Evaluated] = {}

    def evaluate(self, settings: Sequence[Setting], seed: int) -> list[Evaluated]:
        cases = tuple(
            _Case(
                base=self.base,
                admission=self.admission,
                setting=s,
                workload=self.workload,
                prices=self.start.prices,
            )
            for s in settings
        )
        runs = self.backend.map(_batch, cases, seed, self.options.replications)
        evaluated = []
        for index, setting in enumerate(settings):
            mine = tuple(run[index] for run in runs)
            figures = {name: interval([r[name] for r in mine]) for name in FIGURES}
            violations = tuple(self.options.constraints.violations(figures))
            evaluated.append(
                Evaluated(setting=setting, figures=figures, violations=violations, runs=mine)
            )
        return evaluated

    def cached(self, settings: Sequence[Setting]) -> list[Evaluated]:
        fresh = [s for s in dict.fromkeys(settings) if s not in self.cache]
        if fresh:
            for one in self.evaluate(fresh, self.options.seed):
                self.cache[one.setting] = one
        return [self.cache[s] for s in settings]

    def step(self, current: Evaluated, knob: str) -> Evaluated:
        """Coordinate descent along ``knob``: the best of its values that beats ``current``."""
        values = self.options.space.values(knob, self.start.setting)
        candidates = self.cached([current.setting.with_knob(knob, v) for v in values])
        objective = self.options.objective
        best = current
        for candidate in candidates:
            if candidate.setting == current.setting or not _beats(objective, candidate, current):
                continue
            if best is current or _objective_mean(objective, candidate) > _objective_mean(
                objective, best
            ):
                best = candidate
        return best

    def run(self) -> tuple[Evaluated, int]:
        current = self.cached([self.start.setting])[0]
        passes = 0
        for _ in range(self.options.passes):
            passes += 1
            before = current.setting
            for knob in KNOBS:
                current = self.step(current, knob)
            if current.setting == before:
                break
        return current, passes


def _objective_mean(objective: str, evaluated: Evaluated) -> float:
    name = "goodput" if objective == "goodput" else "cost_per_request"
    mean = evaluated.figures[name].mean
    return mean if objective == "goodput" else -mean


@dataclass(frozen=True, slots=True, kw_only=True)
class TuneResult:
    """The search's outcome: the start and the best setting re-run on fresh seeds, the paired
    gain, the verdict and the config diff."""

    objective: str
    start: Evaluated
    best: Evaluated
    gain: Interval
    improved: bool
    evaluated: int
    passes: int
    replications: int
    seed: int
    diff: str
    workload: str
    prices: Prices
    constraints: Constraints

    @property
    def verdict(self) -> str:
        if self.improved:
            return (
                f"the best setting beats the starting config by more than the interval width "
                f"({self.objective})"
            )
        if not self.best.feasible:
            return "no setting searched meets the constraints"
        return "the starting config is already on the frontier"

    def as_dict(self) -> dict[str, Any]:
        return {
            "objective": self.objective,
            "workload": self.workload,
            "replications": self.replications,
            "seed": self.seed,
            "constraints": self.constraints.as_dict(),
            "prices": {
                "per_1k_tokens": self.prices.per_1k_tokens,
                "worker_hour": self.prices.worker_hour,
                "source": self.prices.source,
            },
            "evaluated": self.evaluated,
            "passes": self.passes,
            "start": self.start.as_dict(),
            "best": self.best.as_dict(),
            "gain": self.gain.as_dict(),
            "improved": self.improved,
            "verdict": self.verdict,
            "changes": {
                key: {"from": self.start.setting.yaml_keys()[key], "to": value}
                for key, value in self.best.setting.yaml_keys().items()
                if self.start.setting.yaml_keys()[key] != value
            },
            "diff": self.diff,
        }


def _confirm_seed(seed: int) -> int:
    return random.Random(f"tidegate-lab/tune/confirm/{seed}").getrandbits(48)


def tune(
    start: Start, workload: Workload, options: TuneOptions, backend: Backend | None = None
) -> TuneResult:
    """Search ``options.space`` from ``start`` on ``workload``; see the module."""
    search = _Search(start, workload, options, backend or PoolBackend())
    found, passes = search.run()
    start_run, best_run = search.evaluate(
        [start.setting, found.setting], _confirm_seed(options.seed)
    )
    if found.setting == start.setting:
        best_run = start_run
    key = "goodput" if options.objective == "goodput" else "cost_per_request"
    a, b = start_run.figures[key], best_run.figures[key]
    improved = best_run.feasible and (
        (b.low > a.high if options.objective == "goodput" else b.high < a.low)
        or (not start_run.feasible and found.setting != start.setting)
    )
    return TuneResult(
        objective=options.objective,
        start=start_run,
        best=best_run,
        gain=_gain(options.objective, best_run, start_run),
        improved=bool(improved),
        evaluated=len(search.cache),
        passes=passes,
        replications=options.replications,
        seed=options.seed,
        diff=_checked_diff(start, found.setting),
        workload=workload.describe(),
        prices=start.prices,
        constraints=options.constraints,
    )


# --------------------------------------------------------------------------- the diff

_SECTION = re.compile(r"^(?P<name>[A-Za-z_][\w-]*):\s*(#.*)?$")
_KEY = re.compile(
    r"^(?P<indent>\s+)(?P<key>[A-Za-z_][\w-]*):(?P<value>[^#\n]*?)(?P<comment>\s+#.*)?$"
)


def _scalar(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _block(lines: list[str], section: str) -> tuple[int, int] | None:
    """The line range of a block-style top-level ``section`` (its header, the end), if any."""
    for index, line in enumerate(lines):
        match = _SECTION.match(line)
        if match and match["name"] == section:
            end = index + 1
            while end < len(lines) and (
                not lines[end].strip() or lines[end][:1].isspace() or lines[end].startswith("#")
            ):
                end += 1
            while end > index + 1 and not lines[end - 1].strip():
                end -= 1
            return index, end
    return None


def _set_key(lines: list[str], section: str, key: str, value: Any) -> bool:
    """Set ``section.key`` to ``value`` in place, keeping the file's layout and comments;
    False when the section is not written in block style."""
    text = _scalar(value)
    found = _block(lines, section)
    if found is None:
        if any(line.startswith(f"{section}:") for line in lines):
            return False  # a flow-style or otherwise inline section
        if lines and lines[-1].strip():
            lines.append("")
        lines.extend([f"{section}:", f"  {key}: {text}"])
        return True
    header, end = found
    indent: str | None = None
    last = header
    for index in range(header + 1, end):
        if lines[index][:1].isspace() and lines[index].strip():
            last = index  # the block's last line, a nested key's included
        match = _KEY.match(lines[index])
        if match is None or (indent is not None and match["indent"] != indent):
            continue  # not a key, or a nested one
        indent = match["indent"]
        if match["key"] == key:
            lines[index] = f"{indent}{key}: {text}{match['comment'] or ''}"
            return True
    lines.insert(last + 1, f"{indent or '  '}{key}: {text}")
    return True


def _changed(old: Setting, new: Setting) -> list[tuple[str, str, Any]]:
    return [
        (*KEYS[knob], getattr(new, knob))
        for knob in KNOBS
        if getattr(old, knob) != getattr(new, knob)
    ]


def _edited(text: str, changes: list[tuple[str, str, Any]]) -> str | None:
    """``text`` with each change made in place, or None when the result does not read back
    with the new values (a flow-style section, say)."""
    lines = text.splitlines()
    for section, key, value in changes:
        if not _set_key(lines, section, key, value):
            return None
    edited = "\n".join(lines) + "\n"
    try:
        data = yaml.safe_load(edited) or {}
    except yaml.YAMLError:
        return None
    for section, key, value in changes:
        block = data.get(section)
        if not isinstance(block, dict) or block.get(key) != value:
            return None
    return edited


def config_diff(text: str, name: str, old: Setting, new: Setting) -> str:
    """The change from ``old`` to ``new`` as a unified diff of the YAML file (``text``, named
    ``name``), only the changed keys edited; empty when nothing changes. A file whose layout
    cannot be edited in place gets a diff of its changed keys alone."""
    changes = _changed(old, new)
    if not changes:
        return ""
    edited = _edited(text, changes)
    before = text if edited is not None else _fragment(_changed(new, old))
    after = edited if edited is not None else _fragment(changes)
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=name,
            tofile=f"{name} (tuned)",
        )
    )


def _fragment(changes: list[tuple[str, str, Any]]) -> str:
    lines: list[str] = []
    for section in dict.fromkeys(section for section, _, _ in changes):
        lines.append(f"{section}:")
        lines.extend(f"  {k}: {_scalar(v)}" for s, k, v in changes if s == section)
    return "\n".join(lines) + "\n"


def _checked_diff(start: Start, new: Setting) -> str:
    """:func:`config_diff` of the start and ``new``, once the tuned file has been read by the
    gateway's loader (a setting it refuses raises ``ValueError`` naming the key)."""
    edited = _edited(start.text, _changed(start.setting, new))
    if edited is not None and edited != start.text:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / start.path.name
            path.write_text(edited, encoding="utf-8")
            load_replay_config(path)
    return config_diff(start.text, start.path.name, start.setting, new)
