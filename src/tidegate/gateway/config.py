"""The gateway's configuration: one YAML file plus ``TIDEGATE_*`` environment overrides.

Every model forbids unknown keys, so a misspelt key refuses to start and the message names the key
and the file. Secrets are never inline values: ``api_key_file`` and ``keys_file`` name files whose
contents are read at start-up. The ``production`` profile adds rules (see :func:`profile_problems`).

Environment overrides descend by ``__`` (``TIDEGATE_SERVER__PORT=9000``), values as YAML scalars.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tidegate.catalogue import ModelInfo, find
from tidegate.errors import ConfigError
from tidegate.gateway.approval import check_override, override_problems
from tidegate.providers.azure_openai import AzureOpenAIOptions
from tidegate.providers.bedrock import BedrockOptions
from tidegate.providers.gemini import GeminiOptions
from tidegate.providers.presets import preset_named

__all__ = [
    "AdmissionConfig",
    "AuthConfig",
    "BreakerConfig",
    "BudgetConfig",
    "CacheConfig",
    "CanaryConfig",
    "Config",
    "DegradeConfig",
    "DegradedConfig",
    "FlagConfig",
    "HeadroomConfig",
    "IdempotencyConfig",
    "LedgerConfig",
    "LoggingConfig",
    "OutputConfig",
    "Price",
    "Profile",
    "ProviderConfig",
    "RateConfig",
    "RateLimitsConfig",
    "RetryConfig",
    "RouteConfig",
    "ServerConfig",
    "StateConfig",
    "StreamConfig",
    "TracingConfig",
    "VersionConfig",
    "catalogue_entry",
    "load_config",
    "profile_problems",
    "unpriced_providers",
]

ENV_PREFIX = "TIDEGATE_"
#: TIDEGATE_* variables that are not overrides: the workers', the image's sha, the admin client's.
NOT_OVERRIDES = frozenset(
    {
        "TIDEGATE_CONFIG",
        "TIDEGATE_GIT_SHA",
        "TIDEGATE_ADMIN_URL",
        "TIDEGATE_ADMIN_KEY_FILE",
        "TIDEGATE_METRICS_DIR",
    }
)
SECRET_KEY_NAMES = frozenset({"api_key", "apikey", "password", "secret", "token", "keys"})

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class Profile(StrEnum):
    DEV = "dev"
    STAGING = "staging"
    PRODUCTION = "production"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    workers: PositiveInt = 1
    drain_seconds: NonNegFloat = 20.0
    max_body_bytes: PositiveInt = 1_048_576
    request_timeout_s: PositiveFloat = 60.0
    #: What a connection may make the server hold before the app sees it (``gateway.protocol``):
    #: a client's head is ~12 fields, ~1 KiB; 100 and 32 KiB are Apache's and nginx's defaults.
    max_header_count: PositiveInt = 100
    max_header_bytes: Annotated[int, Field(ge=1024)] = 32_768
    #: From a connection's (or a request's) first byte to the end of its headers.
    header_timeout_s: PositiveFloat = 10.0
    #: From the end of the headers to the end of the body: 1 MiB at 35 KiB/s.
    body_timeout_s: PositiveFloat = 30.0
    #: An idle keep-alive connection is closed after this (uvicorn's own default).
    keep_alive_s: PositiveFloat = 5.0
    #: Requests held before a model request is refused at the door; None: 2 x (slots + queue_cap).
    max_open_requests: PositiveInt | None = None
    #: A second listener for the admin API, the console and (``admin_metrics``) /metrics, which
    #: the public port then answers 404; None: admin on the public port, no console; 0: any port.
    admin_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    admin_host: str = "127.0.0.1"
    admin_metrics: bool = True

    @model_validator(mode="after")
    def _admin_port_is_another(self) -> ServerConfig:
        if self.admin_port is not None and self.admin_port != 0 and self.admin_port == self.port:
            raise ValueError("server.admin_port must differ from server.port")
        return self


class AuthConfig(_Strict):
    keys_file: Path | None = None
    admin_keys_file: Path | None = None


class LeaseConfig(_Strict):
    """Rate-limit tokens and budget taken from the state store several requests at a time."""

    #: The most requests one lease covers; 1 switches leases off (every request asks the store).
    max_chunk: Annotated[int, Field(ge=1, le=1024)] = 128
    #: How long a lease is drawn from before the store is told what it was used for.
    hold_s: PositiveFloat = 0.25


class StateConfig(_Strict):
    url: str = "sqlite:///.tidegate/state.db"
    fast_url: str | None = None
    timeout_s: PositiveFloat = 0.5
    leases: LeaseConfig = Field(default_factory=LeaseConfig)


class StreamConfig(_Strict):
    first_token_timeout_s: PositiveFloat = 10.0
    stall_timeout_s: PositiveFloat = 10.0
    max_duration_s: PositiveFloat = 55.0


#: The provider types, each a module of ``tidegate.providers`` (docs/providers.md).
PROVIDER_TYPES = ("openai", "anthropic", "azure_openai", "bedrock", "gemini", "fake")
#: Types whose upstream answers with one choice, so ``n`` above 1 cannot be honoured.
ONE_CHOICE_TYPES = frozenset({"anthropic", "bedrock"})
#: Types that need ``base_url``; the others have a default endpoint (or run in-process).
NEEDS_BASE_URL = frozenset({"openai", "anthropic", "azure_openai"})
#: In a provider's ``models``: any model id; ending a route alias (``"openai/*"``): pass through.
ANY_MODEL = "*"
WILDCARD_SUFFIX = "/*"
#: Types that send each request's ``model`` (one instance serves all); the others call theirs.
BODY_MODEL_TYPES = frozenset({"openai", "anthropic", "gemini", "fake"})
_Share = Annotated[float, Field(gt=0, le=1)]  # a canary's share of its route's traffic


class ProviderConfig(_Strict):
    type: Literal["openai", "anthropic", "azure_openai", "bedrock", "gemini", "fake"]
    model: str
    #: More model ids the provider serves (each with its own breaker: ``<name>/<model>``); ``"*"``
    #: serves any id a ``"<prefix>/*"`` route passes through (docs/providers.md).
    models: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    base_url: str | None = None
    api_key_file: Path | None = None
    data_classes: tuple[str, ...] = ("public", "internal", "confidential")
    context_window: PositiveInt | None = None
    accepts_prefill: bool = False
    approved_fallback: bool | None = None  # unset: its eval verdict decides (gateway/approval.py)
    approved_fallback_reason: Annotated[str, Field(min_length=1)] | None = None
    stream: StreamConfig = StreamConfig()
    #: Behaviour of the in-process fake provider (only with ``type: fake``).
    fake: dict[str, Any] | None = None
    #: Settings of the types that need more than a URL and a key: each its module's strict model.
    azure_openai: AzureOpenAIOptions | None = None
    bedrock: BedrockOptions | None = None
    gemini: GeminiOptions | None = None
    #: An OpenAI-compatible service's base URL, auth and field rules (docs/providers/presets.md).
    preset: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _model_from_models(cls, data: Any) -> Any:
        """Without ``model``, the first id ``models`` lists is the provider's own."""
        if isinstance(data, dict) and "model" not in data and isinstance(data.get("models"), list):
            listed = [m for m in data["models"] if m != ANY_MODEL]
            if listed:
                data = {**data, "model": listed[0]}
        return data

    def serves(self, model: str) -> bool:
        """Whether a request may reach this provider with ``model`` (``"*"``: any id)."""
        return model == self.model or model in self.models or ANY_MODEL in self.models

    @model_validator(mode="after")
    def _needs_base_url(self) -> ProviderConfig:
        if ANY_MODEL in self.models and self.type not in BODY_MODEL_TYPES:
            raise ValueError(f"'models: [\"*\"]' is not for type {self.type!r}: it calls one model")
        default_url = self._check_preset()
        if self.type in NEEDS_BASE_URL and not (self.base_url or default_url):
            raise ValueError(f"a provider of type {self.type!r} needs base_url")
        for section in ("fake", "azure_openai", "bedrock", "gemini"):
            if self.type != section and getattr(self, section) is not None:
                raise ValueError(f"'{section}' settings are only for providers of type {section}")
        check_override(self)
        return self

    def _check_preset(self) -> str | None:
        """The preset's default base URL, after refusing a preset that cannot be used here."""
        if self.preset is None:
            return None
        if self.type != "openai":
            raise ValueError("'preset' is only for providers of type openai")
        preset = preset_named(self.preset)
        if preset.auth == "bearer" and self.api_key_file is None:
            raise ValueError(f"preset {preset.name!r} needs api_key_file (a Bearer key)")
        return preset.base_url


