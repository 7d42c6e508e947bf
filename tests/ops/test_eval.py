"""The offline eval gate: checks, the suite format, thresholds, runs and stored verdicts."""

from __future__ import annotations

import json
import math
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ops.conftest import FIXTURES
from tidegate.clock import ManualClock
from tidegate.errors import ConfigError, ProviderError, ProviderErrorKind
from tidegate.gateway.config import load_config
from tidegate.ops.eval import (
    VERDICTS_FILE,
    Contains,
    EvalReport,
    EvalThresholds,
    EvalVerdict,
    JsonSchema,
    MaxLength,
    Regex,
    answer_text,
    check_answer,
    default_verdict_store,
    evaluate,
    latest_verdicts,
    load_suite,
    parse_suite,
    record_verdict,
    run_suite,
    schema_errors,
    verdict_for,
)
from tidegate.providers.base import JSONObject
from tidegate.providers.fake import FakeProvider, Outcome
from tidegate.providers.wire import chat_completion

EVAL = FIXTURES / "eval"
RANK = {EvalVerdict.BLOCK: 0, EvalVerdict.REVIEW: 1, EvalVerdict.GO: 2}


def _case(case_id: str, checks: list[dict[str, Any]], **extra: Any) -> str:
    messages = [{"role": "user", "content": case_id}]
    return json.dumps({"id": case_id, "messages": messages, "checks": checks, **extra})


def _completion(text: str) -> JSONObject:
    return chat_completion(id="chatcmpl-test", model="m", created=0, content=text)


# --------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize(
    ("rate", "verdict"),
    [
        (1.0, EvalVerdict.GO),
        (0.95, EvalVerdict.GO),
        (0.9499, EvalVerdict.REVIEW),
        (0.8, EvalVerdict.REVIEW),
        (0.7999, EvalVerdict.BLOCK),
        (0.0, EvalVerdict.BLOCK),
    ],
)
def test_default_thresholds_give_go_review_and_block(rate: float, verdict: EvalVerdict) -> None:
    """go at >= 0.95, block below 0.8, review in between; both boundaries are inclusive of go/review."""
    assert verdict_for(rate, EvalThresholds()) is verdict


def test_thresholds_are_configurable() -> None:
    """With go at 0.9 and block below 0.5, 0.9 is go and 0.5 is review."""
    thresholds = EvalThresholds(go_at=0.9, block_below=0.5)
    assert verdict_for(0.9, thresholds) is EvalVerdict.GO
    assert verdict_for(0.5, thresholds) is EvalVerdict.REVIEW
    assert verdict_for(0.49, thresholds) is EvalVerdict.BLOCK


def test_equal_thresholds_leave_no_room_for_review() -> None:
    """go_at == block_below makes the gate binary: at or above is go, below is block."""
    thresholds = EvalThresholds(go_at=0.9, block_below=0.9)
    assert verdict_for(0.9, thresholds) is EvalVerdict.GO
    assert verdict_for(0.8999, thresholds) is EvalVerdict.BLOCK


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"go_at": 1.5}, "go_at"),
        ({"go_at": math.nan}, "go_at"),
        ({"block_below": -0.1}, "block_below"),
        ({"go_at": 0.7, "block_below": 0.8}, "block_below"),
    ],
)
def test_thresholds_refuse_impossible_values(kwargs: dict[str, float], field: str) -> None:
    """Rates outside [0, 1], nan, or block above go are refused, naming the field."""
    with pytest.raises(ValueError, match=field):
        EvalThresholds(**kwargs)


def test_a_pass_rate_outside_zero_and_one_is_refused() -> None:
    """verdict_for takes a rate, not a count."""
    with pytest.raises(ValueError, match="pass_rate"):
        verdict_for(3.0, EvalThresholds())


@settings(max_examples=100, deadline=None)
@given(
    st.floats(min_value=0, max_value=1),
    st.floats(min_value=0, max_value=1),
    st.floats(min_value=0, max_value=1),
    st.floats(min_value=0, max_value=1),
)
def test_a_higher_pass_rate_never_gets_a_worse_verdict(
    a: float, b: float, x: float, y: float
) -> None:
    """The verdict is monotonic in the pass rate, whatever the (valid) thresholds."""
    thresholds = EvalThresholds(go_at=max(x, y), block_below=min(x, y))
    low, high = sorted((a, b))
    assert RANK[verdict_for(low, thresholds)] <= RANK[verdict_for(high, thresholds)]


