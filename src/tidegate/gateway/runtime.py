"""Everything one gateway process holds, built once from the config: the wiring, not the logic.

The request logic lives in :mod:`tidegate.gateway.pipeline`; every decision in it is made by an
object from :mod:`tidegate.policy`. :func:`build_runtime` puts one process together from the
parts :mod:`tidegate.gateway.build` makes from the config (the routes come from
:mod:`tidegate.gateway.routes`, the shared flags' reload from :mod:`tidegate.gateway.flags`).
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import aiohttp
import structlog

from tidegate.catalogue.tokens import InputCounter, PromptCounter
from tidegate.clock import Clock, SystemClock
from tidegate.errors import ConfigError, DeadlineExceeded, ProviderError, StoreError
from tidegate.gateway.approval import log_fallback_overrides, may_fall_back
from tidegate.gateway.auth import AdminKeys, Identity, KeyRing
from tidegate.gateway.build import (
    admin_keys_from,
    admission_options_from,
    breaker_events,
    breakers_for,
    bucket_options,
    budget_options_from,
    canaries_from,
    check_config_against_policies,
    corpus_from,
    flag_specs,
    fleet_flight_from,
    fleet_retry_budget_from,
    keys_from,
    open_stores,
    output_filter_from,
    providers_from,
    retry_budget_from,
    retry_policy_from,
    slow_start_from,
    upstream_session,
    with_leases,
)
from tidegate.gateway.canary import Canary, canary_flag_specs
from tidegate.gateway.config import Config, Price, ProviderConfig
from tidegate.gateway.degraded import Corpus
from tidegate.gateway.flags import refresh_flags
from tidegate.gateway.keys import sync_keys
from tidegate.gateway.ledger import LedgerOff, LedgerWriter, ledger_from
from tidegate.gateway.metrics import Metrics
from tidegate.gateway.pricing import (
    effective_prices,
    input_counters,
    prompt_counters,
    warn_unpriced,
)
from tidegate.gateway.redaction import OutputFilter
from tidegate.gateway.routes import Route, routes_from, version_routes_from
from tidegate.gateway.timing import warn_timeouts
from tidegate.gateway.tracing import Tracing, attempt_event
from tidegate.gateway.upstreams import expand_providers, upstream_configs
from tidegate.policy.admission import AdmissionController, Ticket, TicketState
from tidegate.policy.attempts import AttemptEvent, AttemptPolicy, RetryPlanned, RetryRefused
from tidegate.policy.breaker import BreakerState, CircuitBreaker
from tidegate.policy.budget import BudgetOptions
from tidegate.policy.deadline import Deadline
from tidegate.policy.flags import FlagSet
from tidegate.policy.headroom import HeadroomBook
from tidegate.policy.ratelimit import BucketOptions, TakeResult, TokenBucket
from tidegate.policy.retry import RetryBudget, RetryOptions
from tidegate.policy.routing import FailoverOptions, retry_same
from tidegate.policy.slowstart import SlowStart
from tidegate.providers.base import Provider
from tidegate.providers.transport import ReportsHeadroom
from tidegate.state.leases import LeasedBuckets, LeasedQuotas
from tidegate.state.url import Stores
from tidegate.state.verdicts import read_latest_verdicts, verdict_store_for

if TYPE_CHECKING:
    from tidegate.state.redis import RedisRetryBudgetCounter, RedisSingleFlight

__all__ = [
    "AdmissionGate",
    "Flight",
    "Overrides",
    "Route",
    "Runtime",
    "build_runtime",
    "close_runtime",
    "expire_leases",
    "refresh_flags",
    "refresh_verdicts",
]

#: What a single-flight leader hands its followers: body, served_by, served model, usage.
Flight = tuple[bytes, str, str, dict[str, int]]

log = structlog.get_logger("tidegate")

BREAKER_STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class AdmissionGate:
    """The admission controller, awaited: a waiting ticket is a future resolved when it starts."""

    def __init__(self, controller: AdmissionController, metrics: Metrics) -> None:
        self.controller = controller
        self._metrics = metrics
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}

    def offer(self, *, request_id: str, klass: str, tenant: str, deadline: Deadline) -> Ticket:
        """A ticket, started or waiting (then :meth:`wait` for it), or a typed refusal at once."""
        return self.controller.offer(
            request_id=request_id, klass=klass, tenant=tenant, deadline_at=deadline.at
        )

    async def wait(self, ticket: Ticket, deadline: Deadline) -> None:
        """Until the waiting ``ticket`` starts; ``DeadlineExceeded`` if the deadline comes first."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = waiter
        self._pump()
        try:
            async with asyncio.timeout(deadline.remaining()):
                await waiter
        except TimeoutError:
            self._abandon(ticket)
            raise DeadlineExceeded(
                "the request's deadline passed while it waited for a slot", policy="admission"
            ) from None
        except BaseException:
            self._abandon(ticket)
            raise

    def exit(self, ticket: Ticket, *, completed: bool) -> None:
        """Free the ticket's slot (recording its service time when it completed) and start more."""
        if completed and ticket.state is TicketState.STARTED:
            self.controller.finish(ticket)
        else:
            self.controller.cancel(ticket)
        # Every waiting ticket has a waiter here, so with none start() has nothing to start
        # (cancelled heap entries it would drop are dropped by a later start()).
        if self._waiters:
            self._pump()

    def _abandon(self, ticket: Ticket) -> None:
        self._waiters.pop(ticket, None)
        self.controller.cancel(ticket)
        self._pump()

    def _pump(self) -> None:
        while (ticket := self.controller.start()) is not None:
            waiter = self._waiters.pop(ticket, None)
            if waiter is None or waiter.done():
                self.controller.cancel(ticket)
                continue
            waiter.set_result(None)

    def refresh_metrics(self) -> None:
        """Queue depths into the gauges: done when /metrics is scraped, not on every request."""
        for klass in self.controller.options.classes:
            self._metrics.queue_depth.labels(klass).set(self.controller.depth(klass))


