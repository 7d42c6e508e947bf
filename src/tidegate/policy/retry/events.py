"""What a retried call reports as it happens: each retry scheduled, the give-up, a budget denial."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from tidegate.errors import ProviderErrorKind
from tidegate.policy.retry.planner import GiveUpReason

__all__ = ["RetryBudgetDenied", "RetryEvent", "RetryGaveUp", "RetryScheduled"]


@dataclass(frozen=True, slots=True)
class RetryScheduled:
    """A retry was scheduled: attempt number ``attempt`` starts after ``delay`` seconds.

    ``kind`` is how the previous attempt failed; ``from_retry_after`` says whether the delay was
    the provider's ``retry_after`` rather than the jittered backoff.
    """

    attempt: int
    delay: float
    kind: ProviderErrorKind
    from_retry_after: bool = False


@dataclass(frozen=True, slots=True)
class RetryGaveUp:
    """No further attempt was made, after ``attempts`` attempts (0: none could start)."""

    reason: GiveUpReason
    attempts: int


@dataclass(frozen=True, slots=True)
class RetryBudgetDenied:
    """The retry budget refused a retry that was otherwise allowed."""


RetryEvent: TypeAlias = RetryScheduled | RetryGaveUp | RetryBudgetDenied