# --------------------------------------------------------------------------- checks


def test_each_check_kind_passes_and_fails() -> None:
    """contains, regex, max_length and json_schema each pass a fitting answer and fail another."""
    assert check_answer("Paris, France", Contains("Paris")) is None
    assert check_answer("paris", Contains("Paris")) == "does not contain 'Paris'"
    assert check_answer("in 1889", Regex(re.compile(r"\b\d{4}\b"))) is None
    assert check_answer("long ago", Regex(re.compile(r"\d+"))) == r"does not match /\d+/"
    assert check_answer("x" * 10, MaxLength(10)) is None
    assert check_answer("x" * 11, MaxLength(10)) == "is 11 characters, over the limit of 10"
    schema = JsonSchema({"type": "object", "required": ["city"]})
    assert check_answer('{"city": "Paris"}', schema) is None
    assert check_answer("Paris", schema) == "is not JSON"
    assert check_answer("{}", schema) == (
        "does not fit the schema: $ is missing required property 'city'"
    )


def test_schema_subset_checks_types_required_enum_items_and_extra_properties() -> None:
    """Every supported keyword is applied, with the JSON path of each problem."""
    schema = {
        "type": "object",
        "required": ["city", "tags"],
        "additionalProperties": False,
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Lyon"]},
            "rank": {"type": "integer"},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "note": {"type": ["string", "null"]},
        },
    }
    good = {"city": "Lyon", "rank": 2.0, "ok": True, "tags": ["a"], "note": None}
    assert schema_errors(good, schema) == []
    bad = {"city": "Nice", "rank": 2.5, "ok": 1, "tags": ["a", 3], "extra": 1}
    assert schema_errors(bad, schema) == [
        '$.city should be one of ["Paris", "Lyon"]',
        "$.rank should be integer, got float",
        "$.ok should be boolean, got int",
        "$.tags[1] should be string, got int",
        "$ has an unexpected property 'extra'",
    ]


def test_booleans_are_not_numbers_and_enum_matches_by_type() -> None:
    """true is not a number, and an enum of 1 does not accept true."""
    assert schema_errors(True, {"type": "number"}) == ["$ should be number, got bool"]
    assert schema_errors(True, {"enum": [1]}) == ["$ should be one of [1]"]
    assert schema_errors(1.0, {"enum": [1]}) == []


def test_answer_text_reads_the_first_choice() -> None:
    """The first choice's content; text parts are joined; a malformed body is empty."""
    assert answer_text(_completion("hi")) == "hi"
    parts = {"choices": [{"message": {"content": [{"type": "text", "text": "a"}, {"text": "b"}]}}]}
    assert answer_text(parts) == "ab"
    assert answer_text({"choices": []}) == ""


# --------------------------------------------------------------------------- the suite


def test_the_golden_suite_parses() -> None:
    """The fixture suite has five cases, each check parsed into its kind."""
    cases = load_suite(EVAL / "golden.jsonl")
    assert [c.id for c in cases][:2] == ["capital-contains", "capital-regex"]
    assert isinstance(cases[2].checks[0], JsonSchema)
    assert cases[3].params == {"max_tokens": 40}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "suite:1: not JSON"),
        (_case("a", [{"startswith": "x"}]), "'startswith' with 'x' is not a check"),
        (_case("a", [{"contains": "x", "regex": "y"}]), "exactly one key"),
        (_case("a", [{"regex": "("}]), "does not compile"),
        (_case("a", [{"json_schema": {"pattern": "x"}}]), "uses pattern, which this gate"),
        (_case("a", [{"json_schema": {"type": "date"}}]), "$.type must be one of"),
        (_case("a", [{"max_length": -1}]), "is not a check"),
        (_case("a", []), "checks must be a non-empty list"),
        (_case("a", [{"contains": "x"}], params={"model": "gpt"}), "params must be an object"),
        (_case("a", [{"contains": "x"}], extra=1), "unknown key 'extra'"),
        (_case("a", [{"contains": "x"}]) + "\n" + _case("a", [{"contains": "y"}]), "used twice"),
        ("\n\n", "the suite has no cases"),
    ],
)
def test_a_bad_suite_is_refused_naming_the_line(text: str, message: str) -> None:
    """A malformed line, an unknown check or an unsupported schema keyword stops the run."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_suite(text)


# --------------------------------------------------------------------------- running


@pytest.mark.asyncio
async def test_run_suite_scores_each_case_against_the_provider() -> None:
    """Each case is sent with its params and the provider's model id; failures keep reasons."""
    answers = {"good": "Paris", "bad": "Berlin"}

    def handler(body: JSONObject, attempt: int) -> Outcome:
        return _completion(answers[body["messages"][0]["content"]])

    clock = ManualClock()
    provider = FakeProvider("p", handler, sleep=clock.asleep)
    cases = parse_suite(
        _case("good", [{"contains": "Paris"}], params={"temperature": 0})
        + "\n"
        + _case("bad", [{"contains": "Paris"}, {"max_length": 3}])
    )
    report = await run_suite(provider, "model-2026-01", cases, target="p")
    assert (report.passed, report.total, report.pass_rate) == (1, 2, 0.5)
    assert report.verdict is EvalVerdict.BLOCK
    assert report.results[1].reasons == (
        "the answer does not contain 'Paris'",
        "the answer is 6 characters, over the limit of 3",
    )
    sent = provider.attempts[0].body
    assert (sent["model"], sent["temperature"]) == ("model-2026-01", 0)


