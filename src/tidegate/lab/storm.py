"""A retry storm: a provider outage under naive retries, backoff with jitter, a retry budget,
and a breaker.

Clients send new requests (Poisson) to one provider that can take ``capacity`` calls in any one
second; calls beyond that fail as overloaded. During the outage every call fails. Each request
has a deadline and is driven through the gateway's own combination of policies
(:class:`~tidegate.policy.attempts.AttemptPolicy`, run on the event queue by
:func:`~tidegate.lab.calls.run_call`): the real retry planner, with a retry budget and a circuit
breaker when the strategy has them, so the numbers describe tidegate's own retry code:

- ``naive``: up to four tries, retried at once;
- ``backoff``: up to four tries, full-jitter exponential backoff;
- ``budget``: backoff, and retries may add only a share of the first tries;
- ``breaker``: backoff and budget, and a breaker that fails fast while the provider is down.

Retries cannot create capacity: served stays bounded by the outage; what the controls change is
how many calls the provider receives, how high the peak is, and for how many seconds the
provider is pushed over its capacity.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.lab.calls import run_call
from tidegate.lab.engine import EventQueue
from tidegate.lab.replicate import chosen, replicate
from tidegate.policy.attempts import AttemptPolicy, Call, Stop
from tidegate.policy.breaker import BreakerOptions, CircuitBreaker
from tidegate.policy.deadline import Deadline
from tidegate.policy.retry import Jitter, RetryBudget, RetryOptions
from tidegate.policy.routing import ProviderSpec, RoutePlan

__all__ = [
    "STRATEGIES",
    "StormOptions",
    "StormResult",
    "run_storm",
    "run_storms",
    "storm_summary",
]

#: The strategies, from the least to the most protective.
STRATEGIES: Final = ("naive", "backoff", "budget", "breaker")
#: The strategies without a breaker get one that never opens (its verdicts change nothing).
_NEVER_OPENS: Final = BreakerOptions(consecutive_failures=2**62, minimum_calls=2**62)
_PROVIDER: Final = ProviderSpec("provider", frozenset({"internal"}))
_PLAN: Final = RoutePlan((_PROVIDER,), ())


@dataclass(frozen=True, slots=True, kw_only=True)
class StormOptions:
    """The traffic, the provider and its outage, and the retry settings compared."""

    #: New requests per second (Poisson), for ``duration`` seconds.
    rate: float = 12.0
    duration: float = 120.0
    #: Calls the provider accepts in any one second; more fail as overloaded.
    capacity: int = 20
    #: The outage: every call fails from ``outage_start`` for ``outage_length`` seconds.
    outage_start: float = 30.0
    outage_length: float = 30.0
    #: Seconds a caller waits for its answer, retries included.
    deadline: float = 10.0
    #: Seconds a successful call takes, and a failed one takes to come back.
    call_latency: float = 0.3
    failure_latency: float = 0.1
    #: Seconds one attempt may take.
    per_try: float = 2.0
    #: Tries per request, the first included.
    attempts: int = 4
    #: Backoff of the jittered strategies.
    base: float = 0.5
    cap: float = 8.0
    #: Retry budget: retries may add this share of first tries, plus a floor per second.
    budget_ratio: float = 0.1
    budget_floor_per_s: float = 1.0
    #: Breaker settings for the ``breaker`` strategy.
    breaker: BreakerOptions = field(
        default_factory=lambda: BreakerOptions(
            consecutive_failures=5, failure_rate=0.5, minimum_calls=10, window=10.0, recovery=5.0
        )
    )

    def __post_init__(self) -> None:
        for name in ("rate", "duration", "deadline", "call_latency", "failure_latency", "per_try"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity!r}")
        if self.outage_start < 0 or self.outage_length < 0:
            raise ValueError("outage_start and outage_length must be >= 0")
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StormResult:
    """What one strategy did to the provider and for the callers."""

    strategy: str
    requests: int
    #: Calls that reached the provider (first tries and retries).
    calls: int
    #: The most calls the provider received in one second.
    peak: int
    served: int
    gave_up: int
    #: Seconds in which the provider received more calls than its capacity.
    seconds_over_capacity: int
    #: Calls the breaker refused without reaching the provider.
    short_circuited: int
    give_up_reasons: dict[str, int]
    #: Calls per second, second by second.
    calls_per_second: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "requests": self.requests,
            "calls": self.calls,
            "peak": self.peak,
            "served": self.served,
            "gave_up": self.gave_up,
            "seconds_over_capacity": self.seconds_over_capacity,
            "short_circuited": self.short_circuited,
            "give_up_reasons": dict(sorted(self.give_up_reasons.items())),
        }


def _policy(strategy: str, options: StormOptions) -> RetryOptions:
    if strategy == "naive":
        return RetryOptions(attempts=options.attempts, base=0.0, cap=0.0, jitter=Jitter.NONE)
    return RetryOptions(
        attempts=options.attempts, base=options.base, cap=options.cap, jitter=Jitter.FULL
    )


class _Storm:
    """One run's state; every method is an event on the queue."""

    def __init__(self, strategy: str, options: StormOptions, seed: int) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
        self.options = options
        self.strategy = strategy
        self.queue = EventQueue()
        clock = self.queue.clock
        self.clock = clock
        self.arrivals = random.Random(f"tidegate-lab/storm/{seed}/arrivals")
        budget = (
            RetryBudget(
                clock,
                ratio=options.budget_ratio,
                min_retries_per_second=options.budget_floor_per_s,
            )
            if strategy in ("budget", "breaker")
            else None
        )
        self.policy = AttemptPolicy(
            _policy(strategy, options),
            breakers={
                "provider": CircuitBreaker(
                    "provider",
                    options.breaker if strategy == "breaker" else _NEVER_OPENS,
                    clock=clock,
                    rng=random.Random(f"tidegate-lab/storm/{seed}/breaker"),
                )
            },
            rng=random.Random(f"tidegate-lab/storm/{seed}/jitter"),
            budget=budget,
        )
        seconds = math.ceil(options.duration + options.deadline) + 2
        self.per_second = [0] * seconds
        self.requests = 0
        self.served = 0
        self.gave_up = 0
        self.short_circuited = 0
        self.reasons: dict[str, int] = {}

    # -- the provider

    def _outcome(self, now: float) -> ProviderError | None:
        options = self.options
        second = int(now)
        self.per_second[second] += 1
        if options.outage_start <= now < options.outage_start + options.outage_length:
            return ProviderError(ProviderErrorKind.SERVER, "provider outage", provider="provider")
        if self.per_second[second] > options.capacity:
            return ProviderError(
                ProviderErrorKind.OVERLOADED, "provider over capacity", provider="provider"
            )
        return None

    # -- events

    def arrive(self) -> None:
        now = self.clock.now()
        self.requests += 1
        deadline = Deadline.after(self.clock, self.options.deadline)
        attempts = self.policy.start(_PLAN, deadline, self._per_try, [])
        run_call(self.queue, attempts, self._call, self._ended)
        gap = -math.log(1.0 - self.arrivals.random()) / self.options.rate
        if now + gap < self.options.duration:
            self.queue.at(now + gap, self.arrive)

    def _per_try(self, spec: ProviderSpec) -> float:
        return self.options.per_try

    def _call(self, call: Call) -> tuple[float, ProviderError | None]:
        error = self._outcome(self.clock.now())
        latency = self.options.call_latency if error is None else self.options.failure_latency
        return latency, error

    def _ended(self, stop: Stop | None) -> None:
        if stop is None:
            self.served += 1
            return
        if stop.reason == "circuit_open":
            self.short_circuited += 1
        self._give_up(stop.reason)

    def _give_up(self, reason: str) -> None:
        self.gave_up += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def run(self) -> StormResult:
        self.queue.at(0.0, self.arrive)
        self.queue.run()
        per_second = tuple(self.per_second)
        capacity = self.options.capacity
        return StormResult(
            strategy=self.strategy,
            requests=self.requests,
            calls=sum(per_second),
            peak=max(per_second),
            served=self.served,
            gave_up=self.gave_up,
            seconds_over_capacity=sum(1 for calls in per_second if calls > capacity),
            short_circuited=self.short_circuited,
            give_up_reasons=dict(self.reasons),
            calls_per_second=per_second,
        )


