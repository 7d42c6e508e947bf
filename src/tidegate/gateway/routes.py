"""A model alias's route: its providers in the order they are tried, each with what it may see
and how much it can read, and the time one attempt may take.

Built once from the config's ``models`` section (and, for a canary whose versions name their own
providers, once per version); the request path plans each request over these.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidegate.gateway.config import Config
from tidegate.policy.routing import ProviderSpec

__all__ = ["Route", "routes_from", "version_routes_from"]


@dataclass(frozen=True)
class Route:
    alias: str
    specs: tuple[ProviderSpec, ...]
    per_try_timeout_s: float


def _route(config: Config, alias: str, names: tuple[str, ...], per_try: float) -> Route:
    specs = tuple(
        ProviderSpec(
            name,
            frozenset(config.providers[name].data_classes),
            config.providers[name].context_window,
        )
        for name in names
    )
    return Route(alias, specs, per_try)


def routes_from(config: Config) -> dict[str, Route]:
    """Every alias's route."""
    return {
        alias: _route(config, alias, route.providers, route.per_try_timeout_s)
        for alias, route in config.models.items()
    }


def version_routes_from(config: Config) -> dict[tuple[str, str], Route]:
    """The routes of canary versions that name their own providers, by (alias, version)."""
    return {
        (alias, name): _route(config, alias, version.providers, route.per_try_timeout_s)
        for alias, route in config.models.items()
        if route.canary is not None
        for name, version in (
            ("baseline", route.canary.baseline),
            ("candidate", route.canary.candidate),
        )
        if version.providers
    }
