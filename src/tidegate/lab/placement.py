"""Where state lives: N workers behind round-robin, each with its own store or all with one.

The same synthetic workload reaches ``workers`` gateway processes through a round-robin
dispatcher (request ``i``, of whatever kind, goes to worker ``i mod N``) and meets the real
store classes through their async API. In the ``per_process`` placement every worker opens its
own ``store_from_url("memory://")``; in the ``shared`` placement one ``Stores`` serves them all
(what a Redis or Postgres URL gives a fleet). Three kinds of request share the dispatcher:

* **chat** requests: ``requests_per_user`` for each of ``users``, at uniform random times over
  ``window_s``, each taking one token from the user's bucket (``BucketStore.take`` on
  ``user:<u>`` with ``rate`` and ``burst``). The figure is each user's admitted requests over
  the most the limit admits in the window, ``burst + rate x window_s``: about ``N`` per process
  (each worker keeps its own full bucket), at most 1 shared.
* **follow-ups**: a share ``followup_share`` of the chat requests carry an idempotency key. An
  admitted one claims the key (``IdempotencyStore.claim``), executes once and completes the
  claim with its answer; its client then sends the same request again ``followups`` times (the
  answer was lost), each after a delay uniform in ``[0.5, 1.5] x followup_delay_s``. A
  follow-up claims the key on the worker it lands on: a replay there found its history; a fresh
  claim found none, so the request executes a second time (and completes, so a later follow-up
  to that worker replays). Follow-ups are not charged to the rate limit, so their fate shows
  the idempotency store alone. The figures: the share of follow-ups that found their history
  (about ``1/N`` per process, 1 shared) and executions per key (1 shared).
* **prompts**: ``prompts`` distinct prompts, each asked ``repeats`` times at uniform random
  times over the window: ``CacheStore.get``, and on a miss one model call and
  ``CacheStore.put`` (fresh for ``cache_ttl_s``, longer than the window by default). Model
  calls: ``P`` shared; per process each worker misses once per prompt it sees, about
  ``N (1 - (1 - 1/N)^K) P``, at most ``min(N, K) P``.

Determinism: the workload (times, keys, delays) is drawn from ``random.Random`` seeded from the
run's seed, identical for both placements; the stores read the run's
:class:`~tidegate.clock.ManualClock`, set to each event's time before its store calls. Each run
is one ``asyncio.run`` of sequential awaits, so the order of store operations is the order of
the events.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from tidegate.clock import ManualClock
from tidegate.lab.replicate import replicate
from tidegate.policy.ratelimit import BucketOptions
from tidegate.state.base import ClaimOutcome, StoredResponse
from tidegate.state.url import Stores, store_from_url

__all__ = [
    "PLACEMENTS",
    "PlacementOptions",
    "PlacementResult",
    "placement_summary",
    "placement_theory",
    "run_placement",
]

#: One ``memory://`` store per worker, and one store for every worker.
PLACEMENTS: Final = ("per_process", "shared")

_CHAT: Final = 0
_FOLLOWUP: Final = 1
_PROMPT: Final = 2
_LEASE_S: Final = 60.0
_KEEP_S: Final = 86_400.0
_ANSWER: Final = StoredResponse(200, b'{"answer": "stored"}')


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementOptions:
    """The fleet, the per-user limit and the three kinds of request."""

    #: Gateway processes behind the round-robin dispatcher.
    workers: int = 4
    #: Users, and chat requests each sends over ``window_s`` (uniform random times).
    users: int = 20
    requests_per_user: int = 240
    window_s: float = 60.0
    #: The per-user limit: tokens a second and bucket size.
    rate: float = 0.5
    burst: float = 5.0
    #: The share of chat requests with an idempotency key, sent again ``followups`` times,
    #: each after a delay uniform in ``[0.5, 1.5] x followup_delay_s``.
    followup_share: float = 0.2
    followups: int = 1
    followup_delay_s: float = 5.0
    #: Distinct prompts, each asked ``repeats`` times over the window; a cached answer stays
    #: fresh ``cache_ttl_s``.
    prompts: int = 40
    repeats: int = 8
    cache_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        counts = ("workers", "users", "requests_per_user", "followups", "prompts", "repeats")
        for name in counts:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("window_s", "followup_delay_s", "cache_ttl_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not 0 <= self.followup_share <= 1:
            raise ValueError(f"followup_share must be in [0, 1], got {self.followup_share!r}")
        BucketOptions(rate=self.rate, burst=self.burst)  # checks rate and burst

    @property
    def bucket(self) -> BucketOptions:
        return BucketOptions(rate=self.rate, burst=self.burst)

    @property
    def limit(self) -> float:
        """The most one user's bucket admits over the window: ``burst + rate x window_s``."""
        return self.burst + self.rate * self.window_s


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementResult:
    """One placement over one run."""

    placement: str
    #: Per user: chat requests admitted, and admitted over :attr:`PlacementOptions.limit`
    #: (the mean over users).
    admitted_per_user: float
    limit_ratio: float
    #: Keys claimed by admitted chat requests, follow-ups sent, follow-ups that found a replay.
    keys: int
    followups: int
    history_found: int
    #: Executions of keyed requests: one per key, plus one per follow-up that found nothing.
    executions: int
    #: Prompt asks, and the model calls their cache misses made.
    asks: int
    model_calls: int

    @property
    def history_share(self) -> float:
        return self.history_found / self.followups if self.followups else math.nan

    @property
    def executions_per_key(self) -> float:
        return self.executions / self.keys if self.keys else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {
            "placement": self.placement,
            "admitted_per_user": self.admitted_per_user,
            "limit_ratio": self.limit_ratio,
            "keys": self.keys,
            "followups": self.followups,
            "history_found": self.history_found,
            "history_share": _num(self.history_share),
            "second_executions": self.executions - self.keys,
            "executions_per_key": _num(self.executions_per_key),
            "asks": self.asks,
            "model_calls": self.model_calls,
        }


