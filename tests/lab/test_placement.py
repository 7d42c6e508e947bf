"""Tests for the placement scenario: per-process ``memory://`` stores against one shared store."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from typer.testing import CliRunner

import tidegate.lab.placement as placement_module
from tidegate.clock import Clock
from tidegate.lab.cli import lab_app
from tidegate.lab.placement import (
    PLACEMENTS,
    PlacementOptions,
    placement_summary,
    placement_theory,
    run_placement,
)
from tidegate.state.memory import MemoryBucketStore, MemoryCacheStore, MemoryIdempotencyStore
from tidegate.state.url import Stores, store_from_url

OPTIONS = PlacementOptions()  # 4 workers, limit 0.5/s burst 5 over 60 s, 40 prompts x 8


def both(seed: int = 1, options: PlacementOptions = OPTIONS) -> dict[str, Any]:
    return {p: run_placement(options, placement=p, seed=seed) for p in PLACEMENTS}


def test_the_same_seed_gives_the_same_run() -> None:
    """A run is a function of its options and seed; another seed draws another workload."""
    first, again = both(3), both(3)
    assert {p: r.as_dict() for p, r in first.items()} == {p: r.as_dict() for p, r in again.items()}
    assert first["per_process"].as_dict() != both(4)["per_process"].as_dict()


def test_per_process_buckets_multiply_the_limit_by_the_workers() -> None:
    """Each of 4 workers keeps a full bucket per user: per process admits between 3 and 4
    times the limit (4 at most; a little less as a bucket full at a lull wastes its refill),
    one shared bucket never more than the limit itself (burst + rate x window)."""
    runs = both()
    per_process, shared = runs["per_process"], runs["shared"]
    assert 3.0 <= per_process.limit_ratio <= 4.0
    assert shared.admitted_per_user <= OPTIONS.limit
    assert 0.9 <= shared.limit_ratio <= 1.0


def test_follow_ups_find_their_history_one_time_in_n_per_process() -> None:
    """Round-robin sends a follow-up to the worker that stored its answer about 1/N of the
    time (within four binomial standard errors of 1/4); a shared store always has it."""
    runs = both()
    per_process, shared = runs["per_process"], runs["shared"]
    n = per_process.followups
    assert n > 300
    noise = 4 * math.sqrt(0.25 * 0.75 / n)
    assert abs(per_process.history_share - 0.25) <= noise
    assert shared.history_share == 1.0
    assert shared.history_found == shared.followups


def test_a_repeated_idempotent_request_executes_once_only_with_a_shared_store() -> None:
    """Executions per key: exactly one shared (every follow-up a replay), more than one per
    process (a follow-up on another worker runs again), near the expected 2 - 1/N."""
    runs = both()
    per_process, shared = runs["per_process"], runs["shared"]
    assert shared.executions == shared.keys > 0
    assert shared.as_dict()["second_executions"] == 0
    assert per_process.executions_per_key > 1.0
    assert per_process.executions_per_key == pytest.approx(1.75, abs=0.1)
    assert per_process.executions - per_process.keys == per_process.followups - (
        per_process.history_found
    )


def test_per_process_caches_make_more_model_calls() -> None:
    """Each worker misses once per prompt it sees: more calls than one shared cache, which
    calls the model once per distinct prompt, and never more than min(N, K) x P."""
    runs = both()
    per_process, shared = runs["per_process"], runs["shared"]
    assert shared.model_calls == OPTIONS.prompts
    assert per_process.model_calls > shared.model_calls
    assert per_process.model_calls <= min(OPTIONS.workers, OPTIONS.repeats) * OPTIONS.prompts
    assert per_process.asks == shared.asks == OPTIONS.prompts * OPTIONS.repeats


def test_one_worker_makes_the_placements_alike() -> None:
    """With one worker, per process is one store: the same figures as shared."""
    runs = both(options=PlacementOptions(workers=1))
    assert runs["per_process"].as_dict() | {"placement": ""} == runs["shared"].as_dict() | {
        "placement": ""
    }
    assert runs["shared"].limit_ratio <= 1.0


def test_the_runs_use_the_real_memory_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per process opens one memory:// store per worker, shared opens one; both are the
    memory store classes the gateway uses."""
    opened: list[Stores] = []
    real = store_from_url

    async def spy(url: str, *, clock: Clock) -> Stores:
        stores = await real(url, clock=clock)
        opened.append(stores)
        return stores

    monkeypatch.setattr(placement_module, "store_from_url", spy)
    small = PlacementOptions(users=2, requests_per_user=20, prompts=3, repeats=2)
    run_placement(small, placement="per_process", seed=0)
    assert len(opened) == small.workers
    assert len({id(s) for s in opened}) == small.workers
    opened.clear()
    run_placement(small, placement="shared", seed=0)
    (stores,) = opened
    assert isinstance(stores.buckets, MemoryBucketStore)
    assert isinstance(stores.idempotency, MemoryIdempotencyStore)
    assert isinstance(stores.cache, MemoryCacheStore)


