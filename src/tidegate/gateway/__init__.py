"""The ASGI service: the request pipeline, health and metrics endpoints, config and auth."""

from tidegate.gateway.app import Gateway
from tidegate.gateway.auth import Identity, KeyRing, hash_key
from tidegate.gateway.config import Config, load_config

__all__ = ["Config", "Gateway", "Identity", "KeyRing", "hash_key", "load_config"]
