"""Tests for the retry storm: the real retry planner, budget and breaker against an outage."""

from __future__ import annotations

from dataclasses import replace

import pytest

import tidegate.lab.storm as storm_module
from tidegate.lab.storm import STRATEGIES, StormOptions, run_storm, run_storms
from tidegate.policy.breaker import CircuitBreaker
from tidegate.policy.retry import RetryBudget, RetryPlanner


@pytest.fixture(scope="module")
def results() -> dict[str, storm_module.StormResult]:
    return {r.strategy: r for r in run_storms(seed=4)}


def _isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, as ruff's isort-style sort orders them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    assert storm_module.__all__ == sorted(storm_module.__all__, key=_isort_order)
    for name in storm_module.__all__:
        assert hasattr(storm_module, name)


def test_every_strategy_sees_the_same_requests_and_settles_each(
    results: dict[str, storm_module.StormResult],
) -> None:
    """All strategies face the same arrivals, and each request is served or given up."""
    assert tuple(results) == STRATEGIES
    requests = {r.requests for r in results.values()}
    assert len(requests) == 1
    for result in results.values():
        assert result.served + result.gave_up == result.requests
        assert result.calls == sum(result.calls_per_second)
        assert result.as_dict()["strategy"] == result.strategy


def test_retrying_multiplies_the_load_during_the_outage(
    results: dict[str, storm_module.StormResult],
) -> None:
    """Without a budget the provider receives several times the new requests and is pushed over
    its capacity for about the whole outage."""
    options = StormOptions()
    for name in ("naive", "backoff"):
        result = results[name]
        assert result.calls > 1.5 * result.requests
        assert result.peak > 2 * options.capacity
        assert result.seconds_over_capacity >= 0.8 * options.outage_length


def test_a_retry_budget_keeps_the_provider_near_its_capacity(
    results: dict[str, storm_module.StormResult],
) -> None:
    """The budget cuts the calls and the seconds over capacity; served barely moves."""
    naive, budget = results["naive"], results["budget"]
    assert budget.calls < 0.7 * naive.calls
    assert budget.seconds_over_capacity < naive.seconds_over_capacity / 3
    assert budget.served >= 0.9 * naive.served
    assert budget.give_up_reasons.get("retry_budget", 0) > 0


def test_the_breaker_fails_fast_instead_of_calling_a_dead_provider(
    results: dict[str, storm_module.StormResult],
) -> None:
    """With a breaker, calls during the outage are refused without reaching the provider."""
    breaker = results["breaker"]
    assert breaker.short_circuited > 0
    assert breaker.give_up_reasons["circuit_open"] == breaker.short_circuited
    assert breaker.calls < results["budget"].calls
    assert breaker.seconds_over_capacity <= results["budget"].seconds_over_capacity


def test_no_outage_means_no_storm() -> None:
    """Without an outage and below capacity every strategy serves everything with one call each."""
    quiet = StormOptions(outage_length=0.0, rate=8.0, duration=60.0)
    for result in run_storms(quiet, seed=1):
        assert result.gave_up == 0
        assert result.calls == result.requests == result.served


def test_the_storm_uses_the_policy_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """The storm asks tidegate.policy's planner, budget and breaker for every decision."""
    seen: set[str] = set()
    for cls, method in (
        (RetryPlanner, "after_failure"),
        (RetryBudget, "try_spend"),
        (CircuitBreaker, "acquire"),
    ):
        original = getattr(cls, method)

        def spy(
            self: object, *args: object, _o: object = original, _n: str = method, **kw: object
        ) -> object:
            seen.add(_n)
            return _o(self, *args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(cls, method, spy)
    run_storm("breaker", replace(StormOptions(), duration=70.0), seed=2)
    assert seen == {"after_failure", "try_spend", "acquire"}


def test_the_same_seed_gives_the_same_storm() -> None:
    """Two runs with one seed agree; options and strategies are validated."""
    first = run_storm("backoff", seed=9)
    assert first == run_storm("backoff", seed=9)
    with pytest.raises(ValueError, match="strategy"):
        run_storm("pray")
    with pytest.raises(ValueError, match="rate"):
        StormOptions(rate=0.0)
    with pytest.raises(ValueError, match="capacity"):
        StormOptions(capacity=0)
