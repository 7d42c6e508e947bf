"""Socket level: the real gateway in front of the real fake upstream, one failure mode per test.

Each test asserts three things: the attempts the upstream saw (count, model and order), a bound
on the wall time the request took, and exactly what the client received (status, body, and the
``X-Tidegate-Served-By`` / ``X-Tidegate-Tried`` headers). The client is the official ``openai``
SDK with its own retries switched off.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.gateway.harness import KEY, LOW_KEY, running_gateway
from tests.gateway.upstream import (
    CLOCK,
    RunningUpstream,
    metric,
    openai_provider,
    running_upstream,
    wait_until,
)
from tidegate.policy.retry import RetryOptions

pytestmark = pytest.mark.slow

PRIMARY = "primary-model"
FALLBACK = "fallback-model"
PRIMARY_TEXT = "from the primary"
FALLBACK_TEXT = "from the fallback"
QUESTION = "say hi please"
#: The fake counts whitespace-separated words as tokens, in the prompt and in the answer.
QUESTION_TOKENS = 3
ANSWER_TOKENS = 3


def _script(faults: Sequence[dict[str, Any]] = (), **primary: Any) -> dict[str, Any]:
    """A primary that misbehaves as told and a healthy fallback."""
    return {
        "models": {
            PRIMARY: {"text": PRIMARY_TEXT, "faults": list(faults), **primary},
            FALLBACK: {"text": FALLBACK_TEXT},
        }
    }


def _config(
    up: RunningUpstream,
    *,
    route: Sequence[str] = ("primary", "backup"),
    per_try_timeout_s: float = 5.0,
    retry: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Two OpenAI-compatible providers on the fake upstream behind the alias ``chat``."""
    return {
        "providers": {
            "primary": openai_provider(up, PRIMARY),
            "backup": openai_provider(up, FALLBACK),
        },
        "models": {"chat": {"providers": list(route), "per_try_timeout_s": per_try_timeout_s}},
        "retry": {"attempts": 3, "base_s": 0.05, "cap_s": 0.1, **(retry or {})},
        **extra,
    }


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=10.0)


def _ask(
    client: openai.OpenAI, content: str = QUESTION, headers: dict[str, str] | None = None
) -> Any:
    """One non-streamed request to ``chat``; the SDK's raw response (headers and parsed body)."""
    return client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": content}], extra_headers=headers
    )


@dataclass
class Timer:
    """Wall time of a block, read from the real clock."""

    elapsed: float = 0.0


@contextmanager
def timer() -> Iterator[Timer]:
    """Measure the wall time of the block."""
    timing = Timer()
    started = CLOCK.now()
    try:
        yield timing
    finally:
        timing.elapsed = CLOCK.now() - started


def _settled_attempts(up: RunningUpstream) -> list[dict[str, Any]]:
    """The attempt log once no attempt is still running (a hung-up attempt takes a moment)."""
    assert wait_until(lambda: all(a["outcome"] != "pending" for a in up.attempts()), within=1.0)
    return up.attempts()


@dataclass
class Outcome:
    """One request through the gateway: what the client got, how long it took, what upstream saw."""

    raw: Any
    error: openai.APIStatusError | None
    elapsed: float
    attempts: list[dict[str, Any]]

    @property
    def seen(self) -> list[tuple[str, str]]:
        """``(model, outcome)`` of every attempt, in the order the upstream received them."""
        return [(a["model"], a["outcome"]) for a in self.attempts]

    @property
    def received_at(self) -> list[float]:
        return [float(a["received_at"]) for a in self.attempts]

    @property
    def refusal(self) -> openai.APIStatusError:
        assert self.error is not None, "the request was expected to fail"
        return self.error


def _scenario(
    tmp_path: Path,
    script: dict[str, Any],
    config: Callable[[RunningUpstream], dict[str, Any]] = _config,
    *,
    content: str = QUESTION,
    headers: dict[str, str] | None = None,
    **gateway: Any,
) -> Outcome:
    """Serve ``script``, put a gateway with ``config`` in front of it, and ask one question."""
    raw: Any = None
    error: openai.APIStatusError | None = None
    with (
        running_upstream(script) as up,
        running_gateway(tmp_path, config(up), **gateway) as (base, _),
        _client(base) as client,
    ):
        with timer() as t:
            try:
                raw = _ask(client, content, headers)
            except openai.APIStatusError as refused:
                error = refused
        attempts = _settled_attempts(up)
    return Outcome(raw, error, t.elapsed, attempts)