@dataclass
class Runtime:
    """The per-process objects the pipeline drives."""

    config: Config
    config_path: Path
    clock: Clock
    rng: random.Random
    metrics: Metrics
    keys: KeyRing
    stores: Stores
    providers: dict[str, Provider]
    provider_configs: dict[str, ProviderConfig]
    breakers: dict[str, CircuitBreaker]
    routes: dict[str, Route]
    retry_policy: RetryOptions
    retry_budget: RetryBudget
    failover: FailoverOptions
    admission: AdmissionGate
    flags: FlagSet
    user_bucket: BucketOptions | None
    tenant_bucket: BucketOptions | None
    budget: BudgetOptions | None
    prices: dict[str, Price]
    output_filter: OutputFilter = field(default_factory=OutputFilter)
    admin_keys: AdminKeys | None = None
    fleet_flight: RedisSingleFlight | None = None
    fleet_retry_budget: RedisRetryBudgetCounter | None = None
    tracing: Tracing = field(default_factory=Tracing)
    #: The spend ledger's writer (:mod:`tidegate.gateway.ledger`).
    ledger: LedgerWriter | LedgerOff = field(default_factory=LedgerOff)
    #: Canary rollouts by route alias, and the routes of versions with their own providers.
    canaries: dict[str, Canary] = field(default_factory=dict)
    version_routes: dict[tuple[str, str], Route] = field(default_factory=dict)
    #: Routes of models a wildcard alias passes through to a ``"*"`` provider, made on first use
    #: (:mod:`tidegate.gateway.passthrough`).
    passthrough: dict[str, Route] = field(default_factory=dict)
    #: Providers whose latest eval-gate verdict is ``block``: never an automatic fallback.
    blocked: frozenset[str] = frozenset()
    #: Each provider's latest eval-gate verdict (``go``, ``review``, ``block``); a provider not
    #: in it has none. Reloaded with ``blocked``.
    verdicts: Mapping[str, str] = field(default_factory=dict)
    corpus: Corpus | None = None
    sleep: Callable[[float], Awaitable[None]] = SystemClock().asleep
    session: aiohttp.ClientSession | None = None
    flights: dict[str, asyncio.Future[Flight]] = field(default_factory=dict)
    git_sha: str = "unknown"
    local_buckets: dict[BucketOptions, TokenBucket] = field(default_factory=dict)
    in_flight: int = 0
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _approved_memo: tuple[frozenset[str], Mapping[str, str], frozenset[str]] | None = field(
        default=None, repr=False
    )
    #: Each provider's model id, and each model's prices per 1k tokens (input, output): the
    #: lookups by name the request path makes, built once from the config.
    model_ids: dict[str, str] = field(init=False, repr=False)
    prices_per_1k: dict[str, tuple[float, float]] = field(init=False, repr=False)
    #: Each provider's counters of a prompt's tokens before the provider says (its model's
    #: encoding for OpenAI's models, the four-characters estimate for the rest), chosen once.
    prompt_counters: dict[str, PromptCounter] = field(init=False, repr=False)
    input_counters: dict[str, InputCounter] = field(init=False, repr=False)
    #: The providers ramping back after their breaker closed (``breaker.slow_start_s``).
    slow_start: SlowStart | None = None
    #: What each provider last reported of its rate limits (``headroom``), told by the
    #: providers whose APIs report it.
    headroom: HeadroomBook = field(init=False, repr=False)
    #: What a chat reservation reads of its primary, in one lookup: the prompt counter and the
    #: model's prices per 1k tokens (input, output; 0 when it has none).
    reserve_meters: dict[str, tuple[PromptCounter, float, float]] = field(init=False, repr=False)
    #: The routing rule the retry planner asks: ``retry_same`` with :attr:`failover`.
    retry_on: Callable[[ProviderError], bool] = field(init=False, repr=False)
    #: How a model call combines retries, breakers, the retry budget and failover: every call
    #: (JSON, stream, rescue, embeddings) starts its attempts here.
    attempts: AttemptPolicy = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.retry_on = functools.partial(retry_same, options=self.failover)
        self.model_ids = {name: cfg.model for name, cfg in self.provider_configs.items()}
        self.prices_per_1k = {
            model: (price.input_per_1k, price.output_per_1k) for model, price in self.prices.items()
        }
        self.prompt_counters = prompt_counters(self.provider_configs)
        self.input_counters = input_counters(self.provider_configs)
        self.reserve_meters = {
            name: (self.prompt_counters[name], *self.prices_per_1k.get(model, (0.0, 0.0)))
            for name, model in self.model_ids.items()
        }
        self.attempts = AttemptPolicy(
            self.retry_policy,
            breakers=self.breakers,
            rng=self.rng,
            budget=self.retry_budget,
            retry_on=self.retry_on,
            on_event=self.tracing.recording(_count_attempt_events(self.metrics), attempt_event),
        )
        watched = self.config.headroom
        self.headroom = HeadroomBook(
            self.clock,
            low_fraction=watched.low_fraction,
            horizon_s=watched.horizon_s,
            prefer_others=watched.prefer_others,
        )
        for provider in self.providers.values():
            if isinstance(provider, ReportsHeadroom):
                # Under the upstream's own name: the names a route reaches it by share its limits.
                provider.headers_seen = self.headroom.watcher(
                    provider.name, provider.headroom_dialect
                )

    def approved_fallbacks(self) -> frozenset[str]:
        """Providers that automatic failover may use: a latest eval verdict of ``go`` or
        ``review``, or an operator's override in the config; never one the eval gate blocks or
        one set to ``approved_fallback: false`` (:func:`may_fall_back`).

        Worked out again only when ``blocked`` or ``verdicts`` (reloaded every few seconds) is
        another object: the provider configs are fixed for the runtime's life.
        """
        blocked, verdicts = self.blocked, self.verdicts
        memo = self._approved_memo
        if memo is None or memo[0] is not blocked or memo[1] is not verdicts:
            approved = {
                n
                for n, cfg in self.provider_configs.items()
                if n not in blocked and may_fall_back(cfg, verdicts.get(n))
            }
            memo = self._approved_memo = (blocked, verdicts, frozenset(approved))
        return memo[2]

    def forget_approved(self) -> None:
        """Work the approved fallbacks out again (an upstream was added)."""
        self._approved_memo = None

    def ready_problems(self) -> list[str]:
        problems = [] if self.providers else ["no providers configured"]
        if self.config.degraded.corpus_dir is not None and (
            self.corpus is None or not len(self.corpus)
        ):
            problems.append("the degraded-mode corpus is configured but empty")
        return problems

    def refresh_gauges(self) -> None:
        """The gauges that are read from the policies (and the request count) at scrape time."""
        self.metrics.in_flight.set(self.in_flight)
        self.refresh_breaker_metrics()
        self.refresh_headroom_metrics()
        self.admission.refresh_metrics()

    def refresh_headroom_metrics(self) -> None:
        for name, found in self.headroom.reported().items():
            for allowance in found.allowances:
                self.metrics.headroom_remaining.labels(name, allowance.resource).set(
                    allowance.remaining
                )

    def refresh_breaker_metrics(self) -> None:
        for name, breaker in self.breakers.items():
            self.metrics.breaker_state.labels(name).set(BREAKER_STATE_VALUE[breaker.state])

    async def take_local(self, key: str, options: BucketOptions) -> TakeResult:
        """The fail-open path of a rate limit: a bucket in this process only."""
        bucket = self.local_buckets.get(options)
        if bucket is None:
            bucket = self.local_buckets[options] = TokenBucket(options, self.clock)
        return bucket.take(key)

    async def take_failing_open(
        self, key: str, options: BucketOptions, exc: StoreError
    ) -> TakeResult:
        """The take the bucket store could not make (``exc``), counted, logged and made in
        this process instead: a rate limit fails open."""
        self.metrics.store_errors.labels("buckets", "fail_open").inc()
        log.warning("store_unavailable", store="buckets", action="fail_open", error=str(exc))
        return await self.take_local(key, options)

    def identity_class(self, identity: Identity, requested: str | None) -> str:
        """The admission class: the key's, lowered (never raised) by an ``X-Tidegate-Priority``."""
        if requested is None:  # the usual case: the key's own class
            return identity.priority
        classes = self.config.admission.classes
        own = classes.index(identity.priority)
        if requested in classes and classes.index(requested) > own:
            return requested
        return identity.priority


