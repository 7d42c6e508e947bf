"""A model alias's route: its providers in the order they are tried, each with what it may see
and how much it can read, and the time one attempt may take.

Built once from the config's ``models`` section (and, for a canary whose versions name their own
providers, once per version); the request path plans each request over these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidegate.gateway.config import Config
from tidegate.gateway.pricing import context_window_of
from tidegate.policy.routing import ProviderSpec, RoutePlan, plan_route

__all__ = ["PLANS_REMEMBERED", "Route", "routes_from", "version_routes_from"]

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


def _route(config: Config, alias: str, names: tuple[str, ...], per_try: float) -> Route:
    specs = tuple(
        ProviderSpec(
            name,
            frozenset(config.providers[name].data_classes),
            context_window_of(config.providers[name]),
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
