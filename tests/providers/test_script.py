"""The fake-model script: loading, validation and per-attempt planning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.errors import ConfigError
from tidegate.providers.base import MalformedChunk
from tidegate.providers.fake_upstream import EXAMPLE_SCRIPT
from tidegate.providers.script import (
    ModelScript,
    Pause,
    ScriptRunner,
    count_prompt_tokens,
    generate_tokens,
    load_script,
    parse_script,
)

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "one two three"}]}


def runner(model: dict[str, Any], seed: int = 0) -> ScriptRunner:
    return ScriptRunner(parse_script({"seed": seed, "models": {"m": model}}))


def test_the_example_script_loads() -> None:
    """The example shipped with the package is a valid script."""
    script = load_script(EXAMPLE_SCRIPT)
    assert {"primary-model", "fallback-model", "*"} <= set(script.models)


def test_an_unknown_key_is_named_in_the_error(tmp_path: Path) -> None:
    """A misspelt key fails loading with its full dotted path in the message."""
    path = tmp_path / "script.yaml"
    path.write_text("models:\n  m:\n    latncy: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"models\.m\.latncy: unknown key"):
        load_script(path)


def test_an_unknown_fault_key_is_named_in_the_error() -> None:
    """A key a fault kind does not have is refused, naming the fault and the key."""
    with pytest.raises(ConfigError, match=r"models\.m\.faults\.0\.http\.colour: unknown key"):
        parse_script({"models": {"m": {"faults": [{"kind": "http", "status": 500, "colour": 1}]}}})


def test_text_and_tokens_are_exclusive() -> None:
    """Setting both text and tokens is an error."""
    with pytest.raises(ConfigError, match="either text or tokens"):
        parse_script({"models": {"m": {"text": "hi", "tokens": 3}}})


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    """A script path that does not exist raises ConfigError naming the path."""
    with pytest.raises(ConfigError, match="cannot read"):
        load_script(tmp_path / "absent.yaml")


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_tokens_join_back_into_the_text(text: str) -> None:
    """The generated tokens concatenate to exactly the scripted text."""
    assert "".join(generate_tokens(ModelScript(text=text))) == text


def test_generated_tokens_without_text() -> None:
    """Without text the answer is ``token1 token2 ...`` of the given count."""
    assert "".join(generate_tokens(ModelScript(tokens=3))) == "token1 token2 token3"


def test_prompt_tokens_are_words() -> None:
    """The prompt token count is the number of words over all message texts and parts."""
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a b c"}]},
    ]
    assert count_prompt_tokens(messages) == 5


def test_faults_follow_attempt_numbers_per_model() -> None:
    """``on_attempts`` picks attempts by their number, counted per model name."""
    plans = runner({"faults": [{"on_attempts": [1, 3], "kind": "http", "status": 503}]})
    actions = [plans.plan(dict(CHAT), endpoint="chat", created=0).action for _ in range(4)]
    assert actions == ["error", "answer", "error", "answer"]
    other = plans.plan({**CHAT, "model": "n"}, endpoint="chat", created=0)
    assert (other.action, other.status, other.attempt) == ("error", 404, 1)


def test_probability_faults_repeat_with_the_seed() -> None:
    """Two runners with the same seed fail the same attempts; the rate is roughly the one set."""
    model = {"faults": [{"probability": 0.3, "kind": "reset"}]}
    first = runner(model, seed=11)
    second = runner(model, seed=11)
    trace_a = [first.plan(dict(CHAT), endpoint="chat", created=0).fault for _ in range(200)]
    trace_b = [second.plan(dict(CHAT), endpoint="chat", created=0).fault for _ in range(200)]
    assert trace_a == trace_b
    assert 30 <= trace_a.count("reset") <= 90


def test_reset_restarts_counts_and_draws() -> None:
    """After reset, the same attempts fail again in the same way."""
    plans = runner({"faults": [{"probability": 0.5, "kind": "reset"}]}, seed=3)
    before = [plans.plan(dict(CHAT), endpoint="chat", created=0).fault for _ in range(20)]
    plans.reset()
    after = [plans.plan(dict(CHAT), endpoint="chat", created=0).fault for _ in range(20)]
    assert before == after


def test_context_window_counts_prompt_and_max_tokens() -> None:
    """Prompt words plus max_tokens above the window give OpenAI's context_length_exceeded."""
    plans = runner({"context_window": 10})
    assert plans.plan({**CHAT, "max_tokens": 7}, endpoint="chat", created=0).action == "answer"
    plan = plans.plan({**CHAT, "max_tokens": 8}, endpoint="chat", created=0)
    assert plan.body is not None
    assert (plan.status, plan.body["error"]["code"]) == (400, "context_length_exceeded")