@pytest.mark.asyncio
async def test_a_provider_error_fails_the_case_with_its_kind() -> None:
    """A provider that errors fails the case; the run goes on to the next case."""
    outcomes: list[Outcome] = [
        ProviderError(ProviderErrorKind.SERVER, "boom", provider="p"),
        _completion("Paris"),
    ]
    provider = FakeProvider("p", outcomes, sleep=ManualClock().asleep)
    cases = parse_suite(
        _case("a", [{"contains": "Paris"}]) + "\n" + _case("b", [{"contains": "Paris"}])
    )
    report = await run_suite(
        provider, "m", cases, target="p", thresholds=EvalThresholds(go_at=0.5, block_below=0.5)
    )
    assert report.results[0].reasons == ("the provider failed (server): boom",)
    assert report.results[0].answer is None
    assert report.results[1].passed
    assert report.verdict is EvalVerdict.GO


@pytest.mark.asyncio
async def test_evaluate_builds_the_target_as_the_gateway_does() -> None:
    """The fixture config's fake providers are built from config and scored go and block."""
    config_path = EVAL / "tidegate.yaml"
    config = load_config(config_path, env={})
    cases = load_suite(EVAL / "golden.jsonl")
    steady = await evaluate(config, config_path, "steady", cases)
    wayward = await evaluate(config, config_path, "wayward", cases)
    assert (steady.passed, steady.verdict) == (5, EvalVerdict.GO)
    assert (wayward.passed, wayward.verdict) == (0, EvalVerdict.BLOCK)
    assert steady.details()["failed"] == []


@pytest.mark.asyncio
async def test_an_upstream_of_one_more_model_is_a_target(tmp_path: Path) -> None:
    """``<provider>/<model>`` (a model its ``models`` lists) is judged as its own upstream: that
    is the name failover looks its verdict up by."""
    from tests.gateway.harness import write_config

    text = '{"city": "Paris", "country": "France", "population_millions": 2.1}'
    section = {"type": "fake", "models": ["m-1", "m-2"], "fake": {"text": text}}
    path = write_config(
        tmp_path, {"providers": {"p": section}, "models": {"chat": {"providers": ["p"]}}}
    )
    report = await evaluate(
        load_config(path, env={}), path, "p/m-2", load_suite(EVAL / "golden.jsonl")
    )
    assert (report.target, report.verdict) == ("p/m-2", EvalVerdict.GO)


@pytest.mark.asyncio
async def test_evaluate_refuses_an_unknown_target() -> None:
    """A target that is not a provider of the config is a ConfigError listing the known ones."""
    config_path = EVAL / "tidegate.yaml"
    with pytest.raises(ConfigError, match="known: broken, steady, wayward"):
        await evaluate(load_config(config_path, env={}), config_path, "nope", [])


# --------------------------------------------------------------------------- stored verdicts


def _report(target: str, passed: int, total: int) -> EvalReport:
    from tidegate.ops.eval import CaseResult

    results = tuple(CaseResult(str(i), i < passed, (), "") for i in range(total))
    return EvalReport(target, results, EvalThresholds())


