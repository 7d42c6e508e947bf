"""The model catalogue: what the common models of each provider cost, how much they read and
write, and what they can do, shipped as data (``models.json`` beside this module).

The file names the date it was compiled and, per provider, the public pricing page its figures
come from; a model whose figures could not be confirmed is left out rather than guessed. It is
read once per process (:func:`load`) and looked up by provider and model id (:func:`lookup`).

A config's own entries win: ``prices:`` over the catalogue's price, ``providers.<name>.
context_window`` over its window (``tidegate.gateway.config`` and ``tidegate.gateway.routes``
ask here only for what the config leaves out).

How an id is looked up (:meth:`Catalogue.lookup`):

- the provider's own entries, by id or by one of an entry's ``aliases`` (the dated snapshots
  known to cost what the undated id costs); ``azure_openai`` reads OpenAI's entries;
- on Bedrock, a geographic cross-region profile (``us.``, ``eu.``, ``apac.``) is read past: it
  is billed as the model is in the region the request was made in;
- there is no general rule that strips a date from an id: a snapshot is not always priced as
  its alias is (``gpt-4o-2024-05-13`` costs twice what ``gpt-4o`` costs), so an unlisted
  snapshot is unknown, and the gateway says so at start-up.

Which catalogue section a configured provider reads (:func:`section_for`): its type's, except
that an ``openai`` provider pointed at Groq, Mistral or DeepSeek (by the host of its
``base_url``) reads that provider's, and a ``fake`` stands in for whichever catalogued model its
``model`` names (its cost is what that model would have cost).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "CROSS_REGION_PREFIXES",
    "Catalogue",
    "ModelInfo",
    "ProviderInfo",
    "find",
    "load",
    "lookup",
    "parse",
    "section_for",
]

#: The prefixes of Bedrock's geographic cross-region inference profiles.
CROSS_REGION_PREFIXES = ("us.", "eu.", "apac.")
#: Tokens in the million the pricing pages quote their prices per.
PER_MILLION = 1_000_000


@dataclass(frozen=True, slots=True)
class ProviderInfo:
    """A provider's section: its pricing page, the page its limits come from, its note."""

    name: str
    source: str
    limits_source: str | None = None
    note: str = ""
    #: Another section whose entries this one uses (``azure_openai``: ``openai``).
    same_as: str | None = None
    #: API hosts an ``openai``-type provider is recognised as this provider by.
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One catalogued model. Prices are US dollars per token."""

    provider: str
    id: str
    input_per_token: float
    output_per_token: float
    cached_input_per_token: float | None
    context_window: int
    max_output_tokens: int | None
    tools: bool
    vision: bool
    json_mode: bool
    prefill: bool
    #: The pricing page the figures come from, and the date the catalogue was compiled.
    source: str
    compiled: str
    aliases: tuple[str, ...] = ()
    #: The OpenAI token encoding of the model (``o200k_base``, ``cl100k_base``), if it has one.
    encoding: str | None = None

    @property
    def per_1k(self) -> tuple[float, float]:
        """(input, output) US dollars per thousand tokens, as ``prices:`` entries are written."""
        return self.input_per_token * 1000, self.output_per_token * 1000


@dataclass(frozen=True)
class Catalogue:
    """The whole catalogue: its date, its providers and its models."""

    compiled: str
    providers: Mapping[str, ProviderInfo]
    models: tuple[ModelInfo, ...]

    def __post_init__(self) -> None:
        index: dict[tuple[str, str], ModelInfo] = {}
        for model in self.models:
            for name in (model.id, *model.aliases):
                index.setdefault((model.provider, name), model)
        object.__setattr__(self, "_index", index)

    def lookup(self, provider: str, model: str) -> ModelInfo | None:
        """The entry for ``model`` as ``provider`` serves it, or ``None`` when not catalogued."""
        info = self.providers.get(provider)
        section = (info.same_as or provider) if info is not None else provider
        index: dict[tuple[str, str], ModelInfo] = self._index  # type: ignore[attr-defined]
        found = index.get((section, model))
        if found is None and section == "bedrock" and model.startswith(CROSS_REGION_PREFIXES):
            found = index.get((section, model.split(".", 1)[1]))
        return found

    def find(self, model: str) -> ModelInfo | None:
        """The first entry of any provider for ``model`` (what a fake stands in for)."""
        for provider in self.providers:
            found = self.lookup(provider, model)
            if found is not None:
                return found
        return None

    def entries(self, provider: str | None = None) -> list[ModelInfo]:
        """The models, in file order; only ``provider``'s (its own section's) when given."""
        if provider is None:
            return list(self.models)
        info = self.providers.get(provider)
        section = (info.same_as or provider) if info is not None else provider
        return [m for m in self.models if m.provider == section]


def _per_token(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{where}: a price must be a non-negative number, got {value!r}")
    return float(value) / PER_MILLION


def _count(value: Any, where: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: must be a positive whole number of tokens, got {value!r}")
    return value


def _model(
    raw: Mapping[str, Any], providers: Mapping[str, ProviderInfo], compiled: str
) -> ModelInfo:
    where = f"models[{raw.get('provider')}/{raw.get('id')}]"
    provider = providers.get(raw["provider"])
    if provider is None or provider.same_as is not None:
        raise ValueError(f"{where}: provider {raw['provider']!r} has no section of its own")
    window = _count(raw["context_window"], f"{where}.context_window")
    assert window is not None
    limit = _count(raw.get("max_output_tokens"), f"{where}.max_output_tokens", optional=True)
    if limit is not None and limit > window:
        raise ValueError(f"{where}: max_output_tokens {limit} is above the window {window}")
    cached = raw.get("cached_input")
    return ModelInfo(
        provider=provider.name,
        id=raw["id"],
        input_per_token=_per_token(raw["input"], f"{where}.input"),
        output_per_token=_per_token(raw["output"], f"{where}.output"),
        cached_input_per_token=None if cached is None else _per_token(cached, f"{where}.cached"),
        context_window=window,
        max_output_tokens=limit,
        tools=bool(raw["tools"]),
        vision=bool(raw["vision"]),
        json_mode=bool(raw["json_mode"]),
        prefill=bool(raw["prefill"]),
        source=provider.source,
        compiled=compiled,
        aliases=tuple(raw.get("aliases", ())),
        encoding=raw.get("encoding"),
    )


def parse(data: Mapping[str, Any]) -> Catalogue:
    """A catalogue from the data file's content; ``ValueError`` names the entry at fault."""
    compiled = data["compiled"]
    providers = {
        name: ProviderInfo(
            name=name,
            source=section["source"],
            limits_source=section.get("limits_source"),
            note=section.get("note", ""),
            same_as=section.get("same_as"),
            hosts=tuple(section.get("hosts", ())),
        )
        for name, section in data["providers"].items()
    }
    models = tuple(_model(raw, providers, compiled) for raw in data["models"])
    return Catalogue(compiled=compiled, providers=providers, models=models)


@functools.cache
def load() -> Catalogue:
    """The shipped catalogue, read and checked once per process."""
    text = resources.files(__package__).joinpath("models.json").read_text(encoding="utf-8")
    return parse(json.loads(text))


def section_for(provider_type: str, base_url: str | None, preset: str | None = None) -> str | None:
    """The catalogue section a configured provider reads (``None``: every section, a fake)."""
    catalogue = load()
    if preset is not None and preset in catalogue.providers:
        return preset
    if provider_type == "fake":
        return None
    if provider_type == "openai" and base_url:
        host = urlsplit(base_url).hostname or ""
        for info in catalogue.providers.values():
            if host in info.hosts:
                return info.name
    return provider_type


def lookup(provider: str, model: str) -> ModelInfo | None:
    """The shipped catalogue's entry for ``model`` of ``provider`` (see :meth:`Catalogue.lookup`)."""
    return load().lookup(provider, model)


def find(
    provider_type: str, model: str, base_url: str | None = None, preset: str | None = None
) -> ModelInfo | None:
    """The entry for a configured provider's model: its section's (:func:`section_for`)."""
    section = section_for(provider_type, base_url, preset)
    catalogue = load()
    return catalogue.find(model) if section is None else catalogue.lookup(section, model)
