"""Retries that cannot outlive the deadline or multiply an outage.

Three controls keep retries useful instead of harmful:

- **Backoff with jitter** (:class:`RetryOptions`): each retry waits longer than the one before, by
  a random amount, so that clients that failed together do not come back together.
- **A retry budget** (:class:`RetryBudget`): over a sliding window, retries may add only a small
  share of the first tries (plus a small floor), so a provider that is down does not receive
  several times its normal load from retries.
- **The deadline** (:class:`~tidegate.policy.deadline.Deadline`): no attempt starts at or after
  it, each attempt is capped at the time left, and a wait that would leave no time is not taken.

:class:`RetryPlanner` makes every decision and performs no I/O; :func:`call_with_deadline` and
:func:`acall_with_deadline` drive it with a sync or an async sleep. Only a
:class:`~tidegate.errors.ProviderError` whose ``retryable`` is true is retried: a bad request, a
refusal by another policy or a bug is raised at once. A provider's ``retry_after`` replaces the
jittered backoff: the planner waits exactly that long, or gives up at once when that wait would
leave no time before the deadline.

The modules, one noun each: ``options`` (:class:`RetryOptions`, :class:`Jitter` and the backoff
arithmetic), ``budget`` (:class:`RetryBudget`), ``planner`` (:class:`RetryPlanner` and its
answers), ``events`` and ``calls`` (the two drivers).
"""

import warnings

from tidegate.policy.retry.budget import RetryBudget
from tidegate.policy.retry.calls import acall_with_deadline, call_with_deadline
from tidegate.policy.retry.events import RetryBudgetDenied, RetryEvent, RetryGaveUp, RetryScheduled
from tidegate.policy.retry.options import Jitter, RetryOptions, backoff_ceiling, provider_layer
from tidegate.policy.retry.planner import Attempt, GiveUp, GiveUpReason, Retry, RetryPlanner

__all__ = [
    "Attempt",
    "GiveUp",
    "GiveUpReason",
    "Jitter",
    "Retry",
    "RetryBudget",
    "RetryBudgetDenied",
    "RetryEvent",
    "RetryGaveUp",
    "RetryOptions",
    "RetryPlanner",
    "RetryScheduled",
    "acall_with_deadline",
    "backoff_ceiling",
    "call_with_deadline",
    "provider_layer",
]


def __getattr__(name: str) -> object:
    # The names of the previous release, kept for one release: the options of a policy are
    # called ...Options everywhere else.
    if name == "RetryPolicy":
        warnings.warn(
            "RetryPolicy is now RetryOptions; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return RetryOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
