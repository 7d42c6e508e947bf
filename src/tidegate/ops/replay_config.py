"""The settings ``tidegate lab replay`` runs a log through, read from a tidegate YAML file exactly
as the gateway reads it.

The lab never imports the gateway (``tests/test_layers.py``); this module, in ``ops`` (which sees
both), is the one bridge: the file goes through the gateway's own loader
(:func:`~tidegate.gateway.config.load_config`: every key, default and refusal is the gateway's),
the start-up check of the policies (:func:`~tidegate.gateway.build.check_config_against_policies`)
and the gateway's own builders of the policies' options (:mod:`tidegate.gateway.build`), so a
replay's admission, retries, retry budget and breaker are the ones the gateway would build from
the same file. :func:`tidegate.lab.replay.load_replay_config` turns what it returns into a
:class:`~tidegate.lab.replay.ReplayConfig`.

Two things differ from starting the gateway, on purpose:

- The environment's ``TIDEGATE_*`` overrides are not applied (``env={}``): a replay reads the
  file it is given, whatever the machine running the lab has set.
- A secret file the config names (``auth.keys_file``, ``auth.admin_keys_file``, a provider's
  ``api_key_file``) need not exist. The live config usually names files that only its pods
  hold; whether a file exists is a fact about the machine, not about the config, and a replay
  never reads a secret. Every other refusal holds, the profile's rules included: a
  ``production`` config the gateway would refuse to start (no rate limits, no budgets, ...)
  is refused here with the gateway's message.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tidegate.errors import ConfigError
from tidegate.gateway.build import (
    admission_options_from,
    breaker_options_from,
    check_config_against_policies,
    retry_policy_from,
)
from tidegate.gateway.config import Config, load_config
from tidegate.policy.admission import AdmissionOptions
from tidegate.policy.breaker import BreakerOptions
from tidegate.policy.retry import RetryOptions
from tidegate.policy.routing import FailoverOptions

__all__ = ["ReplaySettings", "gateway_config", "replay_settings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplaySettings:
    """The policies' options of one config, as the gateway builds them."""

    admission: AdmissionOptions
    retry: RetryOptions
    #: ``retry.budget_ratio`` and ``retry.budget_floor_per_s``: the retry budget's
    #: (:func:`~tidegate.gateway.build.retry_budget_from` builds it from these two).
    budget_ratio: float
    budget_floor_per_s: float
    breaker: BreakerOptions
    failover: FailoverOptions
    #: ``server.request_timeout_s``.
    deadline: float
    #: The shortest of the routes' ``per_try_timeout_s`` (the replay has one provider).
    per_try: float


def gateway_config(path: str | Path) -> Config:
    """``path`` read by the gateway's loader, without the environment's overrides and without
    needing its secret files to exist (see the module). Raises ``ValueError`` with the gateway's
    message, which names the file and the key at fault."""
    path = Path(path)
    try:
        config = load_config(path, env={}, secret_files=False)
    except ConfigError as exc:
        raise ValueError(exc.message) from None
    try:
        check_config_against_policies(config)
    except ConfigError as exc:
        raise ValueError(f"{path}: {exc.message}") from None
    return config


def replay_settings(path: str | Path) -> ReplaySettings:
    """The admission, retry, retry budget, breaker, failover and timeout settings of a tidegate
    YAML file, built by the gateway's own functions (:func:`gateway_config` reads the file)."""
    config = gateway_config(path)
    return ReplaySettings(
        admission=admission_options_from(config),
        retry=retry_policy_from(config),
        budget_ratio=config.retry.budget_ratio,
        budget_floor_per_s=config.retry.budget_floor_per_s,
        breaker=breaker_options_from(config),
        # As the gateway's runtime builds its failover table's options.
        failover=FailoverOptions(retry_timeouts=config.retry.retry_timeouts_on_same_provider),
        deadline=config.server.request_timeout_s,
        per_try=min(route.per_try_timeout_s for route in config.models.values()),
    )
