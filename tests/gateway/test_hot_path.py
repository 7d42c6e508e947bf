"""The shortcuts the request path takes for speed behave exactly like what they replace."""

from __future__ import annotations

import gc
from collections.abc import Callable, MutableMapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.clock import ManualClock
from tidegate.gateway.metrics import Metrics
from tidegate.gateway.pipeline import Exchange
from tidegate.policy.routing import SkipReason

Message = MutableMapping[str, Any]


#: Yields to the event loop without any time passing.
CLOCK = ManualClock()


async def _rounds(n: int = 3) -> None:
    """Let the loop run ``n`` rounds of callbacks."""
    for _ in range(n):
        await CLOCK.asleep(0)


# --------------------------------------------------------------------------- metrics


def test_labelled_children_are_looked_up_once() -> None:
    """The same label values give the same child; removing or clearing forgets it."""
    metrics = Metrics()
    child = metrics.requests.labels("chat", "m-1", "p", "ok")
    assert metrics.requests.labels("chat", "m-1", "p", "ok") is child
    assert metrics.requests.labels(route="chat", model="m-1", served_by="p", outcome="ok") is child
    child.inc()
    metrics.requests.remove("chat", "m-1", "p", "ok")
    fresh = metrics.requests.labels("chat", "m-1", "p", "ok")
    assert fresh is not child
    metrics.requests.clear()
    assert metrics.requests.labels("chat", "m-1", "p", "ok") is not fresh
    with pytest.raises(ValueError):
        metrics.latency.labels("only-one")


_LABEL_VALUES = st.sampled_from(["chat", "embed", "m-1", 'quote"d', "back\\slash", "new\nline"])


@settings(max_examples=100, deadline=None)
@given(
    counts=st.lists(
        st.tuples(_LABEL_VALUES, _LABEL_VALUES, st.floats(min_value=0, max_value=1e6)),
        max_size=30,
    ),
    observations=st.lists(
        st.tuples(
            _LABEL_VALUES,
            st.floats(min_value=0, max_value=500) | st.sampled_from([0.005, 1.0, 120.0]),
        ),
        max_size=30,
    ),
)
def test_loop_metrics_expose_what_prometheus_client_metrics_expose(
    counts: list[tuple[str, str, float]], observations: list[tuple[str, float]]
) -> None:
    """The same updates through LoopCounter / LoopHistogram and through prometheus_client's
    Counter / Histogram give the same exposition, less prometheus_client's ``_created`` lines."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client import Counter as NativeCounter
    from prometheus_client import Histogram as NativeHistogram

    from tidegate.gateway.metrics import LATENCY_BUCKETS, LoopCounter, LoopHistogram

    loop, native = CollectorRegistry(), CollectorRegistry()
    counters = (
        LoopCounter("t_calls", "Calls.", ["a", "b"], registry=loop),
        NativeCounter("t_calls", "Calls.", ["a", "b"], registry=native),
    )
    histograms = (
        LoopHistogram("t_seconds", "Time.", ["a"], buckets=LATENCY_BUCKETS, registry=loop),
        NativeHistogram("t_seconds", "Time.", ["a"], buckets=LATENCY_BUCKETS, registry=native),
    )
    plain = (
        LoopCounter("t_plain", "Unlabelled.", registry=loop),
        NativeCounter("t_plain", "Unlabelled.", registry=native),
    )
    for a, b, amount in counts:
        for counter in counters:
            counter.labels(a, b).inc(amount)
        for counter in plain:
            counter.inc(amount)
    for a, seconds in observations:
        for histogram in histograms:
            histogram.labels(a=a).observe(seconds)

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if "_created" not in line]

    assert lines(loop) == lines(native)


# --------------------------------------------------------------------------- small memos


def test_the_tried_header_follows_new_attempts() -> None:
    ex = Exchange(request_id="r")
    assert ex.tried_header() == ""
    ex.tried.append(("primary", None))
    assert ex.tried_header() == "primary=ok"
    ex.tried.append(("backup", SkipReason.BREAKER_OPEN))
    assert ex.tried_header() == "primary=ok, backup=skipped:breaker_open"


@pytest.mark.asyncio
async def test_approved_fallbacks_follow_the_eval_gate(
    gateway_client: Callable[..., Any],
) -> None:
    """A new set of blocked providers, or of verdicts, is taken into account at once."""
    from tests.gateway.harness import fake, unvetted

    config = {
        "providers": {
            "a": {**fake(), "approved_fallback": False},
            "b": {**fake(), "approved_fallback": True},
            "c": {**fake(), "approved_fallback": True},
            "d": unvetted(fake()),
        },
        "models": {"chat": {"providers": ["a", "b", "c", "d"]}},
    }
    async with gateway_client(config) as (_, app):
        rt = app.runtime
        assert rt.approved_fallbacks() == {"b", "c"}
        rt.blocked = frozenset({"c"})
        assert rt.approved_fallbacks() == {"b"}
        rt.blocked = frozenset()
        assert rt.approved_fallbacks() == {"b", "c"}
        rt.verdicts = {"a": "go", "d": "review"}  # a verdict does not beat approved_fallback: false
        assert rt.approved_fallbacks() == {"b", "c", "d"}


def test_tune_gc_freezes_start_up_objects_and_collects_less_often() -> None:
    from tidegate.gateway.app import GC_YOUNG_THRESHOLD, tune_gc

    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_the_ascii_shortcut_strips_what_the_full_table_strips() -> None:
    """Every ASCII character alone and among others: the shortcut never keeps a hidden one."""
    from tidegate.gateway.redaction import _STRIP_TABLE, INVISIBLE_CHARACTERS, strip_invisible

    for code in range(0x80):
        char = chr(code)
        for text in (char, f"ab{char}cd", f"{char}\n{char}"):
            assert strip_invisible(text) == text.translate(_STRIP_TABLE), repr(text)
    mixed = "plain text, then " + "".join(sorted(INVISIBLE_CHARACTERS)) + " and more\n"
    assert strip_invisible(mixed) == "plain text, then  and more\n"


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet=st.characters(max_codepoint=0xA0)) | st.text())
def test_strip_invisible_is_the_full_table_on_any_text(text: str) -> None:
    """ASCII or not, with or without hidden characters: the shortcut changes no result."""
    from tidegate.gateway.redaction import _STRIP_TABLE, strip_invisible

    assert strip_invisible(text) == text.translate(_STRIP_TABLE)
