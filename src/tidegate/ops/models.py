"""``tidegate models``: the model catalogue, and with ``--config`` what each configured
provider is priced at and how much it reads, and where that comes from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tidegate.catalogue import ModelInfo, load
from tidegate.errors import ConfigError

__all__ = ["catalogue_table", "effective_table", "models_command"]


def _per_million(value: float | None) -> str:
    return "-" if value is None else f"{value * 1_000_000:g}"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _capabilities(model: ModelInfo) -> str:
    flags = [("tools", model.tools), ("vision", model.vision), ("json", model.json_mode)]
    flags.append(("prefill", model.prefill))
    return " ".join(name for name, on in flags if on) or "-"


def catalogue_table(provider: str | None = None) -> Table:
    """The catalogue's models (only ``provider``'s when given), prices in $ per 1M tokens."""
    catalogue = load()
    table = Table(title=f"model catalogue, compiled {catalogue.compiled} ($ per 1M tokens)")
    for column in ("provider", "model", "input", "cached", "output", "window", "max out"):
        table.add_column(column, justify="right" if column not in ("provider", "model") else "left")
    table.add_column("capabilities")
    for model in catalogue.entries(provider):
        table.add_row(
            provider or model.provider,
            model.id,
            _per_million(model.input_per_token),
            _per_million(model.cached_input_per_token),
            _per_million(model.output_per_token),
            _count(model.context_window),
            _count(model.max_output_tokens),
            _capabilities(model),
        )
    return table


def effective_table(config_path: Path) -> Table:
    """Each configured provider's model, its price and context window, and their sources."""
    from tidegate.gateway.config import catalogue_entry, load_config

    config = load_config(config_path)
    table = Table(title=f"effective models of {config_path} ($ per 1M tokens)")
    for column in ("provider", "type", "model", "input", "output", "price from"):
        table.add_column(column)
    table.add_column("window", justify="right")
    table.add_column("window from")
    for name, provider in config.providers.items():
        entry = catalogue_entry(provider)
        configured = config.prices.get(provider.model)
        prices: tuple[float | None, float | None]
        if configured is not None:
            prices = (configured.input_per_1k / 1000, configured.output_per_1k / 1000)
            price_from = "config"
        elif entry is not None:
            prices, price_from = (entry.input_per_token, entry.output_per_token), "catalogue"
        else:
            prices, price_from = (None, None), "none"
        window, window_from = provider.context_window, "config"
        if window is None:
            window = None if entry is None else entry.context_window
            window_from = "none" if entry is None else "catalogue"
        table.add_row(
            name,
            provider.type,
            provider.model,
            _per_million(prices[0]),
            _per_million(prices[1]),
            price_from,
            _count(window),
            window_from,
        )
    return table


def models_command(
    provider: Annotated[
        str | None, typer.Option("--provider", "-p", help="Only this provider's models.")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="Also show what this config's providers use."),
    ] = None,
) -> None:
    """Print the model catalogue (prices, windows, capabilities, the sources' date)."""
    console = Console(width=160)
    catalogue = load()
    if provider is not None and provider not in catalogue.providers:
        known = ", ".join(catalogue.providers)
        typer.echo(
            f"tidegate: no provider {provider!r} in the catalogue (known: {known})", err=True
        )
        raise typer.Exit(2)
    console.print(catalogue_table(provider))
    names = [provider] if provider is not None else list(catalogue.providers)
    for name in names:
        info = catalogue.providers[name]
        console.print(f"{name}: {info.source}" + (f" ({info.note})" if info.note else ""))
    if config is not None:
        try:
            console.print(effective_table(config))
        except ConfigError as exc:
            typer.echo(f"tidegate: {exc}", err=True)
            raise typer.Exit(2) from None
