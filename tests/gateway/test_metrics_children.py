"""The children the request path updates: found again, counted exactly, refused when wrong."""

from __future__ import annotations

import math

import pytest

from tidegate.gateway.metrics import Metrics


def test_model_children_are_the_labelled_children_found_once() -> None:
    """A model's spend and token counters are the families' own children, the same each time."""
    metrics = Metrics()
    children = metrics.model_children("m-1")
    assert children == (
        metrics.spend.labels("m-1"),
        metrics.tokens.labels("m-1", "prompt"),
        metrics.tokens.labels("m-1", "completion"),
    )
    assert metrics.model_children("m-1") is children
    assert metrics.model_children("m-2") != children


def test_a_counter_adds_exactly_as_floats_do_and_refuses_a_negative_amount() -> None:
    """A child's value is the running float sum of its amounts; a negative one changes nothing."""
    child = Metrics().tokens.labels("m-1", "prompt")
    amounts = [1, 0.1, 0.2, 7, 1e-9, 3.5]
    expected = 0.0
    for amount in amounts:
        child.inc(amount)
        expected += amount
        assert child.value == expected
    with pytest.raises(ValueError, match="non-negative"):
        child.inc(-1)
    assert child.value == expected
    child.inc(math.inf)
    assert child.value == math.inf


def test_a_histogram_keeps_the_float_sum_and_the_bucket_of_each_observation() -> None:
    """Each observation goes in the first bucket whose bound it does not exceed."""
    child = Metrics().latency.labels("chat", "ok")
    expected = 0.0
    for seconds in (0.005, 0.0051, 0.3, 120.0, 500.0):
        child.observe(seconds)
        expected += seconds
    assert child.sum == expected
    assert [child.counts[i] for i in (0, 1, 6, 13, 14)] == [1, 1, 1, 1, 1]
    assert sum(child.counts) == 5


def test_positional_and_named_labels_find_the_same_child_and_check_the_names() -> None:
    """Label values by position or by name reach one child; wrong names or counts are refused."""
    metrics = Metrics()
    named = metrics.attempts.labels(provider="p", result="ok")
    assert metrics.attempts.labels("p", "ok") is named
    with pytest.raises(ValueError, match="the labels are"):
        metrics.attempts.labels("p", result="ok")
    with pytest.raises(ValueError, match="2 label values expected, got 3"):
        metrics.attempts.labels("p", "ok", "extra")
    assert metrics.attempts.labels("p", "ok") is named
