"""Helpers for the offline-check tests: the fixture folders and copies to break."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

FIXTURES = Path(__file__).parent / "fixtures"

Copier = Callable[[str], Path]


def edit_yaml(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    """Load the YAML mapping in ``path``, let ``change`` alter it in place, and write it back."""
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


@pytest.fixture
def copy_fixture(tmp_path: Path) -> Copier:
    """A fresh copy of a fixture folder (``"envs/good"``) in tmp_path, safe to break."""

    def copy(name: str) -> Path:
        target = tmp_path / name.replace("/", "-")
        shutil.copytree(FIXTURES / name, target)
        return target

    return copy
