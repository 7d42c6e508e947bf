"""Pure, synchronous decisions. Time comes from an injected Clock, randomness from an injected rng.

This package imports only ``tidegate.clock``, ``tidegate.errors`` and the standard library. The
names below are the main objects of each policy; every module's own ``__all__`` has the rest (its
events and pure helper math), e.g. ``tidegate.policy.rollout.decide``.
"""

import warnings

from tidegate.policy.admission import (
    AdmissionController,
    AdmissionOptions,
    RefusalReason,
    Ticket,
    TicketState,
)
from tidegate.policy.attempts import AttemptPolicy, Attempts, is_evidence
from tidegate.policy.autoscale import (
    DampedLaw,
    DampedOptions,
    ProportionalLaw,
    ScaleDecision,
    ScaleSignals,
)
from tidegate.policy.breaker import BreakerOptions, BreakerState, CircuitBreaker, Permit
from tidegate.policy.budget import (
    BudgetDecision,
    BudgetOptions,
    BudgetVerdict,
    Cost,
    DailyBudget,
    Quota,
    Reservation,
    Usage,
)
from tidegate.policy.deadline import Deadline, Layer, chain_problems
from tidegate.policy.flags import AuditEntry, FlagSet, FlagSpec, KillSwitchMode, check_answering
from tidegate.policy.ratelimit import (
    BucketOptions,
    BucketState,
    TakeResult,
    TokenBucket,
    ratelimit_headers,
)
from tidegate.policy.retry import (
    Jitter,
    RetryBudget,
    RetryOptions,
    RetryPlanner,
    acall_with_deadline,
    call_with_deadline,
    provider_layer,
)
from tidegate.policy.rollout import (
    GateDecision,
    RolloutGate,
    RolloutOptions,
    Schedule,
    Verdict,
    WindowStats,
    cohort_bucket,
    in_cohort,
    wilson_interval,
)
from tidegate.policy.routing import (
    FailoverOptions,
    ProviderSpec,
    RoutePlan,
    SkipReason,
    describe_attempts,
    next_candidates,
    plan_route,
    retry_same,
)

__all__ = [
    "AdmissionController",
    "AdmissionOptions",
    "AttemptPolicy",
    "Attempts",
    "AuditEntry",
    "BreakerOptions",
    "BreakerState",
    "BucketOptions",
    "BucketState",
    "BudgetDecision",
    "BudgetOptions",
    "BudgetVerdict",
    "CircuitBreaker",
    "Cost",
    "DailyBudget",
    "DampedLaw",
    "DampedOptions",
    "Deadline",
    "FailoverOptions",
    "FlagSet",
    "FlagSpec",
    "GateDecision",
    "Jitter",
    "KillSwitchMode",
    "Layer",
    "Permit",
    "ProportionalLaw",
    "ProviderSpec",
    "Quota",
    "RefusalReason",
    "Reservation",
    "RetryBudget",
    "RetryOptions",
    "RetryPlanner",
    "RolloutGate",
    "RolloutOptions",
    "RoutePlan",
    "ScaleDecision",
    "ScaleSignals",
    "Schedule",
    "SkipReason",
    "TakeResult",
    "Ticket",
    "TicketState",
    "TokenBucket",
    "Usage",
    "Verdict",
    "WindowStats",
    "acall_with_deadline",
    "call_with_deadline",
    "chain_problems",
    "check_answering",
    "cohort_bucket",
    "describe_attempts",
    "in_cohort",
    "is_evidence",
    "next_candidates",
    "plan_route",
    "provider_layer",
    "ratelimit_headers",
    "retry_same",
    "wilson_interval",
]


_RENAMED = {"RetryPolicy": RetryOptions, "GateRules": RolloutOptions}


def __getattr__(name: str) -> object:
    # The names of the previous release, kept for one release (see the modules' own).
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"{name} is now {new.__name__}; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return new
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