def _check_answer(outcome: Outcome, *, served_by: str, tried: str) -> ChatCompletion:
    """The answer is a 200 from ``served_by`` naming its model, with the fake's exact usage."""
    assert outcome.error is None, outcome.error
    model, text = (PRIMARY, PRIMARY_TEXT) if served_by == "primary" else (FALLBACK, FALLBACK_TEXT)
    raw = outcome.raw
    reply: ChatCompletion = raw.parse()
    assert raw.http_response.status_code == 200
    assert raw.headers["x-tidegate-served-by"] == served_by
    assert raw.headers["x-tidegate-tried"] == tried
    assert reply.model == model
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    assert (
        reply.usage.prompt_tokens,
        reply.usage.completion_tokens,
        reply.usage.total_tokens,
    ) == (QUESTION_TOKENS, ANSWER_TOKENS, QUESTION_TOKENS + ANSWER_TOKENS)
    return reply


def _check_refusal(outcome: Outcome, *, status: int, body: dict[str, Any], tried: str) -> None:
    """The client got exactly ``status`` and ``body``, and no provider claims to have served."""
    refusal = outcome.refusal
    assert refusal.status_code == status
    assert refusal.body == body  # the SDK hands over the "error" object
    assert refusal.response.headers["x-tidegate-tried"] == tried
    assert "x-tidegate-served-by" not in refusal.response.headers


def test_retry_after_is_honoured_before_the_second_attempt(tmp_path: Path) -> None:
    """A 429 with Retry-After: 2 is retried on the same provider no sooner than 2 s later."""
    fault = {"on_attempts": [1], "kind": "http", "status": 429, "retry_after": 2}
    outcome = _scenario(tmp_path, _script([fault]))
    _check_answer(outcome, served_by="primary", tried="primary=rate_limited, primary=ok")
    assert outcome.seen == [(PRIMARY, "http_429"), (PRIMARY, "ok")]
    first, second = outcome.received_at
    assert second - first >= 1.99  # wall-clock stamps: allow for a slewing clock
    assert 2.0 <= outcome.elapsed < 3.5


def test_retry_after_beyond_the_deadline_fails_over_at_once(tmp_path: Path) -> None:
    """A Retry-After longer than the caller's deadline leaves is not waited out: the fallback serves."""
    fault = {"kind": "http", "status": 429, "retry_after": 2}
    outcome = _scenario(tmp_path, _script([fault]), headers={"X-Tidegate-Deadline-Ms": "1500"})
    _check_answer(outcome, served_by="backup", tried="primary=rate_limited, backup=ok")
    assert outcome.seen == [(PRIMARY, "http_429"), (FALLBACK, "ok")]
    assert outcome.elapsed < 1.0


def test_persistent_429_backs_off_with_jitter_then_fails_over(tmp_path: Path) -> None:
    """A 429 without Retry-After is retried after full-jitter waits, retry.attempts times, then fails over."""
    seed = 10
    policy = RetryOptions(attempts=3, base=0.2, factor=2.0, cap=0.4)
    draws = random.Random(seed)
    first_wait = policy.delay(0, draws)
    second_wait = policy.delay(1, draws, first_wait)
    # The seed was picked so that both waits are visibly jittered, well under their ceilings.
    assert first_wait < 0.15
    assert second_wait < 0.25
    retry = {"attempts": 3, "base_s": 0.2, "factor": 2.0, "cap_s": 0.4, "jitter": "full"}

    def config(up: RunningUpstream) -> dict[str, Any]:
        return _config(up, retry=retry)

    fault = {"kind": "http", "status": 429}
    outcome = _scenario(tmp_path, _script([fault]), config, rng=random.Random(seed))
    tried = "primary=rate_limited, primary=rate_limited, primary=rate_limited, backup=ok"
    _check_answer(outcome, served_by="backup", tried=tried)
    assert outcome.seen == [(PRIMARY, "http_429")] * 3 + [(FALLBACK, "ok")]
    gaps = [later - earlier for earlier, later in itertools.pairwise(outcome.received_at[:3])]
    slack = 0.15  # a loopback round trip and the gateway's own work, on a busy machine
    for gap, wait in zip(gaps, (first_wait, second_wait), strict=True):
        assert wait - 0.01 <= gap < wait + slack
    assert first_wait + second_wait <= outcome.elapsed < first_wait + second_wait + 1.0