class VersionConfig(_Strict):
    """One version of a route: its providers, prompt template and parameters."""

    providers: tuple[str, ...] | None = None
    prompt_version: str = ""
    system_prompt: str | None = None
    params: dict[str, Any] = {}


class CanaryConfig(_Strict):
    salt: Annotated[str, Field(min_length=1)]
    baseline: VersionConfig = VersionConfig()
    candidate: VersionConfig
    schedule: Annotated[tuple[_Share, ...], Field(min_length=1)] = (0.05, 0.25, 0.5, 1.0)
    evaluate_every_s: PositiveFloat = 60.0
    min_requests: PositiveInt = 200
    min_baseline_requests: PositiveInt = 200
    error_margin: Annotated[float, Field(ge=0, le=1)] = 0.02
    validation_margin: Annotated[float, Field(ge=0, le=1)] = 0.02
    latency_ratio: Annotated[float, Field(ge=1)] = 1.2
    cost_ratio: Annotated[float, Field(ge=1)] = 1.25


class RouteConfig(_Strict):
    providers: Annotated[tuple[str, ...], Field(min_length=1)]
    per_try_timeout_s: PositiveFloat = 15.0
    description: str = ""
    canary: CanaryConfig | None = None


class RetryConfig(_Strict):
    attempts: PositiveInt = 3
    base_s: PositiveFloat = 0.5
    factor: Annotated[float, Field(ge=1.0)] = 2.0
    cap_s: PositiveFloat = 8.0
    jitter: Literal["full", "equal", "decorrelated", "none"] = "full"
    budget_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    budget_floor_per_s: NonNegFloat = 1.0
    retry_timeouts_on_same_provider: bool = False


