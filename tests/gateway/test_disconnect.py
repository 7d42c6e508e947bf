"""Socket level: a client that hangs up mid-request leaves no bookkeeping behind.

The upstream is slow on purpose; the client gives up after a fraction of a second, before the
answer (or in the middle of a stream). Within about a second the gateway must have: no request
in flight, no breaker permit held (the next request reaches the primary), no budget held (the
reservation settled or refunded), and no upstream call still running on the caller's behalf.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.harness import KEY, running_gateway
from tests.gateway.upstream import (
    CLOCK,
    RunningUpstream,
    metric,
    openai_provider,
    running_upstream,
    wait_until,
)
from tidegate.gateway.app import Gateway
from tidegate.policy.budget import Usage

pytestmark = pytest.mark.slow

PRIMARY = "primary-model"
FALLBACK = "fallback-model"
PRIMARY_TEXT = "from the primary, one slow word after another"
FALLBACK_TEXT = "from the fallback"
#: The budget subject of the harness's test key: ``tenant:user``.
SUBJECT = "t1:u1"
#: How long the client waits before it gives up, and how soon the gateway must have cleaned up.
GIVE_UP_S = 0.3
CLEAN_WITHIN_S = 1.0
AUTH = {"Authorization": f"Bearer {KEY}"}


def _script(**primary: Any) -> dict[str, Any]:
    return {
        "models": {
            PRIMARY: {"text": PRIMARY_TEXT, **primary},
            FALLBACK: {"text": FALLBACK_TEXT},
        }
    }


#: The primary answers after two seconds: far longer than the client is willing to wait.
SLOW = _script(latency=2.0)
#: The primary streams its first token at once, then one token every half second.
DRIP = _script(tokens_per_second=2.0)
FAST = _script()


def _config(up: RunningUpstream) -> dict[str, Any]:
    """One breaker failure would open the circuit, so a cancellation counted as one would show."""
    return {
        "providers": {
            "primary": openai_provider(up, PRIMARY),
            "backup": openai_provider(up, FALLBACK),
        },
        "models": {"chat": {"providers": ["primary", "backup"], "per_try_timeout_s": 5.0}},
        "retry": {"attempts": 1},
        "breaker": {"consecutive_failures": 1, "recovery_s": 0.3, "recovery_jitter": 0.0},
        "budgets": {"calls": 100},
    }


def _body(content: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": "chat", "messages": [{"role": "user", "content": content}], "stream": stream}


def _impatient_client() -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(5.0, read=GIVE_UP_S), trust_env=False)


def _usage(app: Gateway) -> Usage:
    """Today's budget use of the test key, read from the gateway's own quota store."""
    assert app.runtime is not None
    return asyncio.run(app.runtime.stores.quotas.usage(SUBJECT))


def _in_flight(base: str) -> float | None:
    return metric(base, "tidegate_in_flight_requests")


def _breaker(base: str) -> float | None:
    return metric(base, "tidegate_breaker_state", provider="primary")


def _last_outcome(up: RunningUpstream) -> str:
    return str(up.attempts()[-1]["outcome"])


def _ask(base: str, content: str) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        json=_body(content),
        headers=AUTH,
        timeout=5.0,
        trust_env=False,
    )


def _served(response: httpx.Response) -> tuple[int, str, str, str]:
    """``(status, served by, tried, model)`` of a non-streamed answer."""
    return (
        response.status_code,
        response.headers.get("x-tidegate-served-by", "-"),
        response.headers.get("x-tidegate-tried", "-"),
        response.json().get("model", "-"),
    )


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, Gateway, RunningUpstream]]:
    """The gateway's base URL and app, in front of a fake upstream whose primary is slow."""
    with running_upstream(SLOW) as up, running_gateway(tmp_path, _config(up)) as (base, app):
        yield base, app, up


def test_disconnect_before_the_answer_leaves_nothing_held(
    gateway: tuple[str, Gateway, RunningUpstream],
) -> None:
    """A client that gives up before the answer: gauge back to 0, budget refunded, breaker closed."""
    base, app, up = gateway
    started = CLOCK.now()
    with _impatient_client() as client, pytest.raises(httpx.ReadTimeout):
        client.post(f"{base}/v1/chat/completions", json=_body("hello"), headers=AUTH)
    gave_up = CLOCK.now()
    assert GIVE_UP_S <= gave_up - started < GIVE_UP_S + 0.5

    assert wait_until(lambda: _in_flight(base) == 0.0, within=CLEAN_WITHIN_S)
    # The gateway dropped its upstream call too, instead of waiting for the slow answer.
    assert wait_until(lambda: _last_outcome(up) == "client_disconnected", within=CLEAN_WITHIN_S)
    cleaned = CLOCK.now() - gave_up
    usage = _usage(app)
    closed_requests = metric(
        base,
        "tidegate_requests_total",
        route="chat",
        model="-",
        served_by="-",
        outcome="client_closed",
    )
    state = _breaker(base)

    # The primary, fast again, serves the next request: no permit was left behind.
    up.replace_script(FAST)
    after = _served(_ask(base, "hello again"))
    # Settlement runs just after the last byte is sent, so give it a moment.
    assert wait_until(lambda: _usage(app).reserved_calls == 0, within=CLEAN_WITHIN_S)
    usage_after = _usage(app)
    seen = [(a["model"], a["outcome"]) for a in up.attempts()]

    assert cleaned < CLEAN_WITHIN_S
    assert (usage.calls, usage.reserved_calls, usage.reserved_tokens) == (0, 0, 0)  # refunded
    assert closed_requests == 1.0
    assert state == 0.0
    assert after == (200, "primary", "primary=ok", PRIMARY)
    assert (usage_after.calls, usage_after.reserved_calls) == (1, 0)
    assert seen == [(PRIMARY, "client_disconnected"), (PRIMARY, "ok")]


