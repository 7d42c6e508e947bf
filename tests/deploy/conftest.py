"""Paths and loaders shared by the deployment tests."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tidegate.gateway.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
PRODUCTION_CONFIG = DEPLOY / "tidegate.production.yaml"
COMPOSE_CONFIG = DEPLOY / "compose" / "tidegate.yaml"
NGINX_CONF = DEPLOY / "nginx.conf"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

#: Environment variable names that look like they hold a secret.
SECRET_NAME = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|PRIVATE)", re.IGNORECASE)

_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)(h|ms|m|s))")


def seconds(value: str | int | float) -> float:
    """A Docker Compose duration (``40s``, ``1m30s``, ``500ms``) or a number, in seconds."""
    if isinstance(value, int | float):
        return float(value)
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ValueError(f"not a duration: {value!r}")
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


def nginx_directive(name: str, text: str | None = None) -> list[str]:
    """The arguments of every ``name ...;`` directive in nginx.conf (comments left out)."""
    source = NGINX_CONF.read_text(encoding="utf-8") if text is None else text
    lines = [line.split("#", 1)[0] for line in source.splitlines()]
    found = re.findall(rf"(?:^|[;{{}}\s]){re.escape(name)}\s+([^;{{]*);", "\n".join(lines))
    return [" ".join(args.split()) for args in found]


def manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes object in deploy/kubernetes/*.yaml, with its file (not kustomize's own)."""
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if (
                isinstance(document, dict)
                and document.get("kind", "Kustomization") != "Kustomization"
            ):
                yield path, document


def by_kind(kind: str) -> dict[str, Any]:
    """The one Kubernetes object of ``kind``."""
    found = [doc for _, doc in manifests() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


KEYS = {
    "keys": [
        {
            "id": "checkout-service",
            "sha256": "0" * 64,
            "tenant": "shop",
            "user": "checkout",
            "priority": "critical",
            "data_class": "internal",
            "models": ["chat-default"],
        }
    ]
}


def secret_overrides(config_path: Path, folder: Path) -> dict[str, str]:
    """Dummy secret files in ``folder`` and the ``TIDEGATE_*`` overrides pointing at them.

    A config names the paths where the orchestrator mounts its secrets; the overrides are how an
    operator points the same file at other mounts, and they go through the real loader.
    """
    raw = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    env: dict[str, str] = {}
    if (raw.get("auth") or {}).get("keys_file"):
        keys = folder / "keys.yaml"
        keys.write_text(yaml.safe_dump(KEYS), encoding="utf-8")
        env["TIDEGATE_AUTH__KEYS_FILE"] = str(keys)
    if (raw.get("auth") or {}).get("admin_keys_file"):
        admin = folder / "admin-keys.yaml"
        admin.write_text(yaml.safe_dump({"keys": [{"id": "oncall", "sha256": "1" * 64}]}))
        env["TIDEGATE_AUTH__ADMIN_KEYS_FILE"] = str(admin)
    for name, provider in raw["providers"].items():
        if provider.get("api_key_file"):
            secret = folder / f"{name}-api-key"
            secret.write_text("placeholder\n", encoding="utf-8")
            env[f"TIDEGATE_PROVIDERS__{name.upper()}__API_KEY_FILE"] = str(secret)
    return env


def load_with_secrets(config_path: Path, folder: Path, **extra: str) -> Config:
    """``config_path`` through the real loader, with dummy secrets in ``folder``."""
    return load_config(config_path, env={**secret_overrides(config_path, folder), **extra})
