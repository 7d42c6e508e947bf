"""Canary rollout: sticky cohorts, the metric gate, and the schedule of traffic shares.

A user's cohort comes from a stable hash of the rollout's salt and the user id, so a user who is
in the canary at 5% stays in it at 25% and on every replica and release. The gate compares the
canary's window of requests with the baseline's window from the same time and answers proceed,
hold or rollback, with a sentence per reason:

- error and validation-failure rates roll back only when even the low end of the canary's Wilson
  interval is above the baseline's rate plus a margin: confident it is worse, not unlucky. These
  rules already account for the sample size, so they may roll back before ``min_requests``;
- p95 latency and cost per request roll back when canary / baseline is over a ratio; a few
  requests make a noisy p95, so these wait for ``min_requests``;
- too few requests, or missing data (a ``None``, a baseline too small to compare against, a zero
  baseline that makes a ratio meaningless) holds: the gate never proceeds on what it cannot see.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from itertools import pairwise
from typing import Final

__all__ = [
    "BUCKETS",
    "DEFAULT_RULES",
    "DEFAULT_SCHEDULE",
    "CanaryHeld",
    "CanaryProceeded",
    "CanaryRolledBack",
    "GateDecision",
    "RolloutGate",
    "RolloutOptions",
    "RolloutStep",
    "Schedule",
    "Verdict",
    "WindowStats",
    "cohort_bucket",
    "decide",
    "in_cohort",
    "wilson_interval",
]

#: Cohort buckets: a share is resolved to whole buckets of 0.01 %.
BUCKETS: Final = 10_000


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_share(share: float, field: str = "share") -> None:
    if not _is_real(share) or not 0.0 <= share <= 1.0:
        raise ValueError(f"{field} must be a number in [0, 1], got {share!r}")


# --------------------------------------------------------------------------- cohorts


def cohort_bucket(salt: str, user_id: str) -> int:
    """The user's bucket in ``[0, BUCKETS)`` for the rollout named by ``salt``.

    The first 8 bytes of ``sha256(salt + "\\x00" + user_id)`` (UTF-8), read big-endian, modulo
    ``BUCKETS``. It never uses Python's ``hash()``, which changes per process, so every replica
    and every release puts a user in the same bucket. A new salt reshuffles everyone, which is
    how two rollouts avoid landing on the same users. ``salt`` may not contain ``"\\x00"``.
    """
    if not isinstance(salt, str) or "\x00" in salt:
        raise ValueError(f"salt must be a string without NUL characters, got {salt!r}")
    if not isinstance(user_id, str):
        raise ValueError(f"user_id must be a string, got {user_id!r}")
    digest = hashlib.sha256(f"{salt}\x00{user_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def in_cohort(salt: str, user_id: str, share: float) -> bool:
    """Whether the user gets the new version when it has ``share`` (0..1) of the traffic.

    True when the user's bucket is below ``round(share * BUCKETS)``: the cohort at a larger
    share contains the cohort at every smaller share.
    """
    _check_share(share)
    return cohort_bucket(salt, user_id) < round(share * BUCKETS)


# --------------------------------------------------------------------------- statistics


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval ``(low, high)`` for a rate of ``successes`` in ``n`` trials.

    ``z`` is the normal quantile (1.96 for about 95 %). The interval lies in [0, 1] and contains
    the observed rate; with ``n == 0`` nothing is known and it is ``(0.0, 1.0)``.
    """
    if not _is_int(n) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if not _is_int(successes) or not 0 <= successes <= n:
        raise ValueError(f"successes must be an int in [0, n={n}], got {successes!r}")
    if not _is_real(z) or z <= 0:
        raise ValueError(f"z must be a finite number > 0, got {z!r}")
    if n == 0:
        return (0.0, 1.0)
    rate = successes / n
    z2 = z * z
    denominator = 1.0 + z2 / n
    centre = (rate + z2 / (2 * n)) / denominator
    half = z * math.sqrt(rate * (1.0 - rate) / n + z2 / (4 * n * n)) / denominator
    # Clamp: rounding must not push the ends past [0, 1] or across the observed rate.
    low = 0.0 if successes == 0 else max(0.0, min(rate, centre - half))
    high = 1.0 if successes == n else min(1.0, max(rate, centre + half))
    return (low, high)


# --------------------------------------------------------------------------- the gate


