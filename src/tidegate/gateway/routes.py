"""A model alias's route: its providers in the order they are tried, each with what it may see
and how much it can read, and the time one attempt may take.

Built once from the config's ``models`` section (and, for a canary whose versions name their own
providers, once per version); the request path plans each request over these. A wildcard alias
(``"openai/*"``) becomes one route per model its providers list (``openai/gpt-4o-mini``), each
reaching the upstreams that serve that model (:mod:`tidegate.gateway.upstreams`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tidegate.gateway.config import Config, ProviderConfig
from tidegate.gateway.pricing import context_window_of
from tidegate.gateway.upstreams import upstream_configs, wildcard_aliases, wildcard_names
from tidegate.policy.routing import ProviderSpec, RoutePlan, plan_route

__all__ = ["PLANS_REMEMBERED", "Route", "route_of", "routes_from", "version_routes_from"]

#: Route plans a route remembers (combinations of data class, approved fallbacks and open
#: breakers) before it forgets them all.
PLANS_REMEMBERED = 1024


@dataclass(frozen=True)
class Route:
    """A model alias and the providers it routes to, in order."""

    alias: str
    specs: tuple[ProviderSpec, ...]
    per_try_timeout_s: float
    #: Plans by (data class, approved fallbacks, open breakers): see :meth:`plan`.
    _plans: dict[tuple[str, frozenset[str], frozenset[str]], RoutePlan] = field(
        default_factory=dict, compare=False, repr=False
    )
    #: The providers' names, in order (what the route step asks the breakers about).
    names: tuple[str, ...] = field(init=False, compare=False, repr=False)
    #: The smallest context window known among the providers (``None``: none is known, and the
    #: route step counts no prompt to fit one).
    smallest_window: int | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        windows = [s.context_window for s in self.specs if s.context_window is not None]
        object.__setattr__(self, "names", tuple(s.name for s in self.specs))
        object.__setattr__(self, "smallest_window", min(windows) if windows else None)

    def limit(self, spec: ProviderSpec) -> float:
        """The time one attempt on the route may take (the same for each of its providers)."""
        return self.per_try_timeout_s

    def plan(
        self, data_class: str, approved: frozenset[str], open_breakers: frozenset[str]
    ) -> RoutePlan:
        """The route's plan for these inputs (:func:`~tidegate.policy.routing.plan_route`),
        worked out once per combination and then remembered: ``plan_route`` checks its inputs
        and builds the plan, about 80 bytecodes a request (``benchmarks/opcodes.py``), for the
        few combinations a route meets."""
        key = (data_class, approved, open_breakers)
        known = self._plans.get(key)
        if known is None:
            if len(self._plans) >= PLANS_REMEMBERED:
                self._plans.clear()
            known = self._plans[key] = plan_route(
                self.specs, data_class=data_class, approved=approved, open_breakers=open_breakers
            )
        return known


def route_of(
    upstreams: Mapping[str, ProviderConfig], alias: str, names: tuple[str, ...], per_try: float
) -> Route:
    """The route of ``alias`` over these upstreams, in order."""
    specs = tuple(
        ProviderSpec(
            name,
            frozenset(upstreams[name].data_classes),
            context_window_of(upstreams[name]),
        )
        for name in names
    )
    return Route(alias, specs, per_try)


def routes_from(config: Config) -> dict[str, Route]:
    """Every alias's route, with those a wildcard alias makes of its providers' models."""
    upstreams = upstream_configs(config)
    routes = {
        alias: route_of(upstreams, alias, route.providers, route.per_try_timeout_s)
        for alias, route in config.models.items()
        if not alias.endswith("/*")
    }
    for alias, route, model in wildcard_aliases(config):
        names = wildcard_names(config, route, model)
        routes[alias] = route_of(upstreams, alias, names, route.per_try_timeout_s)
    return routes


def version_routes_from(config: Config) -> dict[tuple[str, str], Route]:
    """The routes of canary versions that name their own providers, by (alias, version)."""
    return {
        (alias, name): route_of(
            upstream_configs(config), alias, version.providers, route.per_try_timeout_s
        )
        for alias, route in config.models.items()
        if route.canary is not None
        for name, version in (
            ("baseline", route.canary.baseline),
            ("candidate", route.canary.candidate),
        )
        if version.providers
    }
