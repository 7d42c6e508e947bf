"""What the runtime takes from the model catalogue (:mod:`tidegate.catalogue`), with the
config's own entries first: each model's price, each provider's context window, and each
provider's token counters (OpenAI's models by their encoding, the rest by the estimate).

The effective price of a model is its ``prices:`` entry if there is one, else its catalogue
entry's; the effective context window of a provider is its ``context_window`` if set, else its
model's in the catalogue. Cost, budgets and the context-length failover use these.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog

from tidegate.catalogue.tokens import InputCounter, PromptCounter, input_counter, prompt_counter
from tidegate.gateway.config import (
    Config,
    Price,
    ProviderConfig,
    catalogue_entry,
    unpriced_providers,
)
from tidegate.gateway.upstreams import upstream_configs

__all__ = [
    "context_window_of",
    "effective_prices",
    "input_counters",
    "price_sources",
    "prompt_counters",
    "warn_unpriced",
]

log = structlog.get_logger("tidegate")


def effective_prices(config: Config) -> dict[str, Price]:
    """Each model's price: the config's entry, else its catalogue entry's (by model id); the
    models a provider lists under ``models`` are priced each as its own."""
    prices = dict(config.prices)
    for provider in upstream_configs(config).values():
        if provider.model in prices:
            continue
        entry = catalogue_entry(provider)
        if entry is not None:
            per_input, per_output = entry.per_1k
            prices[provider.model] = Price(input_per_1k=per_input, output_per_1k=per_output)
    return prices


def price_sources(config: Config) -> dict[str, str]:
    """Where each provider's price comes from: ``config``, ``catalogue`` or ``none``."""
    sources = {}
    for name, provider in config.providers.items():
        if provider.model in config.prices:
            sources[name] = "config"
        else:
            sources[name] = "catalogue" if catalogue_entry(provider) is not None else "none"
    return sources


def context_window_of(provider: ProviderConfig) -> int | None:
    """The provider's context window: its ``context_window``, else its catalogue entry's."""
    if provider.context_window is not None:
        return provider.context_window
    entry = catalogue_entry(provider)
    return None if entry is None else entry.context_window


def prompt_counters(providers: Mapping[str, ProviderConfig]) -> dict[str, PromptCounter]:
    """Each provider's counter of a chat prompt's tokens (its encoding looked up once, here)."""
    return {
        name: prompt_counter(cfg.type, cfg.model, cfg.base_url) for name, cfg in providers.items()
    }


def input_counters(providers: Mapping[str, ProviderConfig]) -> dict[str, InputCounter]:
    """Each provider's counter of an embeddings input's tokens."""
    return {
        name: input_counter(cfg.type, cfg.model, cfg.base_url) for name, cfg in providers.items()
    }


def warn_unpriced(config: Config) -> None:
    """A warning at start-up for each provider whose model has no price anywhere: its requests
    would cost nothing in the spend metrics and the cost budgets."""
    for name in unpriced_providers(config):
        provider = config.providers[name]
        log.warning(
            "model_unpriced",
            provider=name,
            type=provider.type,
            model=provider.model,
            fix=f"add prices.{provider.model} (the model is in no catalogue)",
        )