def test_theory() -> None:
    """Uniform placement: N x the limit, 1/N found, 2 - 1/N executions, N(1-(1-1/N)^K) P calls."""
    theory = placement_theory(OPTIONS)
    mine, ours = theory["per_process"], theory["shared"]
    assert mine["limit_ratio"] == 4.0
    assert mine["history_share"] == 0.25
    assert mine["executions_per_key"] == pytest.approx(1.75)
    assert mine["model_calls"] == pytest.approx(40 * 4 * (1 - 0.75**8))
    assert mine["model_calls_bound"] == 160.0
    assert ours == {
        "limit_ratio": 1.0,
        "history_share": 1.0,
        "executions_per_key": 1.0,
        "model_calls": 40.0,
        "model_calls_bound": 40.0,
    }
    two = placement_theory(PlacementOptions(followups=2))["per_process"]
    assert two["history_share"] == pytest.approx((0.25 + (1 - 0.75**2)) / 2)


def test_summary_has_intervals_over_replications() -> None:
    """The summary gives each figure of each placement as an interval over the replications."""
    small = PlacementOptions(users=5, requests_per_user=120)
    summary = placement_summary(small, seed=2, replications=3)
    assert set(summary) == set(PLACEMENTS)
    assert summary["shared"]["history_share"].mean == 1.0
    assert summary["per_process"]["limit_ratio"].n == 3
    assert summary["per_process"]["model_calls"].mean > summary["shared"]["model_calls"].mean


@pytest.mark.parametrize(
    "bad",
    [
        {"workers": 0},
        {"users": 0},
        {"repeats": 0},
        {"followup_share": 1.5},
        {"window_s": 0.0},
        {"rate": -1.0},
    ],
)
def test_bad_options_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be"):
        PlacementOptions(**bad)


def test_an_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown placement"):
        run_placement(OPTIONS, placement="sticky")


runner = CliRunner()


def test_the_command_prints_both_placements_and_json() -> None:
    """``tidegate lab placement`` prints the rows side by side, and --json parses."""
    result = runner.invoke(lab_app, ["placement", "--replications", "2", "--jobs", "1"])
    assert result.exit_code == 0, result.output
    for text in ("per-user limit x", "follow-ups with history", "model calls", "theory, shared"):
        assert text in result.stdout
    args = ["placement", "--workers", "2", "--replications", "2", "--jobs", "1", "--json"]
    result = runner.invoke(lab_app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["workers"] == 2
    assert data["placements"]["shared"]["executions_per_key"]["mean"] == 1.0
    assert data["placements"]["per_process"]["limit_ratio"]["n"] == 2
    assert data["theory"]["per_process"]["limit_ratio"] == 2.0


def test_zero_workers_is_a_clear_error() -> None:
    result = runner.invoke(lab_app, ["placement", "--workers", "0"])
    assert result.exit_code == 2
    assert "--workers" in result.output
