"""Configuration: unknown keys, the production profile and secret files refuse to start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tidegate.cli import app as cli
from tidegate.errors import ConfigError
from tidegate.gateway.config import load_config

MINIMAL: dict[str, Any] = {
    "providers": {"p": {"type": "fake", "model": "m-2026-01"}},
    "models": {"chat": {"providers": ["p"]}},
}


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_minimal_config_loads_with_documented_defaults(tmp_path: Path) -> None:
    """Two sections are enough; everything else has a default."""
    config = load_config(_write(tmp_path, MINIMAL), env={})
    assert config.server.port == 8080
    assert config.state.url == "sqlite:///.tidegate/state.db"
    assert config.retry.jitter == "full"


def test_misspelt_key_names_the_key_and_the_file(tmp_path: Path) -> None:
    """A typo refuses to start; the message names the dotted key and the file."""
    path = _write(tmp_path, {**MINIMAL, "server": {"prot": 9000}})
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert "unknown key 'server.prot'" in str(caught.value)
    assert str(path) in str(caught.value)


def test_inline_secret_is_refused_with_a_hint(tmp_path: Path) -> None:
    """An inline api_key is not a known key, and the message says to use a file."""
    data = {
        **MINIMAL,
        "providers": {
            "p": {"type": "openai", "model": "m", "base_url": "http://x/v1", "api_key": "sk-1"}
        },
    }
    with pytest.raises(ConfigError, match="use api_key_file"):
        load_config(_write(tmp_path, data), env={})


def test_missing_secret_file_refuses_to_start(tmp_path: Path) -> None:
    """A secret file that does not exist is named at start-up."""
    data = {**MINIMAL, "auth": {"keys_file": "nowhere/keys.yaml"}}
    with pytest.raises(
        ConfigError, match=r"auth.keys_file: secret file 'nowhere/keys.yaml' does not exist"
    ):
        load_config(_write(tmp_path, data), env={})


def test_production_refuses_the_fake_provider_and_missing_controls(tmp_path: Path) -> None:
    """Production needs auth, limits, budgets, durable state and pinned ids, and no fake."""
    data = {**MINIMAL, "profile": "production", "state": {"url": "memory://"}}
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, data), env={})
    message = str(caught.value)
    for needle in (
        "needs authentication",
        "needs rate limits",
        "needs budgets",
        "durable state URL",
        "must not use the fake provider (providers.p)",
    ):
        assert needle in message


def test_production_refuses_unpinned_model_ids(tmp_path: Path) -> None:
    """A model id ending in 'latest' is not pinned."""
    (tmp_path / "keys.yaml").write_text("keys: []\n", encoding="utf-8")
    (tmp_path / "key.txt").write_text("sk\n", encoding="utf-8")
    provider: dict[str, Any] = {
        "type": "openai",
        "model": "gpt-4o-latest",
        "base_url": "http://x/v1",
        "api_key_file": "key.txt",
    }
    data = {
        "profile": "production",
        "auth": {"keys_file": "keys.yaml"},
        "rate_limits": {"per_user": {"rate_per_s": 1, "burst": 5}},
        "budgets": {"calls": 100},
        "state": {"url": "postgresql://db/tidegate"},
        "providers": {"p": provider},
        "models": {"chat": {"providers": ["p"]}},
    }
    with pytest.raises(
        ConfigError, match=r"pinned model ids: providers\.p\.model is 'gpt-4o-latest'"
    ):
        load_config(_write(tmp_path, data), env={})
    provider["model"] = "gpt-4o-2024-08-06"
    assert load_config(_write(tmp_path, data), env={}).profile.value == "production"


def test_production_refuses_a_fallback_override_without_a_reason(tmp_path: Path) -> None:
    """approved_fallback: true is an override of the eval verdict: production wants the reason,
    and names the key to set; with approved_fallback_reason the same config starts."""
    (tmp_path / "keys.yaml").write_text("keys: []\n", encoding="utf-8")
    base = {"type": "openai", "base_url": "http://x/v1"}
    backup: dict[str, Any] = {**base, "model": "m-2026-02", "approved_fallback": True}
    data = {
        "profile": "production",
        "auth": {"keys_file": "keys.yaml"},
        "rate_limits": {"per_user": {"rate_per_s": 1, "burst": 5}},
        "budgets": {"calls": 100},
        "state": {"url": "postgresql://db/tidegate"},
        "providers": {"p": {**base, "model": "m-2026-01"}, "backup": backup},
        "models": {"chat": {"providers": ["p", "backup"]}},
    }
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, data), env={})
    assert "set providers.backup.approved_fallback_reason" in str(caught.value)
    backup["approved_fallback_reason"] = "the same model on a second account"
    config = load_config(_write(tmp_path, data), env={})
    assert config.providers["backup"].approved_fallback_reason == (
        "the same model on a second account"
    )
    backup["approved_fallback"] = False  # taking a provider out needs no reason
    del backup["approved_fallback_reason"]
    assert (
        load_config(_write(tmp_path, data), env={}).providers["backup"].approved_fallback is False
    )


def test_a_fallback_reason_needs_an_explicit_approval(tmp_path: Path) -> None:
    """approved_fallback_reason alone explains nothing: the provider's eval verdict decides."""
    data = {
        **MINIMAL,
        "providers": {"p": {"type": "fake", "model": "m", "approved_fallback_reason": "why"}},
    }
    with pytest.raises(ConfigError, match="explains an explicit approved_fallback"):
        load_config(_write(tmp_path, data), env={})
    assert load_config(_write(tmp_path, MINIMAL), env={}).providers["p"].approved_fallback is None