def test_one_500_is_retried_on_the_same_provider(tmp_path: Path) -> None:
    """A single 500 is retried on the primary, which then answers; the fallback is not called."""
    outcome = _scenario(tmp_path, _script([{"on_attempts": [1], "kind": "http", "status": 500}]))
    _check_answer(outcome, served_by="primary", tried="primary=server, primary=ok")
    assert outcome.seen == [(PRIMARY, "http_500"), (PRIMARY, "ok")]
    assert outcome.elapsed < 1.0


def test_persistent_503_is_bounded_then_the_fallback_answers(tmp_path: Path) -> None:
    """A primary answering 503 every time gets retry.attempts tries, then the fallback answers."""
    outcome = _scenario(tmp_path, _script([{"kind": "http", "status": 503}]))
    tried = "primary=overloaded, primary=overloaded, primary=overloaded, backup=ok"
    _check_answer(outcome, served_by="backup", tried=tried)
    assert outcome.seen == [(PRIMARY, "http_503")] * 3 + [(FALLBACK, "ok")]
    assert outcome.elapsed < 1.5


@pytest.mark.parametrize(
    ("fault", "served_by", "tried", "seen"),
    [
        pytest.param(
            {"kind": "reset", "on_attempts": [1]},
            "primary",
            "primary=connection, primary=ok",
            [(PRIMARY, "reset"), (PRIMARY, "ok")],
            id="once",
        ),
        pytest.param(
            {"kind": "reset"},
            "backup",
            "primary=connection, primary=connection, primary=connection, backup=ok",
            [(PRIMARY, "reset")] * 3 + [(FALLBACK, "ok")],
            id="always",
        ),
    ],
)
def test_reset_before_headers_is_retried_then_failed_over(
    tmp_path: Path,
    fault: dict[str, Any],
    served_by: str,
    tried: str,
    seen: list[tuple[str, str]],
) -> None:
    """A connection reset before any header is retried; if it persists, the fallback serves."""
    outcome = _scenario(tmp_path, _script([fault]))
    _check_answer(outcome, served_by=served_by, tried=tried)
    assert outcome.seen == seen
    assert outcome.elapsed < 1.5


def _silent_config(route: Sequence[str]) -> Callable[[RunningUpstream], dict[str, Any]]:
    def config(up: RunningUpstream) -> dict[str, Any]:
        return _config(up, route=route, per_try_timeout_s=0.5, server={"request_timeout_s": 3.0})

    return config


def test_silent_provider_times_out_once_then_fails_over(tmp_path: Path) -> None:
    """A provider that never answers costs one per-try timeout, is not retried, and the fallback serves."""
    script = _script([{"kind": "no_response"}])
    outcome = _scenario(tmp_path, script, _silent_config(["primary", "backup"]))
    _check_answer(outcome, served_by="backup", tried="primary=timeout, backup=ok")
    # "no_response" (not "pending"): the gateway hung up on the silent attempt.
    assert outcome.seen == [(PRIMARY, "no_response"), (FALLBACK, "ok")]
    assert 0.5 <= outcome.elapsed < 1.2


def test_silent_provider_alone_ends_inside_the_budget(tmp_path: Path) -> None:
    """With no fallback, a silent provider gives a 504 after one per-try timeout, not after retries."""
    outcome = _scenario(tmp_path, _script([{"kind": "no_response"}]), _silent_config(["primary"]))
    _check_refusal(
        outcome,
        status=504,
        body={
            "type": "timeout_error",
            "code": "provider_timeout",
            "message": "no answer within 0.5s",
            "retryable": True,
        },
        tried="primary=timeout",
    )
    assert outcome.seen == [(PRIMARY, "no_response")]
    assert 0.5 <= outcome.elapsed < 1.2


CONTEXT_SCRIPT = {
    "models": {
        PRIMARY: {"text": PRIMARY_TEXT, "context_window": 8},
        "small-model": {"text": "from the small one", "context_window": 4},
        "unknown-model": {"text": "from the unknown one"},
        "big-model": {"text": "from the big one", "context_window": 1000},
    }
}
#: Twelve words: more than the primary's window of eight.
LONG_QUESTION = "please read all of these twelve words and then answer me briefly"
PRIMARY_CONTEXT_MESSAGE = (
    "This model's maximum context length is 8 tokens. However, you requested 12 tokens "
    "(12 in the messages, 0 in the completion). Please reduce the length of the messages or "
    "completion."
)