class BreakerConfig(_Strict):
    consecutive_failures: PositiveInt = 5
    failure_rate: Annotated[float, Field(gt=0, le=1)] = 0.5
    window_s: PositiveFloat = 30.0
    minimum_calls: PositiveInt = 10
    recovery_s: PositiveFloat = 30.0
    recovery_jitter: Annotated[float, Field(ge=0, le=1)] = 0.2
    slow_start_s: Annotated[float, Field(ge=0)] = 0.0  # policy/slowstart.py; 0: off


class RateConfig(_Strict):
    rate_per_s: PositiveFloat
    burst: PositiveFloat


class RateLimitsConfig(_Strict):
    per_user: RateConfig | None = None
    per_tenant: RateConfig | None = None


class DegradeConfig(_Strict):
    model: str | None = None
    max_tokens: PositiveInt | None = None


class BudgetConfig(_Strict):
    calls: PositiveInt | None = None
    tokens: PositiveInt | None = None
    cost_usd: PositiveFloat | None = None
    degrade_at: Annotated[float, Field(gt=0, le=1)] = 0.8
    degrade: DegradeConfig = DegradeConfig()
    default_max_tokens: PositiveInt = 1024


class Price(_Strict):
    input_per_1k: NonNegFloat = 0.0
    output_per_1k: NonNegFloat = 0.0


class AdmissionConfig(_Strict):
    classes: Annotated[tuple[str, ...], Field(min_length=1)] = ("critical", "standard", "batch")
    slots: PositiveInt = 64
    queue_cap: PositiveInt = 256
    tenant_max_in_flight: PositiveInt | None = None
    tenant_max_waiting: PositiveInt | None = None
    mode: Literal["queue_cap", "deadline"] = "deadline"
    service_rate: PositiveFloat | None = None
    dequeue: Literal["fifo", "strict", "weighted"] = "strict"
    weights: dict[str, PositiveFloat] | None = None
    priority_at_admission: bool = True
    conditional_priority: PositiveFloat | None = None
    initial_service_time_s: PositiveFloat = 1.0
    drop_expired_at_dequeue: bool = True


class IdempotencyConfig(_Strict):
    ttl_s: PositiveFloat = 86_400.0
    wait_s: NonNegFloat = 5.0
    lease_margin_s: PositiveFloat = 5.0


class CacheConfig(_Strict):
    enabled: bool = True
    ttl_s: PositiveFloat = 300.0
    stale_ttl_s: NonNegFloat = 86_400.0