class Verdict(StrEnum):
    """What the gate tells the rollout to do."""

    PROCEED = "proceed"
    HOLD = "hold"
    ROLLBACK = "rollback"


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowStats:
    """One version's requests in one window of time.

    ``errors`` and ``validation_failures`` count requests out of ``requests``; ``p95_latency`` is
    in seconds and ``cost_per_request`` in any currency unit, both ``None`` when not measured.
    """

    requests: int
    errors: int
    validation_failures: int
    p95_latency: float | None
    cost_per_request: float | None

    def __post_init__(self) -> None:
        if not _is_int(self.requests) or self.requests < 0:
            raise ValueError(f"requests must be an int >= 0, got {self.requests!r}")
        for field in ("errors", "validation_failures"):
            value = getattr(self, field)
            if not _is_int(value) or not 0 <= value <= self.requests:
                raise ValueError(
                    f"{field} must be an int in [0, requests={self.requests}], got {value!r}"
                )
        for field in ("p95_latency", "cost_per_request"):
            value = getattr(self, field)
            if value is not None and (not _is_real(value) or value < 0):
                raise ValueError(f"{field} must be a finite number >= 0 or None, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutOptions:
    """The gate's thresholds.

    - ``min_requests`` (200): canary requests in the window before the gate may proceed or
      judge latency and cost.
    - ``min_baseline_requests`` (200): baseline requests in the window before anything is compared.
    - ``error_margin`` (0.02): how far, in absolute rate, the low end of the canary's error rate
      may sit above the baseline's error rate before it rolls back.
    - ``validation_margin`` (0.02): the same for validation failures.
    - ``latency_ratio`` (1.2): the largest canary / baseline p95 latency accepted.
    - ``cost_ratio`` (1.25): the largest canary / baseline cost per request accepted.
    - ``z`` (1.96): the Wilson interval's normal quantile, about 95 % two-sided.

    A smaller margin catches a bad release sooner and stops more good ones.
    """

    min_requests: int = 200
    min_baseline_requests: int = 200
    error_margin: float = 0.02
    validation_margin: float = 0.02
    latency_ratio: float = 1.2
    cost_ratio: float = 1.25
    z: float = 1.96

    def __post_init__(self) -> None:
        for field in ("min_requests", "min_baseline_requests"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")
        for field in ("error_margin", "validation_margin"):
            value = getattr(self, field)
            if not _is_real(value) or not 0.0 <= value < 1.0:
                raise ValueError(f"{field} must be a number in [0, 1), got {value!r}")
        for field in ("latency_ratio", "cost_ratio"):
            value = getattr(self, field)
            if not _is_real(value) or value < 1.0:
                raise ValueError(f"{field} must be a finite number >= 1, got {value!r}")
        if not _is_real(self.z) or self.z <= 0:
            raise ValueError(f"z must be a finite number > 0, got {self.z!r}")


DEFAULT_RULES: Final = RolloutOptions()


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The verdict and the sentences behind it.

    For rollback and hold, ``reasons`` are the checks that rolled back or held; for proceed, the
    checks that passed.
    """

    verdict: Verdict
    reasons: tuple[str, ...]


def _rate_check(
    what: str, canary: tuple[int, int], baseline: tuple[int, int], margin: float, z: float
) -> tuple[bool, str]:
    """(rolls back?, sentence) for a rate judged by the canary's Wilson low end; ``canary`` and
    ``baseline`` are each (bad, requests)."""
    bad, canary_n = canary
    baseline_bad, baseline_n = baseline
    low, _ = wilson_interval(bad, canary_n, z)
    baseline_rate = baseline_bad / baseline_n
    limit = baseline_rate + margin
    observed = f"{what} {bad}/{canary_n}" + (f" = {bad / canary_n:.1%}" if canary_n else "")
    against = (
        f"the baseline's {baseline_bad}/{baseline_n} = {baseline_rate:.1%} "
        f"plus the {margin:.1%} margin = {limit:.1%}"
    )
    if low > limit:
        return True, f"{observed} (Wilson low end {low:.1%}) is above {against}"
    return False, f"{observed} (Wilson low end {low:.1%}) is within {against}"


def _ratio_check(
    what: str, unit: str, canary: float | None, baseline: float | None, limit: float
) -> tuple[Verdict, str]:
    """(verdict, sentence) for a measure judged by canary / baseline."""
    if canary is None or baseline is None:
        missing = " and ".join(
            side for side, value in (("canary", canary), ("baseline", baseline)) if value is None
        )
        return Verdict.HOLD, f"{what} is not measured for the {missing}"
    if baseline == 0:
        if canary == 0:
            return Verdict.PROCEED, f"{what} is 0 for both canary and baseline"
        return (
            Verdict.HOLD,
            f"{what} is {canary:.4g}{unit} for the canary but 0 for the baseline: "
            "no ratio can be formed",
        )
    ratio = canary / baseline
    verdict = Verdict.ROLLBACK if ratio > limit else Verdict.PROCEED
    return verdict, (
        f"{what} {canary:.4g}{unit} is {ratio:.2f}x the baseline's {baseline:.4g}{unit}, "
        f"{'over' if verdict is Verdict.ROLLBACK else 'within'} the {limit:.2f}x limit"
    )


def decide(
    canary: WindowStats, baseline: WindowStats, rules: RolloutOptions = DEFAULT_RULES
) -> GateDecision:
    """Judge the canary's window against the baseline's window from the same time."""
    rollback: list[str] = []
    hold: list[str] = []
    passed: list[str] = []

    if baseline.requests < rules.min_baseline_requests:
        hold.append(
            f"only {baseline.requests} baseline requests in this window; "
            f"{rules.min_baseline_requests} are needed to compare against"
        )
        return GateDecision(Verdict.HOLD, tuple(hold))

    for what, bad, baseline_bad, margin in (
        ("error rate", canary.errors, baseline.errors, rules.error_margin),
        (
            "validation-failure rate",
            canary.validation_failures,
            baseline.validation_failures,
            rules.validation_margin,
        ),
    ):
        worse, sentence = _rate_check(
            what, (bad, canary.requests), (baseline_bad, baseline.requests), margin, rules.z
        )
        (rollback if worse else passed).append(sentence)

    if canary.requests < rules.min_requests:
        hold.append(
            f"only {canary.requests} canary requests in this window; "
            f"{rules.min_requests} are needed to judge latency and cost and to proceed"
        )
    else:
        for what, unit, canary_value, baseline_value, limit in (
            ("p95 latency", " s", canary.p95_latency, baseline.p95_latency, rules.latency_ratio),
            (
                "cost per request",
                "",
                canary.cost_per_request,
                baseline.cost_per_request,
                rules.cost_ratio,
            ),
        ):
            verdict, sentence = _ratio_check(what, unit, canary_value, baseline_value, limit)
            if verdict is Verdict.ROLLBACK:
                rollback.append(sentence)
            elif verdict is Verdict.HOLD:
                hold.append(sentence)
            else:
                passed.append(sentence)

    if rollback:
        return GateDecision(Verdict.ROLLBACK, tuple(rollback))
    if hold:
        return GateDecision(Verdict.HOLD, tuple(hold))
    return GateDecision(Verdict.PROCEED, tuple(passed))


# --------------------------------------------------------------------------- the schedule


@dataclass(frozen=True, slots=True)
class Schedule:
    """The traffic shares a rollout steps through, strictly increasing, each in (0, 1]."""

    shares: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)

    def __post_init__(self) -> None:
        if not isinstance(self.shares, tuple) or not self.shares:
            raise ValueError(f"shares must be a non-empty tuple, got {self.shares!r}")
        for share in self.shares:
            if not _is_real(share) or not 0.0 < share <= 1.0:
                raise ValueError(f"shares must each be a number in (0, 1], got {share!r}")
        if any(a >= b for a, b in pairwise(self.shares)):
            raise ValueError(f"shares must be strictly increasing, got {self.shares!r}")

    def next_share(self, current: float) -> float | None:
        """The first share above ``current``, or ``None`` when there is none (the rollout is done)."""
        _check_share(current, "current")
        return next((share for share in self.shares if share > current), None)


DEFAULT_SCHEDULE: Final = Schedule()


@dataclass(frozen=True, slots=True)
class CanaryProceeded:
    """Event: the gate proceeded; the share moved up (or stayed, at the end of the schedule)."""

    old_share: float
    new_share: float


@dataclass(frozen=True, slots=True)
class CanaryHeld:
    """Event: the gate held the share where it is."""

    share: float
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CanaryRolledBack:
    """Event: the gate sent every user back to the baseline (share 0)."""

    old_share: float
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RolloutStep:
    """One gate evaluation: the decision and the share before and after it."""

    decision: GateDecision
    old_share: float
    new_share: float


class RolloutGate:
    """Drives a rollout: at each window, judge the canary and move its share along the schedule.

    Proceed moves to the schedule's next share (staying put at the end), hold keeps the share,
    rollback sets it to 0. The gate keeps no state; the caller stores the share (a flag, so that
    every change is audited with who and why).
    """

    __slots__ = ("_on_event", "rules", "schedule")

    def __init__(
        self,
        rules: RolloutOptions = DEFAULT_RULES,
        schedule: Schedule = DEFAULT_SCHEDULE,
        *,
        on_event: Callable[[CanaryProceeded | CanaryHeld | CanaryRolledBack], None] | None = None,
    ) -> None:
        self.rules = rules
        self.schedule = schedule
        self._on_event = on_event

    def evaluate(
        self, current_share: float, canary: WindowStats, baseline: WindowStats
    ) -> RolloutStep:
        """Decide on this window and return the share the rollout should have next."""
        _check_share(current_share, "current_share")
        decision = decide(canary, baseline, self.rules)
        event: CanaryProceeded | CanaryHeld | CanaryRolledBack
        if decision.verdict is Verdict.PROCEED:
            nxt = self.schedule.next_share(current_share)
            new_share = current_share if nxt is None else nxt
            event = CanaryProceeded(current_share, new_share)
        elif decision.verdict is Verdict.HOLD:
            new_share = current_share
            event = CanaryHeld(current_share, decision.reasons)
        else:
            new_share = 0.0
            event = CanaryRolledBack(current_share, decision.reasons)
        if self._on_event is not None:
            self._on_event(event)
        return RolloutStep(decision, current_share, new_share)

    def __repr__(self) -> str:
        return f"RolloutGate({self.rules!r}, {self.schedule!r})"


def __getattr__(name: str) -> object:
    # The names of the previous release, kept for one release: the options of a policy are
    # called ...Options everywhere else.
    if name == "GateRules":
        warnings.warn(
            "GateRules is now RolloutOptions; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return RolloutOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
