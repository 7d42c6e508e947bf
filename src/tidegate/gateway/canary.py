"""The canary controller: a route's candidate version, a sticky cohort, and a gate at every step.

A route with a ``canary`` section has two versions (providers, prompt template, parameters). Each
caller is assigned by the sticky cohort hash of ``tenant:user`` (``policy.rollout.in_cohort``),
where the user is the request's ``user`` field (the end user) or else the API key's user: a user
in the candidate's cohort at 5% stays in it at 25%. The share and the rollout's state are
flags (``rollout.<alias>.share``, ``rollout.<alias>.state``), so every move is audited and shared
by every replica, and a rollback is a flag change, never a deploy.

At each evaluation the gate (``policy.rollout.RolloutGate``) compares the candidate's window with
the baseline's from the same window: errors, validation failures (``finish_reason == "length"``,
or an answer that is not the JSON a ``response_format`` asked for), p95 latency and cost per
request. Proceed moves the share to the schedule's next step; hold keeps collecting; rollback sets
the share to 0 with ``who = rollout-controller`` and the gate's reasons as ``why``. Windows are per
process: with several replicas each judges its own sample, and a compare-and-set on the rollout
state store makes sure a step is taken once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

import orjson
import structlog

from tidegate.gateway.config import CanaryConfig, Config, VersionConfig
from tidegate.gateway.flags import set_flag
from tidegate.policy.flags import FlagSet, FlagSpec
from tidegate.policy.rollout import (
    RolloutGate,
    RolloutOptions,
    Schedule,
    Verdict,
    WindowStats,
    in_cohort,
)
from tidegate.state.rollout import VersionConflict

__all__ = [
    "CONTROLLER",
    "Canary",
    "RolloutState",
    "Window",
    "canary_flag_specs",
    "share_flag",
    "state_flag",
    "validation_failed",
]

log = structlog.get_logger("tidegate")

#: Who the audit history names for the controller's own changes.
CONTROLLER = "rollout-controller"
#: Latencies kept per window for the p95: enough for a stable estimate, bounded in memory.
MAX_SAMPLES = 10_000


class RolloutState(StrEnum):
    IDLE = "idle"
    RUNNING = "running"
    PAUSED = "paused"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"
    DONE = "done"


def share_flag(alias: str) -> str:
    return f"rollout.{alias}.share"


def state_flag(alias: str) -> str:
    return f"rollout.{alias}.state"


def canary_flag_specs(config: Config) -> list[FlagSpec]:
    specs = []
    for alias, route in config.models.items():
        if route.canary is None:
            continue
        specs.append(
            FlagSpec(share_flag(alias), float, 0.0, f"share of {alias} traffic on the candidate")
        )
        specs.append(
            FlagSpec(
                state_flag(alias),
                str,
                RolloutState.IDLE.value,
                f"state of the {alias} rollout",
                choices=frozenset(s.value for s in RolloutState),
            )
        )
    return specs


@dataclass
class Window:
    """One version's outcomes since the last step."""

    requests: int = 0
    errors: int = 0
    validation_failures: int = 0
    cost: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def record(self, *, error: bool, invalid: bool, latency: float, cost: float) -> None:
        self.requests += 1
        self.errors += error
        self.validation_failures += invalid and not error
        self.cost += cost
        if len(self.latencies) < MAX_SAMPLES:
            self.latencies.append(latency)

    def stats(self) -> WindowStats:
        p95 = None
        if self.latencies:
            ordered = sorted(self.latencies)
            p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return WindowStats(
            requests=self.requests,
            errors=self.errors,
            validation_failures=self.validation_failures,
            p95_latency=p95,
            cost_per_request=self.cost / self.requests if self.requests else None,
        )


def validation_failed(body: Mapping[str, Any], finish_reason: str | None, content: str) -> bool:
    """A truncated answer, or one that is not the JSON the request's ``response_format`` asked for."""
    if finish_reason == "length":
        return True
    wanted = body.get("response_format")
    if wanted is None:  # the usual case, without the cost of an ABC isinstance check
        return False
    if not isinstance(wanted, Mapping) or wanted.get("type") not in ("json_object", "json_schema"):
        return False
    try:
        value = orjson.loads(content)
    except orjson.JSONDecodeError:
        return True
    schema = (wanted.get("json_schema") or {}).get("schema") or {}
    required = schema.get("required") if isinstance(schema, Mapping) else None
    if isinstance(required, list):
        return not isinstance(value, dict) or any(k not in value for k in required)
    return False


@dataclass
class Canary:
    """One route's rollout: its config, its gate and the two windows."""

    alias: str
    config: CanaryConfig
    gate: RolloutGate
    windows: dict[str, Window] = field(
        default_factory=lambda: {"baseline": Window(), "candidate": Window()}
    )

    @classmethod
    def from_config(cls, alias: str, config: CanaryConfig) -> Canary:
        rules = RolloutOptions(
            min_requests=config.min_requests,
            min_baseline_requests=config.min_baseline_requests,
            error_margin=config.error_margin,
            validation_margin=config.validation_margin,
            latency_ratio=config.latency_ratio,
            cost_ratio=config.cost_ratio,
        )
        return cls(alias, config, RolloutGate(rules, Schedule(tuple(config.schedule))))

    def version_for(self, flags: FlagSet, tenant: str, user: str) -> tuple[str, VersionConfig]:
        """The caller's version: the candidate while its cohort is inside the current share."""
        state = flags.get_str(state_flag(self.alias))
        share = flags.get_float(share_flag(self.alias))
        live = state in (RolloutState.RUNNING, RolloutState.PAUSED, RolloutState.DONE)
        if live and share > 0 and in_cohort(self.config.salt, f"{tenant}:{user}", share):
            return "candidate", self.config.candidate
        return "baseline", self.config.baseline

    def reset(self) -> None:
        self.windows = {"baseline": Window(), "candidate": Window()}

    def status(self, flags: FlagSet) -> dict[str, Any]:
        return {
            "state": flags.get_str(state_flag(self.alias)),
            "share": flags.get_float(share_flag(self.alias)),
            "schedule": list(self.config.schedule),
            "windows": {
                name: {f.name: getattr(stats, f.name) for f in fields(stats)}
                for name, stats in ((n, w.stats()) for n, w in self.windows.items())
            },
        }