def test_max_tokens_truncates_with_length() -> None:
    """A max_tokens below the answer's length cuts it and sets finish_reason length."""
    plan = runner({"text": "a b c d"}).plan({**CHAT, "max_tokens": 2}, endpoint="chat", created=0)
    assert plan.body is not None
    choice = plan.body["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("a b", "length")


def test_prefill_refusals() -> None:
    """A prefill is refused when the model does not accept it or a refuse_prefill fault fires."""
    prefill = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Sure"}]}
    assert (
        runner({"accepts_prefill": False}).plan(prefill, endpoint="chat", created=0).status == 400
    )
    faulty = runner({"faults": [{"kind": "refuse_prefill"}]})
    assert faulty.plan(dict(CHAT), endpoint="chat", created=0).fault is None
    assert faulty.plan(prefill, endpoint="chat", created=0).status == 400


def test_stream_plan_paces_tokens_and_inserts_the_malformed_chunk() -> None:
    """ttft comes first, tokens are spaced by 1/tokens_per_second, the bad chunk is the N-th."""
    model = {
        "text": "a b c",
        "ttft": 0.5,
        "tokens_per_second": 4,
        "faults": [{"kind": "malformed_chunk", "chunk": 3}],
    }
    plan = runner(model).plan({**CHAT, "stream": True}, endpoint="chat", created=0)
    assert plan.steps[0] == Pause(0.5)
    data = [step for step in plan.steps if not isinstance(step, Pause)]
    assert isinstance(data[2], MalformedChunk)
    assert [step for step in plan.steps if isinstance(step, Pause)] == [
        Pause(0.5),
        Pause(0.25),
        Pause(0.25),
    ]
    assert plan.ending == "done"


def test_non_streamed_answer_waits_for_the_whole_generation() -> None:
    """A non-streamed answer is planned for latency + ttft + the time of the later tokens."""
    model = {"text": "a b c", "latency": 0.25, "ttft": 0.5, "tokens_per_second": 4}
    plan = runner(model).plan(dict(CHAT), endpoint="chat", created=0)
    assert plan.latency == 1.25


def test_a_raw_fault_plans_its_bytes_on_either_endpoint() -> None:
    """A raw fault sends its status, headers and body as given: a string as it is, anything
    else as JSON, on chat and embeddings alike."""
    plans = runner(
        {
            "faults": [
                {"on_attempts": [1], "kind": "raw", "body": {"choices": []}},
                {
                    "on_attempts": [2],
                    "kind": "raw",
                    "status": 401,
                    "body": "data: x\n\n",
                    "content_type": "text/event-stream",
                    "headers": {"x-request-id": "req_1"},
                },
            ]
        }
    )
    first = plans.plan(dict(CHAT), endpoint="chat", created=0)
    assert (first.action, first.status, first.raw) == ("raw", 200, b'{"choices":[]}')
    assert first.headers == {"Content-Type": "application/json"}
    second = plans.plan({"model": "m", "input": "x"}, endpoint="embeddings", created=0)
    assert (second.action, second.status, second.raw, second.endpoint) == (
        "raw",
        401,
        b"data: x\n\n",
        "embeddings",
    )
    assert second.headers == {"Content-Type": "text/event-stream", "x-request-id": "req_1"}
    assert second.fault == "raw"


def test_a_raw_fault_status_must_be_an_answer_status() -> None:
    """A raw status below 200 is refused when the script loads, naming the key."""
    with pytest.raises(ConfigError, match=r"models\.m\.faults\.0\.raw\.status"):
        parse_script({"models": {"m": {"faults": [{"kind": "raw", "status": 101}]}}})
