import importlib

import pytest

PACKAGES = [
    "tidegate",
    "tidegate.clock",
    "tidegate.errors",
    "tidegate.testing",
    "tidegate.policy",
    "tidegate.state",
    "tidegate.gateway",
    "tidegate.providers",
    "tidegate.ops",
    "tidegate.lab",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_exported_name_exists_and_is_listed_once(name: str) -> None:
    """A package's public API is exactly its __all__: each name resolves, none repeats."""
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert len(exported) == len(set(exported))
    for attr in exported:
        assert hasattr(module, attr), f"{name}.{attr} is listed in __all__ but missing"


def test_policy_package_reexports_the_module_objects() -> None:
    """tidegate.policy's names are the very objects of the policy modules, not copies."""
    from tidegate import policy
    from tidegate.policy import admission, breaker, retry

    assert policy.AdmissionController is admission.AdmissionController
    assert policy.CircuitBreaker is breaker.CircuitBreaker
    assert policy.RetryPlanner is retry.RetryPlanner


def test_policy_imports_nothing_above_it() -> None:
    """policy/ imports only clock, errors and the standard library (DESIGN: imports point down)."""
    import ast
    from pathlib import Path

    import tidegate.policy

    root = Path(tidegate.policy.__file__).parent
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("tidegate")
            ):
                assert node.module.split(".")[1] in {"clock", "errors", "policy"}, (
                    path,
                    node.module,
                )
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("tidegate."), (path, alias.name)
