"""Tests for tidegate.policy.routing: route plans, the failover table and the Tried header."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.policy import routing
from tidegate.policy.routing import (
    RULES,
    FailedOver,
    FailoverAction,
    FailoverOptions,
    FailoverStopped,
    ProviderSkipped,
    ProviderSpec,
    RoutePlan,
    Skip,
    SkipReason,
    describe_attempts,
    next_candidates,
    plan_route,
    retry_same,
    rule_for,
)

K = ProviderErrorKind
ALL = frozenset({"public", "internal", "personal"})
NOT_PERSONAL = frozenset({"public", "internal"})

PRIMARY = ProviderSpec("primary", ALL, context_window=8_000)
BACKUP = ProviderSpec("backup", NOT_PERSONAL, context_window=32_000)
SPARE = ProviderSpec("spare", ALL, context_window=128_000)
ROUTE = (PRIMARY, BACKUP, SPARE)


def error(kind: ProviderErrorKind, **kwargs: bool) -> ProviderError:
    return ProviderError(kind, f"{kind.value} for a test", provider="primary", **kwargs)


def plan(
    *,
    data_class: str = "internal",
    approved: frozenset[str] = frozenset({"backup", "spare"}),
    open_breakers: frozenset[str] = frozenset(),
    providers: tuple[ProviderSpec, ...] = ROUTE,
) -> RoutePlan:
    return plan_route(
        providers, data_class=data_class, approved=approved, open_breakers=open_breakers
    )


def names(providers: tuple[ProviderSpec, ...]) -> list[str]:
    return [p.name for p in providers]


# --------------------------------------------------------------------------- the public surface


def isort_key(name: str) -> tuple[int, str]:
    """Constants, then classes, then functions, each alphabetical (ruff's RUF022 order)."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_all_is_sorted_and_complete() -> None:
    """The module lists its public names in a sorted __all__, and each one exists."""
    assert list(routing.__all__) == sorted(routing.__all__, key=isort_key)
    for name in routing.__all__:
        assert hasattr(routing, name)


# --------------------------------------------------------------------------- plan_route


def test_healthy_route_keeps_every_provider_in_order() -> None:
    """With everything allowed and no breaker open, every provider is a candidate, in order."""
    result = plan()
    assert names(result.candidates) == ["primary", "backup", "spare"]
    assert result.skipped == ()


def test_primary_needs_no_approval() -> None:
    """The primary is a candidate even when the approved set is empty."""
    result = plan(approved=frozenset())
    assert names(result.candidates) == ["primary"]
    assert result.skipped == (
        Skip("backup", SkipReason.NOT_APPROVED),
        Skip("spare", SkipReason.NOT_APPROVED),
    )


def test_fallback_not_approved_is_skipped() -> None:
    """A fallback the release gate did not approve is skipped with not_approved."""
    result = plan(approved=frozenset({"spare"}))
    assert names(result.candidates) == ["primary", "spare"]
    assert result.skipped == (Skip("backup", SkipReason.NOT_APPROVED),)


def test_data_class_applies_to_the_primary_too() -> None:
    """A primary that may not receive the data class is skipped like any fallback."""
    restricted = ProviderSpec("primary", frozenset({"public"}))
    result = plan(providers=(restricted, SPARE))
    assert names(result.candidates) == ["spare"]
    assert result.skipped == (Skip("primary", SkipReason.DATA_CLASS),)


def test_data_class_skips_an_approved_fallback() -> None:
    """Personal data never goes to a fallback that may not receive it, approved or not."""
    result = plan(data_class="personal")
    assert names(result.candidates) == ["primary", "spare"]
    assert result.skipped == (Skip("backup", SkipReason.DATA_CLASS),)


def test_open_breaker_skips_primary_and_fallbacks() -> None:
    """A provider whose breaker is open is skipped with breaker_open, primary or not."""
    result = plan(open_breakers=frozenset({"primary", "spare"}))
    assert names(result.candidates) == ["backup"]
    assert result.skipped == (
        Skip("primary", SkipReason.BREAKER_OPEN),
        Skip("spare", SkipReason.BREAKER_OPEN),
    )


def test_unapproved_fallback_is_skipped_even_when_everything_else_is_down() -> None:
    """With the primary and the approved fallback down, the unapproved one is still not used."""
    result = plan(approved=frozenset({"backup"}), open_breakers=frozenset({"primary", "backup"}))
    assert result.candidates == ()
    assert result.skipped == (
        Skip("primary", SkipReason.BREAKER_OPEN),
        Skip("backup", SkipReason.BREAKER_OPEN),
        Skip("spare", SkipReason.NOT_APPROVED),
    )


def test_skip_reason_precedence_is_data_class_then_approval_then_breaker() -> None:
    """When several reasons apply, the most lasting one is reported."""
    result = plan(
        data_class="personal",
        approved=frozenset({"spare"}),
        open_breakers=frozenset({"primary", "backup", "spare"}),
    )
    assert result.skipped == (
        Skip("primary", SkipReason.BREAKER_OPEN),
        Skip("backup", SkipReason.DATA_CLASS),
        Skip("spare", SkipReason.BREAKER_OPEN),
    )
    unapproved_and_open = plan(approved=frozenset(), open_breakers=frozenset({"backup"}))
    assert unapproved_and_open.skipped[0] == Skip("backup", SkipReason.NOT_APPROVED)


def test_plan_route_reports_each_skip_as_an_event() -> None:
    """Every skipped provider is reported once through on_event, in route order."""
    events: list[ProviderSkipped] = []
    plan_route(
        ROUTE,
        data_class="personal",
        approved=frozenset(),
        open_breakers=frozenset(),
        on_event=events.append,
    )
    assert events == [
        ProviderSkipped("backup", SkipReason.DATA_CLASS),
        ProviderSkipped("spare", SkipReason.NOT_APPROVED),
    ]


def test_plan_route_refuses_bad_input() -> None:
    """An empty route, an empty data class and repeated provider names are ValueErrors."""
    with pytest.raises(ValueError, match="providers"):
        plan_route([], data_class="public", approved=(), open_breakers=())
    with pytest.raises(ValueError, match="data_class"):
        plan(data_class="")
    with pytest.raises(ValueError, match="repeated"):
        plan(providers=(PRIMARY, BACKUP, PRIMARY))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "", "data_classes": ALL}, "name"),
        ({"name": "a,b", "data_classes": ALL}, "name"),
        ({"name": "a=b", "data_classes": ALL}, "name"),
        ({"name": "has space", "data_classes": ALL}, "name"),
        ({"name": "ok", "data_classes": frozenset()}, "data_classes"),
        ({"name": "ok", "data_classes": {"public"}}, "data_classes"),
        ({"name": "ok", "data_classes": ALL, "context_window": 0}, "context_window"),
        ({"name": "ok", "data_classes": ALL, "context_window": True}, "context_window"),
    ],
)
def test_provider_spec_validates_each_field(kwargs: dict[str, object], field: str) -> None:
    """A bad provider spec raises ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        ProviderSpec(**kwargs)  # type: ignore[arg-type]


def test_provider_spec_accepts_model_like_names() -> None:
    """Names such as vendor/model-1.5:latest are valid provider names."""
    assert ProviderSpec("vendor/model-1.5:latest", ALL).name == "vendor/model-1.5:latest"


names_strategy = st.lists(
    st.sampled_from(["a", "b", "c", "d", "e", "f"]), min_size=1, max_size=6, unique=True
)
classes = st.sampled_from(["public", "internal", "personal"])


@settings(max_examples=200, deadline=None)
@given(
    route=names_strategy,
    allowed=st.lists(st.frozensets(classes, min_size=1), min_size=6, max_size=6),
    data_class=classes,
    approved=st.frozensets(st.sampled_from("abcdef")),
    open_breakers=st.frozensets(st.sampled_from("abcdef")),
)
def test_plan_partitions_the_route_and_obeys_every_rule(
    route: list[str],
    allowed: list[frozenset[str]],
    data_class: str,
    approved: frozenset[str],
    open_breakers: frozenset[str],
) -> None:
    """Every provider is either a candidate or skipped, order is kept, and each rule holds."""
    providers = tuple(ProviderSpec(n, allowed[i]) for i, n in enumerate(route))
    result = plan_route(
        providers, data_class=data_class, approved=approved, open_breakers=open_breakers
    )
    candidate_names = names(result.candidates)
    skipped_names = [s.name for s in result.skipped]
    assert sorted(candidate_names + skipped_names) == sorted(route)
    assert candidate_names == [n for n in route if n in candidate_names]
    assert skipped_names == [n for n in route if n in skipped_names]
    for candidate in result.candidates:
        assert data_class in candidate.data_classes
        assert candidate.name not in open_breakers
        assert candidate.name == route[0] or candidate.name in approved
    for skip in result.skipped:
        assert skip.name != route[0] or skip.reason is not SkipReason.NOT_APPROVED


# --------------------------------------------------------------------------- the rule table

EXPECTED_ACTIONS = {
    K.RATE_LIMITED: FailoverAction.RETRY_THEN_FAILOVER,
    K.OVERLOADED: FailoverAction.RETRY_THEN_FAILOVER,
    K.SERVER: FailoverAction.RETRY_THEN_FAILOVER,
    K.CONNECTION: FailoverAction.RETRY_THEN_FAILOVER,
    K.MALFORMED: FailoverAction.RETRY_THEN_FAILOVER,
    K.TIMEOUT: FailoverAction.FAILOVER,
    K.NOT_FOUND: FailoverAction.FAILOVER,
    K.CONTEXT_LENGTH: FailoverAction.FAILOVER_LARGER_CONTEXT,
    K.BAD_REQUEST: FailoverAction.STOP,
    K.AUTH: FailoverAction.STOP,
    K.CONTENT_FILTER: FailoverAction.STOP,
    K.CANCELLED: FailoverAction.STOP,
}


def test_rules_cover_every_error_kind_exactly_once() -> None:
    """The failover table has one rule per provider error kind, no more, no less."""
    assert set(RULES) == set(ProviderErrorKind)
    assert set(EXPECTED_ACTIONS) == set(ProviderErrorKind)


@pytest.mark.parametrize("kind", list(ProviderErrorKind))
def test_rule_action_per_kind(kind: ProviderErrorKind) -> None:
    """Each error kind has the documented action and a reason."""
    assert RULES[kind].action is EXPECTED_ACTIONS[kind]
    assert RULES[kind].why


def test_rules_table_is_read_only() -> None:
    """RULES cannot be changed at run time."""
    with pytest.raises(TypeError):
        RULES[K.TIMEOUT] = RULES[K.SERVER]  # type: ignore[index]


@pytest.mark.parametrize(
    "kind", [K.RATE_LIMITED, K.OVERLOADED, K.SERVER, K.CONNECTION, K.MALFORMED]
)
def test_retryable_kinds_retry_the_same_provider(kind: ProviderErrorKind) -> None:
    """Transient kinds are retried on the same provider first."""
    assert retry_same(error(kind)) is True


@pytest.mark.parametrize(
    "kind",
    [
        K.TIMEOUT,
        K.NOT_FOUND,
        K.CONTEXT_LENGTH,
        K.BAD_REQUEST,
        K.AUTH,
        K.CONTENT_FILTER,
        K.CANCELLED,
    ],
)
def test_other_kinds_do_not_retry_the_same_provider(kind: ProviderErrorKind) -> None:
    """Timeouts, model-specific errors and stopping errors are not retried on the same provider."""
    assert retry_same(error(kind)) is False


def test_timeout_retry_is_an_option() -> None:
    """With retry_timeouts on, a timeout is retried on the same provider and still fails over."""
    options = FailoverOptions(retry_timeouts=True)
    assert retry_same(error(K.TIMEOUT), options) is True
    assert rule_for(K.TIMEOUT, options).action is FailoverAction.RETRY_THEN_FAILOVER
    assert rule_for(K.TIMEOUT).action is FailoverAction.FAILOVER
    assert rule_for(K.SERVER, options) is RULES[K.SERVER]


def test_provider_override_stops_same_provider_retry_but_not_failover() -> None:
    """A 429 the provider marks not retryable (a spent quota) is not retried, yet fails over."""
    quota = error(K.RATE_LIMITED, retryable=False)
    assert retry_same(quota) is False
    assert names(next_candidates(plan(), PRIMARY, quota)) == ["backup", "spare"]


def test_retry_same_works_as_a_one_argument_retry_on() -> None:
    """retry_same, bare or with options bound by partial, takes just the error."""
    bound = functools.partial(retry_same, options=FailoverOptions(retry_timeouts=True))
    assert [retry_same(error(K.TIMEOUT)), bound(error(K.TIMEOUT))] == [False, True]


def test_failover_options_validate_their_field() -> None:
    """A non-bool retry_timeouts raises ValueError naming the field."""
    with pytest.raises(ValueError, match="retry_timeouts"):
        FailoverOptions(retry_timeouts=1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- next_candidates


@pytest.mark.parametrize(
    "kind",
    [K.RATE_LIMITED, K.OVERLOADED, K.SERVER, K.CONNECTION, K.MALFORMED, K.TIMEOUT, K.NOT_FOUND],
)
def test_failover_kinds_move_on_to_the_rest_of_the_plan(kind: ProviderErrorKind) -> None:
    """A failing-over kind leaves the candidates after the failed one, in order."""
    result = plan()
    assert names(next_candidates(result, PRIMARY, error(kind))) == ["backup", "spare"]
    assert names(next_candidates(result, BACKUP, error(kind))) == ["spare"]
    assert next_candidates(result, SPARE, error(kind)) == ()


@pytest.mark.parametrize("kind", [K.BAD_REQUEST, K.AUTH, K.CONTENT_FILTER, K.CANCELLED])
def test_stopping_kinds_leave_no_candidates(kind: ProviderErrorKind) -> None:
    """A caller's mistake, our credentials or a cancellation is never sent elsewhere."""
    assert next_candidates(plan(), PRIMARY, error(kind)) == ()