def _num(value: float) -> float | None:
    return None if math.isnan(value) else value


@dataclass(frozen=True, slots=True)
class _Chat:
    user: int
    keyed: bool
    delays: tuple[float, ...]


def _workload(options: PlacementOptions, seed: int) -> list[tuple[float, int, int, Any]]:
    """The chat requests and prompt asks as ``(time, seq, kind, payload)``, in time order."""
    rng = random.Random(f"tidegate-lab/placement/{seed}/workload")
    window, delay = options.window_s, options.followup_delay_s
    events: list[tuple[float, int, Any]] = []
    for user in range(options.users):
        for _ in range(options.requests_per_user):
            at = rng.random() * window
            keyed = rng.random() < options.followup_share
            delays = tuple(delay * (0.5 + rng.random()) for _ in range(options.followups))
            events.append((at, _CHAT, _Chat(user, keyed, delays)))
    for prompt in range(options.prompts):
        for _ in range(options.repeats):
            events.append((rng.random() * window, _PROMPT, prompt))
    events.sort(key=lambda event: event[0])
    return [(at, seq, kind, payload) for seq, (at, kind, payload) in enumerate(events)]


class _Run:
    """One placement over one workload; the event loop of :meth:`run` awaits the stores."""

    def __init__(self, options: PlacementOptions, placement: str, seed: int) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r}; choose from {PLACEMENTS}")
        self.options = options
        self.placement = placement
        self.clock = ManualClock()
        self.bucket = options.bucket
        self.heap = _workload(options, seed)  # sorted, so already a heap
        self.seq = len(self.heap)
        self.next_worker = 0
        self.admitted = [0] * options.users
        self.keys = self.followups = self.found = self.executions = 0
        self.asks = self.calls = 0

    async def open(self) -> list[Stores]:
        if self.placement == "shared":
            one = await store_from_url("memory://", clock=self.clock)
            return [one] * self.options.workers
        return [
            await store_from_url("memory://", clock=self.clock) for _ in range(self.options.workers)
        ]

    def dispatch(self) -> int:
        """Round-robin: the next worker, whatever the request."""
        worker = self.next_worker
        self.next_worker = (worker + 1) % self.options.workers
        return worker

    async def run(self) -> PlacementResult:
        workers = await self.open()
        heap = self.heap
        while heap:
            at, _, kind, payload = heapq.heappop(heap)
            self.clock.set(at)
            stores = workers[self.dispatch()]
            if kind == _CHAT:
                await self.chat(stores, payload, at)
            elif kind == _FOLLOWUP:
                await self.followup(stores, payload)
            else:
                await self.prompt(stores, payload)
        for stores in {id(s): s for s in workers}.values():
            await stores.aclose()
        return self.result()

    async def chat(self, stores: Stores, chat: _Chat, at: float) -> None:
        taken = await stores.buckets.take(f"user:{chat.user}", self.bucket)
        if not taken.allowed:
            return
        self.admitted[chat.user] += 1
        if not chat.keyed:
            return
        key = f"key:{self.keys}"
        self.keys += 1
        await self.execute(stores, key)
        when = at
        for delay in chat.delays:
            when += delay
            self.seq += 1
            heapq.heappush(self.heap, (when, self.seq, _FOLLOWUP, key))

    async def execute(self, stores: Stores, key: str) -> bool:
        """Claim ``key`` and, if this worker has no history of it, execute and complete it;
        True when the claim found a stored answer (a replay)."""
        claim = await stores.idempotency.claim(key, "same-body", lease_s=_LEASE_S)
        if claim.outcome is ClaimOutcome.REPLAY:
            return True
        if claim.outcome is not ClaimOutcome.CLAIMED:  # pragma: no cover - answers are instant
            raise RuntimeError(f"unexpected claim outcome {claim.outcome}")
        self.executions += 1
        await stores.idempotency.complete(key, claim.token, _ANSWER, ttl_s=_KEEP_S)
        return False

    async def followup(self, stores: Stores, key: str) -> None:
        self.followups += 1
        if await self.execute(stores, key):
            self.found += 1

    async def prompt(self, stores: Stores, prompt: int) -> None:
        self.asks += 1
        key = f"prompt:{prompt}"
        if await stores.cache.get(key) is not None:
            return
        self.calls += 1
        await stores.cache.put(key, b"model answer", ttl_s=self.options.cache_ttl_s)

    def result(self) -> PlacementResult:
        users = self.options.users
        admitted = math.fsum(self.admitted) / users
        return PlacementResult(
            placement=self.placement,
            admitted_per_user=admitted,
            limit_ratio=admitted / self.options.limit,
            keys=self.keys,
            followups=self.followups,
            history_found=self.found,
            executions=self.executions,
            asks=self.asks,
            model_calls=self.calls,
        )