def test_sqlite_verdicts_live_beside_the_gateway_state(tmp_path: Path) -> None:
    """Verdicts go to an eval_verdicts table in the gateway's SQLite file; the latest wins."""
    url = f"sqlite:///{tmp_path}/state.db"
    assert latest_verdicts(url) == {}
    assert not (tmp_path / "state.db").exists()
    clock = ManualClock()
    record_verdict(url, "a", EvalVerdict.GO, {"passed": 5}, clock=clock)
    record_verdict(url, "b", EvalVerdict.BLOCK, {"passed": 0}, clock=clock)
    clock.advance(60.0)
    record_verdict(url, "a", EvalVerdict.REVIEW, {"passed": 4}, clock=clock)
    assert latest_verdicts(url) == {"a": EvalVerdict.REVIEW, "b": EvalVerdict.BLOCK}
    with sqlite3.connect(tmp_path / "state.db") as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        rows = conn.execute("SELECT target, verdict, details, at FROM eval_verdicts").fetchall()
    assert {"flags", "eval_verdicts"} <= tables
    assert rows[-1] == ("a", "review", '{"passed": 4}', clock.wall())


def test_json_verdicts_append_and_the_latest_wins(tmp_path: Path) -> None:
    """The JSON store keeps every verdict with its details; the latest per target is read."""
    path = tmp_path / VERDICTS_FILE
    record_verdict(path, "a", EvalVerdict.BLOCK, _report("a", 1, 5).details(), clock=ManualClock())
    record_verdict(path, "a", EvalVerdict.GO, _report("a", 5, 5).details(), clock=ManualClock())
    assert latest_verdicts(path) == {"a": EvalVerdict.GO}
    stored = json.loads(path.read_text())["verdicts"]
    assert [e["verdict"] for e in stored] == ["block", "go"]
    assert stored[0]["details"]["failed"] == ["1", "2", "3", "4"]


def test_a_postgres_store_is_refused(tmp_path: Path) -> None:
    """Only SQLite URLs and JSON files hold verdicts; other URLs are a ConfigError."""
    with pytest.raises(ConfigError, match="not postgresql"):
        record_verdict("postgresql://db/x", "a", EvalVerdict.GO, {})


def test_the_default_store_follows_the_state_url(tmp_path: Path) -> None:
    """A sqlite state URL is used as is; any other state puts a JSON file beside the config."""
    config_path = EVAL / "tidegate.yaml"
    config = load_config(config_path, env={})
    assert default_verdict_store(config, config_path) == "sqlite:///.tidegate/eval-fixture.db"
    shared = config.model_copy(
        update={"state": config.state.model_copy(update={"url": "postgresql://db/x"})}
    )
    assert default_verdict_store(shared, config_path) == str(EVAL / VERDICTS_FILE)


def test_a_canary_version_is_a_target(tmp_path: Path) -> None:
    """ALIAS@candidate runs on the candidate's provider with its system prompt and parameters."""
    import asyncio

    import yaml

    from tidegate.gateway.config import load_config
    from tidegate.ops.eval import EvalVerdict, evaluate, parse_suite, resolve_target

    config_path = tmp_path / "tidegate.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "state": {"url": "memory://"},
                "providers": {
                    "old": {"type": "fake", "model": "m-old", "fake": {"text": "old answer"}},
                    "new": {"type": "fake", "model": "m-new", "fake": {"text": "new answer"}},
                },
                "models": {
                    "chat": {
                        "providers": ["old"],
                        "canary": {
                            "salt": "s",
                            "candidate": {
                                "providers": ["new"],
                                "system_prompt": "be brief",
                                "params": {"temperature": 0},
                            },
                        },
                    }
                },
            }
        ),
        encoding="utf-8",
    )
    config = load_config(config_path, env={})
    name, prepare = resolve_target(config, config_path, "chat@candidate")
    assert name == "new"
    assert prepare is not None
    shaped = prepare({"model": "x", "messages": [{"role": "user", "content": "hi"}]})
    assert shaped["messages"][0] == {"role": "system", "content": "be brief"}
    assert shaped["temperature"] == 0
    assert resolve_target(config, config_path, "chat@baseline")[0] == "old"
    suite = parse_suite(
        '{"id": "c1", "messages": [{"role": "user", "content": "hi"}], "checks": [{"contains": "new"}]}'
    )
    assert (
        asyncio.run(evaluate(config, config_path, "chat@candidate", suite)).verdict
        is EvalVerdict.GO
    )
    assert (
        asyncio.run(evaluate(config, config_path, "chat@baseline", suite)).verdict
        is EvalVerdict.BLOCK
    )
    with pytest.raises(ConfigError, match="is not a version"):
        resolve_target(config, config_path, "chat@nightly")
