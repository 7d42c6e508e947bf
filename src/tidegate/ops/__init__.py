"""Offline checks an operator runs before and around a release.

- :mod:`tidegate.ops.envs`: environment rules (``ENV...``) and the drift between two environments;
- :mod:`tidegate.ops.timeouts`: the timeout chain and drain periods over the real files
  (``TMO...``);
- :mod:`tidegate.ops.rollback`: the rollback plan (``RBK...``);
- :mod:`tidegate.ops.eval`: the offline eval gate (go, review, block) and its stored verdicts;
- :mod:`tidegate.ops.findings`: the :class:`Finding` every check reports;
- :mod:`tidegate.ops.cli`: the ``check`` commands and the ``eval`` command.
"""

from tidegate.ops.envs import RULES as ENV_RULES
from tidegate.ops.envs import Difference, check_envs, drift
from tidegate.ops.eval import (
    EvalCase,
    EvalReport,
    EvalThresholds,
    EvalVerdict,
    latest_verdicts,
    load_suite,
    record_verdict,
    run_suite,
    verdict_for,
)
from tidegate.ops.findings import Finding, Rule, Severity, format_finding, has_errors
from tidegate.ops.rollback import RULES as ROLLBACK_RULES
from tidegate.ops.rollback import UnitKind, check_rollback
from tidegate.ops.timeouts import RULES as TIMEOUT_RULES
from tidegate.ops.timeouts import check_timeouts

__all__ = [
    "ENV_RULES",
    "ROLLBACK_RULES",
    "TIMEOUT_RULES",
    "Difference",
    "EvalCase",
    "EvalReport",
    "EvalThresholds",
    "EvalVerdict",
    "Finding",
    "Rule",
    "Severity",
    "UnitKind",
    "check_envs",
    "check_rollback",
    "check_timeouts",
    "drift",
    "format_finding",
    "has_errors",
    "latest_verdicts",
    "load_suite",
    "record_verdict",
    "run_suite",
    "verdict_for",
]
