"""How one model call combines the policies: which provider next, for how long, under which
breaker permit; whether to wait and retry; when to fail over; when to stop.

Retries (:mod:`~tidegate.policy.retry`), breakers (:mod:`~tidegate.policy.breaker`), failover
(:mod:`~tidegate.policy.routing`) and the retry budget are each a small pure object. How they are
put together for one call is this module, written once, and driven alike by the gateway (JSON
answers, streams before their first chunk, a stream's rescue, embeddings) and by the lab's event
loop. It performs no I/O and reads time only from the deadline's clock: a controller told each
outcome, with thin drivers around it (the shape of Polly v8's strategies).

:meth:`AttemptPolicy.start` begins one call's :class:`Attempts` over a route plan and a
deadline. Every answer is a step:

- :class:`Call`: call ``spec`` now and give it ``timeout`` seconds, under ``permit``;
- :class:`Wait`: wait ``delay`` seconds (a retry of the same provider), then ask :meth:`~Attempts.resume`;
- :class:`Stop`: make no further attempt and raise ``error``.

The driver tells each call's end: :meth:`~Attempts.succeeded`, :meth:`~Attempts.failed` (which
answers the next step), :meth:`~Attempts.broke` (a committed stream that failed mid-answer) or
:meth:`~Attempts.abandoned` (cancelled, or an error that is not the provider's). Each ends the
call's permit exactly once, by :func:`is_evidence`: a failure the breaker records, or a release.

After a failure, in this order:

1. the permit ends: ``failure()`` when the error is evidence about the provider, else
   ``release()``;
2. the retry planner may retry the same provider: a retryable error that ``retry_on`` keeps for
   it (the failover table's rule), within the attempts, the deadline and the retry budget, after
   the jittered backoff or the provider's ``Retry-After``;
3. else failover: the candidates after this one that the failover table allows
   (:func:`~tidegate.policy.routing.next_candidates`); a kind whose rule stops ends the call;
4. each next candidate's breaker is asked for a permit; one that has opened meanwhile is skipped
   (``skipped:breaker_open`` in the record of what was tried).

The first attempt on each provider counts as a first try in the retry budget; an attempt that
cannot start because the deadline left no time stops the call with
:class:`~tidegate.errors.DeadlineExceeded` (or, after a wait, with the provider's last error).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple, TypeAlias

from tidegate.errors import CircuitOpen, DeadlineExceeded, ProviderError, ProviderErrorKind
from tidegate.policy.breaker import CircuitBreaker, Permit
from tidegate.policy.deadline import Deadline
from tidegate.policy.retry import GiveUp, GiveUpReason, RetryBudget, RetryOptions, RetryPlanner
from tidegate.policy.routing import (
    FailedOver,
    ProviderSpec,
    RoutePlan,
    SkipReason,
    next_candidates,
    retry_same,
)

__all__ = [
    "NOT_EVIDENCE",
    "AttemptEvent",
    "AttemptPolicy",
    "Attempts",
    "Call",
    "RetryPlanned",
    "RetryRefused",
    "Step",
    "Stop",
    "Tried",
    "Wait",
    "is_evidence",
]

_K = ProviderErrorKind

#: Error kinds that say nothing about the provider's health: its breaker permit is released.
NOT_EVIDENCE: Final = frozenset(
    {_K.BAD_REQUEST, _K.CONTEXT_LENGTH, _K.CONTENT_FILTER, _K.CANCELLED}
)

#: What was tried, in order: ``(provider, None)`` for an answer, ``(provider, kind)`` for a
#: failure, ``(provider, SkipReason.BREAKER_OPEN)`` for a breaker that refused the attempt.
Tried: TypeAlias = list[tuple[str, ProviderErrorKind | SkipReason | None]]


def is_evidence(error: ProviderError, *, cut_short: bool) -> bool:
    """Whether ``error`` says something about the provider's health (its breaker records a
    failure) or not (the permit is released).

    Not evidence: an error about the request itself (a bad request, a prompt over the context
    window, a content filter), the caller going away, and a timeout of an attempt that was
    ``cut_short``, given less time than the provider's own limit because the caller's deadline
    (or any tighter limit) left no more: the provider may well have answered in its own time. A
    tenant sending short deadlines must not open a healthy provider's breaker for everyone.
    """
    if error.kind in NOT_EVIDENCE:
        return False
    return not (cut_short and error.kind is _K.TIMEOUT)


class Call(NamedTuple):
    """Call ``spec`` now, and give it ``timeout`` seconds; ``permit`` is its breaker's.

    The steps are named tuples: one or two are made for every model call, and a frozen
    dataclass builds its fields one ``object.__setattr__`` at a time."""

    spec: ProviderSpec
    timeout: float
    permit: Permit
    #: The attempt's number on this provider (1 for its first try).
    attempt: int


class Wait(NamedTuple):
    """Wait ``delay`` seconds, then :meth:`Attempts.resume` (a retry of ``provider``)."""

    delay: float
    provider: str


class Stop(NamedTuple):
    """Make no further attempt: the call ends with ``error``.

    ``reason`` says why the last provider was given up: a
    :class:`~tidegate.policy.retry.GiveUpReason` value (``not_retryable``, ``attempts_exhausted``,
    ``deadline``, ``retry_after_exceeds_deadline``, ``retry_budget``), or ``circuit_open`` when no
    candidate's breaker admitted a call.
    """

    error: Exception
    reason: str


Step: TypeAlias = Call | Wait | Stop


@dataclass(frozen=True, slots=True)
class RetryPlanned:
    """Event: ``provider`` failed with ``kind`` and is tried again (attempt ``attempt``) after
    ``delay`` seconds (the provider's own ``Retry-After`` when ``from_retry_after``)."""

    provider: str
    attempt: int
    delay: float
    kind: ProviderErrorKind
    from_retry_after: bool


@dataclass(frozen=True, slots=True)
class RetryRefused:
    """Event: a retry of ``provider`` that was otherwise allowed was refused by a retry budget."""

    provider: str


AttemptEvent: TypeAlias = RetryPlanned | RetryRefused | FailedOver


_CIRCUIT_OPEN: Final = "circuit_open"


def _ignore(event: AttemptEvent) -> None:
    del event


class AttemptPolicy:
    """What every model call of a gateway (or of a simulation) shares.

    ``retry_on`` says which retryable errors are retried on the same provider before failing
    over: the failover table's rule, :func:`~tidegate.policy.routing.retry_same` with its default
    options unless given (the gateway binds its configured ones); ``on_event`` hears every
    retry, refusal and failover (for metrics).
    """

    __slots__ = ("breakers", "budget", "on_event", "planner")

    def __init__(
        self,
        retry: RetryOptions,
        *,
        breakers: Mapping[str, CircuitBreaker],
        rng: random.Random,
        budget: RetryBudget | None = None,
        retry_on: Callable[[ProviderError], bool] | None = None,
        on_event: Callable[[AttemptEvent], None] | None = None,
    ) -> None:
        self.breakers = breakers
        self.budget = budget
        self.planner = RetryPlanner(
            retry, rng=rng, budget=budget, retry_on=retry_same if retry_on is None else retry_on
        )
        self.on_event = on_event or _ignore

    def start(
        self,
        plan: RoutePlan,
        deadline: Deadline,
        limit: Callable[[ProviderSpec], float],
        tried: Tried,
        *,
        only: ProviderSpec | None = None,
    ) -> Attempts:
        """The attempts of one call over ``plan``'s candidates (or ``only`` that one, with its
        retries), before ``deadline``. ``limit(spec)`` is the provider's own time limit for one
        attempt (an attempt gets less only when the deadline leaves less); ``tried`` is appended
        with what was tried."""
        return Attempts(self, plan, deadline, limit, tried, only)


class Attempts:
    """The attempts of one model call: see the module docstring for the protocol."""

    __slots__ = (
        "_call",
        "_deadline",
        "_limit",
        "_number",
        "_only",
        "_plan",
        "_policy",
        "_previous_delay",
        "_queue",
        "_spec",
        "_why",
        "last",
        "tried",
    )

    def __init__(
        self,
        policy: AttemptPolicy,
        plan: RoutePlan,
        deadline: Deadline,
        limit: Callable[[ProviderSpec], float],
        tried: Tried,
        only: ProviderSpec | None,
    ) -> None:
        self._policy = policy
        self._plan = plan
        self._deadline = deadline
        self._limit = limit
        self.tried = tried
        self._only = only is not None
        #: The candidates still to try.
        self._queue: Iterator[ProviderSpec] = iter((only,) if only is not None else plan.candidates)
        #: The provider of the current (or last) call, and that call while it is under way.
        self._spec: ProviderSpec | None = None
        self._call: Call | None = None
        self._number = 0
        self._previous_delay: float | None = None
        #: Why the last provider was given up (see :class:`Stop`).
        self._why = _CIRCUIT_OPEN
        #: The last provider error, which a call that gives up ends with.
        self.last: ProviderError | None = None

    @property
    def provider(self) -> ProviderSpec | None:
        """The provider of the call under way (or last made)."""
        return self._spec

    def begin(self) -> Call | Stop:
        """The first step: a call of the first candidate whose breaker admits one."""
        return self._next_provider()

    def resume(self) -> Call | Stop:
        """After a :class:`Wait`: the retry, unless the deadline left no time for it. Should the
        provider's breaker have opened meanwhile, the next candidate is called instead."""
        spec = self._spec
        assert spec is not None, "resume() follows a Wait"
        own = self._limit(spec)
        step = self._policy.planner.start(self._deadline, own)
        if isinstance(step, GiveUp):
            assert self.last is not None
            return Stop(self.last, step.reason.value)
        try:
            permit = self._acquire(spec, step.timeout)
        except CircuitOpen:
            self.tried.append((spec.name, SkipReason.BREAKER_OPEN))
            return self._next_provider()
        self._number += 1
        return self._start(spec, step.timeout, permit)

    def retry_refused(self) -> Call | Stop:
        """After a :class:`Wait`, another retry budget (the fleet's) refused the retry: the
        provider's retries end as if its error could not be retried, and failover applies."""
        spec = self._spec
        assert spec is not None, "retry_refused() follows a Wait"
        assert self.last is not None
        self._policy.on_event(RetryRefused(spec.name))
        self._why = GiveUpReason.RETRY_BUDGET.value
        return self._fail_over(spec, self.last)

    def succeeded(self) -> None:
        """The call answered (a stream: it ended complete): a success for the breaker."""
        call = self._ended()
        call.permit.success()
        self.tried.append((call.spec.name, None))

    def failed(self, error: ProviderError) -> Step:
        """The call failed with ``error`` before anything was committed: the next step."""
        call = self._ended()
        spec = call.spec
        own = self._limit(spec)
        # Given less than the provider's own limit, the caller's deadline was the tighter one.
        self._settle(call.permit, error, cut_short=call.timeout < own)
        self.tried.append((spec.name, error.kind))
        self.last = error
        plan = self._policy.planner.after_failure(
            error, self._number, self._deadline, own, previous_delay=self._previous_delay
        )
        if not isinstance(plan, GiveUp):
            self._policy.on_event(
                RetryPlanned(spec.name, plan.attempt, plan.delay, plan.kind, plan.from_retry_after)
            )
            self._previous_delay = plan.delay
            return Wait(plan.delay, spec.name)
        if plan.reason is GiveUpReason.RETRY_BUDGET:
            self._policy.on_event(RetryRefused(spec.name))
        self._why = plan.reason.value
        return self._fail_over(spec, error)

    def broke(self, error: ProviderError, *, cut_short: bool = False) -> None:
        """A committed call (a stream past its first chunk) failed with ``error``: its permit
        ends by the same rule, and no other attempt follows (a rescue starts its own).
        ``cut_short``: the caller's deadline was its tighter limit."""
        call = self._ended()
        self._settle(call.permit, error, cut_short=cut_short)
        self.tried.append((call.spec.name, error.kind))
        self.last = error

    def abandoned(self, *, answered: bool = False) -> None:
        """The call ended for a reason that says nothing about the provider (the caller went
        away; ``answered``: it answered, but not what was wanted): the permit is released."""
        if self._call is None:
            return
        call = self._ended()
        call.permit.release()
        if answered:
            self.tried.append((call.spec.name, None))

    # ------------------------------------------------------------------ the rest is bookkeeping

    def _next_provider(self) -> Call | Stop:
        """A first attempt on the next candidate the deadline and its breaker allow."""
        planner = self._policy.planner
        for spec in self._queue:
            own = self._limit(spec)
            step = planner.start(self._deadline, own)
            if isinstance(step, GiveUp):
                return Stop(
                    DeadlineExceeded(
                        "the deadline passed before the first attempt could start",
                        policy="retry",
                    ),
                    step.reason.value,
                )
            try:
                permit = self._acquire(spec, step.timeout)
            except CircuitOpen:
                self.tried.append((spec.name, SkipReason.BREAKER_OPEN))
                self._why = _CIRCUIT_OPEN
                continue
            if self._policy.budget is not None:
                self._policy.budget.record_first_try()
            self._spec, self._number, self._previous_delay = spec, 1, None
            return self._start(spec, step.timeout, permit)
        if self.last is not None:
            return Stop(self.last, self._why)
        return Stop(
            CircuitOpen(
                "every candidate provider's breaker opened", policy="breaker", retry_after=1.0
            ),
            _CIRCUIT_OPEN,
        )

    def _acquire(self, spec: ProviderSpec, timeout: float) -> Permit:
        breaker = self._policy.breakers[spec.name]
        return breaker.acquire(deadline_at=self._deadline.clock.now() + timeout)

    def _start(self, spec: ProviderSpec, timeout: float, permit: Permit) -> Call:
        call = self._call = Call(spec, timeout, permit, self._number)
        return call

    def _ended(self) -> Call:
        """The call under way, which has now ended: its permit is to be settled, once."""
        call = self._call
        assert call is not None, "no call is under way"
        self._call = None
        return call

    @staticmethod
    def _settle(permit: Permit, error: ProviderError, *, cut_short: bool) -> None:
        if is_evidence(error, cut_short=cut_short):
            permit.failure()
        else:
            permit.release()

    def _fail_over(self, spec: ProviderSpec, error: ProviderError) -> Call | Stop:
        rest = () if self._only else next_candidates(self._plan, spec, error)
        self._queue = iter(rest)
        if rest:
            self._policy.on_event(FailedOver(spec.name, rest[0].name, error.kind))
        return self._next_provider()