def test_disconnect_during_the_probe_frees_the_probe_slot(
    gateway: tuple[str, Gateway, RunningUpstream],
) -> None:
    """A caller that leaves while its request is the half-open probe does not keep the slot."""
    base, app, up = gateway
    # One failure opens the primary's breaker; the fallback answers.
    up.replace_script(_script(faults=[{"kind": "http", "status": 500}]))
    opened = _served(_ask(base, "first"))
    open_state = _breaker(base)
    # The primary comes back slow; once the breaker half-opens, the next request is its probe.
    up.replace_script(SLOW)
    assert wait_until(lambda: _breaker(base) == 1.0, within=CLEAN_WITHIN_S)
    with _impatient_client() as client, pytest.raises(httpx.ReadTimeout):
        client.post(f"{base}/v1/chat/completions", json=_body("probe"), headers=AUTH)
    gave_up = CLOCK.now()
    assert wait_until(lambda: _in_flight(base) == 0.0, within=CLEAN_WITHIN_S)
    assert wait_until(lambda: _last_outcome(up) == "client_disconnected", within=CLEAN_WITHIN_S)
    cleaned = CLOCK.now() - gave_up
    usage = _usage(app)

    # Had the abandoned probe kept its lease, this request would skip the primary.
    up.replace_script(FAST)
    after = _served(_ask(base, "after the probe"))
    closed_state = _breaker(base)
    seen = [(a["model"], a["outcome"]) for a in up.attempts()]

    assert opened == (200, "backup", "primary=server, backup=ok", FALLBACK)
    assert open_state == 2.0
    assert cleaned < CLEAN_WITHIN_S
    assert (usage.calls, usage.reserved_calls) == (1, 0)
    assert after == (200, "primary", "primary=ok", PRIMARY)
    assert closed_state == 0.0
    assert seen == [
        (PRIMARY, "http_500"),
        (FALLBACK, "ok"),
        (PRIMARY, "client_disconnected"),  # the abandoned probe
        (PRIMARY, "ok"),  # the next probe, which closes the circuit
    ]


def test_disconnect_mid_stream_leaves_nothing_held(tmp_path: Path) -> None:
    """A client that hangs up after the first streamed token: gauge 0, budget released, breaker closed."""
    with (
        running_upstream(DRIP) as up,
        running_gateway(tmp_path, _config(up)) as (base, app),
        httpx.Client(timeout=5.0, trust_env=False) as client,
    ):
        started = CLOCK.now()
        with client.stream(
            "POST", f"{base}/v1/chat/completions", json=_body("hello", stream=True), headers=AUTH
        ) as response:
            status = response.status_code
            headers = response.headers
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
            # Leaving the block here closes the connection with the stream unfinished.
        gave_up = CLOCK.now()
        assert wait_until(lambda: _in_flight(base) == 0.0, within=CLEAN_WITHIN_S)
        assert wait_until(lambda: _last_outcome(up) == "client_disconnected", within=CLEAN_WITHIN_S)
        cleaned = CLOCK.now() - gave_up
        usage = _usage(app)
        state = _breaker(base)

        up.replace_script(FAST)
        after = _served(_ask(base, "hello again"))
        seen = [(a["model"], a["outcome"]) for a in up.attempts()]

    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-tidegate-served-by"] == "primary"
    chunk = httpx.Response(200, content=first.removeprefix("data: ")).json()
    assert chunk["model"] == PRIMARY
    assert gave_up - started < 1.0  # the first token came at once; the rest would take 3.5 s
    assert cleaned < CLEAN_WITHIN_S
    # Settled (billed for what was streamed) or refunded: either way nothing is still held.
    assert (usage.reserved_calls, usage.reserved_tokens) == (0, 0)
    assert usage.calls in (0, 1)
    assert state == 0.0
    assert after == (200, "primary", "primary=ok", PRIMARY)
    assert seen == [(PRIMARY, "client_disconnected"), (PRIMARY, "ok")]
