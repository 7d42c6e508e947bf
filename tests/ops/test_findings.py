"""Findings: the shared shape of every check's report."""

from __future__ import annotations

import pytest

from tidegate.ops.findings import (
    Finding,
    Rule,
    Severity,
    count_by_severity,
    format_finding,
    has_errors,
    rule_table,
)

ERR = Rule("X001", Severity.ERROR, "an error rule")
WARN = Rule("X002", Severity.WARNING, "a warning rule")


def test_a_rule_builds_findings_with_its_id_and_severity() -> None:
    """Rule.finding carries the rule's id and severity, and the message and place given."""
    assert ERR.finding("broken", "a.yaml") == Finding("X001", Severity.ERROR, "broken", "a.yaml")


def test_only_errors_fail_a_check() -> None:
    """Warnings alone do not fail; one error does."""
    warning = WARN.finding("hm", "")
    assert not has_errors([])
    assert not has_errors([warning])
    assert has_errors([warning, ERR.finding("no", "")])


def test_counts_name_every_severity() -> None:
    """count_by_severity lists both severities, zero when absent."""
    counts = count_by_severity([ERR.finding("a", ""), ERR.finding("b", "")])
    assert counts == {Severity.ERROR: 2, Severity.WARNING: 0}


def test_format_puts_severity_id_place_and_message_on_one_line() -> None:
    """One aligned line per finding; a finding without a place skips it."""
    assert format_finding(ERR.finding("broken", "a.yaml")) == "ERROR   X001 a.yaml: broken"
    assert format_finding(WARN.finding("hm", "")) == "WARNING X002 hm"


def test_severity_strings_are_accepted() -> None:
    """A severity given as its string becomes the enum member."""
    assert Finding("X", "warning", "m", "").severity is Severity.WARNING  # type: ignore[arg-type]


@pytest.mark.parametrize(("rule_id", "message"), [("", "m"), ("X", "")])
def test_a_finding_needs_an_id_and_a_message(rule_id: str, message: str) -> None:
    """An empty rule id or message is a bug in the check."""
    with pytest.raises(ValueError):
        Finding(rule_id, Severity.ERROR, message, "")


def test_a_rule_table_refuses_a_repeated_id() -> None:
    """Two rules with one id would make the id ambiguous."""
    assert list(rule_table(ERR, WARN)) == ["X001", "X002"]
    with pytest.raises(ValueError, match="X001"):
        rule_table(ERR, ERR)
