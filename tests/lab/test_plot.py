"""Tests for the lab's plots: each writes a PNG, the same one every time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

import tidegate.lab.plot as plot_module
from tidegate.lab import plot
from tidegate.lab.capacity import capacity_table
from tidegate.lab.gameday import load_scenario, run_gameday
from tidegate.lab.load import backpressure, load_sweep
from tidegate.lab.scaling import LAWS, AutoscaleOptions, run_autoscale
from tidegate.lab.storm import StormOptions, run_storms
from tidegate.lab.surge import SurgeOptions, run_surge
from tidegate.lab.workload import Exponential

from .test_load import fleet

PNG = b"\x89PNG\r\n\x1a\n"


def _isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, as ruff's isort-style sort orders them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_exported() -> None:
    """The public API is an ``__all__`` sorted as ruff sorts it, whose every name exists."""
    assert plot_module.__all__ == sorted(plot_module.__all__, key=_isort_order)
    for name in plot_module.__all__:
        assert hasattr(plot_module, name)


def _draw_load(path: Path) -> Path:
    return plot.plot_load(
        load_sweep([4.0, 12.0], fleet(), horizon=60.0, warmup=5.0, with_theory=True), path
    )


def _draw_backpressure(path: Path) -> Path:
    return plot.plot_backpressure(backpressure(14.0, io=Exponential(mean=0.8), horizon=30.0), path)


def _draw_storm(path: Path) -> Path:
    return plot.plot_storm(run_storms(StormOptions(duration=40.0)), 20, path)


def _draw_surge(path: Path) -> Path:
    return plot.plot_surge(run_surge(SurgeOptions(slots=2, duration=30.0)), path)


def _draw_gameday(path: Path) -> Path:
    scenario = replace(load_scenario(), duration=1800.0)
    return plot.plot_gameday(run_gameday(scenario), path)


def _draw_autoscale(path: Path) -> Path:
    options = AutoscaleOptions(surge_start=30.0, surge_end=120.0, duration=180.0, lead_time=30.0)
    return plot.plot_autoscale([run_autoscale(law, options) for law in LAWS], path)


def _draw_capacity(path: Path) -> Path:
    return plot.plot_capacity(capacity_table([(1, 8), (1, 64)], cpu=0.015, io=0.8), path)


DRAWINGS: dict[str, Callable[[Path], Path]] = {
    "load": _draw_load,
    "backpressure": _draw_backpressure,
    "storm": _draw_storm,
    "surge": _draw_surge,
    "gameday": _draw_gameday,
    "autoscale": _draw_autoscale,
    "capacity": _draw_capacity,
}


@pytest.mark.parametrize("name", sorted(DRAWINGS))
def test_each_plot_writes_the_same_png_every_time(tmp_path: Path, name: str) -> None:
    """A plot is a PNG in a folder it creates, byte for byte the same for the same run."""
    first = DRAWINGS[name](tmp_path / "a" / f"{name}.png")
    second = DRAWINGS[name](tmp_path / "b" / f"{name}.png")
    data = first.read_bytes()
    assert data.startswith(PNG)
    assert len(data) > 5_000
    assert data == second.read_bytes()
