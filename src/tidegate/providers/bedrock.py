"""The ``bedrock`` provider type (being written: see docs/providers.md)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from pydantic import BaseModel, ConfigDict

from tidegate.clock import Clock
from tidegate.errors import ConfigError
from tidegate.providers.base import Provider

__all__ = ["BedrockOptions", "build"]


class BedrockOptions(BaseModel):
    """The ``bedrock:`` section of a provider of this type."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def build(
    name: str,
    *,
    model: str,
    base_url: str | None,
    api_key: str | None,
    options: BedrockOptions | None,
    session: aiohttp.ClientSession,
    clock: Clock,
    base_dir: Path,
) -> Provider:
    """The provider for one config section (files named in ``options`` relative to base_dir)."""
    raise ConfigError(f"providers.{name}: the bedrock provider type is not built yet")
