"""Each part of a gateway process's runtime, built from its section of the config.

:func:`tidegate.gateway.runtime.build_runtime` puts the parts together; each is made here by a
function of its own, so that a part can be built (and its config refused) without the rest:
the policies' options, the flag specs, the canaries, the output filter, the keys, the stores and
their leases, the providers and their pooled session, the breakers, the degraded-mode corpus and,
with Redis, the fleet's shared retry budget and single flight. A config the policies refuse stops
the process at start-up, naming its section (:func:`check_config_against_policies`).
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from tidegate.clock import Clock, SystemClock
from tidegate.errors import ConfigError
from tidegate.gateway.auth import AdminKeys, KeyRing
from tidegate.gateway.canary import Canary
from tidegate.gateway.config import Config, ProviderConfig, resolve
from tidegate.gateway.degraded import Corpus
from tidegate.gateway.metrics import Metrics
from tidegate.gateway.redaction import OutputFilter
from tidegate.gateway.tracing import Tracing, breaker_event
from tidegate.gateway.upstreams import needs_own_instance, upstream_configs
from tidegate.policy.admission import AdmissionOptions
from tidegate.policy.breaker import (
    BreakerEvent,
    BreakerOptions,
    CircuitBreaker,
    CircuitClosed,
    CircuitHalfOpened,
    CircuitOpened,
)
from tidegate.policy.budget import BudgetOptions, Quota
from tidegate.policy.flags import FlagSpec
from tidegate.policy.ratelimit import BucketOptions
from tidegate.policy.retry import Jitter, RetryBudget, RetryOptions
from tidegate.policy.slowstart import SlowStart, SlowStartOptions
from tidegate.providers.base import Provider
from tidegate.state.leases import LeasedBuckets, LeasedQuotas
from tidegate.state.url import Stores, store_from_urls

if TYPE_CHECKING:
    from tidegate.state.redis import RedisRetryBudgetCounter, RedisSingleFlight

__all__ = [
    "admin_keys_from",
    "admission_options_from",
    "breaker_events",
    "breaker_options_from",
    "breakers_for",
    "bucket_options",
    "budget_options_from",
    "build_provider",
    "canaries_from",
    "check_config_against_policies",
    "corpus_from",
    "flag_specs",
    "fleet_flight_from",
    "fleet_retry_budget_from",
    "keys_from",
    "open_stores",
    "output_filter_from",
    "providers_from",
    "retry_budget_from",
    "retry_policy_from",
    "slow_start_from",
    "upstream_session",
    "with_leases",
]

# --------------------------------------------------------------------------- the policies


def retry_policy_from(config: Config) -> RetryOptions:
    r = config.retry
    return RetryOptions(
        attempts=r.attempts, base=r.base_s, factor=r.factor, cap=r.cap_s, jitter=Jitter(r.jitter)
    )


def retry_budget_from(config: Config, clock: Clock) -> RetryBudget:
    """This process's retry budget (with Redis the fleet's is kept beside it)."""
    return RetryBudget(
        clock,
        ratio=config.retry.budget_ratio,
        min_retries_per_second=config.retry.budget_floor_per_s,
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


def slow_start_from(config: Config, clock: Clock, rng: random.Random) -> SlowStart | None:
    """The recovered providers' ramp (``breaker.slow_start_s``), or None when it is off."""
    window = config.breaker.slow_start_s
    return SlowStart(SlowStartOptions(window_s=window), clock, rng) if window > 0 else None


def budget_options_from(config: Config) -> BudgetOptions | None:
    b = config.budgets
    if b is None:
        return None
    return BudgetOptions(
        quota=Quota(calls=b.calls, tokens=b.tokens, cost=b.cost_usd), degrade_at=b.degrade_at
    )


def bucket_options(cfg: Any) -> BucketOptions | None:
    """A rate limit's bucket (``rate_limits.per_user`` or ``per_tenant``), if one is set."""
    return None if cfg is None else BucketOptions(rate=cfg.rate_per_s, burst=cfg.burst)


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


# --------------------------------------------------------------------------- flags and canaries


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


def canaries_from(config: Config) -> dict[str, Canary]:
    """A rollout for every route with a ``canary`` section, by alias."""
    return {
        alias: Canary.from_config(alias, route.canary)
        for alias, route in config.models.items()
        if route.canary is not None
    }


# --------------------------------------------------------------------------- what is read


def output_filter_from(config: Config) -> OutputFilter:
    try:
        return OutputFilter(config.output.deny_patterns, config.output.replacement)
    except ValueError as exc:
        raise ConfigError(f"output.deny_patterns: {exc}") from None


def keys_from(config: Config, config_path: Path) -> KeyRing:
    """The API keys of ``auth.keys_file``; none without one (dev)."""
    if config.auth.keys_file is None:
        return KeyRing({})
    return KeyRing.from_file(
        resolve(config_path, config.auth.keys_file), classes=config.admission.classes
    )


def admin_keys_from(config: Config, config_path: Path) -> AdminKeys | None:
    """The operators' keys of ``auth.admin_keys_file``; without one the admin API is off."""
    if config.auth.admin_keys_file is None:
        return None
    return AdminKeys.from_file(resolve(config_path, config.auth.admin_keys_file))


def corpus_from(config: Config, config_path: Path) -> Corpus | None:
    """The degraded-mode corpus of ``degraded.corpus_dir``, indexed now, if one is set."""
    degraded = config.degraded
    if degraded.corpus_dir is None:
        return None
    return Corpus.build(
        resolve(config_path, degraded.corpus_dir),
        excerpt_chars=degraded.excerpt_chars,
        max_file_bytes=degraded.max_file_bytes,
    )


# --------------------------------------------------------------------------- the stores


