"""Pass-through routes: a wildcard alias (``"openai/*"``) asked for a model that no provider of
its route lists, served by those whose ``models`` holds ``"*"``.

Each such model becomes an upstream on first use (``<provider>/<model>``, with its own breaker,
counters and catalogue price, sharing the provider's instance) and its route is remembered. The
caller's text becomes a metric label and a breaker's name this way, so it is held to the names a
route may use, and at most :data:`PASSTHROUGH_REMEMBERED` models are taken on per process; past
that an unlisted model is refused like an unknown one (list it in ``models`` instead).
"""

from __future__ import annotations

import re

from tidegate.catalogue.tokens import input_counter, prompt_counter
from tidegate.errors import ModelNotFound
from tidegate.gateway.build import breaker_events, breakers_for
from tidegate.gateway.config import WILDCARD_SUFFIX, RouteConfig, catalogue_entry
from tidegate.gateway.routes import Route, route_of
from tidegate.gateway.runtime import Runtime
from tidegate.gateway.upstreams import served_as, upstream_name

__all__ = ["PASSTHROUGH_REMEMBERED", "passthrough_route"]

#: Models a process takes on through ``"*"`` providers, at most.
PASSTHROUGH_REMEMBERED = 64
#: A model id that may become part of an upstream's name (as route provider names are written).
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")


def passthrough_route(rt: Runtime, alias: str) -> Route | None:
    """The route of ``alias`` through a wildcard alias, or ``None`` when none serves it."""
    known = rt.passthrough.get(alias)
    if known is not None:
        return known
    for pattern, route in rt.config.models.items():
        if not pattern.endswith(WILDCARD_SUFFIX):
            continue
        prefix = pattern[:-1]
        model = alias[len(prefix) :]
        if not alias.startswith(prefix) or _MODEL.fullmatch(model) is None:
            continue
        served = _route(rt, alias, route, model)
        if served is not None:
            return served
    return None


def _route(rt: Runtime, alias: str, route: RouteConfig, model: str) -> Route | None:
    providers = rt.config.providers
    bases = [name for name in route.providers if providers[name].serves(model)]
    if not bases:
        return None
    if len(rt.passthrough) >= PASSTHROUGH_REMEMBERED:
        raise ModelNotFound(
            f"no model named {alias!r}: this gateway already passes {PASSTHROUGH_REMEMBERED}"
            " models through; list the model under its provider's models"
        )
    names = tuple(_upstream(rt, base, model) for base in bases)
    found = rt.passthrough[alias] = route_of(
        rt.provider_configs, alias, names, route.per_try_timeout_s
    )
    return found


def _upstream(rt: Runtime, base: str, model: str) -> str:
    """The upstream of ``base`` serving ``model``, made now if it is new."""
    cfg = rt.config.providers[base]
    name = upstream_name(base, cfg, model)
    if name in rt.provider_configs:
        return name
    served = rt.provider_configs[name] = served_as(cfg, model)
    rt.providers[name] = rt.providers[base]
    rt.breakers.update(
        breakers_for(
            {name: rt.providers[base]},
            rt.config,
            rt.clock,
            rt.rng,
            breaker_events(rt.metrics, rt.tracing, rt.slow_start),
        )
    )
    rt.model_ids[name] = model
    count = rt.prompt_counters[name] = prompt_counter(served.type, model, served.base_url)
    rt.input_counters[name] = input_counter(served.type, model, served.base_url)
    entry = catalogue_entry(served)
    if model not in rt.prices_per_1k and entry is not None:
        rt.prices_per_1k[model] = entry.per_1k
    rt.reserve_meters[name] = (count, *rt.prices_per_1k.get(model, (0.0, 0.0)))
    rt.forget_approved()
    return name