def run_placement(
    options: PlacementOptions | None = None, *, placement: str, seed: int = 0
) -> PlacementResult:
    """One run of one placement (``per_process`` or ``shared``) on the workload of ``seed``."""
    run = _Run(options if options is not None else PlacementOptions(), placement, seed)
    return asyncio.run(run.run())


def placement_theory(options: PlacementOptions | None = None) -> dict[str, dict[str, float]]:
    """What each placement should give if round-robin spread each user's, key's and prompt's
    requests over the workers independently and uniformly (the chat demand per worker above
    the limit): the limit multiplied by ``N``, follow-ups that find their history ``1/N``
    (more with several follow-ups), executions per key the expected distinct workers among
    ``1 + followups`` sends, and model calls the expected distinct workers among ``K`` asks
    times ``P`` (at most ``min(N, K) x P``)."""
    o = options if options is not None else PlacementOptions()
    n = o.workers
    miss = 1.0 - 1.0 / n
    offered = o.requests_per_user / o.limit
    history = math.fsum(1.0 - miss**j for j in range(1, o.followups + 1)) / o.followups
    return {
        "per_process": {
            "limit_ratio": min(float(n), offered),
            "history_share": history,
            "executions_per_key": n * (1.0 - miss ** (1 + o.followups)),
            "model_calls": o.prompts * n * (1.0 - miss**o.repeats),
            "model_calls_bound": float(min(n, o.repeats) * o.prompts),
        },
        "shared": {
            "limit_ratio": min(1.0, offered),
            "history_share": 1.0,
            "executions_per_key": 1.0,
            "model_calls": float(o.prompts),
            "model_calls_bound": float(o.prompts),
        },
    }


def _placement_replication(options: PlacementOptions, seed: int) -> dict[str, dict[str, Any]]:
    figures = {}
    for placement in PLACEMENTS:
        one = run_placement(options, placement=placement, seed=seed).as_dict()
        del one["placement"]
        figures[placement] = one
    return figures


def placement_summary(
    options: PlacementOptions | None = None,
    *,
    seed: int = 0,
    replications: int = 10,
    jobs: int = 1,
    progress: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Both placements over independent replications (both on the same workload in each):
    per placement, each figure a mean with its 95% interval."""
    summary, _ = replicate(
        _placement_replication,
        options if options is not None else PlacementOptions(),
        seed=seed,
        replications=replications,
        workers=jobs,
        progress=progress,
    )
    result: dict[str, dict[str, Any]] = summary
    return result
