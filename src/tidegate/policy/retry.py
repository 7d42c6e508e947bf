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
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, TypeAlias, TypeVar

from tidegate.clock import Clock
from tidegate.errors import DeadlineExceeded, ProviderError, ProviderErrorKind
from tidegate.policy.deadline import Deadline, Layer

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

_POLICY: Final = "retry"
_floor: Final = math.floor
_isnan: Final = math.isnan
T = TypeVar("T")


def _check_finite(field: str, value: float, *, minimum: float) -> None:
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{field} must be a finite number >= {minimum!r}, got {value!r}")


class Jitter(StrEnum):
    """How a backoff is randomised.

    ``full`` waits anywhere between zero and the exponential ceiling; ``equal`` waits half the
    ceiling plus a random amount up to the other half; ``decorrelated`` grows from the previous
    wait (between ``base`` and three times the previous wait); ``none`` waits the ceiling itself,
    which makes clients that failed together retry together.
    """

    FULL = "full"
    EQUAL = "equal"
    DECORRELATED = "decorrelated"
    NONE = "none"


def backoff_ceiling(retry_number: int, *, base: float, factor: float, cap: float) -> float:
    """``min(cap, base * factor ** retry_number)``, without overflowing for large numbers."""
    if retry_number < 0:
        raise ValueError(f"retry_number must be >= 0, got {retry_number!r}")
    try:
        raw = base * factor**retry_number
    except OverflowError:
        return cap
    return min(cap, raw)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryOptions:
    """How many tries, and how long to wait between them.

    Retries are numbered from 0: retry 0 is the wait before the second attempt.
    """

    #: Total tries, the first one included; 1 means never retry.
    attempts: int = 3
    #: Seconds: the ceiling of the first retry's wait, and the least decorrelated wait.
    base: float = 0.5
    #: How much the ceiling grows per retry.
    factor: float = 2.0
    #: Seconds: no wait is ever longer.
    cap: float = 8.0
    #: How the wait is randomised below its ceiling.
    jitter: Jitter = Jitter.FULL
    #: Seconds: the shortest attempt worth starting; an attempt never starts with less time left.
    min_attempt: float = 0.01

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise ValueError(f"attempts must be an int, got {self.attempts!r}")
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts!r}")
        _check_finite("base", self.base, minimum=0.0)
        _check_finite("factor", self.factor, minimum=1.0)
        _check_finite("cap", self.cap, minimum=self.base)
        _check_finite("min_attempt", self.min_attempt, minimum=0.0)
        # Accept the plain string too ("equal"), so options read from config need no conversion.
        try:
            jitter = Jitter(self.jitter)
        except ValueError:
            choices = ", ".join(j.value for j in Jitter)
            raise ValueError(f"jitter must be one of {choices}, got {self.jitter!r}") from None
        object.__setattr__(self, "jitter", jitter)

    def ceiling(self, retry_number: int) -> float:
        """The exponential ceiling for retry ``retry_number``: ``min(cap, base * factor**n)``."""
        return backoff_ceiling(retry_number, base=self.base, factor=self.factor, cap=self.cap)

    def delay(self, retry_number: int, rng: random.Random, previous: float | None = None) -> float:
        """The jittered wait before retry ``retry_number`` (0 for the first retry).

        ``previous`` is the wait before the previous retry; only ``decorrelated`` uses it, and
        takes ``base`` when it is ``None``.
        """
        ceiling = self.ceiling(retry_number)
        if self.jitter is Jitter.NONE:
            return ceiling
        if self.jitter is Jitter.FULL:
            return min(ceiling, rng.uniform(0.0, ceiling))
        if self.jitter is Jitter.EQUAL:
            half = ceiling / 2.0
            return min(ceiling, half + rng.uniform(0.0, half))
        last = self.base if previous is None else previous
        if math.isnan(last) or last < 0:
            raise ValueError(f"previous must be a wait in seconds >= 0, got {previous!r}")
        high = max(self.base, 3.0 * last)
        return min(self.cap, high, rng.uniform(self.base, high))

    def max_delay(self, retry_number: int) -> float:
        """The longest wait :meth:`delay` can return for retry ``retry_number``.

        For ``decorrelated`` it assumes each ``previous`` was this policy's own earlier delay.
        """
        if self.jitter is not Jitter.DECORRELATED:
            return self.ceiling(retry_number)
        if retry_number < 0:
            raise ValueError(f"retry_number must be >= 0, got {retry_number!r}")
        # Follow the same float steps as delay() so the bound holds to the last bit.
        high = self.base
        for _ in range(retry_number + 1):
            grown = min(self.cap, max(self.base, 3.0 * high))
            if grown == high:
                break  # at the cap (or stuck at a zero base): it cannot grow any more
            high = grown
        return high

    def worst_total_backoff(self, attempts: int | None = None) -> float:
        """The longest total wait across all retries of ``attempts`` tries (default: ours)."""
        tries = self.attempts if attempts is None else attempts
        if tries < 1:
            raise ValueError(f"attempts must be >= 1, got {tries!r}")
        return math.fsum(self.max_delay(n) for n in range(tries - 1))


