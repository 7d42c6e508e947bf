"""The drivers: a call retried as the planner allows, with a sync or an async sleep.

Only a :class:`~tidegate.errors.ProviderError` whose ``retryable`` is true is retried: a bad
request, a refusal by another policy or a bug is raised at once. Both drivers share one run
object, so they give the same timeouts, events and outcome.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from tidegate.errors import DeadlineExceeded
from tidegate.policy.deadline import Deadline
from tidegate.policy.retry.events import RetryBudgetDenied, RetryEvent, RetryGaveUp, RetryScheduled
from tidegate.policy.retry.planner import GiveUp, GiveUpReason, RetryPlanner

__all__ = ["acall_with_deadline", "call_with_deadline"]

_POLICY: Final = "retry"
T = TypeVar("T")


def _ignore(event: RetryEvent) -> None:
    del event


class _Run:
    """The bookkeeping of one call, shared by the sync and the async driver."""

    __slots__ = ("attempts", "deadline", "emit", "per_try", "planner", "previous_delay")

    def __init__(
        self,
        planner: RetryPlanner,
        deadline: Deadline,
        per_try: float,
        on_event: Callable[[RetryEvent], None] | None,
    ) -> None:
        self.planner = planner
        self.deadline = deadline
        self.per_try = per_try
        self.emit = on_event or _ignore
        self.attempts = 0
        self.previous_delay: float | None = None

    def begin(self) -> float:
        """The first attempt's timeout; raises DeadlineExceeded if no attempt can start."""
        step = self.planner.start(self.deadline, self.per_try)
        if isinstance(step, GiveUp):
            self.emit(RetryGaveUp(step.reason, 0))
            raise DeadlineExceeded(
                "the deadline passed before the first attempt could start", policy=_POLICY
            )
        if self.planner.budget is not None:
            self.planner.budget.record_first_try()
        self.attempts = 1
        return step.timeout

    def failed(self, error: Exception) -> float | None:
        """The wait before the next attempt, or None to give up and re-raise ``error``."""
        plan = self.planner.after_failure(
            error, self.attempts, self.deadline, self.per_try, previous_delay=self.previous_delay
        )
        if isinstance(plan, GiveUp):
            if plan.reason is GiveUpReason.RETRY_BUDGET:
                self.emit(RetryBudgetDenied())
            self.emit(RetryGaveUp(plan.reason, self.attempts))
            return None
        self.emit(RetryScheduled(plan.attempt, plan.delay, plan.kind, plan.from_retry_after))
        self.previous_delay = plan.delay
        return plan.delay

    def resume(self) -> float | None:
        """After the wait: the next attempt's timeout, or None if the deadline left no time."""
        step = self.planner.start(self.deadline, self.per_try)
        if isinstance(step, GiveUp):
            self.emit(RetryGaveUp(step.reason, self.attempts))
            return None
        self.attempts += 1
        return step.timeout


def call_with_deadline(
    fn: Callable[[float], T],
    deadline: Deadline,
    planner: RetryPlanner,
    *,
    per_try: float,
    sleep: Callable[[float], None],
    on_event: Callable[[RetryEvent], None] | None = None,
) -> T:
    """Call ``fn(timeout)`` until it returns, retrying as ``planner`` allows.

    ``fn`` receives the attempt's timeout in seconds and must give up by then. The first attempt
    is recorded in the planner's budget as a first try; each retry is taken from it when
    scheduled. On giving up, the last attempt's error is raised as it was; if the deadline left
    no time for even one attempt, :class:`~tidegate.errors.DeadlineExceeded` is raised instead.
    """
    run = _Run(planner, deadline, per_try, on_event)
    timeout = run.begin()
    while True:
        try:
            return fn(timeout)
        except Exception as error:
            delay = run.failed(error)
            if delay is None:
                raise
            last = error
        sleep(delay)
        next_timeout = run.resume()
        if next_timeout is None:
            raise last
        timeout = next_timeout


async def acall_with_deadline(
    fn: Callable[[float], Awaitable[T]],
    deadline: Deadline,
    planner: RetryPlanner,
    *,
    per_try: float,
    sleep: Callable[[float], Awaitable[None]],
    on_event: Callable[[RetryEvent], None] | None = None,
) -> T:
    """The async twin of :func:`call_with_deadline`: the same run, awaiting ``fn`` and ``sleep``.

    Cancellation is not an error to retry: it propagates at once.
    """
    run = _Run(planner, deadline, per_try, on_event)
    timeout = run.begin()
    while True:
        try:
            return await fn(timeout)
        except Exception as error:
            delay = run.failed(error)
            if delay is None:
                raise
            last = error
        await sleep(delay)
        next_timeout = run.resume()
        if next_timeout is None:
            raise last
        timeout = next_timeout