class Overrides(TypedDict, total=False):
    """What :func:`build_runtime` takes besides the config: the image's git sha (``/version``
    answers it), and the parts tests and tools bring instead of those the config would make: a
    manual clock and its sleep, a seeded rng, stores, fake providers or the session for real
    ones, a tracer provider that keeps its spans."""

    clock: Clock
    sleep: Callable[[float], Awaitable[None]]
    rng: random.Random
    stores: Stores
    providers: dict[str, Provider]
    session: aiohttp.ClientSession
    git_sha: str
    tracer_provider: Any


async def build_runtime(
    config: Config, config_path: Path, **overrides: Unpack[Overrides]
) -> Runtime:
    """Construct one process's runtime, each part by its builder in :mod:`.build`.

    The policies' options, the flags, the canaries, the output filter and the keys are checked
    before the stores are opened (the corpus and the admin keys are read after them). The
    shared flags and the eval-gate verdicts are loaded before it returns.
    """
    check_config_against_policies(config)
    warn_unpriced(config)
    warn_timeouts(config)
    log_fallback_overrides(config.providers)
    # Validate what can fail cheaply before opening anything.
    tracing = Tracing.from_config(config.tracing, provider=overrides.get("tracer_provider"))
    specs = flag_specs(config) + canary_flag_specs(config)
    canaries = canaries_from(config)
    output_filter = output_filter_from(config)
    system = SystemClock()
    clock = overrides.get("clock") or system
    rng = overrides.get("rng") or random.Random()
    keys = keys_from(config, config_path)
    stores = overrides.get("stores")
    if stores is None:
        stores = await open_stores(config, clock)
    with_leases(stores, config, clock)
    session, providers = overrides.get("session"), overrides.get("providers")
    if providers is None:
        if session is None:
            session = upstream_session(tracing)
        providers = providers_from(config, config_path, session, system)
    upstreams = upstream_configs(config)
    providers = expand_providers(providers, upstreams)
    metrics = Metrics()
    slow_start = slow_start_from(config, clock, rng)
    runtime = Runtime(
        config=config,
        config_path=config_path,
        clock=clock,
        rng=rng,
        metrics=metrics,
        keys=keys,
        stores=stores,
        providers=providers,
        provider_configs=upstreams,
        breakers=breakers_for(
            providers, config, clock, rng, breaker_events(metrics, tracing, slow_start)
        ),
        slow_start=slow_start,
        routes=routes_from(config),
        version_routes=version_routes_from(config),
        corpus=corpus_from(config, config_path),
        retry_policy=retry_policy_from(config),
        retry_budget=retry_budget_from(config, clock),
        failover=FailoverOptions(retry_timeouts=config.retry.retry_timeouts_on_same_provider),
        admission=AdmissionGate(
            AdmissionController(admission_options_from(config), clock), metrics
        ),
        flags=FlagSet(specs, clock),
        user_bucket=bucket_options(config.rate_limits.per_user),
        tenant_bucket=bucket_options(config.rate_limits.per_tenant),
        budget=budget_options_from(config),
        prices=effective_prices(config),
        output_filter=output_filter,
        canaries=canaries,
        tracing=tracing,
        sleep=overrides.get("sleep", getattr(clock, "asleep", system.asleep)),
        session=session,
        git_sha=overrides.get("git_sha", "unknown"),
        fleet_retry_budget=fleet_retry_budget_from(stores, config),
        fleet_flight=fleet_flight_from(stores, config),
        admin_keys=admin_keys_from(config, config_path),
    )
    runtime.ledger = ledger_from(stores.ledger, config.ledger, clock, runtime.sleep, metrics)
    await refresh_flags(runtime)
    await sync_keys(runtime, changed=True)  # the store's virtual keys join the file's
    refresh_verdicts(runtime)
    runtime.refresh_breaker_metrics()
    return runtime


