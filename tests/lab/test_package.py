"""Tests for the lab package's public API."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import tidegate.lab as lab


def test_every_exported_name_resolves_to_its_module_object() -> None:
    """tidegate.lab's names are sorted, unique, and the very objects of the lab modules."""
    assert lab.__all__ == sorted(lab.__all__, key=lambda n: (0 if n[:1].isupper() else 1, n))
    assert len(set(lab.__all__)) == len(lab.__all__)
    from tidegate.lab import engine, surge, theory

    assert lab.Simulation is engine.Simulation
    assert lab.run_surge is surge.run_surge
    assert lab.erlang_c is theory.erlang_c
    for name in lab.__all__:
        assert getattr(lab, name) is not None


def test_the_lab_never_imports_the_gateway_or_simpy() -> None:
    """The lab sits beside the gateway, never on it; SimPy is for the benchmark only."""
    root = Path(lab.__file__).parent
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                assert not name.startswith(("tidegate.gateway", "simpy")), (path.name, name)


def test_importing_the_lab_does_not_load_matplotlib() -> None:
    """Plots import matplotlib only when asked for, so the engine runs without it loaded."""
    import sys

    loaded_before = "matplotlib" in sys.modules
    importlib.reload(lab)
    assert loaded_before or "matplotlib" not in sys.modules