def _context_config(route: Sequence[str]) -> Callable[[RunningUpstream], dict[str, Any]]:
    """A primary with a small window and fallbacks with a smaller, an unknown and a larger one.

    Every known window holds the prompt's estimate, so the check before sending lets each
    provider through: what fails over here is the provider's own context_length refusal."""

    def config(up: RunningUpstream) -> dict[str, Any]:
        return {
            "providers": {
                "primary": openai_provider(up, PRIMARY, context_window=200),
                "small": openai_provider(up, "small-model", context_window=100),
                "unknown": openai_provider(up, "unknown-model"),
                "big": openai_provider(up, "big-model", context_window=1000),
            },
            "models": {"chat": {"providers": list(route), "per_try_timeout_s": 5.0}},
            "retry": {"attempts": 3, "base_s": 0.05, "cap_s": 0.1},
        }

    return config


def test_context_length_goes_once_to_a_larger_window(tmp_path: Path) -> None:
    """context_length_exceeded: one attempt, then only a fallback with a larger known window."""
    config = _context_config(["primary", "small", "unknown", "big"])
    outcome = _scenario(tmp_path, CONTEXT_SCRIPT, config, content=LONG_QUESTION)
    assert outcome.error is None, outcome.error
    raw = outcome.raw
    reply = raw.parse()
    assert raw.http_response.status_code == 200
    assert raw.headers["x-tidegate-served-by"] == "big"
    assert raw.headers["x-tidegate-tried"] == "primary=context_length, big=ok"
    assert reply.model == "big-model"
    assert reply.choices[0].message.content == "from the big one"
    assert outcome.seen == [(PRIMARY, "http_400"), ("big-model", "ok")]
    assert outcome.elapsed < 1.0


def test_context_length_without_a_larger_window_is_the_callers_400(tmp_path: Path) -> None:
    """With only smaller or unknown windows behind it, the primary's refusal reaches the caller."""
    config = _context_config(["primary", "small", "unknown"])
    outcome = _scenario(tmp_path, CONTEXT_SCRIPT, config, content=LONG_QUESTION)
    _check_refusal(
        outcome,
        status=400,
        body={
            "type": "invalid_request_error",
            "code": "provider_context_length",
            "message": f"HTTP 400 context_length_exceeded: {PRIMARY_CONTEXT_MESSAGE}",
            "retryable": False,
        },
        tried="primary=context_length",
    )
    assert outcome.seen == [(PRIMARY, "http_400")]
    assert outcome.elapsed < 1.0


def test_content_filter_refusal_is_final(tmp_path: Path) -> None:
    """A content-filter refusal gets one attempt, no failover, and its reason reaches the caller."""
    outcome = _scenario(tmp_path, _script([{"kind": "content_filter"}]))
    _check_refusal(
        outcome,
        status=400,
        body={
            "type": "invalid_request_error",
            "code": "provider_content_filter",
            "message": "HTTP 400 content_filter: The prompt was refused by the content filter.",
            "retryable": False,
        },
        tried="primary=content_filter",
    )
    assert outcome.seen == [(PRIMARY, "http_400")]
    assert outcome.elapsed < 1.0


def _served(raw: Any) -> tuple[str, str, str]:
    """``(served by, tried, model)`` of a successful raw response."""
    assert raw.http_response.status_code == 200
    reply: ChatCompletion = raw.parse()
    return raw.headers["x-tidegate-served-by"], raw.headers["x-tidegate-tried"], reply.model