async def expire_leases(runtime: Runtime, *, flush: bool = False) -> None:
    """Tell the store what the leases whose time is up used, and give back what they hold
    unused (with ``flush``, every lease): budget leases settle, token leases return tokens."""
    for store, leased in (
        ("quotas", runtime.stores.quotas),
        ("buckets", runtime.stores.buckets),
    ):
        if not isinstance(leased, LeasedQuotas | LeasedBuckets):
            continue
        try:
            await (leased.flush() if flush else leased.expire())
        except StoreError as exc:  # the leases stay taken in the store: it errs toward refusing
            runtime.metrics.store_errors.labels(store, "settle_lost").inc()
            log.warning("lease_settle_failed", store=store, error=str(exc))


def _count_attempt_events(metrics: Metrics) -> Callable[[AttemptEvent], None]:
    """Count the attempts policy's retries, refused retries and failovers."""

    def on_event(event: AttemptEvent) -> None:
        if isinstance(event, RetryPlanned):
            metrics.retries.labels(event.provider).inc()
        elif isinstance(event, RetryRefused):
            metrics.retry_budget_denials.inc()
        else:
            metrics.failovers.labels(event.from_provider, event.kind.value).inc()

    return on_event


def refresh_verdicts(runtime: Runtime) -> None:
    """Reload the eval-gate verdicts (written by ``tidegate eval``); keep the last on failure."""
    store = verdict_store_for(runtime.config.state.url, runtime.config_path.parent)
    try:
        latest = read_latest_verdicts(store)
    except (ConfigError, StoreError) as exc:
        log.warning("verdicts_unreadable", store=store, error=str(exc))
        return
    runtime.verdicts = latest
    runtime.blocked = frozenset(t for t, v in latest.items() if v == "block")


async def close_runtime(runtime: Runtime) -> None:
    await runtime.ledger.close()  # the rows still buffered, before the stores close
    await runtime.tracing.aclose()  # its last spans exported, off the event loop
    if runtime.corpus is not None:
        runtime.corpus.close()
    for provider in runtime.providers.values():
        await provider.aclose()
    if runtime.session is not None:
        await runtime.session.close()
    await expire_leases(runtime, flush=True)
    await runtime.stores.aclose()
