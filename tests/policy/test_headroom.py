"""Provider-reported headroom: reading OpenAI's and Anthropic's rate-limit headers, when a
provider is low, and the route order that goes around it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.clock import ManualClock
from tidegate.policy.headroom import (
    Allowance,
    HeadroomBook,
    parse_duration,
    prefer_ample,
    read_headers,
)
from tidegate.policy.routing import ProviderSpec, RoutePlan, Skip, SkipReason

WALL = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def openai_headers(remaining: int, limit: int = 100, reset: str = "6m0s") -> dict[str, str]:
    return {
        "x-ratelimit-limit-requests": str(limit),
        "x-ratelimit-remaining-requests": str(remaining),
        "x-ratelimit-reset-requests": reset,
        "x-ratelimit-limit-tokens": "40000",
        "x-ratelimit-remaining-tokens": "39000",
        "x-ratelimit-reset-tokens": "20ms",
    }


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0.5", 0.5),
        ("17", 17.0),
        ("", None),
        ("soon", None),
        ("5x", None),
        ("1s2", None),
        ("-3", None),
        ("inf", None),
    ],
)
def test_reset_durations(text: str, seconds: float | None) -> None:
    found = parse_duration(text)
    if seconds is None:
        assert found is None
    else:
        assert found == pytest.approx(seconds)


def test_openai_headers_become_allowances_with_clock_times() -> None:
    found = read_headers(openai_headers(7), now=50.0, now_wall=WALL)
    assert found is not None
    assert found.observed_at == 50.0
    requests, tokens = found.allowances
    assert requests == Allowance("requests", 7, 100, 410.0)
    assert (tokens.resource, tokens.remaining, tokens.limit) == ("tokens", 39000, 40000)
    assert tokens.reset_at == pytest.approx(50.02)


def test_anthropic_headers_with_rfc3339_resets() -> None:
    headers = {
        "anthropic-ratelimit-requests-limit": "50",
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2026-01-01T00:00:30Z",
        "anthropic-ratelimit-input-tokens-limit": "20000",
        "anthropic-ratelimit-input-tokens-remaining": "19000",
        "anthropic-ratelimit-input-tokens-reset": "2026-01-01T00:00:01+00:00",
        "anthropic-ratelimit-output-tokens-remaining": "oops",  # unreadable: left out
    }
    found = read_headers(headers, now=10.0, now_wall=WALL)
    assert found is not None
    assert found.allowances == (
        Allowance("requests", 0, 50, 40.0),
        Allowance("input_tokens", 19000, 20000, 11.0),
    )


def test_answers_that_report_nothing_leave_the_book_as_it_was() -> None:
    clock = ManualClock(0.0, wall_start=WALL)
    book = HeadroomBook(clock)
    assert book.observe("p", {"content-type": "application/json"}) is None
    assert book.latest("p") is None
    book.observe("p", openai_headers(3))
    book.observe("p", {"content-type": "application/json"})
    latest = book.latest("p")
    assert latest is not None
    assert latest.allowances[0].remaining == 3


def test_low_until_the_reported_reset_then_not() -> None:
    clock = ManualClock(0.0, wall_start=WALL)
    book = HeadroomBook(clock, low_fraction=0.05)
    book.observe("p", openai_headers(6, reset="10s"))
    assert book.low("p") is None  # 6% left: above the line
    book.observe("p", openai_headers(5, reset="10s"))
    low = book.low("p")
    assert low is not None
    assert low.resource == "requests"
    clock.advance(9.9)
    assert book.low("p") is not None
    clock.advance(0.1)
    assert book.low("p") is None  # refilled, as far as the provider said
    assert book.low("never-reported") is None


def test_a_report_without_a_reset_holds_for_the_horizon() -> None:
    clock = ManualClock(0.0, wall_start=WALL)
    book = HeadroomBook(clock, horizon_s=30.0)
    book.observe("p", {"x-ratelimit-remaining-requests": "0"})  # no limit, no reset
    assert book.low("p") is not None
    clock.advance(29.0)
    assert book.low("p") is not None
    clock.advance(1.0)
    assert book.low("p") is None


def test_the_snapshot_shows_what_is_left_and_whether_it_is_low() -> None:
    clock = ManualClock(100.0, wall_start=WALL)
    book = HeadroomBook(clock)
    book.observe("b", openai_headers(90, reset="1s"))
    book.observe("a", openai_headers(1, reset="1m"))
    clock.advance(0.5)
    assert book.snapshot() == {
        "a": {
            "low": True,
            "requests": {"remaining": 1, "limit": 100, "reset_in_s": 59.5},
            "tokens": {"remaining": 39000, "limit": 40000, "reset_in_s": 0.0},
        },
        "b": {
            "low": False,
            "requests": {"remaining": 90, "limit": 100, "reset_in_s": 0.5},
            "tokens": {"remaining": 39000, "limit": 40000, "reset_in_s": 0.0},
        },
    }


def test_settings_are_checked() -> None:
    clock = ManualClock(0.0)
    with pytest.raises(ValueError, match="low_fraction"):
        HeadroomBook(clock, low_fraction=1.0)
    with pytest.raises(ValueError, match="horizon_s"):
        HeadroomBook(clock, horizon_s=0.0)


def _plan(*names: str) -> RoutePlan:
    return RoutePlan(
        tuple(ProviderSpec(n, frozenset({"internal"})) for n in names),
        (Skip("gone", SkipReason.BREAKER_OPEN),),
    )


def test_low_candidates_go_last_in_route_order() -> None:
    plan = _plan("a", "b", "c", "d")
    moved = prefer_ample(plan, {"a", "c"})
    assert [c.name for c in moved.candidates] == ["b", "d", "a", "c"]
    assert moved.skipped == plan.skipped


@pytest.mark.parametrize(
    "low",
    [set(), {"a", "b", "c"}, {"c"}, {"b", "c"}, {"x"}],
    ids=["none", "all", "last", "tail", "other"],
)
def test_a_plan_that_needs_no_move_is_the_same_plan(low: set[str]) -> None:
    plan = _plan("a", "b", "c")
    assert prefer_ample(plan, low) is plan


@given(
    st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=7, unique=True),
    st.sets(st.sampled_from("abcdefg")),
)
def test_reordering_keeps_every_candidate_and_both_orders(names: list[str], low: set[str]) -> None:
    plan = _plan(*names)
    moved = [c.name for c in prefer_ample(plan, low).candidates]
    assert sorted(moved) == sorted(names)
    ample = [n for n in names if n not in low]
    lows = [n for n in names if n in low]
    if ample:
        assert moved == ample + lows
    else:
        assert moved == names


def test_a_watcher_reads_only_its_dialects_headers() -> None:
    clock = ManualClock(0.0, wall_start=WALL)
    book = HeadroomBook(clock)
    openai = book.watcher("o", "openai")
    anthropic = book.watcher("a", "anthropic")
    openai({"anthropic-ratelimit-requests-remaining": "0"})
    anthropic(openai_headers(0))
    assert book.reported() == {}
    openai(openai_headers(0))
    anthropic({"anthropic-ratelimit-requests-remaining": "0"})
    assert sorted(book.reported()) == ["a", "o"]
    assert book.low("a") is not None
    assert book.low("o") is not None