def test_environment_overrides_are_validated_too(tmp_path: Path) -> None:
    """TIDEGATE_SERVER__PORT sets server.port; a misspelt override is named like a key."""
    path = _write(tmp_path, MINIMAL)
    assert load_config(path, env={"TIDEGATE_SERVER__PORT": "9001"}).server.port == 9001
    with pytest.raises(
        ConfigError, match=r"with overrides TIDEGATE_SERVER__PROT\): unknown key 'server.prot'"
    ):
        load_config(path, env={"TIDEGATE_SERVER__PROT": "9001"})


def test_route_naming_an_unknown_provider_is_refused(tmp_path: Path) -> None:
    """A route may only name configured providers."""
    data = {**MINIMAL, "models": {"chat": {"providers": ["p", "ghost"]}}}
    with pytest.raises(ConfigError, match="'ghost', which is not under providers"):
        load_config(_write(tmp_path, data), env={})


def test_serve_refuses_to_start_and_exits_2(tmp_path: Path) -> None:
    """`tidegate serve` prints the problem and exits with status 2 instead of serving."""
    path = _write(tmp_path, {**MINIMAL, "servr": {}})
    result = CliRunner().invoke(cli, ["serve", "--config", str(path)])
    assert result.exit_code == 2
    assert "refusing to start" in result.output
    assert "unknown key 'servr'" in result.output


def _keys(model: type[Any], prefix: str = "") -> list[str]:
    import typing

    from pydantic import BaseModel

    def nested(annotation: Any) -> list[tuple[type[BaseModel], str]]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [(annotation, ".")]
        if typing.get_origin(annotation) is dict:
            return [(m, ".<name>.") for m, _ in nested(typing.get_args(annotation)[1])]
        return [pair for arg in typing.get_args(annotation) for pair in nested(arg)]

    found = []
    for name, field in model.model_fields.items():
        key = prefix + name
        found.append(key)
        for inner, joint in nested(field.annotation):
            found += _keys(inner, key + joint)
    return found


def test_every_config_key_is_documented() -> None:
    """docs/configuration.md has a row for every key the config models accept."""
    from tidegate.gateway.config import Config

    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    sections = {
        "server",
        "auth",
        "state",
        "retry",
        "breaker",
        "rate_limits",
        "admission",
        "idempotency",
        "cache",
        "degraded",
        "output",
        "tracing",
        "logging",
        "providers.<name>.stream",
        "rate_limits.per_user",
        "rate_limits.per_tenant",
        "budgets.degrade",
    }
    missing = [k for k in _keys(Config) if k not in sections and f"| `{k}` |" not in doc]
    assert missing == []