class DegradedConfig(_Strict):
    corpus_dir: Path | None = None
    limit: PositiveInt = 3
    limit_per_doc: PositiveInt = 1
    excerpt_chars: PositiveInt = 300
    max_file_bytes: PositiveInt = 4_194_304
    stale_cache: bool = True


class OutputConfig(_Strict):
    deny_patterns: tuple[str, ...] = ()
    replacement: str = "[redacted]"


class TracingConfig(_Strict):
    enabled: bool = False
    exporter: Literal["otlp", "console"] = "otlp"
    endpoint: str | None = None
    service_name: str = "tidegate"
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    propagate_upstream: bool = True  # traceparent/tracestate on every upstream request


class LedgerConfig(_Strict):
    enabled: bool = True
    batch_rows: PositiveInt = 500
    flush_s: PositiveFloat = 1.0
    retention_days: PositiveInt | None = 90


class HeadroomConfig(_Strict):
    prefer_others: bool = False
    low_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.05
    horizon_s: PositiveFloat = 60.0


class LoggingConfig(_Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json_lines: bool = True


class FlagConfig(_Strict):
    name: str
    type: Literal["bool", "int", "float", "str"]
    default: bool | int | float | str
    description: Annotated[str, Field(min_length=1)]
    choices: tuple[str, ...] | None = None


class Config(_Strict):
    profile: Profile = Profile.DEV
    server: ServerConfig = ServerConfig()
    auth: AuthConfig = AuthConfig()
    state: StateConfig = StateConfig()
    providers: Annotated[dict[str, ProviderConfig], Field(min_length=1)]
    models: Annotated[dict[str, RouteConfig], Field(min_length=1)]
    retry: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()
    rate_limits: RateLimitsConfig = RateLimitsConfig()
    budgets: BudgetConfig | None = None
    prices: dict[str, Price] = {}
    admission: AdmissionConfig = AdmissionConfig()
    idempotency: IdempotencyConfig = IdempotencyConfig()
    cache: CacheConfig = CacheConfig()
    degraded: DegradedConfig = DegradedConfig()
    output: OutputConfig = OutputConfig()
    logging: LoggingConfig = LoggingConfig()
    tracing: TracingConfig = TracingConfig()
    ledger: LedgerConfig = LedgerConfig()
    headroom: HeadroomConfig = HeadroomConfig()
    flags: tuple[FlagConfig, ...] = ()
    default_data_class: str = "internal"

    @model_validator(mode="after")
    def _routes_name_known_providers(self) -> Config:
        for alias, route in self.models.items():
            versions = (
                [] if route.canary is None else [route.canary.baseline, route.canary.candidate]
            )
            extra = [n for v in versions for n in (v.providers or ())]
            _check_wildcard(alias, route, self.providers)
            for name in (*route.providers, *extra):
                if not names_upstream(self.providers, name):
                    raise ValueError(
                        f"models.{alias}.providers names {name!r}, which is not under providers"
                    )
        degrade = self.budgets.degrade.model if self.budgets is not None else None
        if degrade is not None and degrade not in self.models:
            raise ValueError(f"budgets.degrade.model names {degrade!r}, which is not under models")
        return self


def names_upstream(providers: Mapping[str, ProviderConfig], name: str) -> bool:
    """Whether a route's ``name`` is a provider, or ``<provider>/<model>`` of a model it lists."""
    if name in providers:
        return True
    return any(
        name.startswith(base + "/") and name[len(base) + 1 :] in cfg.models
        for base, cfg in providers.items()
    )


def _check_wildcard(
    alias: str, route: RouteConfig, providers: Mapping[str, ProviderConfig]
) -> None:
    """A ``"<prefix>/*"`` alias names bare providers and has no canary."""
    if ANY_MODEL not in alias:
        return
    if not alias.endswith(WILDCARD_SUFFIX) or alias.count(ANY_MODEL) > 1:
        raise ValueError(f"models.{alias}: a wildcard alias ends with '/*' (like 'openai/*')")
    if route.canary is not None:
        raise ValueError(f"models.{alias}: a wildcard alias cannot have a canary")
    for name in route.providers:
        if name not in providers:
            raise ValueError(f"models.{alias}.providers: {name!r} is not a provider's name")


# --------------------------------------------------------------------------- loading


_PINNED = re.compile(r"(^|[-:/])latest$")


def profile_problems(config: Config) -> list[str]:
    """What the configured profile forbids; empty when the config may start."""
    if config.profile is not Profile.PRODUCTION:
        return []
    problems = []
    if config.auth.keys_file is None:
        problems.append("production needs authentication: set auth.keys_file")
    limits = config.rate_limits
    if limits.per_user is None and limits.per_tenant is None:
        problems.append("production needs rate limits: set rate_limits.per_user or per_tenant")
    if config.budgets is None:
        problems.append("production needs budgets: set budgets")
    if not config.state.url.startswith(("sqlite:///", "postgresql://", "postgres://")):
        problems.append(
            f"production needs a durable state URL (sqlite:/// or postgresql://), not {config.state.url!r}"
        )
    for name, provider in config.providers.items():
        if provider.type == "fake":
            problems.append(f"production must not use the fake provider (providers.{name})")
        if _PINNED.search(provider.model):
            problems.append(
                f"production needs pinned model ids: providers.{name}.model is {provider.model!r}"
            )
    problems += override_problems(config.providers)
    if config.budgets is not None and config.budgets.cost_usd is not None:
        problems += [
            f"production with budgets.cost_usd needs every model priced: providers.{name} "
            f"({config.providers[name].model!r}) is in no catalogue and has no prices entry"
            for name in unpriced_providers(config)
        ]
    return problems


def catalogue_entry(provider: ProviderConfig) -> ModelInfo | None:
    """The model catalogue's entry for a provider's model (``tidegate.catalogue``), if any."""
    preset = getattr(provider, "preset", None)  # a preset names the provider it stands for
    return find(
        provider.type,
        provider.model,
        provider.base_url,
        preset if isinstance(preset, str) else None,
    )


def unpriced_providers(config: Config) -> list[str]:
    """The providers (fakes aside: they are never billed) whose model has no ``prices`` entry
    and no catalogue entry: their spend would count as nothing."""
    return [
        name
        for name, provider in config.providers.items()
        if provider.type != "fake"
        and provider.model not in config.prices
        and catalogue_entry(provider) is None
    ]


def _loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc)


