"""The rollback plan: each rule fails on a broken copy of the passing plan."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.ops.conftest import FIXTURES, Copier, edit_yaml
from tidegate.ops.rollback import (
    RULES,
    UnitKind,
    check_rollback,
    find_verify_test,
    load_plan,
    version_problem,
)

GOOD = FIXTURES / "rollback" / "good"
BAD = FIXTURES / "rollback" / "bad"


def _unit(data: dict[str, Any], kind: str) -> dict[str, Any]:
    unit: dict[str, Any] = next(u for u in data["units"] if u["kind"] == kind)
    return unit


def _edit(kind: str, **changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda data: _unit(data, kind).update(changes)


def _drop_owner(data: dict[str, Any]) -> None:
    _unit(data, "model").pop("owner")


def _drop_config(data: dict[str, Any]) -> None:
    data["units"] = [u for u in data["units"] if u["kind"] != "config"]


#: One way to break each rule, starting from the passing plan.
BREAKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "RBK001": _drop_owner,
    "RBK002": _edit("model", previous="latest"),
    "RBK003": _edit("application", previous="ghcr.io/example/tidegate:1.4.2"),
    "RBK004": _edit("prompt", step={"action": "deploy", "run": "make release"}),
    "RBK005": _drop_config,
    "RBK006": _edit("dependency", verify="verify/not_written.py"),
    "RBK007": _edit("model", verify="verify/smoke_check.py::test_never_written"),
}


def test_every_rule_has_a_way_to_break_it() -> None:
    """The table of breaks covers exactly the rules the module declares."""
    assert set(BREAKS) == set(RULES)


def test_good_plan_passes_every_rule() -> None:
    """The passing plan has every kind, exact versions, flag steps for prompt and config."""
    plan, findings = load_plan(GOOD / "rollback.yaml")
    assert findings == []
    assert plan is not None
    assert {unit.kind for unit in plan.units} == set(UnitKind)
    assert check_rollback(GOOD / "rollback.yaml") == []


@pytest.mark.parametrize("rule_id", sorted(BREAKS))
def test_each_rule_fails_on_its_broken_plan(copy_fixture: Copier, rule_id: str) -> None:
    """Breaking the passing plan one way gives exactly that rule's finding."""
    root = copy_fixture("rollback/good")
    plan = root / "rollback.yaml"
    assert check_rollback(plan) == []
    edit_yaml(plan, BREAKS[rule_id])
    assert [f.rule_id for f in check_rollback(plan)] == [rule_id]


def test_the_failing_plan_on_disk_breaks_the_documented_rules() -> None:
    """latest, a range, an untagged image, a prompt deploy, no config unit, missing tests."""
    findings = check_rollback(BAD / "rollback.yaml")
    assert sorted({f.rule_id for f in findings}) == [
        "RBK002",
        "RBK003",
        "RBK004",
        "RBK005",
        "RBK006",
        "RBK007",
    ]
    messages = [f.message for f in findings]
    assert "chat model: previous version 'latest' moves: name one exact version" in messages
    assert "no rollback step for config" in messages


def test_a_config_rollback_that_needs_a_deploy_is_refused(copy_fixture: Copier) -> None:
    """Config, like a prompt, must roll back by flag: a deploy waits for a build."""
    root = copy_fixture("rollback/good")
    edit_yaml(root / "rollback.yaml", _edit("config", step={"action": "deploy", "run": "x"}))
    (finding,) = check_rollback(root / "rollback.yaml")
    assert finding.rule_id == "RBK004"
    assert finding.message.startswith("gateway settings: a config rollback must be a flag change")


def test_an_unquoted_version_number_is_refused_with_a_hint(copy_fixture: Copier) -> None:
    """YAML reads 1.10 as 1.1, so a version must be a quoted string."""
    root = copy_fixture("rollback/good")
    edit_yaml(root / "rollback.yaml", _edit("prompt", previous=1.1))
    (finding,) = check_rollback(root / "rollback.yaml")
    assert finding.rule_id == "RBK001"
    assert "quote versions" in finding.message
    assert finding.where.endswith("[units.0 prompt template]")


