"""A release game day: a candidate with a defect that grows with traffic, under three strategies.

A scenario file (JSON) gives the traffic, the baseline and the candidate (error, validation
failure, latency and cost per request) and the defect: the candidate's error rate rises by
``defect_slope`` times its share of the traffic, so it hides at a small share and shows at scale.
Each strategy runs with the gate on and off:

- ``rolling`` replaces instances one step per window, so a request reaches the candidate with the
  share of replaced instances, whoever sent it;
- ``canary`` gives the candidate a sticky cohort of users (:func:`~tidegate.policy.rollout.in_cohort`)
  that grows along the schedule;
- ``blue_green`` flips all traffic at once; flipping back is the rollback.

With the gate on, the real :class:`~tidegate.policy.rollout.RolloutGate` judges every window
(the candidate's requests against the baseline's from the same window; for blue-green, against
the baseline's last window before the flip) and proceeds, holds or rolls back. With the gate
off, the share climbs one step per window, and an alert on the fleet-wide error rate pages a
person who rolls back ``alert_response`` seconds later. The alert stays armed with the gate on.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Final

from tidegate.lab.replicate import aggregate, replicate
from tidegate.lab.report import percentile
from tidegate.policy.rollout import (
    RolloutGate,
    RolloutOptions,
    Schedule,
    Verdict,
    WindowStats,
    in_cohort,
)

__all__ = [
    "STRATEGIES",
    "GamedayScenario",
    "GateStep",
    "ReleaseResult",
    "VersionSpec",
    "gameday_summary",
    "load_scenario",
    "run_gameday",
    "run_release",
]

STRATEGIES: Final = ("rolling", "canary", "blue_green")


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionSpec:
    """One version's behaviour per request; latency is log-normal around ``latency_median``."""

    error_rate: float
    validation_failure_rate: float = 0.0
    latency_median: float = 1.0
    latency_sigma: float = 0.3
    cost_per_request: float = 0.001
    #: Extra error rate per unit of traffic share (the defect that grows with traffic).
    defect_slope: float = 0.0

    def __post_init__(self) -> None:
        for name in ("error_rate", "validation_failure_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        for name in ("latency_median", "latency_sigma", "cost_per_request", "defect_slope"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def error_at(self, share: float) -> float:
        """The error rate when this version carries ``share`` of the traffic."""
        return min(1.0, self.error_rate + self.defect_slope * share)


@dataclass(frozen=True, slots=True, kw_only=True)
class GamedayScenario:
    """The release to rehearse. Times are seconds."""

    baseline: VersionSpec
    candidate: VersionSpec
    #: Requests per second (Poisson) from ``users`` distinct users.
    rate: float = 10.0
    users: int = 20_000
    #: The gate looks at one window at a time; without the gate the share moves once per window.
    window: float = 600.0
    duration: float = 10_800.0
    #: A fleet-wide error rate over one window above this pages a person...
    alert_error_rate: float = 0.05
    #: ...who rolls back this long after the window that fired.
    alert_response: float = 600.0
    #: Instances replaced one per window by ``rolling``.
    rolling_instances: int = 10
    #: The canary's traffic shares.
    canary_shares: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
    #: The gate's thresholds (see :class:`~tidegate.policy.rollout.RolloutOptions`).
    rules: RolloutOptions = field(default_factory=RolloutOptions)
    salt: str = "gameday"

    def __post_init__(self) -> None:
        for name in ("rate", "window", "duration", "alert_response"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.users < 1:
            raise ValueError(f"users must be >= 1, got {self.users!r}")
        if self.rolling_instances < 1:
            raise ValueError(f"rolling_instances must be >= 1, got {self.rolling_instances!r}")
        if not 0.0 < self.alert_error_rate <= 1.0:
            raise ValueError(f"alert_error_rate must be in (0, 1], got {self.alert_error_rate!r}")
        Schedule(self.canary_shares)  # validates the shares

    def schedule(self, strategy: str) -> Schedule:
        """The traffic shares ``strategy`` steps through."""
        if strategy == "rolling":
            n = self.rolling_instances
            return Schedule(tuple(k / n for k in range(1, n + 1)))
        if strategy == "canary":
            return Schedule(self.canary_shares)
        if strategy == "blue_green":
            return Schedule((1.0,))
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def _spec(data: Any, where: str) -> VersionSpec:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object")
    known = {f.name for f in fields(VersionSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}")
    try:
        return VersionSpec(**data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def load_scenario(path: str | Path | None = None) -> GamedayScenario:
    """Read a scenario file; ``None`` reads the one shipped with tidegate.

    Keys: ``baseline`` and ``candidate`` (each: ``error_rate``, ``validation_failure_rate``,
    ``latency_median``, ``latency_sigma``, ``cost_per_request``, ``defect_slope``), and optional
    ``rate``, ``users``, ``window``, ``duration``, ``alert_error_rate``, ``alert_response``,
    ``rolling_instances``, ``canary_shares``, ``rules`` (gate thresholds) and ``salt``.
    Unknown keys are refused, naming the key.
    """
    if path is None:
        text = resources.files("tidegate.lab").joinpath("data/gameday.json").read_text("utf-8")
        where = "the built-in game-day scenario"
    else:
        text = Path(path).read_text(encoding="utf-8")
        where = str(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: the top level must be an object")
    known = {f.name for f in fields(GamedayScenario)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}")
    values: dict[str, Any] = dict(data)
    for side in ("baseline", "candidate"):
        if side not in values:
            raise ValueError(f"{where}: missing {side!r}")
        values[side] = _spec(values[side], f"{where}: {side}")
    if "rules" in values:
        rules = values["rules"]
        if not isinstance(rules, dict):
            raise ValueError(f"{where}: rules must be an object")
        try:
            values["rules"] = RolloutOptions(**rules)
        except TypeError as exc:
            raise ValueError(f"{where}: rules: {exc}") from None
    if "canary_shares" in values:
        values["canary_shares"] = tuple(values["canary_shares"])
    try:
        return GamedayScenario(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class GateStep:
    """One window's decision: at its end (seconds into the release), the share it ran at, the
    evidence, the verdict."""

    at: float
    share: float
    canary_requests: int
    canary_errors: int
    baseline_requests: int
    baseline_errors: int
    action: str
    reasons: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "share": self.share,
            "canary_requests": self.canary_requests,
            "canary_errors": self.canary_errors,
            "baseline_requests": self.baseline_requests,
            "baseline_errors": self.baseline_errors,
            "action": self.action,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseResult:
    """One strategy, gate on or off: who saw the candidate, and when it was rolled back."""

    strategy: str
    gated: bool
    outcome: str
    #: Requests served by the candidate, and how many of those failed.
    exposed: int
    failed: int
    #: Seconds from the start of the release to the rollback; ``None`` if it never happened.
    #: (The release starts after one window on the baseline alone.)
    rolled_back_at: float | None
    steps: tuple[GateStep, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "gated": self.gated,
            "outcome": self.outcome,
            "exposed": self.exposed,
            "failed": self.failed,
            "rolled_back_at": self.rolled_back_at,
            "steps": [step.as_dict() for step in self.steps],
        }


class _Window:
    __slots__ = ("costs", "errors", "latencies", "requests", "validation")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.validation = 0
        self.latencies: list[float] = []
        self.costs = 0.0

    def add(self, error: bool, invalid: bool, latency: float, cost: float) -> None:
        self.requests += 1
        self.errors += error
        self.validation += invalid
        self.latencies.append(latency)
        self.costs += cost

    def stats(self) -> WindowStats:
        ordered = sorted(self.latencies)
        return WindowStats(
            requests=self.requests,
            errors=self.errors,
            validation_failures=self.validation,
            p95_latency=percentile(ordered, 0.95) if ordered else None,
            cost_per_request=self.costs / self.requests if self.requests else None,
        )


def run_release(
    scenario: GamedayScenario, strategy: str, *, gated: bool, seed: int = 0
) -> ReleaseResult:
    """Replay the release with ``strategy`` and the gate on (``gated``) or off."""
    schedule = scenario.schedule(strategy)
    gate = RolloutGate(scenario.rules, schedule)
    rng = random.Random(f"tidegate-lab/gameday/{seed}")
    users = [f"user-{i}" for i in range(scenario.users)]
    # The first window runs on the baseline alone; the release starts when it ends, so even
    # blue-green has a baseline window to be judged against.
    start = scenario.window
    share = 0.0
    now = 0.0
    exposed = failed = 0
    rolled_back_at: float | None = None
    rollback_due: float | None = None
    steps: list[GateStep] = []
    last_baseline: WindowStats | None = None
    outcome = "running"
    base, cand = scenario.baseline, scenario.candidate
    next_arrival = -math.log(1.0 - rng.random()) / scenario.rate
    window_end = scenario.window
    while window_end <= start + scenario.duration + 1e-9:
        canary, baseline = _Window(), _Window()
        candidate_error = cand.error_at(share)
        while next_arrival < window_end:
            if rollback_due is not None and next_arrival >= rollback_due:
                share, rolled_back_at, rollback_due = 0.0, rollback_due - start, None
                outcome = "rolled_back"
                candidate_error = cand.error_at(0.0)
            user = users[int(rng.random() * len(users))]
            if share <= 0.0:
                on_candidate = False
            elif strategy == "canary":
                on_candidate = in_cohort(scenario.salt, user, share)
            else:
                on_candidate = rng.random() < share
            spec, side = (cand, canary) if on_candidate else (base, baseline)
            error = rng.random() < (candidate_error if on_candidate else spec.error_rate)
            invalid = rng.random() < spec.validation_failure_rate
            latency = spec.latency_median * math.exp(spec.latency_sigma * rng.gauss(0.0, 1.0))
            side.add(error, invalid, latency, spec.cost_per_request)
            if on_candidate:
                exposed += 1
                failed += error
            next_arrival += -math.log(1.0 - rng.random()) / scenario.rate
        now = window_end
        window_end += scenario.window
        if now == start:
            last_baseline = baseline.stats()
            share = schedule.shares[0]
            continue
        if rollback_due is not None and rollback_due <= now:
            share, rolled_back_at, rollback_due = 0.0, rollback_due - start, None
            outcome = "rolled_back"
        if share <= 0.0:
            break
        fleet_errors = canary.errors + baseline.errors
        fleet_requests = canary.requests + baseline.requests
        alert = fleet_requests > 0 and fleet_errors / fleet_requests > scenario.alert_error_rate
        if alert and rollback_due is None:
            rollback_due = now + scenario.alert_response
        canary_stats = canary.stats()
        reference = baseline.stats() if baseline.requests else last_baseline
        if reference is None:
            reference = WindowStats(
                requests=0, errors=0, validation_failures=0, p95_latency=None, cost_per_request=None
            )
        if baseline.requests:
            last_baseline = baseline.stats()
        if gated:
            step = gate.evaluate(share, canary_stats, reference)
            action = step.decision.verdict.value
            reasons = step.decision.reasons
            if step.decision.verdict is Verdict.ROLLBACK:
                rolled_back_at, rollback_due = now - start, None
                outcome = "rolled_back"
            new_share = step.new_share
        else:
            nxt = schedule.next_share(share)
            action = "step" if nxt is not None else "stay"
            reasons = ("the gate is off: the share moves on schedule",)
            new_share = share if nxt is None else nxt
        if alert and not (gated and new_share == 0.0):
            reasons = (
                *reasons,
                f"alert: fleet error rate {fleet_errors}/{fleet_requests} is over "
                f"{scenario.alert_error_rate:.0%}; a person rolls back at "
                f"{(rollback_due or now) - start:.0f}s",
            )
        steps.append(
            GateStep(
                at=now - start,
                share=share,
                canary_requests=canary_stats.requests,
                canary_errors=canary_stats.errors,
                baseline_requests=reference.requests,
                baseline_errors=reference.errors,
                action=action,
                reasons=tuple(reasons),
            )
        )
        share = new_share
        if share <= 0.0:
            break
    if outcome == "running":
        outcome = "completed" if share >= 1.0 else "held"
    return ReleaseResult(
        strategy=strategy,
        gated=gated,
        outcome=outcome,
        exposed=exposed,
        failed=failed,
        rolled_back_at=rolled_back_at,
        steps=tuple(steps),
    )


def run_gameday(scenario: GamedayScenario, *, seed: int = 0) -> list[ReleaseResult]:
    """Every strategy, gate off then on, on the same scenario."""
    return [
        run_release(scenario, strategy, gated=gated, seed=seed)
        for strategy in STRATEGIES
        for gated in (False, True)
    ]


def _gameday_replication(scenario: GamedayScenario, seed: int) -> list[dict[str, Any]]:
    return [result.as_dict() for result in run_gameday(scenario, seed=seed)]


def gameday_summary(
    scenario: GamedayScenario,
    *,
    seed: int = 0,
    replications: int = 10,
    jobs: int = 1,
    progress: Callable[[], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """:func:`run_gameday` over independent replications.

    Returns, per strategy and gate, each figure a mean with its 95% interval (``outcome`` kept
    when every replication agrees, else listed per replication; ``rolled_back_at`` over the
    replications that rolled back), without the steps; and the first replication's results
    with their gated steps, to show how one release went.
    """
    _, values = replicate(
        _gameday_replication,
        scenario,
        seed=seed,
        replications=replications,
        workers=jobs,
        progress=progress,
    )
    stripped = [[{k: v for k, v in r.items() if k != "steps"} for r in one] for one in values]
    summary: list[dict[str, Any]] = aggregate(stripped)
    return summary, values[0]
