"""Everything one gateway process holds, built once from the config: the wiring, not the logic.

The request logic lives in :mod:`tidegate.gateway.pipeline`; every decision in it is made by an
object from :mod:`tidegate.policy` that this module constructs from the config.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog

from tidegate.clock import Clock, SystemClock
from tidegate.errors import ConfigError, DeadlineExceeded, ProviderError, StoreError
from tidegate.gateway.auth import AdminKeys, Identity, KeyRing
from tidegate.gateway.canary import Canary, canary_flag_specs
from tidegate.gateway.config import Config, Price, ProviderConfig, resolve
from tidegate.gateway.degraded import Corpus
from tidegate.gateway.flags import refresh_flags
from tidegate.gateway.metrics import Metrics
from tidegate.gateway.redaction import OutputFilter
from tidegate.gateway.tracing import Tracing
from tidegate.policy.admission import AdmissionController, AdmissionOptions, Ticket, TicketState
from tidegate.policy.breaker import (
    BreakerEvent,
    BreakerOptions,
    BreakerState,
    CircuitBreaker,
    CircuitClosed,
    CircuitHalfOpened,
    CircuitOpened,
)
from tidegate.policy.budget import BudgetOptions, Quota
from tidegate.policy.deadline import Deadline
from tidegate.policy.flags import FlagSet, FlagSpec
from tidegate.policy.ratelimit import BucketOptions, TakeResult, TokenBucket
from tidegate.policy.retry import Jitter, RetryBudget, RetryOptions
from tidegate.policy.routing import FailoverOptions, ProviderSpec, RoutePlan, retry_same
from tidegate.providers.base import Provider
from tidegate.state.leases import LeasedBuckets, LeasedQuotas
from tidegate.state.url import Stores, store_from_urls
from tidegate.state.verdicts import read_latest_verdicts, verdict_store_for

if TYPE_CHECKING:
    from tidegate.state.redis import RedisRetryBudgetCounter, RedisSingleFlight

__all__ = ["AdmissionGate", "Flight", "Route", "Runtime", "build_provider", "refresh_flags"]

#: What a single-flight leader hands its followers: body, served_by, served model, usage.
Flight = tuple[bytes, str, str, dict[str, int]]

log = structlog.get_logger("tidegate")

BREAKER_STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


@dataclass(frozen=True)
class Route:
    alias: str
    specs: tuple[ProviderSpec, ...]
    per_try_timeout_s: float


class AdmissionGate:
    """The admission controller, awaited: a waiting ticket is a future resolved when it starts."""

    def __init__(self, controller: AdmissionController, metrics: Metrics) -> None:
        self.controller = controller
        self._metrics = metrics
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}

    async def enter(
        self, *, request_id: str, klass: str, tenant: str, deadline: Deadline
    ) -> Ticket:
        """A started ticket, or a typed refusal at once, or ``DeadlineExceeded`` while waiting."""
        ticket = self.controller.offer(
            request_id=request_id, klass=klass, tenant=tenant, deadline_at=deadline.at
        )
        if ticket.state is TicketState.STARTED:
            return ticket
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
        return ticket

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


def build_provider(
    name: str,
    cfg: ProviderConfig,
    *,
    session: aiohttp.ClientSession,
    config_path: Path,
    clock: SystemClock,
) -> Provider:
    """One provider instance from its config section."""
    api_key = None
    if cfg.api_key_file is not None:
        path = resolve(config_path, cfg.api_key_file)
        try:
            api_key = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(
                f"providers.{name}.api_key_file: cannot read {str(path)!r} ({exc.strerror})"
            ) from None
    if cfg.type == "openai":
        from tidegate.providers.openai import OpenAIProvider

        assert cfg.base_url is not None
        return OpenAIProvider(name, cfg.base_url, api_key, session)
    if cfg.type == "anthropic":
        from tidegate.providers.anthropic import AnthropicProvider

        assert cfg.base_url is not None
        return AnthropicProvider(name, cfg.base_url, api_key, session)
    from tidegate.providers.fake import FakeProvider

    return FakeProvider.from_script(cfg.fake or {}, name=name, sleep=clock.asleep, clock=clock)


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
    #: Canary rollouts by route alias, and the routes of versions with their own providers.
    canaries: dict[str, Canary] = field(default_factory=dict)
    version_routes: dict[tuple[str, str], Route] = field(default_factory=dict)
    #: Providers whose latest eval-gate verdict is ``block``: never an automatic fallback.
    blocked: frozenset[str] = frozenset()
    corpus: Corpus | None = None
    sleep: Callable[[float], Awaitable[None]] = SystemClock().asleep
    session: aiohttp.ClientSession | None = None
    flights: dict[str, asyncio.Future[Flight]] = field(default_factory=dict)
    git_sha: str = "unknown"
    local_buckets: dict[BucketOptions, TokenBucket] = field(default_factory=dict)
    in_flight: int = 0
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _approved_memo: tuple[frozenset[str], frozenset[str]] | None = field(default=None, repr=False)
    #: Route plans by what decides them (see ``pipeline.plan_for``).
    plans: dict[tuple[Any, ...], tuple[Route, RoutePlan]] = field(default_factory=dict, repr=False)
    #: Config values the request path reads, resolved once at start-up (reading a pydantic
    #: model's attribute costs several times a plain object's): the body limit, the request
    #: timeout, whether the response cache is on, each provider's model id, each model's
    #: prices per 1k tokens (input, output) and the budgets' default ``max_tokens``.
    max_body_bytes: int = field(init=False, repr=False)
    request_timeout_s: float = field(init=False, repr=False)
    cache_enabled: bool = field(init=False, repr=False)
    model_ids: dict[str, str] = field(init=False, repr=False)
    prices_per_1k: dict[str, tuple[float, float]] = field(init=False, repr=False)
    default_max_tokens: int = field(init=False, repr=False)
    #: No keys file is configured (dev): a request without keys is anonymous while no key exists.
    no_keys_file: bool = field(init=False, repr=False)
    #: The routing rule the retry planner asks: ``retry_same`` with :attr:`failover`.
    retry_on: Callable[[ProviderError], bool] = field(init=False, repr=False)
    #: Per-provider handlers of the retry planner's events (see ``pipeline._failover``).
    retry_events: dict[str, Callable[[Any], None]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        config = self.config
        self.max_body_bytes = config.server.max_body_bytes
        self.request_timeout_s = config.server.request_timeout_s
        self.cache_enabled = config.cache.enabled
        self.no_keys_file = config.auth.keys_file is None
        self.retry_on = functools.partial(retry_same, options=self.failover)
        self.model_ids = {name: cfg.model for name, cfg in self.provider_configs.items()}
        self.prices_per_1k = {
            model: (price.input_per_1k, price.output_per_1k) for model, price in self.prices.items()
        }
        budgets = config.budgets
        self.default_max_tokens = budgets.default_max_tokens if budgets is not None else 0

    def approved_fallbacks(self) -> frozenset[str]:
        """Providers approved as automatic fallbacks, less those the eval gate blocks.

        Worked out again only when ``blocked`` (reloaded every few seconds) is another set: the
        provider configs are fixed for the runtime's life.
        """
        blocked = self.blocked
        memo = self._approved_memo
        if memo is None or memo[0] is not blocked:
            approved = {
                n
                for n, cfg in self.provider_configs.items()
                if cfg.approved_fallback and n not in blocked
            }
            memo = self._approved_memo = (blocked, frozenset(approved))
        return memo[1]

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
        self.admission.refresh_metrics()

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


def retry_policy_from(config: Config) -> RetryOptions:
    r = config.retry
    return RetryOptions(
        attempts=r.attempts, base=r.base_s, factor=r.factor, cap=r.cap_s, jitter=Jitter(r.jitter)
    )


def admission_options_from(config: Config) -> AdmissionOptions:
    a = config.admission
    return AdmissionOptions(
        classes=a.classes,
        slots=a.slots,
        queue_cap=a.queue_cap,
        tenant_max_in_flight=a.tenant_max_in_flight,
        tenant_max_waiting=a.tenant_max_waiting,
        mode=a.mode,
        service_rate=a.service_rate,
        dequeue=a.dequeue,
        weights=a.weights,
        priority_at_admission=a.priority_at_admission,
        conditional_priority=a.conditional_priority,
        initial_service_time=a.initial_service_time_s,
        drop_expired_at_dequeue=a.drop_expired_at_dequeue,
    )


def breaker_options_from(config: Config) -> BreakerOptions:
    b = config.breaker
    return BreakerOptions(
        consecutive_failures=b.consecutive_failures,
        failure_rate=b.failure_rate,
        window=b.window_s,
        minimum_calls=b.minimum_calls,
        recovery=b.recovery_s,
        recovery_jitter=b.recovery_jitter,
    )


def budget_options_from(config: Config) -> BudgetOptions | None:
    b = config.budgets
    if b is None:
        return None
    return BudgetOptions(
        quota=Quota(calls=b.calls, tokens=b.tokens, cost=b.cost_usd), degrade_at=b.degrade_at
    )


def check_config_against_policies(config: Config) -> None:
    """Build every policy's options once so a bad combination refuses to start, naming it."""
    builders: list[tuple[str, Callable[[Config], object]]] = [
        ("retry", retry_policy_from),
        ("admission", admission_options_from),
        ("breaker", breaker_options_from),
        ("budgets", budget_options_from),
    ]
    for section, build in builders:
        try:
            build(config)
        except ValueError as exc:
            raise ConfigError(f"{section}: {exc}") from None


