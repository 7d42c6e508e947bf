"""What every offline check reports: a :class:`Finding` per problem, under a stable rule id.

A check never raises on bad input: a file that cannot be read, a key that is missing and a
timeout that outlives its caller are all findings. Each check module lists its rules in a
``RULES`` table (id, severity, one line saying what the rule demands), so that the documentation
and the tests can walk every rule, and builds its findings through :meth:`Rule.finding`.

An ``error`` fails the check (the command exits 1); a ``warning`` is printed and does not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "Finding",
    "Rule",
    "Severity",
    "count_by_severity",
    "format_finding",
    "has_errors",
    "rule_table",
]


class Severity(StrEnum):
    """How much a finding matters: an error fails the check, a warning does not."""

    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem: the rule broken, how bad it is, what is wrong in words, and where."""

    rule_id: str
    severity: Severity
    message: str
    where: str

    def __post_init__(self) -> None:
        if not self.rule_id:
            raise ValueError("rule_id must not be empty")
        if not self.message:
            raise ValueError("message must not be empty")
        object.__setattr__(self, "severity", Severity(self.severity))


@dataclass(frozen=True, slots=True)
class Rule:
    """A rule of a check: its stable id, its severity and what it demands, in one line."""

    id: str
    severity: Severity
    summary: str

    def finding(self, message: str, where: str) -> Finding:
        """A finding of this rule at ``where``."""
        return Finding(self.id, self.severity, message, where)


def rule_table(*rules: Rule) -> Mapping[str, Rule]:
    """The rules by id; a repeated id is a bug in the check and raises ``ValueError``."""
    table: dict[str, Rule] = {}
    for rule in rules:
        if rule.id in table:
            raise ValueError(f"rule id {rule.id} is used twice")
        table[rule.id] = rule
    return table


def has_errors(findings: Iterable[Finding]) -> bool:
    """Whether any finding is an error (the check fails)."""
    return any(f.severity is Severity.ERROR for f in findings)


def count_by_severity(findings: Iterable[Finding]) -> dict[Severity, int]:
    """How many findings of each severity, every severity present (zero when none)."""
    counts = dict.fromkeys(Severity, 0)
    for finding in findings:
        counts[finding.severity] += 1
    return counts


def format_finding(finding: Finding) -> str:
    """One line for a terminal: ``ERROR ENV008 production/tidegate.yaml: message``."""
    where = f" {finding.where}:" if finding.where else ""
    return f"{finding.severity.value.upper():<7} {finding.rule_id}{where} {finding.message}"
