"""The production config the image ships: it loads with the real loader and its rules hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import (
    COMPOSE_CONFIG,
    COMPOSE_FILE,
    PRODUCTION_CONFIG,
    by_kind,
    load_with_secrets,
    nginx_directive,
    seconds,
)
from tidegate.errors import ConfigError
from tidegate.gateway.build import check_config_against_policies, retry_policy_from
from tidegate.gateway.config import Config, Profile, load_config, profile_problems
from tidegate.policy.deadline import Layer, chain_problems
from tidegate.policy.retry import provider_layer

#: Where the deployment files declare how long callers wait (read by `tidegate check timeouts`).
CLIENT_TIMEOUT = "tidegate.client_timeout_s"
INGRESS_READ_TIMEOUT = "nginx.ingress.kubernetes.io/proxy-read-timeout"


def _chain(config: Config, client_s: float, balancer_s: float) -> list[Layer]:
    """The timeout layers of every route, from the caller inwards; asserts that they nest."""
    layers = [
        Layer("client", client_s),
        Layer("load balancer", balancer_s),
        Layer("gateway request", config.server.request_timeout_s),
    ]
    policy = retry_policy_from(config)
    for alias, route in config.models.items():
        for name in route.providers:
            stream = config.providers[name].stream.max_duration_s
            provider = provider_layer(
                f"{alias} via {name}", config.retry.attempts, route.per_try_timeout_s, policy
            )
            problems = chain_problems([*layers, Layer(f"{name} stream", stream), provider])
            assert problems == [], problems
    return layers


def test_production_config_loads_with_the_real_loader(tmp_path: Path) -> None:
    """The shipped production config passes the loader and every policy's option checks."""
    config = load_with_secrets(PRODUCTION_CONFIG, tmp_path)
    check_config_against_policies(config)
    assert config.profile is Profile.PRODUCTION
    assert profile_problems(config) == []


def test_production_config_has_what_the_production_profile_demands(tmp_path: Path) -> None:
    """Auth, rate limits, budgets, a postgresql:// store, pinned model ids and no fake provider."""
    config = load_with_secrets(PRODUCTION_CONFIG, tmp_path)
    assert config.auth.keys_file is not None
    assert config.rate_limits.per_user is not None
    assert config.rate_limits.per_tenant is not None
    assert config.budgets is not None
    assert config.state.url.startswith("postgresql://")
    for name, provider in config.providers.items():
        assert provider.type != "fake", name
        assert "latest" not in provider.model, name


def test_production_config_secrets_are_mounted_files_never_values() -> None:
    """Every secret the config needs is a path under a mount, none is an inline value."""
    raw = yaml.safe_load(PRODUCTION_CONFIG.read_text(encoding="utf-8"))
    assert raw["auth"]["keys_file"].startswith("/run/secrets/tidegate/")
    files = [p["api_key_file"] for p in raw["providers"].values() if "api_key_file" in p]
    assert files, "no provider reads a key file"
    assert all(f.startswith("/run/secrets/tidegate/") for f in files)
    url = raw["state"]["url"]
    user = url.split("://", 1)[1].split("@", 1)[0]
    assert ":" not in user, "a password in the state URL"
    assert "passfile=/run/tidegate/" in url


def test_production_config_refuses_to_start_without_its_secret_files(tmp_path: Path) -> None:
    """Unmounted secrets stop the process at start-up, naming the key."""
    with pytest.raises(ConfigError, match=r"auth\.keys_file: secret file"):
        load_config(PRODUCTION_CONFIG, env={})


def test_production_config_refuses_the_fake_provider(tmp_path: Path) -> None:
    """Swapping in the fake provider makes the production profile refuse to start."""
    with pytest.raises(ConfigError, match="must not use the fake provider"):
        load_with_secrets(
            PRODUCTION_CONFIG,
            tmp_path,
            **{
                "TIDEGATE_PROVIDERS__IN-HOUSE__TYPE": "fake",
                "TIDEGATE_PROVIDERS__IN-HOUSE__BASE_URL": "",
            },
        )


def test_production_config_timeouts_nest_from_the_client_inwards(tmp_path: Path) -> None:
    """Client > Ingress > request > stream > attempts x per-try + backoff, on every route."""
    config = load_with_secrets(PRODUCTION_CONFIG, tmp_path)
    client = float(by_kind("Deployment")["metadata"]["annotations"][CLIENT_TIMEOUT])
    balancer = float(by_kind("Ingress")["metadata"]["annotations"][INGRESS_READ_TIMEOUT])
    _chain(config, client, balancer)


def test_production_drain_lets_the_longest_request_finish(tmp_path: Path) -> None:
    """On SIGTERM the drain lasts at least as long as a request may, so none is cut short."""
    config = load_with_secrets(PRODUCTION_CONFIG, tmp_path)
    assert config.server.drain_seconds >= config.server.request_timeout_s


def test_compose_config_loads_and_its_timeouts_nest(tmp_path: Path) -> None:
    """The local stack's gateway config loads with the real loader and its timeouts nest."""
    config = load_with_secrets(COMPOSE_CONFIG, tmp_path)
    check_config_against_policies(config)
    assert config.state.url.startswith("postgresql://")
    assert config.state.fast_url == "redis://redis:6379/0"
    compose = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    client = float(compose["services"]["gateway-1"]["labels"][CLIENT_TIMEOUT])
    (balancer,) = nginx_directive("proxy_read_timeout")
    _chain(config, client, seconds(balancer))


def test_the_image_environment_is_accepted_by_the_loader(tmp_path: Path) -> None:
    """The image sets TIDEGATE_GIT_SHA (served at /version); the loader must not read it as a key."""
    config = load_with_secrets(PRODUCTION_CONFIG, tmp_path, TIDEGATE_GIT_SHA="0123abc")
    assert config.profile is Profile.PRODUCTION