def test_context_length_moves_only_to_a_larger_window() -> None:
    """context_length skips candidates whose window is not larger than the failed one's."""
    small = ProviderSpec("small", ALL, context_window=4_000)
    same = ProviderSpec("same", ALL, context_window=8_000)
    unknown = ProviderSpec("unknown", ALL)
    route = (PRIMARY, small, same, unknown, SPARE)
    result = plan(providers=route, approved=frozenset(names(route)))
    assert names(next_candidates(result, PRIMARY, error(K.CONTEXT_LENGTH))) == ["spare"]


def test_context_length_from_an_unknown_window_has_nowhere_to_go() -> None:
    """When the failed provider's window is unknown, no candidate is known to be larger."""
    mystery = ProviderSpec("mystery", ALL)
    result = plan(providers=(mystery, SPARE), approved=frozenset({"spare"}))
    assert next_candidates(result, mystery, error(K.CONTEXT_LENGTH)) == ()


def test_next_candidates_refuses_a_provider_outside_the_plan() -> None:
    """Asking what follows a provider that was skipped is a ValueError."""
    result = plan(approved=frozenset({"spare"}))
    with pytest.raises(ValueError, match="backup"):
        next_candidates(result, BACKUP, error(K.SERVER))


def test_next_candidates_reports_failover_and_stops() -> None:
    """on_event gets FailedOver with the next provider, or FailoverStopped saying why."""
    events: list[FailedOver | FailoverStopped] = []
    result = plan()
    next_candidates(result, PRIMARY, error(K.TIMEOUT), on_event=events.append)
    next_candidates(result, PRIMARY, error(K.AUTH), on_event=events.append)
    next_candidates(result, SPARE, error(K.SERVER), on_event=events.append)
    assert events == [
        FailedOver("primary", "backup", K.TIMEOUT),
        FailoverStopped("primary", K.AUTH, exhausted=False),
        FailoverStopped("spare", K.SERVER, exhausted=True),
    ]


