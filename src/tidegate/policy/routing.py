"""Routing and failover: which providers a request may reach, and what each provider error does.

A route is an ordered list of providers: the first is the primary, the rest are fallbacks.
:func:`plan_route` turns it into the candidates for one request, in route order, and says why
every other provider was skipped. Three rules decide, checked in this order so that the most
lasting reason is the one reported:

1. ``data_class``: the provider may not receive the request's data class (applies to all,
   the primary included);
2. ``not_approved``: a fallback that the release gate has not approved is never an automatic
   fallback, even when every other provider is down (the primary is exempt: it is what the route
   was released with);
3. ``breaker_open``: the provider's circuit breaker is open.

One more rule applies to one request after the plan is made: :func:`fit_context` skips the
candidates whose known context window is smaller than the prompt plus ``max_tokens``
(``context_window``).

After a failed call, :data:`RULES` says what the error kind does: retry the same provider and then
fail over, fail over at once, fail over only to a larger context window, or stop. A stop is the
caller's own mistake or a verdict that another provider would repeat (bad request, auth, content
filter) or a cancellation, and sending it elsewhere only doubles the failure.

Failover follows the error's *kind* only. A provider may mark one error as not retryable (a spent
quota answered with 429, say): that stops :func:`retry_same`, but the kind still fails over,
because another provider has its own quota.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from tidegate.errors import ProviderError, ProviderErrorKind

__all__ = [
    "DEFAULT_FAILOVER_OPTIONS",
    "RULES",
    "FailedOver",
    "FailoverAction",
    "FailoverOptions",
    "FailoverStopped",
    "ProviderSkipped",
    "ProviderSpec",
    "RoutePlan",
    "Rule",
    "Skip",
    "SkipReason",
    "describe_attempts",
    "fit_context",
    "next_candidates",
    "plan_route",
    "retry_same",
    "rule_for",
]

# Names go into the X-Tidegate-Tried header as ``name=outcome``: no separators, no spaces.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


def _check_name(name: str, field: str) -> None:
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValueError(
            f"{field} must be letters, digits and . _ : / @ + - (starting with a letter or "
            f"digit), got {name!r}"
        )


class SkipReason(StrEnum):
    """Why a provider on the route is not a candidate for this request."""

    DATA_CLASS = "data_class"
    NOT_APPROVED = "not_approved"
    BREAKER_OPEN = "breaker_open"
    CONTEXT_WINDOW = "context_window"


class FailoverAction(StrEnum):
    """What a provider error does to the rest of the route."""

    RETRY_THEN_FAILOVER = "retry_then_failover"
    FAILOVER = "failover"
    FAILOVER_LARGER_CONTEXT = "failover_larger_context"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the failover table: the action for an error kind, and why."""

    action: FailoverAction
    why: str

    @property
    def retries_same(self) -> bool:
        """Whether the same provider is tried again before failing over."""
        return self.action is FailoverAction.RETRY_THEN_FAILOVER

    @property
    def fails_over(self) -> bool:
        """Whether the error may move on to another candidate."""
        return self.action is not FailoverAction.STOP


_A = FailoverAction
_K = ProviderErrorKind

#: The failover table, one rule per error kind, with the defaults of :class:`FailoverOptions`.
RULES: Final[Mapping[ProviderErrorKind, Rule]] = MappingProxyType(
    {
        _K.RATE_LIMITED: Rule(_A.RETRY_THEN_FAILOVER, "the provider asked us to slow down"),
        _K.OVERLOADED: Rule(_A.RETRY_THEN_FAILOVER, "the provider is briefly overloaded"),
        _K.SERVER: Rule(_A.RETRY_THEN_FAILOVER, "a 5xx is often transient"),
        _K.CONNECTION: Rule(_A.RETRY_THEN_FAILOVER, "a dropped connection is often transient"),
        _K.MALFORMED: Rule(_A.RETRY_THEN_FAILOVER, "an unparsable answer is often a one-off"),
        _K.TIMEOUT: Rule(
            _A.FAILOVER, "a silent provider would likely stay silent and spend the deadline again"
        ),
        _K.NOT_FOUND: Rule(_A.FAILOVER, "an unknown or retired model id is specific to it"),
        _K.CONTEXT_LENGTH: Rule(
            _A.FAILOVER_LARGER_CONTEXT, "only a larger context window can take the prompt"
        ),
        _K.BAD_REQUEST: Rule(_A.STOP, "the request itself is wrong; every provider would refuse"),
        _K.AUTH: Rule(_A.STOP, "our credentials are a configuration fault, not an outage"),
        _K.CONTENT_FILTER: Rule(_A.STOP, "shopping for a laxer filter is not a fallback"),
        _K.CANCELLED: Rule(_A.STOP, "the caller went away; nobody is waiting for an answer"),
    }
)

