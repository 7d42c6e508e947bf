"""The gateway's own timeout chain, from its config: each layer must give up before the one that
called it (:func:`tidegate.policy.deadline.chain_problems`).

One chain per route and provider, from the outside in: the request's deadline
(``server.request_timeout_s``), the provider's stream limit (``providers.P.stream.max_duration_s``)
and the route's retrying calls (``retry.attempts`` x ``models.R.per_try_timeout_s`` + the worst
total backoff). ``tidegate check timeouts`` checks these with the deployment's outer layers
(:mod:`tidegate.ops.timeouts`); at start-up :func:`warn_timeouts` logs a warning for each
problem, the same as that check's ``TMO002`` findings, instead of starting silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from tidegate.gateway.config import Config
from tidegate.gateway.upstreams import upstream_configs
from tidegate.policy.deadline import Layer, chain_problems
from tidegate.policy.retry import Jitter, RetryOptions, provider_layer

__all__ = ["ChainLayer", "chain_warnings", "layer_problems", "timeout_chains", "warn_timeouts"]

log = structlog.get_logger("tidegate")


@dataclass(frozen=True, slots=True)
class ChainLayer:
    """One layer of a chain: its limit, the config key that sets it, and how it was worked out."""

    layer: Layer
    key: str
    detail: str = ""


def _retry_options(config: Config) -> RetryOptions:
    r = config.retry
    return RetryOptions(
        attempts=r.attempts, base=r.base_s, factor=r.factor, cap=r.cap_s, jitter=Jitter(r.jitter)
    )


def timeout_chains(config: Config) -> list[list[ChainLayer]]:
    """The gateway's chains, one per route and provider: request, stream, retrying calls.
    ``ValueError`` when the retry settings are refused."""
    policy = _retry_options(config)
    upstreams = upstream_configs(config)
    request = ChainLayer(
        Layer("gateway request", config.server.request_timeout_s), "server.request_timeout_s"
    )
    chains: list[list[ChainLayer]] = []
    attempts = config.retry.attempts
    backoff = policy.worst_total_backoff()
    for alias, route in config.models.items():
        calls = ChainLayer(
            provider_layer(
                f"retrying calls of route {alias}", attempts, route.per_try_timeout_s, policy
            ),
            f"models.{alias}.per_try_timeout_s, retry",
            f"{attempts} tries x {route.per_try_timeout_s:g}s + {backoff:g}s worst backoff",
        )
        for name in route.providers:
            stream = ChainLayer(
                Layer(f"stream limit of provider {name}", upstreams[name].stream.max_duration_s),
                f"providers.{name.partition('/')[0]}.stream.max_duration_s",
            )
            chains.append([request, stream, calls])
    return chains


def layer_problems(layers: Sequence[Layer]) -> list[tuple[int, str]]:
    """The index of each layer that would outlive a layer above it, with the problem in words."""
    found: list[tuple[int, str]] = []
    seen = 0
    for index in range(len(layers)):
        problems = chain_problems(layers[: index + 1])
        if len(problems) > seen:
            seen = len(problems)
            found.append((index, problems[-1]))
    return found


def chain_warnings(chain: list[ChainLayer]) -> list[tuple[str, ChainLayer]]:
    """Each layer of ``chain`` that would outlive a layer above it, with the problem in words."""
    return [(problem, chain[index]) for index, problem in layer_problems([c.layer for c in chain])]


def warn_timeouts(config: Config) -> int:
    """At start-up, a warning for each layer of the gateway's timeout chains that does not nest
    (each once); the number of warnings."""
    try:
        chains = timeout_chains(config)
    except ValueError:  # the retry settings: refused at start-up by their own check
        return 0
    warned: set[tuple[str, str]] = set()
    for chain in chains:
        for problem, link in chain_warnings(chain):
            if (problem, link.key) in warned:
                continue
            warned.add((problem, link.key))
            log.warning(
                "timeout_chain_does_not_nest",
                problem=problem,
                key=link.key,
                detail=link.detail or None,
                check="tidegate check timeouts",
            )
    return len(warned)