def _bucket(cfg: Any) -> BucketOptions | None:
    return None if cfg is None else BucketOptions(rate=cfg.rate_per_s, burst=cfg.burst)


async def build_runtime(
    config: Config,
    config_path: Path,
    *,
    clock: Clock | None = None,
    sleep: Callable[[float], Awaitable[None]] | None = None,
    rng: random.Random | None = None,
    stores: Stores | None = None,
    providers: dict[str, Provider] | None = None,
    session: aiohttp.ClientSession | None = None,
    git_sha: str = "unknown",
    tracer_provider: Any = None,
) -> Runtime:
    """Construct one process's runtime. Tests may pass their own clock, stores and providers."""
    check_config_against_policies(config)
    # Validate everything that can fail before opening anything.
    tracing = Tracing.from_config(config.tracing, provider=tracer_provider)
    specs = flag_specs(config) + canary_flag_specs(config)
    canaries = {
        alias: Canary.from_config(alias, route.canary)
        for alias, route in config.models.items()
        if route.canary is not None
    }
    try:
        output_filter = OutputFilter(config.output.deny_patterns, config.output.replacement)
    except ValueError as exc:
        raise ConfigError(f"output.deny_patterns: {exc}") from None
    system = SystemClock()
    clock = clock or system
    rng = rng or random.Random()
    config_dir = config_path
    keys = KeyRing({})
    if config.auth.keys_file is not None:
        keys = KeyRing.from_file(
            resolve(config_dir, config.auth.keys_file), classes=config.admission.classes
        )
    if stores is None:
        stores = await store_from_urls(
            durable=config.state.url,
            fast=config.state.fast_url,
            clock=clock,
            timeout_s=config.state.timeout_s,
        )
    leases = config.state.leases
    if leases.max_chunk > 1:
        max_chunk, hold_s, wait_s = leases.max_chunk, leases.hold_s, config.state.timeout_s
        stores.buckets = LeasedBuckets(
            stores.buckets, clock, max_chunk=max_chunk, hold_s=hold_s, wait_s=wait_s
        )
        stores.quotas = LeasedQuotas(
            stores.quotas, clock, max_chunk=max_chunk, hold_s=hold_s, wait_s=wait_s
        )
    if providers is None:
        if session is None:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                timeout=aiohttp.ClientTimeout(total=None),
            )
        providers = {
            name: build_provider(name, cfg, session=session, config_path=config_dir, clock=system)
            for name, cfg in config.providers.items()
        }
    breaker_options = breaker_options_from(config)
    metrics = Metrics()
    breakers = {
        name: CircuitBreaker(
            name, breaker_options, clock=clock, rng=rng, on_event=_count_transitions(metrics)
        )
        for name in providers
    }

    def route_of(alias: str, names: tuple[str, ...], per_try: float) -> Route:
        specs = tuple(
            ProviderSpec(
                name,
                frozenset(config.providers[name].data_classes),
                config.providers[name].context_window,
            )
            for name in names
        )
        return Route(alias, specs, per_try)

    routes = {
        alias: route_of(alias, route.providers, route.per_try_timeout_s)
        for alias, route in config.models.items()
    }
    version_routes = {
        (alias, name): route_of(alias, version.providers, route.per_try_timeout_s)
        for alias, route in config.models.items()
        if route.canary is not None
        for name, version in (
            ("baseline", route.canary.baseline),
            ("candidate", route.canary.candidate),
        )
        if version.providers
    }
    corpus = None
    degraded = config.degraded
    if degraded.corpus_dir is not None:
        corpus = Corpus.build(
            resolve(config_dir, degraded.corpus_dir),
            excerpt_chars=degraded.excerpt_chars,
            max_file_bytes=degraded.max_file_bytes,
        )
    runtime = Runtime(
        config=config,
        config_path=config_dir,
        clock=clock,
        rng=rng,
        metrics=metrics,
        keys=keys,
        stores=stores,
        providers=providers,
        provider_configs=dict(config.providers),
        breakers=breakers,
        routes=routes,
        retry_policy=retry_policy_from(config),
        retry_budget=RetryBudget(
            clock,
            ratio=config.retry.budget_ratio,
            min_retries_per_second=config.retry.budget_floor_per_s,
        ),
        failover=FailoverOptions(retry_timeouts=config.retry.retry_timeouts_on_same_provider),
        admission=AdmissionGate(
            AdmissionController(admission_options_from(config), clock), metrics
        ),
        flags=FlagSet(specs, clock),
        user_bucket=_bucket(config.rate_limits.per_user),
        tenant_bucket=_bucket(config.rate_limits.per_tenant),
        budget=budget_options_from(config),
        prices=dict(config.prices),
        output_filter=output_filter,
        corpus=corpus,
        canaries=canaries,
        version_routes=version_routes,
        tracing=tracing,
        sleep=sleep if sleep is not None else getattr(clock, "asleep", system.asleep),
        session=session,
        git_sha=git_sha,
    )
    if stores.redis is not None:
        from tidegate.state.redis import RedisRetryBudgetCounter, RedisSingleFlight

        # Retries across the fleet stay within one shared budget, beside each process's own.
        runtime.fleet_retry_budget = RedisRetryBudgetCounter(
            stores.redis,
            "gateway",
            ratio=config.retry.budget_ratio,
            min_retries_per_second=config.retry.budget_floor_per_s,
        )
        # Identical requests on different replicas share one upstream call, through Redis.
        runtime.fleet_flight = RedisSingleFlight(
            stores.redis,
            lease_s=config.server.request_timeout_s + 5.0,
            wait_s=config.server.request_timeout_s,
        )
    if config.auth.admin_keys_file is not None:
        runtime.admin_keys = AdminKeys.from_file(resolve(config_dir, config.auth.admin_keys_file))
    await refresh_flags(runtime)
    refresh_verdicts(runtime)
    runtime.refresh_breaker_metrics()
    return runtime