def run_storm(strategy: str, options: StormOptions | None = None, *, seed: int = 0) -> StormResult:
    """Run one strategy through the outage."""
    return _Storm(strategy, options if options is not None else StormOptions(), seed).run()


def run_storms(
    options: StormOptions | None = None,
    *,
    seed: int = 0,
    strategies: Iterable[str] = STRATEGIES,
    progress: Callable[[], None] | None = None,
) -> list[StormResult]:
    """Every strategy on the same arrivals (same seed)."""
    results = []
    for strategy in strategies:
        results.append(run_storm(strategy, options, seed=seed))
        if progress is not None:
            progress()
    return results


#: The figures :func:`storm_summary` gives per strategy.
FIGURES: Final = (
    "requests",
    "calls",
    "peak",
    "served",
    "gave_up",
    "seconds_over_capacity",
    "short_circuited",
)


def _storm_replication(
    task: tuple[StormOptions, tuple[str, ...]], seed: int
) -> dict[str, dict[str, int]]:
    options, strategies = task
    return {
        r.strategy: {name: getattr(r, name) for name in FIGURES}
        for r in run_storms(options, seed=seed, strategies=strategies)
    }


def storm_summary(
    options: StormOptions | None = None,
    *,
    seed: int = 0,
    replications: int = 10,
    jobs: int = 1,
    strategies: Iterable[str] = STRATEGIES,
    progress: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every strategy over independent replications (each on its own arrivals, the strategies
    of one replication on the same ones): per strategy, each figure a mean with its 95%
    interval."""
    summary, _ = replicate(
        _storm_replication,
        (
            options if options is not None else StormOptions(),
            chosen(strategies, STRATEGIES, "strategy"),
        ),
        seed=seed,
        replications=replications,
        workers=jobs,
        progress=progress,
    )
    result: dict[str, dict[str, Any]] = summary
    return result
