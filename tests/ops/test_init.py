"""The ops package: its public names, and the documentation of every rule."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from tidegate import ops
from tidegate.ops import ENV_RULES, ROLLBACK_RULES, TIMEOUT_RULES

DOCS = Path(__file__).parents[2] / "docs" / "operations.md"
MODULES = ["envs", "eval", "findings", "rollback", "timeouts", "cli"]


def _isort_key(name: str) -> tuple[int, str]:
    """ruff's isort-style order for __all__: CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_the_package_exports_a_sorted_all_that_resolves() -> None:
    """ops.__all__ is sorted, has no repeats, and every name exists."""
    names = list(ops.__all__)
    assert names == sorted(names, key=_isort_key)
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(ops, name), name


@pytest.mark.parametrize("name", MODULES)
def test_each_module_lists_its_public_names(name: str) -> None:
    """Every ops module has a docstring and a sorted __all__ whose names all resolve."""
    module = importlib.import_module(f"tidegate.ops.{name}")
    assert module.__doc__
    exported = list(module.__all__)
    assert exported == sorted(exported, key=_isort_key)
    for attr in exported:
        assert hasattr(module, attr), f"{name}.{attr}"


def test_rule_ids_are_stable_and_numbered_per_check() -> None:
    """ENV, TMO and RBK ids run from 001 without gaps, so an id never changes meaning."""
    for prefix, rules in (("ENV", ENV_RULES), ("TMO", TIMEOUT_RULES), ("RBK", ROLLBACK_RULES)):
        assert list(rules) == [f"{prefix}{n:03d}" for n in range(1, len(rules) + 1)]


def test_the_operations_page_documents_every_rule() -> None:
    """docs/operations.md has a table row for every rule id, and no id that does not exist."""
    text = DOCS.read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `((?:ENV|TMO|RBK)\d{3})` \|", text, flags=re.MULTILINE))
    declared = set(ENV_RULES) | set(TIMEOUT_RULES) | set(ROLLBACK_RULES)
    assert documented == declared