def flag_specs(config: Config) -> list[FlagSpec]:
    """The flags this deployment defines (``answer.mode`` is built in)."""
    types: dict[str, type[bool] | type[int] | type[float] | type[str]] = {
        "bool": bool,
        "int": int,
        "float": float,
        "str": str,
    }
    specs = []
    for flag in config.flags:
        try:
            specs.append(
                FlagSpec(
                    flag.name,
                    types[flag.type],
                    flag.default,
                    flag.description,
                    choices=None if flag.choices is None else frozenset(flag.choices),
                )
            )
        except ValueError as exc:
            raise ConfigError(f"flags.{flag.name}: {exc}") from None
    return specs


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


def _count_transitions(metrics: Metrics) -> Callable[[BreakerEvent], None]:
    """Count each breaker's state changes by the state it moved to."""
    moved = {CircuitOpened: "open", CircuitHalfOpened: "half_open", CircuitClosed: "closed"}

    def on_event(event: BreakerEvent) -> None:
        to = moved.get(type(event))
        if to is not None:
            metrics.breaker_transitions.labels(event.name, to).inc()

    return on_event


def refresh_verdicts(runtime: Runtime) -> None:
    """Reload the eval-gate verdicts (written by ``tidegate eval``); keep the last on failure."""
    store = verdict_store_for(runtime.config.state.url, runtime.config_path.parent)
    try:
        latest = read_latest_verdicts(store)
    except (ConfigError, StoreError) as exc:
        log.warning("verdicts_unreadable", store=store, error=str(exc))
        return
    runtime.blocked = frozenset(t for t, v in latest.items() if v == "block")


async def close_runtime(runtime: Runtime) -> None:
    runtime.tracing.shutdown()
    if runtime.corpus is not None:
        runtime.corpus.close()
    for provider in runtime.providers.values():
        await provider.aclose()
    if runtime.session is not None:
        await runtime.session.close()
    await expire_leases(runtime, flush=True)
    await runtime.stores.aclose()