def test_a_flag_step_must_name_its_flag(copy_fixture: Copier) -> None:
    """A flag step without the flag's name cannot be carried out."""
    root = copy_fixture("rollback/good")
    edit_yaml(root / "rollback.yaml", _edit("prompt", step={"action": "flag"}))
    (finding,) = check_rollback(root / "rollback.yaml")
    assert finding.rule_id == "RBK001"
    assert "a flag step needs flag" in finding.message


def test_a_plan_that_is_not_yaml_is_one_finding(tmp_path: Path) -> None:
    """An unreadable plan is a finding, not an exception."""
    (tmp_path / "rollback.yaml").write_text("units: [unclosed\n")
    assert [f.rule_id for f in check_rollback(tmp_path / "rollback.yaml")] == ["RBK001"]
    assert [f.rule_id for f in check_rollback(tmp_path / "missing.yaml")] == ["RBK001"]


@pytest.mark.parametrize(
    ("version", "kind"),
    [
        ("latest", UnitKind.MODEL),
        ("ghcr.io/example/tidegate:latest", UnitKind.APPLICATION),
        ("claude-3-5-sonnet-latest", UnitKind.MODEL),
        ("", UnitKind.PROMPT),
        ("  ", UnitKind.CONFIG),
        ("^1.2", UnitKind.DEPENDENCY),
        ("~1.2.0", UnitKind.DEPENDENCY),
        ("*", UnitKind.DEPENDENCY),
        ("1.x", UnitKind.DEPENDENCY),
        ("aiohttp>=3.9", UnitKind.DEPENDENCY),
        ("stable", UnitKind.PROMPT),
        ("ghcr.io/example/tidegate", UnitKind.APPLICATION),
    ],
)
def test_floating_versions_are_refused(version: str, kind: UnitKind) -> None:
    """latest, empty, moving names, ranges and untagged images are not exact versions."""
    assert version_problem(version, kind) is not None


@pytest.mark.parametrize(
    ("version", "kind"),
    [
        ("v13", UnitKind.PROMPT),
        ("1.4.1", UnitKind.APPLICATION),
        ("ghcr.io/example/tidegate:1.4.1", UnitKind.APPLICATION),
        ("ghcr.io/example/tidegate@sha256:0123abcd", UnitKind.APPLICATION),
        ("aiohttp==3.9.5", UnitKind.DEPENDENCY),
        ("gpt-4o-2024-05-13", UnitKind.MODEL),
        ("config-2026-02-20", UnitKind.CONFIG),
    ],
)
def test_exact_versions_are_accepted(version: str, kind: UnitKind) -> None:
    """A version, a tag, a digest, a pinned requirement and a dated model id are exact."""
    assert version_problem(version, kind) is None


def test_verify_tests_are_found_beside_the_plan_then_at_the_repository_root() -> None:
    """A plan-relative path wins; otherwise the path is taken from the repository root."""
    beside, names = find_verify_test("verify/smoke_check.py::TestPrompt::test_cites_sources", GOOD)
    assert beside == GOOD / "verify" / "smoke_check.py"
    assert names == ["TestPrompt", "test_cites_sources"]
    root, names = find_verify_test("tests/ops/test_rollback.py::test_x[a-b]", GOOD)
    assert root is not None
    assert root.resolve() == Path(__file__).resolve()
    assert names == ["test_x"]
    missing, _ = find_verify_test("tests/ops/not_here.py", GOOD)
    assert missing is None


def test_a_method_is_looked_up_inside_its_class(copy_fixture: Copier) -> None:
    """Class::method must be a method of that class, not a function of the same name elsewhere."""
    root = copy_fixture("rollback/good")
    spec = "verify/smoke_check.py::TestPrompt::test_model_answers"
    edit_yaml(root / "rollback.yaml", _edit("prompt", verify=spec))
    (finding,) = check_rollback(root / "rollback.yaml")
    assert finding.rule_id == "RBK007"
    assert "TestPrompt::test_model_answers" in finding.message