def apply_version(body: dict[str, Any], version: VersionConfig) -> dict[str, Any]:
    """The request as this version sends it: its system prompt and parameters."""
    if version.system_prompt is None and not version.params:
        return body
    out = {**body, **version.params}
    if version.system_prompt is not None:
        rest = [m for m in body["messages"] if m.get("role") != "system"]
        out["messages"] = [{"role": "system", "content": version.system_prompt}, *rest]
    return out


async def take_step(rt: Any, alias: str, *, requested_by: str | None = None) -> dict[str, Any]:
    """Judge the windows once and move the rollout: the controller's whole decision.

    Changes are recorded with ``who = rollout-controller``, also when an operator asked for the
    evaluation (``requested_by`` is then named in the reason).
    """
    who = CONTROLLER
    canary: Canary = rt.canaries[alias]
    state = rt.flags.get_str(state_flag(alias))
    share = rt.flags.get_float(share_flag(alias))
    if state != RolloutState.RUNNING:
        return {"verdict": "skipped", "state": state, "share": share, "reasons": []}
    candidate = canary.windows["candidate"].stats()
    baseline = canary.windows["baseline"].stats()
    step = canary.gate.evaluate(share, candidate, baseline)
    reasons = list(step.decision.reasons)
    verdict = step.decision.verdict
    outcome = {"verdict": verdict.value, "share": share, "reasons": reasons}
    if verdict is Verdict.HOLD:
        return {**outcome, "state": state}
    if not await _claim_step(rt, alias, share):
        return {**outcome, "verdict": "taken_elsewhere", "state": state}
    why = "; ".join(reasons) or verdict.value
    if requested_by is not None:
        why += f" (evaluation requested by {requested_by})"
    if verdict is Verdict.ROLLBACK:
        await set_flag(rt, share_flag(alias), 0.0, who, why)
        await set_flag(rt, state_flag(alias), RolloutState.ROLLED_BACK.value, who, why)
        new_state, new_share = RolloutState.ROLLED_BACK.value, 0.0
    elif step.new_share == share:  # proceed at the last step: the candidate has all traffic
        await set_flag(rt, state_flag(alias), RolloutState.DONE.value, who, why)
        new_state, new_share = RolloutState.DONE.value, share
    else:
        await set_flag(rt, share_flag(alias), step.new_share, who, why)
        new_state, new_share = state, step.new_share
        if new_share >= 1.0:  # all traffic on the candidate: nothing is left to compare against
            await set_flag(rt, state_flag(alias), RolloutState.DONE.value, who, why)
            new_state = RolloutState.DONE.value
    log.info("rollout_step", route=alias, verdict=verdict.value, share=new_share, reasons=reasons)
    canary.reset()
    return {**outcome, "state": new_state, "share": new_share}


async def _claim_step(rt: Any, alias: str, share: float) -> bool:
    """Compare-and-set on the rollout state: of several replicas judging the same step, one acts."""
    key = f"canary:{alias}"
    record = await rt.stores.rollout.get(key)
    version = 0 if record is None else record.version
    if record is not None and record.value.get("from_share") == share and record.value.get("done"):
        return False
    try:
        await rt.stores.rollout.put(
            key, {"from_share": share, "done": True}, expected_version=version
        )
    except VersionConflict:
        return False
    return True


async def control(rt: Any, alias: str, action: str, who: str, why: str) -> dict[str, Any]:
    """Operator actions: start, pause, resume, abort."""
    canary: Canary = rt.canaries[alias]
    if action == "start":
        canary.reset()
        await set_flag(rt, share_flag(alias), float(canary.config.schedule[0]), who, why)
        await set_flag(rt, state_flag(alias), RolloutState.RUNNING.value, who, why)
        await rt.stores.rollout.put(
            f"canary:{alias}",
            {"from_share": None, "done": False},
            expected_version=await _version(rt, alias),
        )
    elif action == "pause":
        await set_flag(rt, state_flag(alias), RolloutState.PAUSED.value, who, why)
    elif action == "resume":
        await set_flag(rt, state_flag(alias), RolloutState.RUNNING.value, who, why)
    elif action == "abort":
        await set_flag(rt, share_flag(alias), 0.0, who, why)
        await set_flag(rt, state_flag(alias), RolloutState.ABORTED.value, who, why)
    else:
        raise ValueError(action)
    return canary.status(rt.flags)


async def _version(rt: Any, alias: str) -> int:
    record = await rt.stores.rollout.get(f"canary:{alias}")
    return 0 if record is None else int(record.version)
