"""The offline eval gate: run a golden suite against one provider and say go, review or block.

A suite is a JSON Lines file, one case per line::

    {"id": "capital", "messages": [{"role": "user", "content": "Capital of France?"}],
     "checks": [{"contains": "Paris"}, {"max_length": 200}]}

Checks, each an object with one key; a case passes when every check passes:

- ``{"contains": "text"}``: the answer contains the text (case-sensitive);
- ``{"regex": "pattern"}``: :func:`re.search` finds the pattern in the answer;
- ``{"json_schema": {...}}``: the answer is JSON and fits the schema. The subset understood is
  ``type`` (one or a list), ``required``, ``properties``, ``additionalProperties`` (a boolean),
  ``enum`` and ``items``; ``title``, ``description`` and ``$schema`` are allowed and ignored. Any
  other keyword is refused when the suite is read, so nobody believes it was checked;
- ``{"max_length": N}``: the answer has at most N characters.

A case may add ``"params"`` (e.g. ``{"max_tokens": 200, "temperature": 0}``) to its request.

The pass rate gives the verdict through :class:`EvalThresholds`: ``go`` at or above ``go_at``,
``block`` below ``block_below``, ``review`` in between. Verdicts are stored with
:func:`record_verdict` (an ``eval_verdicts`` table in the gateway's SQLite state file, or a JSON
file) and read back with :func:`latest_verdicts`, so that routing can fail over automatically only
to providers whose latest verdict is not ``block``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, TypeAlias

import aiohttp

from tidegate.clock import Clock, SystemClock
from tidegate.errors import ConfigError, ProviderError
from tidegate.gateway.build import build_provider
from tidegate.gateway.canary import apply_version
from tidegate.gateway.config import Config
from tidegate.gateway.upstreams import upstream_configs
from tidegate.providers.base import JSONObject, Provider
from tidegate.state.sqlite import SQLiteDatabase
from tidegate.state.verdicts import (
    TABLE,
    VERDICTS_FILE,
    read_json,
    read_latest_verdicts,
    verdict_store_for,
)

__all__ = [
    "SCHEMA_KEYWORDS",
    "VERDICTS_FILE",
    "CaseResult",
    "Check",
    "Contains",
    "EvalCase",
    "EvalReport",
    "EvalThresholds",
    "EvalVerdict",
    "JsonSchema",
    "MaxLength",
    "Regex",
    "answer_text",
    "check_answer",
    "default_verdict_store",
    "evaluate",
    "latest_verdicts",
    "load_suite",
    "parse_suite",
    "record_verdict",
    "resolve_target",
    "run_suite",
    "schema_errors",
    "verdict_for",
]


#: The JSON-schema keywords :func:`schema_errors` understands (the annotations are ignored).
SCHEMA_KEYWORDS: Final = frozenset(
    {
        "type",
        "required",
        "properties",
        "additionalProperties",
        "enum",
        "items",
        "title",
        "description",
        "$schema",
    }
)
_TYPES: Final = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})


class EvalVerdict(StrEnum):
    """What the gate says about a target."""

    GO = "go"
    REVIEW = "review"
    BLOCK = "block"


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalThresholds:
    """Where the pass rate turns into a verdict."""

    #: A pass rate at or above this is ``go``.
    go_at: float = 0.95
    #: A pass rate below this is ``block``; between the two it is ``review``.
    block_below: float = 0.8

    def __post_init__(self) -> None:
        for name in ("go_at", "block_below"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number between 0 and 1, got {value!r}")
            if math.isnan(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value!r}")
        if self.block_below > self.go_at:
            raise ValueError(
                f"block_below ({self.block_below!r}) must not be above go_at ({self.go_at!r})"
            )


def verdict_for(pass_rate: float, thresholds: EvalThresholds) -> EvalVerdict:
    """``go`` at or above ``go_at``, ``block`` below ``block_below``, else ``review``."""
    if math.isnan(pass_rate) or not 0.0 <= pass_rate <= 1.0:
        raise ValueError(f"pass_rate must be between 0 and 1, got {pass_rate!r}")
    if pass_rate >= thresholds.go_at:
        return EvalVerdict.GO
    if pass_rate < thresholds.block_below:
        return EvalVerdict.BLOCK
    return EvalVerdict.REVIEW


# --------------------------------------------------------------------------- checks


@dataclass(frozen=True, slots=True)
class Contains:
    text: str


@dataclass(frozen=True, slots=True)
class Regex:
    pattern: re.Pattern[str]


@dataclass(frozen=True, slots=True)
class JsonSchema:
    schema: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class MaxLength:
    limit: int


Check: TypeAlias = Contains | Regex | JsonSchema | MaxLength


def _type_ok(value: Any, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return name == "number" or isinstance(value, int) or value.is_integer()


def schema_errors(value: Any, schema: Mapping[str, Any], path: str = "$") -> list[str]:
    """Where ``value`` does not fit ``schema`` (the subset in :data:`SCHEMA_KEYWORDS`)."""
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_type_ok(value, name) for name in names):
            return [f"{path} should be {' or '.join(names)}, got {type(value).__name__}"]
    errors: list[str] = []
    if "enum" in schema and not any(
        (value == option and type(value) is type(option)) or _same_number(value, option)
        for option in schema["enum"]
    ):
        errors.append(f"{path} should be one of {json.dumps(schema['enum'])}")
    if isinstance(value, dict):
        for name in schema.get("required", ()):
            if name not in value:
                errors.append(f"{path} is missing required property {name!r}")
        properties: Mapping[str, Any] = schema.get("properties", {})
        for name, sub in properties.items():
            if name in value:
                errors += schema_errors(value[name], sub, f"{path}.{name}")
        if schema.get("additionalProperties") is False:
            for name in value:
                if name not in properties:
                    errors.append(f"{path} has an unexpected property {name!r}")
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{index}]")
    return errors


def _same_number(a: Any, b: Any) -> bool:
    numbers = (int, float)
    return (
        isinstance(a, numbers)
        and isinstance(b, numbers)
        and not isinstance(a, bool)
        and not isinstance(b, bool)
        and a == b
    )


def _schema_problem(schema: Any, path: str = "$") -> str | None:
    """Why ``schema`` is outside the supported subset, or ``None``."""
    if not isinstance(schema, Mapping):
        return f"{path} must be an object"
    unknown = sorted(set(schema) - SCHEMA_KEYWORDS)
    if unknown:
        return f"{path} uses {', '.join(unknown)}, which this gate does not check"
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        if not isinstance(names, list) or not all(n in _TYPES for n in names):
            return f"{path}.type must be one of {', '.join(sorted(_TYPES))} or a list of them"
    if "required" in schema and not (
        isinstance(schema["required"], list) and all(isinstance(n, str) for n in schema["required"])
    ):
        return f"{path}.required must be a list of names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{path}.enum must be a list"
    if "additionalProperties" in schema and not isinstance(schema["additionalProperties"], bool):
        return f"{path}.additionalProperties must be true or false here"
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping):
        return f"{path}.properties must be an object"
    for name, sub in properties.items():
        if (problem := _schema_problem(sub, f"{path}.properties.{name}")) is not None:
            return problem
    if "items" in schema:
        return _schema_problem(schema["items"], f"{path}.items")
    return None


def check_answer(answer: str, check: Check) -> str | None:
    """Why ``answer`` fails ``check``, or ``None`` when it passes."""
    if isinstance(check, Contains):
        return None if check.text in answer else f"does not contain {check.text!r}"
    if isinstance(check, Regex):
        if check.pattern.search(answer):
            return None
        return f"does not match /{check.pattern.pattern}/"
    if isinstance(check, MaxLength):
        if len(answer) <= check.limit:
            return None
        return f"is {len(answer)} characters, over the limit of {check.limit}"
    try:
        value = json.loads(answer)
    except ValueError:
        return "is not JSON"
    errors = schema_errors(value, check.schema)
    return None if not errors else "does not fit the schema: " + "; ".join(errors)


# --------------------------------------------------------------------------- the suite


@dataclass(frozen=True, slots=True)
class EvalCase:
    """One golden case: the messages sent and the checks the answer must pass."""

    id: str
    messages: tuple[Mapping[str, Any], ...]
    checks: tuple[Check, ...]
    params: Mapping[str, Any] = field(default_factory=dict)


_CASE_KEYS: Final = frozenset({"id", "messages", "checks", "params"})
_RESERVED_PARAMS: Final = frozenset({"model", "messages", "stream"})


def _parse_check(raw: Any, where: str) -> Check:
    if not isinstance(raw, Mapping) or len(raw) != 1:
        raise ConfigError(f"{where}: a check is an object with exactly one key")
    ((kind, arg),) = raw.items()
    if kind == "contains" and isinstance(arg, str) and arg:
        return Contains(arg)
    if kind == "regex" and isinstance(arg, str):
        try:
            return Regex(re.compile(arg))
        except re.error as exc:
            raise ConfigError(f"{where}: regex {arg!r} does not compile: {exc}") from None
    if kind == "json_schema":
        problem = _schema_problem(arg)
        if problem is not None:
            raise ConfigError(f"{where}: json_schema: {problem}")
        return JsonSchema(arg)
    if kind == "max_length" and isinstance(arg, int) and not isinstance(arg, bool) and arg >= 0:
        return MaxLength(arg)
    known = "contains (text), regex (pattern), json_schema (object), max_length (integer >= 0)"
    raise ConfigError(f"{where}: {kind!r} with {arg!r} is not a check; checks are {known}")


def _parse_case(raw: Any, where: str) -> EvalCase:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: a case is a JSON object")
    unknown = sorted(set(raw) - _CASE_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}")
    case_id = raw.get("id")
    if not isinstance(case_id, str) or not case_id:
        raise ConfigError(f"{where}: id must be a non-empty string")
    messages = raw.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, Mapping) and "role" in m for m in messages)
    ):
        raise ConfigError(f"{where} ({case_id}): messages must be a list of objects with a role")
    checks = raw.get("checks")
    if not isinstance(checks, list) or not checks:
        raise ConfigError(f"{where} ({case_id}): checks must be a non-empty list")
    params = raw.get("params", {})
    if not isinstance(params, Mapping) or _RESERVED_PARAMS & set(params):
        raise ConfigError(
            f"{where} ({case_id}): params must be an object without model, messages or stream"
        )
    parsed = tuple(_parse_check(c, f"{where} ({case_id}) checks.{i}") for i, c in enumerate(checks))
    return EvalCase(case_id, tuple(messages), parsed, dict(params))


def parse_suite(text: str, *, source: str = "suite") -> list[EvalCase]:
    """The cases of a JSON Lines suite; :class:`ConfigError` names the line that is wrong."""
    cases: list[EvalCase] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            raw = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{where}: not JSON: {exc}") from None
        case = _parse_case(raw, where)
        if case.id in seen:
            raise ConfigError(f"{where}: id {case.id!r} is used twice")
        seen.add(case.id)
        cases.append(case)
    if not cases:
        raise ConfigError(f"{source}: the suite has no cases")
    return cases


def load_suite(path: Path) -> list[EvalCase]:
    """Read and parse a suite file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the suite ({exc.strerror})") from exc
    return parse_suite(text, source=str(path))