def test_flapping_primary_opens_the_breaker_and_one_probe_closes_it(tmp_path: Path) -> None:
    """Failures open the breaker, the fallback serves while it is open, one probe closes it."""
    breaker = {"consecutive_failures": 2, "recovery_s": 0.5, "recovery_jitter": 0.0}
    skipped = "backup=ok, primary=skipped:breaker_open"
    with running_upstream(_script([{"kind": "http", "status": 500}])) as up:
        config = _config(up, retry={"attempts": 1}, breaker=breaker)
        with (
            running_gateway(tmp_path, config) as (base, _),
            _client(base) as client,
            ThreadPoolExecutor(max_workers=1) as pool,
            timer() as t,
        ):

            def state() -> float | None:
                return metric(base, "tidegate_breaker_state", provider="primary")

            # Two failures in a row open the primary's breaker; the fallback answers both.
            # (Each question differs, so neither the cache nor single-flight can answer it.)
            first = _served(_ask(client, f"{QUESTION} 1"))
            second = _served(_ask(client, f"{QUESTION} 2"))
            open_state = state()
            # While it is open the primary is skipped without a call.
            while_open = _served(_ask(client, f"{QUESTION} 3"))
            primary_calls_while_open = len(up.attempts(PRIMARY))
            # The primary recovers, slowly, so that its probe is visibly in flight.
            up.replace_script(_script(latency=0.4))
            assert wait_until(lambda: state() == 1.0, within=2.0)
            probe = pool.submit(_ask, client, f"{QUESTION} 4")
            assert wait_until(lambda: len(up.attempts(PRIMARY)) == 3, within=2.0)
            # The one probe holds the slot: a request arriving meanwhile goes to the fallback.
            during_probe = _served(_ask(client, f"{QUESTION} 5"))
            probed = _served(probe.result(timeout=5.0))
            closed_state = state()
            after = _served(_ask(client, f"{QUESTION} 6"))
        seen = [(a["model"], a["outcome"]) for a in _settled_attempts(up)]
    assert first == ("backup", "primary=server, backup=ok", FALLBACK)
    assert second == ("backup", "primary=server, backup=ok", FALLBACK)
    assert open_state == 2.0
    assert while_open == ("backup", skipped, FALLBACK)
    assert primary_calls_while_open == 2
    assert during_probe == ("backup", skipped, FALLBACK)
    assert probed == ("primary", "primary=ok", PRIMARY)
    assert closed_state == 0.0
    assert after == ("primary", "primary=ok", PRIMARY)
    assert seen == [
        (PRIMARY, "http_500"),
        (FALLBACK, "ok"),
        (PRIMARY, "http_500"),
        (FALLBACK, "ok"),
        (FALLBACK, "ok"),  # the breaker is open
        (PRIMARY, "ok"),  # the probe
        (FALLBACK, "ok"),  # the request that arrived while the probe was out
        (PRIMARY, "ok"),  # closed again
    ]
    assert t.elapsed < 4.0


def _await_accounting(base: str) -> None:
    """Give the gateway a moment to account for an answer the client already has."""
    wait_until(
        lambda: (
            metric(base, "tidegate_tokens_total", model=FALLBACK, direction="completion")
            is not None
        ),
        within=1.0,
    )


def test_failover_usage_and_metrics_name_the_serving_model(tmp_path: Path) -> None:
    """After a failover the model, usage, spend and token metrics all belong to the fallback."""
    prices = {
        PRIMARY: {"input_per_1k": 100.0, "output_per_1k": 100.0},
        FALLBACK: {"input_per_1k": 1.0, "output_per_1k": 2.0},
    }
    with running_upstream(_script([{"kind": "http", "status": 503}])) as up:
        config = _config(up, retry={"attempts": 2}, prices=prices)
        with running_gateway(tmp_path, config) as (base, _), _client(base) as client:
            with timer() as t:
                raw = _ask(client)
            _await_accounting(base)
            tokens = {
                (model, direction): metric(
                    base, "tidegate_tokens_total", model=model, direction=direction
                )
                for model in (PRIMARY, FALLBACK)
                for direction in ("prompt", "completion")
            }
            spend = metric(base, "tidegate_spend_usd_total", model=FALLBACK)
            primary_spend = metric(base, "tidegate_spend_usd_total", model=PRIMARY)
            served = metric(
                base,
                "tidegate_requests_total",
                route="chat",
                model=FALLBACK,
                served_by="backup",
                outcome="ok",
            )
            failovers = metric(
                base, "tidegate_failovers_total", provider="primary", reason="overloaded"
            )
            # A fallback's answer is never cached: the same question goes upstream again.
            again = _ask(client)
        attempts = _settled_attempts(up)
    outcome = Outcome(raw, None, t.elapsed, attempts)
    _check_answer(
        outcome, served_by="backup", tried="primary=overloaded, primary=overloaded, backup=ok"
    )
    assert raw.headers["x-tidegate-cache"] == "miss"
    assert tokens == {
        (PRIMARY, "prompt"): None,
        (PRIMARY, "completion"): None,
        (FALLBACK, "prompt"): float(QUESTION_TOKENS),
        (FALLBACK, "completion"): float(ANSWER_TOKENS),
    }
    assert spend == pytest.approx((QUESTION_TOKENS * 1.0 + ANSWER_TOKENS * 2.0) / 1000.0)
    assert primary_spend is None
    assert served == 1.0
    assert failovers == 1.0
    assert again.headers["x-tidegate-cache"] == "miss"
    assert again.headers["x-tidegate-served-by"] == "backup"
    one_request = [(PRIMARY, "http_503")] * 2 + [(FALLBACK, "ok")]
    assert outcome.seen == one_request * 2
    assert outcome.elapsed < 1.0