def provider_layer(name: str, attempts: int, per_try_s: float, policy: RetryOptions) -> Layer:
    """The timeout layer of a retrying provider call, for :func:`chain_problems`.

    It may last ``attempts`` times the per-try timeout plus the worst-case total backoff. A
    provider's ``retry_after`` can stretch a wait beyond the backoff; the deadline bounds that.
    """
    _check_finite("per_try_s", per_try_s, minimum=0.0)
    return Layer(name, attempts * per_try_s + policy.worst_total_backoff(attempts))


class RetryBudget:
    """Retries may add at most ``ratio`` of the first tries, plus a small floor.

    Over a sliding window the budget grants a retry only while the retries granted in the window
    stay within ``ratio * first tries in the window + min_retries_per_second * window``. The floor
    lets a quiet service retry at all (with 3 first tries a minute, 10% of them is no retry);
    the default of one retry a second is small next to the traffic it guards and still covers
    the occasional blip.

    Time is counted in ``buckets`` equal slices of the window, kept in a ring, so memory does not
    grow with traffic. Rounding is always in the provider's favour: a granted retry counts until
    one whole window has passed after its own slice, while a first try stops counting once its
    slice is a window old. So for every retry granted at ``t``, the retries granted in
    ``(t - window, t]`` never exceed ``ratio`` times the first tries recorded in that interval
    plus the floor times ``window``.

    One budget guards one provider (or one process); it is not thread-safe.
    """

    __slots__ = (
        "_clock",
        "_current",
        "_firsts",
        "_min_retries_per_second",
        "_ratio",
        "_retries",
        "_slot",
        "_width",
        "_window",
    )

    def __init__(
        self,
        clock: Clock,
        *,
        ratio: float = 0.1,
        min_retries_per_second: float = 1.0,
        window: float = 10.0,
        buckets: int = 10,
    ) -> None:
        _check_finite("ratio", ratio, minimum=0.0)
        _check_finite("min_retries_per_second", min_retries_per_second, minimum=0.0)
        _check_finite("window", window, minimum=0.0)
        if window == 0:
            raise ValueError("window must be > 0 seconds, got 0")
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
            raise ValueError(f"buckets must be an int >= 1, got {buckets!r}")
        self._clock = clock
        self._ratio = float(ratio)
        self._min_retries_per_second = float(min_retries_per_second)
        self._window = float(window)
        self._width = self._window / buckets
        # One slot more than the window holds, for the retries of the slice leaving the window.
        self._firsts = [0] * (buckets + 1)
        self._retries = [0] * (buckets + 1)
        self._current = self._index(clock.now())
        #: ``_current``'s slot in the ring: where its first tries and retries are counted.
        self._slot = self._current % (buckets + 1)

    @property
    def ratio(self) -> float:
        """The share of first tries that may be retried."""
        return self._ratio

    @property
    def min_retries_per_second(self) -> float:
        """The floor: retries allowed per second of window even without first tries."""
        return self._min_retries_per_second

    @property
    def window(self) -> float:
        """The seconds over which first tries and retries are counted."""
        return self._window

    def _index(self, now: float) -> int:
        return _floor(now / self._width)

    def _roll(self) -> int:
        """Clear the slices that fell out of the ring since the last call; the current slot."""
        index = self._index(self._clock.now())
        if index > self._current:
            self._advance(index)
        return self._slot

    def _advance(self, index: int) -> None:
        """Make slice ``index`` (later than the current one) current, clearing the slots of the
        slices that fell out of the ring on the way."""
        size = len(self._firsts)
        for stale in range(self._current + 1, self._current + 1 + min(index - self._current, size)):
            self._firsts[stale % size] = 0
            self._retries[stale % size] = 0
        self._current = index
        self._slot = index % size

    def _allowance_and_spent(self) -> tuple[float, int]:
        slot = self._roll()
        oldest = (slot + 1) % len(self._firsts)
        firsts = sum(self._firsts) - self._firsts[oldest]
        allowance = self._ratio * firsts + self._min_retries_per_second * self._window
        return allowance, sum(self._retries)

    def record_first_try(self) -> None:
        """Count one first try (not a retry); each adds ``ratio`` to the allowance."""
        # _roll(), inlined: every request counts one, and its slice is nearly always current.
        index = _floor(self._clock.now() / self._width)
        if index > self._current:
            self._advance(index)
        self._firsts[self._slot] += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget if it allows one; ``True`` means it was taken.

        Call it when a retry is scheduled, not when it starts: a granted retry counts at once.
        """
        allowance, spent = self._allowance_and_spent()
        if spent + 1 <= allowance:
            self._retries[self._slot] += 1
            return True
        return False

    def available(self) -> float:
        """How many retries the budget would grant now (may be fractional; never negative)."""
        allowance, spent = self._allowance_and_spent()
        return max(0.0, allowance - spent)

    def __repr__(self) -> str:
        return (
            f"RetryBudget(ratio={self._ratio!r}, "
            f"min_retries_per_second={self._min_retries_per_second!r}, window={self._window!r})"
        )


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
    if _isnan(per_try) or per_try <= 0:
        raise _bad_per_try(per_try)


def _bad_per_try(per_try: float) -> ValueError:
    return ValueError(f"per_try must be > 0 seconds, got {per_try!r}")


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
    policy: RetryOptions,
    *,
    per_try: float,
    sleep: Callable[[float], None],
    rng: random.Random,
    budget: RetryBudget | None = None,
    retry_on: Callable[[ProviderError], bool] | None = None,
    on_event: Callable[[RetryEvent], None] | None = None,
) -> T:
    """Call ``fn(timeout)`` until it returns, retrying as the planner allows.

    ``fn`` receives the attempt's timeout in seconds and must give up by then. The first attempt
    is recorded in ``budget`` as a first try; each retry is taken from it when scheduled. On
    giving up, the last attempt's error is raised as it was; if the deadline left no time for
    even one attempt, :class:`~tidegate.errors.DeadlineExceeded` is raised instead.
    """
    run = _Run(
        RetryPlanner(policy, rng=rng, budget=budget, retry_on=retry_on), deadline, per_try, on_event
    )
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
    policy: RetryOptions,
    *,
    per_try: float,
    sleep: Callable[[float], Awaitable[None]],
    rng: random.Random,
    budget: RetryBudget | None = None,
    retry_on: Callable[[ProviderError], bool] | None = None,
    on_event: Callable[[RetryEvent], None] | None = None,
) -> T:
    """The async twin of :func:`call_with_deadline`: the same planner, awaiting ``fn`` and ``sleep``.

    Cancellation is not an error to retry: it propagates at once.
    """
    # The first attempt starts as the planner starts one (_attempt_timeout(), inlined), without
    # building the planner: most calls succeed at once and never need one.
    if _isnan(per_try) or per_try <= 0:
        raise _bad_per_try(per_try)
    remaining = deadline.remaining()
    if remaining <= policy.min_attempt:
        planner = RetryPlanner(policy, rng=rng, budget=budget, retry_on=retry_on)
        _Run(planner, deadline, per_try, on_event).begin()  # raises, with its event
        raise AssertionError("unreachable: no attempt can start")
    if budget is not None:
        budget.record_first_try()
    try:
        return await fn(min(per_try, remaining))
    except Exception as error:
        planner = RetryPlanner(policy, rng=rng, budget=budget, retry_on=retry_on)
        run = _Run(planner, deadline, per_try, on_event)
        run.attempts = 1
        delay = run.failed(error)
        if delay is None:
            raise
        last = error
    while True:
        await sleep(delay)
        timeout = run.resume()
        if timeout is None:
            raise last
        try:
            return await fn(timeout)
        except Exception as error:
            delay = run.failed(error)
            if delay is None:
                raise
            last = error


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
