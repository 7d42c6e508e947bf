"""Upstreams: each model a provider serves, as the request path sees it.

A provider serves its ``model`` under its own name, and each other id its ``models`` lists under
``<name>/<model>``: every upstream has its own breaker, metrics label, token counter, price and
context window, so one model's failures do not open another's breaker. The name is what routes
list, what ``X-Tidegate-Tried`` shows and what the breaker is keyed by.

A route alias ending in ``/*`` (``"openai/*"``) passes the caller's model through: the caller
asks for ``openai/gpt-4o-mini`` and each provider of the route that serves ``gpt-4o-mini`` is
called with it. The models its providers list become aliases of their own at start-up (a dict
lookup, like any alias); an id none lists reaches the providers whose ``models`` holds ``"*"``
(:mod:`tidegate.gateway.passthrough`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from tidegate.gateway.config import (
    ANY_MODEL,
    BODY_MODEL_TYPES,
    WILDCARD_SUFFIX,
    Config,
    ProviderConfig,
    RouteConfig,
)
from tidegate.providers.base import Provider

__all__ = [
    "expand_providers",
    "listed_models",
    "needs_own_instance",
    "served_as",
    "upstream_configs",
    "upstream_name",
    "wildcard_aliases",
    "wildcard_names",
]


def upstream_name(provider: str, cfg: ProviderConfig, model: str) -> str:
    """The upstream of ``provider`` serving ``model``: its own name for its own model."""
    return provider if model == cfg.model else f"{provider}/{model}"


def served_as(cfg: ProviderConfig, model: str) -> ProviderConfig:
    """The provider's config for one more model: the same settings, that model, no list; its
    ``context_window`` (if set) is its own model's, so the other's comes from the catalogue."""
    update: dict[str, object] = {"model": model, "models": (), "context_window": None}
    if cfg.azure_openai is not None and cfg.azure_openai.deployment is not None:
        update["azure_openai"] = cfg.azure_openai.model_copy(update={"deployment": None})
    return cfg.model_copy(update=update)


def listed_models(config: Config, route: RouteConfig) -> list[str]:
    """The model ids the providers of a wildcard route name (their ``model`` and ``models``),
    in route order, each once."""
    seen: dict[str, None] = {}
    for name in route.providers:
        cfg = config.providers[name]
        for model in (cfg.model, *cfg.models):
            if model != ANY_MODEL:
                seen.setdefault(model, None)
    return list(seen)


def wildcard_names(config: Config, route: RouteConfig, model: str) -> tuple[str, ...]:
    """The upstreams a wildcard route reaches for ``model``: each provider serving it."""
    return tuple(
        upstream_name(name, config.providers[name], model)
        for name in route.providers
        if config.providers[name].serves(model)
    )


def wildcard_aliases(config: Config) -> Iterator[tuple[str, RouteConfig, str]]:
    """Every alias a wildcard route makes of its providers' listed models: (alias, route,
    model). An alias the config names itself is not one of them (it wins)."""
    for alias, route in config.models.items():
        if not alias.endswith(WILDCARD_SUFFIX):
            continue
        prefix = alias[: -len(ANY_MODEL)]
        for model in listed_models(config, route):
            if prefix + model not in config.models:
                yield prefix + model, route, model


def upstream_configs(config: Config) -> dict[str, ProviderConfig]:
    """Every upstream's config, by name: the providers, their listed models, and the models of
    wildcard routes that a provider serving any id takes."""
    upstreams = dict(config.providers)
    for name, cfg in config.providers.items():
        for model in cfg.models:
            if model != ANY_MODEL and model != cfg.model:
                upstreams[f"{name}/{model}"] = served_as(cfg, model)
    for _, route, model in wildcard_aliases(config):
        for name in wildcard_names(config, route, model):
            if name not in upstreams:
                base = name[: -len(model) - 1]
                upstreams[name] = served_as(config.providers[base], model)
    return upstreams


def expand_providers(
    providers: Mapping[str, Provider],
    upstreams: Mapping[str, ProviderConfig],
    build: Mapping[str, Provider] | None = None,
) -> dict[str, Provider]:
    """The provider instance of every upstream: a provider that sends each request's model
    serves all its upstreams with one instance; one built for a model (``build``) has its own."""
    out = dict(providers)
    for name in upstreams:
        if name in out:
            continue
        if build is not None and name in build:
            out[name] = build[name]
            continue
        bases = [b for b in providers if name.startswith(b + "/")]
        if bases:  # (a runtime given only some providers leaves the others out)
            out[name] = providers[max(bases, key=len)]
    return out


def needs_own_instance(cfg: ProviderConfig) -> bool:
    """Whether an upstream of this config needs a provider instance built for its model."""
    return cfg.type not in BODY_MODEL_TYPES