def test_streamed_failover_names_the_serving_model(tmp_path: Path) -> None:
    """A stream that fails over before its first token comes wholly from the fallback, usage included."""
    with running_upstream(_script([{"kind": "http", "status": 503}])) as up:
        config = _config(up, retry={"attempts": 2})
        with running_gateway(tmp_path, config) as (base, _), _client(base) as client:
            with timer() as t:
                raw = client.chat.completions.with_raw_response.create(
                    model="chat",
                    messages=[{"role": "user", "content": QUESTION}],
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = list(raw.parse())
            _await_accounting(base)
            completion = metric(
                base, "tidegate_tokens_total", model=FALLBACK, direction="completion"
            )
            primary_tokens = metric(
                base, "tidegate_tokens_total", model=PRIMARY, direction="completion"
            )
        seen = [(a["model"], a["outcome"]) for a in _settled_attempts(up)]
    assert raw.http_response.status_code == 200
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["x-tidegate-served-by"] == "backup"
    # The headers leave before the stream's end, so they list what happened up to then.
    assert raw.headers["x-tidegate-tried"] == "primary=overloaded, primary=overloaded"
    assert {chunk.model for chunk in chunks} == {FALLBACK}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == FALLBACK_TEXT
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (QUESTION_TOKENS, ANSWER_TOKENS)
    assert completion == float(ANSWER_TOKENS)
    assert primary_tokens is None
    assert seen == [(PRIMARY, "http_503")] * 2 + [(FALLBACK, "ok")]
    assert t.elapsed < 1.0


def _short_deadline_run(
    tmp_path: Path, *, per_try_timeout_s: float, headers: dict[str, str] | None
) -> tuple[list[int], float | None, int]:
    """Five requests from one tenant against a healthy primary that takes 0.2 s, then one from
    another tenant: the five statuses, the primary's breaker state after them, the other's status.
    """
    breaker = {"consecutive_failures": 2, "recovery_s": 30.0, "recovery_jitter": 0.0}
    with running_upstream(_script(latency=0.2)) as up:
        config = _config(
            up,
            route=("primary",),
            per_try_timeout_s=per_try_timeout_s,
            retry={"attempts": 1},
            breaker=breaker,
            # Admission's prior service estimate (1 s) would refuse a 100 ms deadline up front.
            admission={"initial_service_time_s": 0.01},
        )
        with running_gateway(tmp_path, config) as (base, _), _client(base) as client:
            statuses = []
            for n in range(5):
                try:
                    statuses.append(
                        _ask(client, f"{QUESTION} {n}", headers).http_response.status_code
                    )
                except openai.APIStatusError as refused:
                    statuses.append(refused.status_code)
            state = metric(base, "tidegate_breaker_state", provider="primary")
            other = openai.OpenAI(
                base_url=f"{base}/v1", api_key=LOW_KEY, max_retries=0, timeout=10.0
            )
            with other:
                try:
                    served = _ask(other, f"{QUESTION} other").http_response.status_code
                except openai.APIStatusError as refused:
                    served = refused.status_code
    return statuses, state, served


def test_callers_short_deadlines_do_not_open_a_healthy_providers_breaker(tmp_path: Path) -> None:
    """A tenant whose 100 ms deadline is shorter than a healthy provider's 0.2 s gets its 504s,
    and the provider's breaker stays closed: another tenant is served by it straight after."""
    statuses, state, other = _short_deadline_run(
        tmp_path, per_try_timeout_s=5.0, headers={"X-Tidegate-Deadline-Ms": "100"}
    )
    assert statuses == [504] * 5
    assert state == 0.0
    assert other == 200


def test_the_providers_own_per_try_timeout_is_evidence(tmp_path: Path) -> None:
    """The control: the same 0.2 s provider timing out under its own 0.1 s per-try limit is
    evidence, so two such timeouts open its breaker and the other tenant is refused."""
    statuses, state, other = _short_deadline_run(tmp_path, per_try_timeout_s=0.1, headers=None)
    assert statuses[:2] == [504, 504]
    assert state == 2.0
    assert other == 503