_TIMEOUT_RETRIED = Rule(_A.RETRY_THEN_FAILOVER, "timeouts are retried on the same provider")


@dataclass(frozen=True, slots=True, kw_only=True)
class FailoverOptions:
    """Settings of the failover table.

    ``retry_timeouts`` (default ``False``): retry a provider that timed out before failing over.
    Off by default because a provider that said nothing for a whole per-try timeout usually says
    nothing again, and the retry spends the deadline that the fallback needs.
    """

    retry_timeouts: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.retry_timeouts, bool):
            raise ValueError(f"retry_timeouts must be a bool, got {self.retry_timeouts!r}")


DEFAULT_FAILOVER_OPTIONS: Final = FailoverOptions()


@dataclass(frozen=True, slots=True)
class ProviderSpec:
    """One provider on a route, as routing sees it.

    ``data_classes`` lists the data classes the provider may receive (for example ``"public"``,
    ``"internal"``, ``"personal"``); it may not be empty. ``context_window`` is the model's
    context window in tokens, or ``None`` when unknown (an unknown window is never "larger").
    """

    name: str
    data_classes: frozenset[str]
    context_window: int | None = None

    def __post_init__(self) -> None:
        _check_name(self.name, "name")
        if not isinstance(self.data_classes, frozenset) or not self.data_classes:
            raise ValueError(
                f"data_classes of {self.name!r} must be a non-empty frozenset, "
                f"got {self.data_classes!r}"
            )
        if self.context_window is not None and (
            isinstance(self.context_window, bool)
            or not isinstance(self.context_window, int)
            or self.context_window <= 0
        ):
            raise ValueError(
                f"context_window of {self.name!r} must be a positive int or None, "
                f"got {self.context_window!r}"
            )


@dataclass(frozen=True, slots=True)
class Skip:
    """A provider that will not be called for this request, and why."""

    name: str
    reason: SkipReason


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The candidates for one request, in route order, and the providers skipped, in route order."""

    candidates: tuple[ProviderSpec, ...]
    skipped: tuple[Skip, ...]


@dataclass(frozen=True, slots=True)
class ProviderSkipped:
    """Event: a provider on the route was left out of a request's plan."""

    name: str
    reason: SkipReason


@dataclass(frozen=True, slots=True)
class FailedOver:
    """Event: a failed provider handed the request on to the next candidate."""

    from_provider: str
    to_provider: str
    kind: ProviderErrorKind


@dataclass(frozen=True, slots=True)
class FailoverStopped:
    """Event: a provider error ended the route.

    ``exhausted`` is true when the rule allowed failover but no suitable candidate was left, and
    false when the rule itself stops.
    """

    provider: str
    kind: ProviderErrorKind
    exhausted: bool


def plan_route(
    providers: Sequence[ProviderSpec],
    *,
    data_class: str,
    approved: Collection[str],
    open_breakers: Collection[str],
    on_event: Callable[[ProviderSkipped], None] | None = None,
) -> RoutePlan:
    """The candidates for one request, and the reason each other provider is skipped.

    ``approved`` holds the providers the release gate allows as automatic fallbacks; the primary
    (``providers[0]``) does not need to be in it. ``open_breakers`` holds the providers whose
    breaker is open right now. An empty ``candidates`` means nothing may be called.
    """
    if not providers:
        raise ValueError("providers must list at least the primary")
    if not isinstance(data_class, str) or not data_class:
        raise ValueError(f"data_class must be a non-empty string, got {data_class!r}")
    names = [p.name for p in providers]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"providers must have distinct names; repeated: {duplicates}")

    candidates: list[ProviderSpec] = []
    skipped: list[Skip] = []
    for index, provider in enumerate(providers):
        reason: SkipReason | None = None
        if data_class not in provider.data_classes:
            reason = SkipReason.DATA_CLASS
        elif index > 0 and provider.name not in approved:
            reason = SkipReason.NOT_APPROVED
        elif provider.name in open_breakers:
            reason = SkipReason.BREAKER_OPEN
        if reason is None:
            candidates.append(provider)
            continue
        skipped.append(Skip(provider.name, reason))
        if on_event is not None:
            on_event(ProviderSkipped(provider.name, reason))
    return RoutePlan(tuple(candidates), tuple(skipped))


def fit_context(plan: RoutePlan, needed: Callable[[ProviderSpec], int]) -> RoutePlan:
    """``plan`` less the candidates whose known context window is smaller than what the request
    needs of it (``needed(spec)``: its prompt as that provider counts it, plus ``max_tokens``),
    each skipped as ``context_window`` after the plan's own skips. A candidate whose window is
    unknown stays; ``needed`` is asked only of those with one."""
    kept: list[ProviderSpec] = []
    small: list[Skip] = []
    for spec in plan.candidates:
        window = spec.context_window
        if window is not None and needed(spec) > window:
            small.append(Skip(spec.name, SkipReason.CONTEXT_WINDOW))
        else:
            kept.append(spec)
    if not small:
        return plan
    return RoutePlan(tuple(kept), (*plan.skipped, *small))