def _secret_hint(error: Mapping[str, Any]) -> str:
    leaf = str(error["loc"][-1]) if error["loc"] else ""
    if error["type"] == "extra_forbidden" and leaf.lower() in SECRET_KEY_NAMES:
        return f" (secrets are read from files only: use {leaf}_file)"
    return ""


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    applied = []
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name.startswith(ENV_PREFIX + "TEST_"):
            continue
        if name in NOT_OVERRIDES:
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{name}: {'.'.join(path)} does not name a section")
            node = child
        node[path[-1]] = yaml.safe_load(raw) if raw != "" else None
        applied.append(name)
    return applied


def _check_secret_files(config: Config, base: Path) -> None:
    files: list[tuple[str, Path | None]] = [
        ("auth.keys_file", config.auth.keys_file),
        ("auth.admin_keys_file", config.auth.admin_keys_file),
    ]
    files += [(f"providers.{n}.api_key_file", p.api_key_file) for n, p in config.providers.items()]
    for key, path in files:
        if path is None:
            continue
        resolved = path if path.is_absolute() else base / path
        if not resolved.is_file():
            raise ConfigError(f"{key}: secret file {str(path)!r} does not exist or is not a file")


def resolve(config_path: Path, path: Path) -> Path:
    """A path from the config, relative to the config file's folder."""
    return path if path.is_absolute() else config_path.parent / path


def load_config(
    path: str | Path, env: Mapping[str, str] | None = None, *, secret_files: bool = True
) -> Config:
    """Read, override from the environment, validate, apply the profile's rules and (unless not
    ``secret_files``) check the files named exist; a :class:`ConfigError` names file and key."""
    path = Path(path)
    env = os.environ if env is None else env
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror})") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    overridden = _apply_env(data, env)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            where = _loc(error["loc"])
            if error["type"] == "extra_forbidden":
                lines.append(f"unknown key {where!r}{_secret_hint(error)}")
            else:
                lines.append(f"{where}: {error['msg']}")
        origin = f" (with overrides {', '.join(overridden)})" if overridden else ""
        raise ConfigError(f"{path}{origin}: " + "; ".join(lines)) from None
    if secret_files:
        _check_secret_files(config, path.parent)
    problems = profile_problems(config)
    if problems:
        raise ConfigError(
            f"{path}: profile {config.profile.value} refuses to start: " + "; ".join(problems)
        )
    return config
