"""Every retry decision, with no I/O: when an attempt may start, how long it gets, whether and
when to retry after it failed."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.policy.deadline import Deadline
from tidegate.policy.retry.budget import RetryBudget
from tidegate.policy.retry.options import RetryOptions

__all__ = ["Attempt", "GiveUp", "GiveUpReason", "Retry", "RetryPlanner"]


class GiveUpReason(StrEnum):
    """Why no further attempt is made."""

    NOT_RETRYABLE = "not_retryable"
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"
    DEADLINE = "deadline"
    RETRY_AFTER_EXCEEDS_DEADLINE = "retry_after_exceeds_deadline"
    RETRY_BUDGET = "retry_budget"


@dataclass(frozen=True, slots=True)
class Attempt:
    """Start an attempt now, and give it ``timeout`` seconds."""

    timeout: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Wait ``delay`` seconds, then start attempt number ``attempt``.

    ``next_timeout`` is what that attempt gets if the wait takes exactly ``delay``; the caller
    asks :meth:`RetryPlanner.start` again after waiting, because a real sleep may overshoot.
    """

    delay: float
    next_timeout: float
    attempt: int
    kind: ProviderErrorKind
    from_retry_after: bool


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Make no further attempt."""

    reason: GiveUpReason


class RetryPlanner:
    """Every retry decision, with no I/O: when to start, how long to give, whether to retry.

    Call :meth:`start` before every attempt (the first, and each one after a wait) and
    :meth:`after_failure` after every failed attempt. The deadline is the only clock the planner
    reads; the budget, if any, is asked last, so it is spent only on a retry that will be made.
    The planner does not record first tries in the budget: its caller does (the call functions
    below do it when the first attempt starts).
    ``retry_on`` narrows which retryable provider errors are retried (the router uses it to keep
    some failures for another provider instead of the same one).
    """

    __slots__ = ("budget", "policy", "retry_on", "rng")

    def __init__(
        self,
        policy: RetryOptions,
        *,
        rng: random.Random,
        budget: RetryBudget | None = None,
        retry_on: Callable[[ProviderError], bool] | None = None,
    ) -> None:
        self.policy = policy
        self.rng = rng
        self.budget = budget
        self.retry_on = retry_on

    def retryable(self, error: BaseException) -> bool:
        """Whether retrying can fix ``error``: a retryable provider error that ``retry_on`` keeps."""
        if not isinstance(error, ProviderError) or not error.retryable:
            return False
        return self.retry_on is None or self.retry_on(error)

    def start(self, deadline: Deadline, per_try: float) -> Attempt | GiveUp:
        """Start an attempt capped at ``min(per_try, time left)``, unless too little time is left."""
        timeout = _attempt_timeout(self.policy, deadline, per_try)
        return GiveUp(GiveUpReason.DEADLINE) if timeout is None else Attempt(timeout)

    def after_failure(
        self,
        error: BaseException,
        attempt_no: int,
        deadline: Deadline,
        per_try: float,
        *,
        previous_delay: float | None = None,
    ) -> Retry | GiveUp:
        """What to do after attempt number ``attempt_no`` (from 1) failed with ``error``.

        ``previous_delay`` is the wait before the failed attempt, if it was a retry.
        """
        _check_per_try(per_try)
        if attempt_no < 1:
            raise ValueError(f"attempt_no must be >= 1, got {attempt_no!r}")
        if not isinstance(error, ProviderError) or not self.retryable(error):
            return GiveUp(GiveUpReason.NOT_RETRYABLE)
        if attempt_no >= self.policy.attempts:
            return GiveUp(GiveUpReason.ATTEMPTS_EXHAUSTED)
        remaining = deadline.remaining()
        retry_after = error.retry_after
        if retry_after is not None:
            delay = max(0.0, retry_after)
            if delay + self.policy.min_attempt >= remaining:
                return GiveUp(GiveUpReason.RETRY_AFTER_EXCEEDS_DEADLINE)
        else:
            delay = self.policy.delay(attempt_no - 1, self.rng, previous_delay)
            if delay + self.policy.min_attempt >= remaining:
                return GiveUp(GiveUpReason.DEADLINE)
        if self.budget is not None and not self.budget.try_spend():
            return GiveUp(GiveUpReason.RETRY_BUDGET)
        return Retry(
            delay=delay,
            next_timeout=min(per_try, remaining - delay),
            attempt=attempt_no + 1,
            kind=error.kind,
            from_retry_after=retry_after is not None,
        )


def _attempt_timeout(policy: RetryOptions, deadline: Deadline, per_try: float) -> float | None:
    """An attempt's timeout, ``min(per_try, time left)``; None when too little time is left."""
    _check_per_try(per_try)
    remaining = deadline.remaining()
    if remaining <= policy.min_attempt:
        return None
    return min(per_try, remaining)


def _check_per_try(per_try: float) -> None:
    if math.isnan(per_try) or per_try <= 0:
        raise ValueError(f"per_try must be > 0 seconds, got {per_try!r}")