async def open_stores(config: Config, clock: Clock) -> Stores:
    """The stores of ``state.url`` (durable) and ``state.fast_url`` (fast), opened."""
    return await store_from_urls(
        durable=config.state.url,
        fast=config.state.fast_url,
        clock=clock,
        timeout_s=config.state.timeout_s,
    )


def with_leases(stores: Stores, config: Config, clock: Clock) -> None:
    """With ``state.leases.max_chunk`` above 1, take tokens and budget from the store in
    chunks held by this process (the buckets and quotas are wrapped in place)."""
    leases = config.state.leases
    if leases.max_chunk <= 1:
        return
    max_chunk, hold_s, wait_s = leases.max_chunk, leases.hold_s, config.state.timeout_s
    stores.buckets = buckets = LeasedBuckets(
        stores.buckets, clock, max_chunk=max_chunk, hold_s=hold_s, wait_s=wait_s
    )
    stores.take_now = buckets.take_now
    stores.quotas = quotas = LeasedQuotas(
        stores.quotas, clock, max_chunk=max_chunk, hold_s=hold_s, wait_s=wait_s
    )
    stores.reserve_now, stores.settle_now = quotas.reserve_now, quotas.settle_now


def fleet_retry_budget_from(stores: Stores, config: Config) -> RedisRetryBudgetCounter | None:
    """With Redis, retries across the fleet stay within one shared budget, beside each
    process's own."""
    if stores.redis is None:
        return None
    from tidegate.state.redis import RedisRetryBudgetCounter  # the optional redis package

    return RedisRetryBudgetCounter(
        stores.redis,
        "gateway",
        ratio=config.retry.budget_ratio,
        min_retries_per_second=config.retry.budget_floor_per_s,
    )


def fleet_flight_from(stores: Stores, config: Config) -> RedisSingleFlight | None:
    """With Redis, identical requests on different replicas share one upstream call."""
    if stores.redis is None:
        return None
    from tidegate.state.redis import RedisSingleFlight  # the optional redis package

    return RedisSingleFlight(
        stores.redis,
        lease_s=config.server.request_timeout_s + 5.0,
        wait_s=config.server.request_timeout_s,
    )


# --------------------------------------------------------------------------- providers


def upstream_session(tracing: Tracing | None = None) -> aiohttp.ClientSession:
    """The one pooled HTTP session every provider of the process shares; with ``tracing`` on,
    each of its requests sends the current trace context upstream (``traceparent``)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
        timeout=aiohttp.ClientTimeout(total=None),
        trace_configs=None if tracing is None else tracing.trace_configs() or None,
    )


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
        from tidegate.providers.presets import preset_named

        preset = preset_named(cfg.preset) if cfg.preset else None
        base_url = cfg.base_url or (preset.base_url if preset else None)
        assert base_url is not None  # the config refuses a provider with neither
        return OpenAIProvider(name, base_url, api_key, session, preset=preset)
    if cfg.type == "anthropic":
        from tidegate.providers.anthropic import AnthropicProvider

        assert cfg.base_url is not None
        return AnthropicProvider(name, cfg.base_url, api_key, session)
    if cfg.type in ("azure_openai", "bedrock", "gemini"):
        module = importlib.import_module(f"tidegate.providers.{cfg.type}")
        built: Provider = module.build(
            name,
            model=cfg.model,
            base_url=cfg.base_url,
            api_key=api_key,
            options=getattr(cfg, cfg.type),
            session=session,
            clock=clock,
            base_dir=config_path.parent,
        )
        return built
    from tidegate.providers.fake import FakeProvider

    return FakeProvider.from_script(cfg.fake or {}, name=name, sleep=clock.asleep, clock=clock)


def providers_from(
    config: Config, config_path: Path, session: aiohttp.ClientSession, clock: SystemClock
) -> dict[str, Provider]:
    """Every configured provider, by name, and every upstream of a type that calls the model it
    was built for (``<name>/<model>``: :mod:`tidegate.gateway.upstreams`)."""
    configs = {
        name: cfg
        for name, cfg in upstream_configs(config).items()
        if name in config.providers or needs_own_instance(cfg)
    }
    return {
        name: build_provider(name, cfg, session=session, config_path=config_path, clock=clock)
        for name, cfg in configs.items()
    }


def breakers_for(
    providers: Mapping[str, Provider],
    config: Config,
    clock: Clock,
    rng: random.Random,
    on_event: Callable[[BreakerEvent], None],
) -> dict[str, CircuitBreaker]:
    """One breaker per provider, each telling ``on_event`` (:func:`breaker_events`)."""
    options = breaker_options_from(config)
    return {
        name: CircuitBreaker(name, options, clock=clock, rng=rng, on_event=on_event)
        for name in providers
    }


def breaker_events(
    metrics: Metrics, tracing: Tracing | None = None, slow_start: SlowStart | None = None
) -> Callable[[BreakerEvent], None]:
    """What a breaker's events feed: its state changes counted by the state it moved to; with
    ``tracing`` on, its changes and refusals as events of the current span; with
    ``slow_start``, a close starts the provider's ramp and an open ends it."""
    on_event = _count_transitions(metrics, slow_start)
    if tracing is not None:
        on_event = tracing.recording(on_event, breaker_event)
    return on_event


def _count_transitions(
    metrics: Metrics, slow_start: SlowStart | None = None
) -> Callable[[BreakerEvent], None]:
    """Count each breaker's state changes by the state it moved to (and tell ``slow_start``)."""
    moved = {CircuitOpened: "open", CircuitHalfOpened: "half_open", CircuitClosed: "closed"}

    def on_event(event: BreakerEvent) -> None:
        to = moved.get(type(event))
        if to is not None:
            metrics.breaker_transitions.labels(event.name, to).inc()
            if slow_start is not None:
                slow_start.on_event(event)

    return on_event