# --------------------------------------------------------------------------- the Tried header


def test_describe_attempts_formats_tries_then_skips() -> None:
    """Calls come first in the order made, then the plan's skips, as name=outcome pairs."""
    header = describe_attempts(
        [("primary", K.TIMEOUT), ("fallback", None)],
        [Skip("other", SkipReason.BREAKER_OPEN)],
    )
    assert header == "primary=timeout, fallback=ok, other=skipped:breaker_open"


def test_describe_attempts_lists_each_retry_and_late_skips() -> None:
    """A retried provider appears once per attempt; a breaker that opened later shows inline."""
    header = describe_attempts(
        [("primary", K.SERVER), ("primary", K.SERVER), ("backup", SkipReason.BREAKER_OPEN)],
        [Skip("spare", SkipReason.NOT_APPROVED)],
    )
    assert header == (
        "primary=server, primary=server, backup=skipped:breaker_open, spare=skipped:not_approved"
    )


def test_describe_attempts_of_nothing_is_empty() -> None:
    """With nothing tried or skipped the header value is the empty string."""
    assert describe_attempts([]) == ""


def test_describe_attempts_is_the_same_the_first_time_and_after() -> None:
    """A header written from entries already seen matches the one written afresh, from lists,
    generators or tuples alike, and a bad name is refused again, never remembered."""
    tried = [("first-seen", K.TIMEOUT), ("first-seen", None), ("other", SkipReason.DATA_CLASS)]
    skipped = [Skip("late", SkipReason.NOT_APPROVED)]
    expected = (
        "first-seen=timeout, first-seen=ok, other=skipped:data_class, late=skipped:not_approved"
    )
    assert describe_attempts(tried, skipped) == expected
    assert describe_attempts(iter(tried), (s for s in skipped)) == expected
    assert describe_attempts([list(t) for t in tried], tuple(skipped)) == expected  # type: ignore[misc]
    for _ in range(2):
        with pytest.raises(ValueError, match="provider name"):
            describe_attempts(tried, [Skip("bad name", SkipReason.BREAKER_OPEN)])


def test_describe_attempts_of_one_call_is_its_entry() -> None:
    """One call and no skip (nearly every request): its entry alone, from a tuple or a list,
    written afresh or remembered; with a skip, the skip follows it."""
    for _ in range(2):
        assert describe_attempts([("solo", None)]) == "solo=ok"
        assert describe_attempts([["solo", K.TIMEOUT]]) == "solo=timeout"  # type: ignore[list-item]
        assert describe_attempts([("solo", None)], ()) == "solo=ok"
    late = [Skip("late", SkipReason.NOT_APPROVED)]
    assert describe_attempts([("solo", None)], late) == "solo=ok, late=skipped:not_approved"


def test_describe_attempts_refuses_names_that_break_the_format() -> None:
    """A name holding a separator would make the header ambiguous, so it is refused."""
    with pytest.raises(ValueError, match="provider name"):
        describe_attempts([("a=b", None)])