# --------------------------------------------------------------------------- running


@dataclass(frozen=True, slots=True)
class CaseResult:
    """How one case went: passed, or the reasons it failed."""

    case_id: str
    passed: bool
    reasons: tuple[str, ...]
    answer: str | None


@dataclass(frozen=True, slots=True)
class EvalReport:
    """Every case's result, the pass rate and the verdict for one target."""

    target: str
    results: tuple[CaseResult, ...]
    thresholds: EvalThresholds

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def passed(self) -> int:
        return sum(1 for r in self.results if r.passed)

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.results else 0.0

    @property
    def verdict(self) -> EvalVerdict:
        return verdict_for(self.pass_rate, self.thresholds)

    def details(self) -> dict[str, Any]:
        """What is stored beside the verdict: the counts, the thresholds and the failures."""
        return {
            "passed": self.passed,
            "total": self.total,
            "pass_rate": self.pass_rate,
            "go_at": self.thresholds.go_at,
            "block_below": self.thresholds.block_below,
            "failed": [r.case_id for r in self.results if not r.passed],
        }


def answer_text(completion: JSONObject) -> str:
    """The first choice's message content (the parts' text joined when it is a list)."""
    try:
        content = completion["choices"][0]["message"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


async def run_suite(
    provider: Provider,
    model: str,
    cases: Sequence[EvalCase],
    *,
    target: str,
    timeout_s: float = 30.0,
    thresholds: EvalThresholds | None = None,
    prepare: Callable[[JSONObject], JSONObject] | None = None,
) -> EvalReport:
    """Ask ``provider`` (as model id ``model``) every case in turn and score the answers.

    ``prepare`` turns each request into what a route version sends (its prompt and parameters).
    """
    results: list[CaseResult] = []
    for case in cases:
        body: JSONObject = {**case.params, "model": model, "messages": list(case.messages)}
        if prepare is not None:
            body = {**prepare(body), "model": model}
        try:
            completion = await provider.complete(body, timeout=timeout_s)
        except ProviderError as error:
            reason = f"the provider failed ({error.kind.value}): {error.message}"
            results.append(CaseResult(case.id, False, (reason,), None))
            continue
        answer = answer_text(completion)
        reasons = tuple(
            f"the answer {why}"
            for check in case.checks
            if (why := check_answer(answer, check)) is not None
        )
        results.append(CaseResult(case.id, not reasons, reasons, answer))
    return EvalReport(target, tuple(results), thresholds or EvalThresholds())


def resolve_target(
    config: Config, config_path: Path, target: str
) -> tuple[str, Callable[[JSONObject], JSONObject] | None]:
    """The provider a target names, and how to shape requests for it.

    A target is a provider name (or an upstream's, ``<provider>/<model>``, for one more model
    its ``models`` lists), or ``ALIAS@baseline`` / ``ALIAS@candidate``: a route's canary
    version (its first provider, its system prompt and its parameters).
    """
    if "@" not in target:
        if target not in upstream_configs(config):
            known = ", ".join(sorted(config.providers))
            raise ConfigError(
                f"{config_path}: no provider {target!r} under providers (known: {known})"
            )
        return target, None
    alias, _, version_name = target.partition("@")
    route = config.models.get(alias)
    if route is None or route.canary is None or version_name not in ("baseline", "candidate"):
        raise ConfigError(
            f"{config_path}: {target!r} is not a version: use ALIAS@baseline or ALIAS@candidate "
            "of a route with a canary section"
        )
    version = route.canary.candidate if version_name == "candidate" else route.canary.baseline
    provider = (version.providers or route.providers)[0]
    return provider, functools.partial(apply_version, version=version)


async def evaluate(
    config: Config,
    config_path: Path,
    target: str,
    cases: Sequence[EvalCase],
    *,
    timeout_s: float = 30.0,
    thresholds: EvalThresholds | None = None,
) -> EvalReport:
    """Build the target's provider as the gateway does (:func:`build_provider`) and run the suite."""
    name, prepare = resolve_target(config, config_path, target)
    cfg = upstream_configs(config)[name]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        provider = build_provider(
            name, cfg, session=session, config_path=config_path, clock=SystemClock()
        )
        try:
            return await run_suite(
                provider,
                cfg.model,
                cases,
                target=target,
                timeout_s=timeout_s,
                thresholds=thresholds,
                prepare=prepare,
            )
        finally:
            await provider.aclose()


# --------------------------------------------------------------------------- verdict store


def default_verdict_store(config: Config, config_path: Path) -> str:
    """The gateway's SQLite state (``state.url``), or ``eval-verdicts.json`` beside the config."""
    return verdict_store_for(config.state.url, config_path.parent)


def _check_store(store: str | Path) -> None:
    text = str(store)
    if "://" in text and not text.startswith("sqlite:///"):
        raise ConfigError(
            f"verdicts are kept in SQLite (sqlite:///path) or a JSON file, not {text.split(':')[0]}"
        )


def record_verdict(
    store: str | Path,
    target: str,
    verdict: EvalVerdict,
    details: Mapping[str, Any],
    *,
    clock: Clock | None = None,
) -> None:
    """Append ``verdict`` for ``target`` to ``store``: a ``sqlite:///`` URL or a JSON file path."""
    _check_store(store)
    at = (clock or SystemClock()).wall()
    text = json.dumps(dict(details), sort_keys=True)
    if str(store).startswith("sqlite:///"):
        db = SQLiteDatabase.from_url(str(store))
        try:

            def work(conn: sqlite3.Connection) -> None:
                conn.execute(TABLE)
                conn.execute(
                    "INSERT INTO eval_verdicts (target, verdict, details, at) VALUES (?, ?, ?, ?)",
                    (target, verdict.value, text, at),
                )

            db.run(work)
        finally:
            db.close()
        return
    path = Path(store)
    entries = read_json(path)
    entries.append({"target": target, "verdict": verdict.value, "details": dict(details), "at": at})
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps({"verdicts": entries}, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def latest_verdicts(store: str | Path) -> dict[str, EvalVerdict]:
    """Each target's most recent verdict in ``store``; ``{}`` when nothing was recorded."""
    _check_store(store)
    return {t: EvalVerdict(v) for t, v in read_latest_verdicts(store).items()}