def rule_for(kind: ProviderErrorKind, options: FailoverOptions = DEFAULT_FAILOVER_OPTIONS) -> Rule:
    """The rule for ``kind`` under ``options`` (``RULES`` with the options applied)."""
    if kind is ProviderErrorKind.TIMEOUT and options.retry_timeouts:
        return _TIMEOUT_RETRIED
    return RULES[kind]


def retry_same(error: ProviderError, options: FailoverOptions = DEFAULT_FAILOVER_OPTIONS) -> bool:
    """Whether ``error`` is retried on the same provider before failing over.

    True only when the kind's rule retries and the provider did not mark the error as not
    retryable. Usable directly as the retry planner's ``retry_on``; bind other options with
    ``functools.partial(retry_same, options=...)``.
    """
    return rule_for(error.kind, options).retries_same and error.retryable


def next_candidates(
    plan: RoutePlan,
    failed: ProviderSpec,
    error: ProviderError,
    *,
    on_event: Callable[[FailedOver | FailoverStopped], None] | None = None,
) -> tuple[ProviderSpec, ...]:
    """The candidates left after ``failed`` gave up with ``error``, in route order.

    Empty when the error stops the route or nothing suitable is left. For ``context_length`` only
    candidates with a context window known to be larger than the failed provider's remain.
    Retries of the same provider are decided before this, by :func:`retry_same`.
    """
    positions = [c.name for c in plan.candidates]
    if failed.name not in positions:
        raise ValueError(f"{failed.name!r} is not a candidate of this plan")
    rest = plan.candidates[positions.index(failed.name) + 1 :]
    rule = RULES[error.kind]
    if not rule.fails_over:
        rest = ()
    elif rule.action is FailoverAction.FAILOVER_LARGER_CONTEXT:
        limit = failed.context_window
        rest = tuple(
            c
            for c in rest
            if limit is not None and c.context_window is not None and c.context_window > limit
        )
    if on_event is not None:
        if rest:
            on_event(FailedOver(failed.name, rest[0].name, error.kind))
        else:
            on_event(FailoverStopped(failed.name, error.kind, exhausted=rule.fails_over))
    return rest


def describe_attempts(
    tried: Iterable[tuple[str, ProviderErrorKind | SkipReason | None]],
    skipped: Iterable[Skip] = (),
) -> str:
    """The value of the ``X-Tidegate-Tried`` response header.

    Format: comma-and-space separated ``name=outcome`` entries. First every call made, in the
    order made (a provider retried appears once per attempt), then every provider skipped by the
    plan, in route order. ``outcome`` is ``ok`` (``None``), an error kind (``timeout``), or
    ``skipped:<reason>`` (a :class:`SkipReason`, also allowed in ``tried`` for a provider whose
    breaker opened after the plan was made). Example:
    ``primary=timeout, fallback=ok, other=skipped:breaker_open``. Nothing tried is ``""``.
    """
    # Each entry is looked up here first (an entry is never empty): only a pair not written
    # yet costs the call to _entry(). One call and no skip (nearly every request) is its entry.
    if not skipped and isinstance(tried, list) and len(tried) == 1:
        ((name, outcome),) = tried
        return _ENTRIES.get((name, outcome)) or _entry(name, outcome)
    entries = [_ENTRIES.get((name, outcome)) or _entry(name, outcome) for name, outcome in tried]
    for skip in skipped:  # usually none: a loop, not a second list to add
        name, reason = skip.name, skip.reason
        entries.append(_ENTRIES.get((name, reason)) or _entry(name, reason))
    return ", ".join(entries)


#: ``name=outcome`` texts already written (provider names and outcomes are small sets).
_ENTRIES: dict[tuple[str, ProviderErrorKind | SkipReason | None], str] = {}
_ENTRIES_REMEMBERED = 4096


def _entry(name: str, outcome: ProviderErrorKind | SkipReason | None) -> str:
    """``name=outcome``, written once per pair (the name checked then)."""
    known = _ENTRIES.get((name, outcome))
    if known is not None:
        return known
    _check_name(name, "provider name")
    if outcome is None:
        text = "ok"
    elif isinstance(outcome, SkipReason):
        text = f"skipped:{outcome.value}"
    else:
        text = ProviderErrorKind(outcome).value
    if len(_ENTRIES) >= _ENTRIES_REMEMBERED:
        _ENTRIES.clear()
    entry = _ENTRIES[(name, outcome)] = f"{name}={text}"
    return entry
