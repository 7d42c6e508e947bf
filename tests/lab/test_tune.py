"""Tests for `tidegate lab tune`: the search, its verdict, the config diff, the backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import tidegate.lab.tune as tune_module
from tidegate.lab.cli import lab_app
from tidegate.lab.replay import sample_log
from tidegate.lab.tune import (
    Constraints,
    PoolBackend,
    Profile,
    Setting,
    Space,
    TuneOptions,
    Workload,
    config_diff,
    load_start,
    tune,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tidegate.dev.yaml"

#: A deliberately bad starting point: a queue that never refuses, no deadline admission, five
#: tries with the retry budget wide open, a breaker slow to close, one small worker.
BAD = """\
# a config for the tuner to improve
server:
  request_timeout_s: 30   # seconds
providers:
  primary: {type: fake, model: sample-1}
models:
  chat:
    providers: [primary]
    per_try_timeout_s: 8
admission:
  classes: [standard]
  slots: 16
  queue_cap: 100000
  mode: queue_cap
  drop_expired_at_dequeue: false
retry:
  attempts: 5
  base_s: 0.05
  cap_s: 0.2
  budget_ratio: 1.0
  budget_floor_per_s: 100
breaker:
  consecutive_failures: 1000
  recovery_s: 60
"""

#: A short run: 60 s of 30 req/s with a 10 s outage.
SHORT = Workload(profile=Profile(duration=60.0, outage_start=20.0, outage_length=10.0))
#: A small space: one alternative per knob besides the start's own value.
SMALL = Space(
    queue_cap=(32,),
    mode=("deadline",),
    attempts=(2,),
    budget_ratio=(0.1,),
    breaker_failures=(5,),
    breaker_recovery=(10.0,),
    workers=(2,),
)
OPTIONS = TuneOptions(space=SMALL, replications=3, passes=2)


@pytest.fixture
def bad(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD, encoding="utf-8")
    return path


def test_all_is_exported() -> None:
    for name in tune_module.__all__:
        assert hasattr(tune_module, name)


def test_the_start_is_read_by_the_gateways_loader(bad: Path) -> None:
    """The knobs come from the file (server.workers defaults to the gateway's 1), and tokens are
    priced from the config's own prices when it has them."""
    start = load_start(bad)
    assert start.setting == Setting(
        queue_cap=100000,
        mode="queue_cap",
        attempts=5,
        budget_ratio=1.0,
        breaker_failures=1000,
        breaker_recovery=60.0,
        workers=1,
    )
    assert start.prices.source == "default"
    example = load_start(EXAMPLE)
    assert example.prices.per_1k_tokens == pytest.approx((0.0005 + 0.0015) / 2)
    assert "fake-a-2026-01" in example.prices.source
    assert load_start(EXAMPLE, per_1k_tokens=0.01).prices.per_1k_tokens == 0.01


def test_a_bad_config_is_improved_by_more_than_the_interval_width(bad: Path) -> None:
    result = tune(load_start(bad), SHORT, OPTIONS, PoolBackend(2))
    before, after = result.start.figures["goodput"], result.best.figures["goodput"]
    assert result.improved
    assert after.low > before.high
    assert result.gain.low > 0
    assert result.verdict.startswith("the best setting beats the starting config")
    changes = result.as_dict()["changes"]
    assert changes  # and the diff names every changed key, with its new value
    for key, change in changes.items():
        _section, name = key.split(".")
        assert f"+  {name}: {tune_module._scalar(change['to'])}" in result.diff
    assert result.diff.startswith("--- bad.yaml\n+++ bad.yaml (tuned)\n")


def test_the_shipped_example_beats_its_defaults_or_is_on_the_frontier() -> None:
    result = tune(load_start(EXAMPLE), SHORT, OPTIONS, PoolBackend(2))
    assert result.verdict in (
        "the best setting beats the starting config by more than the interval width (goodput)",
        "the starting config is already on the frontier",
    )
    if result.improved:
        assert result.best.figures["goodput"].low > result.start.figures["goodput"].high
        assert result.diff
    else:
        assert not result.best.figures["goodput"].low > result.start.figures["goodput"].high


def test_one_pool_worker_or_two_give_the_same_result(bad: Path) -> None:
    options = TuneOptions(space=SMALL, replications=2, passes=1, seed=3)
    start = load_start(bad)
    one = tune(start, SHORT, options, PoolBackend(1)).as_dict()
    two = tune(start, SHORT, options, PoolBackend(2)).as_dict()
    assert one == two


def test_a_trace_is_a_workload() -> None:
    """A recorded log drives arrivals, deadlines and the provider's health (its outage at
    360-420 s): a breaker that probes sooner after it answers more of the log."""
    workload = Workload(trace=sample_log(seed=0, duration=480.0), name="sample")
    start = load_start(Path(tune_module.__file__).parent / "data" / "candidate.yaml")
    slow = tune_module.run_setting(start, start.setting, workload, seed=1)
    sooner = start.setting.with_knob("breaker_recovery", 5.0)
    quick = tune_module.run_setting(start, sooner, workload, seed=1)
    assert quick["goodput"] > slow["goodput"]
    assert quick["calls_per_request"] > slow["calls_per_request"]
    space = Space(
        queue_cap=(),
        mode=(),
        attempts=(),
        budget_ratio=(),
        breaker_failures=(),
        breaker_recovery=(5.0,),
        workers=(),
    )
    result = tune(start, workload, TuneOptions(space=space, replications=2, passes=1))
    assert result.workload.endswith("requests from sample")
    assert result.evaluated == 2


def test_constraints_decide_feasibility(bad: Path) -> None:
    """A limit no setting meets leaves the start in place and says so."""
    options = TuneOptions(
        space=SMALL, replications=2, passes=1, constraints=Constraints(max_p95=0.01)
    )
    result = tune(load_start(bad), SHORT, options, PoolBackend(2))
    assert not result.best.feasible
    assert result.best.setting == result.start.setting
    assert result.verdict == "no setting searched meets the constraints"
    assert result.diff == ""
    assert any(v.startswith("p95 ") for v in result.start.violations)


def test_the_diff_edits_only_the_changed_keys_in_place() -> None:
    text = (
        "# top comment\n"
        "server:\n"
        "  port: 8080\n"
        "admission:\n"
        "  weights:\n"
        "    standard: 1\n"
        "  queue_cap: 256  # the waiting room\n"
        "logging:\n"
        "  level: info\n"
    )
    old = Setting(
        queue_cap=256,
        mode="deadline",
        attempts=3,
        budget_ratio=0.1,
        breaker_failures=5,
        breaker_recovery=30.0,
        workers=1,
    )
    new = old.with_knob("queue_cap", 32).with_knob("workers", 4).with_knob("attempts", 2)
    diff = config_diff(text, "live.yaml", old, new)
    assert "-  queue_cap: 256  # the waiting room\n+  queue_cap: 32  # the waiting room\n" in diff
    assert "+  workers: 4\n" in diff
    assert "+retry:\n+  attempts: 2\n" in diff
    assert "mode" not in diff
    assert "breaker" not in diff
    assert config_diff(text, "live.yaml", old, old) == ""
    edited = tune_module._edited(text, tune_module._changed(old, new))
    assert edited is not None
    assert edited.startswith("# top comment\n")
    data = yaml.safe_load(edited)
    assert data["admission"] == {"weights": {"standard": 1}, "queue_cap": 32}
    assert data["server"] == {"port": 8080, "workers": 4}
    assert data["retry"] == {"attempts": 2}


def test_the_diff_of_a_flow_style_section_lists_the_keys_alone() -> None:
    text = "admission: {queue_cap: 256, slots: 8}\n"
    old = Setting(
        queue_cap=256,
        mode="deadline",
        attempts=3,
        budget_ratio=0.1,
        breaker_failures=5,
        breaker_recovery=30.0,
        workers=1,
    )
    diff = config_diff(text, "flow.yaml", old, old.with_knob("queue_cap", 8))
    assert " admission:\n-  queue_cap: 256\n+  queue_cap: 8\n" in diff
    assert yaml.safe_load(text)["admission"]["queue_cap"] == 256


def test_bad_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown objective 'speed'; choose from goodput, cost"):
        TuneOptions(objective="speed")
    with pytest.raises(ValueError, match="--max-shed must be a finite number >= 0"):
        Constraints(max_shed=-0.1)
    with pytest.raises(ValueError, match="--max-p95 must be a finite number >= 0"):
        Constraints(max_p95=-1.0)
    with pytest.raises(ValueError, match="max-shed is a share"):
        Constraints(max_shed=2.0)
    with pytest.raises(ValueError, match="space: workers values must be integers >= 1"):
        Space(workers=(0,))
    with pytest.raises(ValueError, match="cannot read a distribution"):
        Profile(io="gamma")
    refused = tmp_path / "refused.yaml"
    refused.write_text(BAD.replace("queue_cap: 100000", "queue_cap: 0"), encoding="utf-8")
    with pytest.raises(ValueError, match=r"admission\.queue_cap"):
        load_start(refused)


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(lab_app, ["tune", *args])
    return result.exit_code, result.stdout, result.stderr


def test_the_command_prints_json(bad: Path) -> None:
    code, out, _ = _cli(
        "--config", str(bad), "--duration", "20", "--outage", "5,5", "--replications", "2",
        "--passes", "1", "--jobs", "1", "--json",
    )  # fmt: skip
    assert code == 0
    data = json.loads(out)
    assert data["objective"] == "goodput"
    assert set(data["best"]["figures"]) == set(tune_module.FIGURES)
    assert data["verdict"] in (
        "the best setting beats the starting config by more than the interval width (goodput)",
        "the starting config is already on the frontier",
    )
    assert data["start"]["setting"]["admission.queue_cap"] == 100000
    assert data["changes"] == {} or data["diff"].startswith("--- bad.yaml")


def test_the_command_refuses_bad_input(bad: Path, tmp_path: Path) -> None:
    code, _, err = _cli("--config", str(bad), "--objective", "speed")
    assert code == 2
    assert "unknown objective 'speed'" in err
    code, _, err = _cli("--config", str(bad), "--max-shed", "-1")
    assert code == 2
    assert "--max-shed must be a finite number >= 0" in err
    code, _, err = _cli("--config", str(bad), "--outage", "soon")
    assert code == 2
    assert "--outage 'soon'" in err
    code, _, err = _cli("--config", str(bad), "--cluster", "remote")
    assert code == 2
    assert "--scheduler ADDRESS" in err
    refused = tmp_path / "refused.yaml"
    refused.write_text(BAD.replace("attempts: 5", "attempts: 0"), encoding="utf-8")
    code, _, err = _cli("--config", str(refused))
    assert code == 2
    assert "retry.attempts" in err


def test_a_missing_dask_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def no_dask(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("dask"):
            raise ImportError(name)
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_dask)
    with pytest.raises(ValueError, match=r"tidegate\[cluster\]"), tune_module.dask_backend():
        pass


def test_a_dask_cluster_gives_the_pools_result(bad: Path) -> None:
    distributed = pytest.importorskip("dask.distributed")
    options = TuneOptions(space=SMALL, replications=2, passes=1, seed=5)
    start = load_start(bad)
    pooled = tune(start, SHORT, options, PoolBackend(2)).as_dict()
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        clustered = tune(start, SHORT, options, tune_module.DaskBackend(client)).as_dict()
    assert clustered == pooled


def test_what_a_dask_task_carries_survives_a_pickle_in_either_build() -> None:
    """The compiled build's frozen classes (admission options, distributions, traces) cannot be
    unpickled; a task's spec and result travel as their fields and are built again."""
    import pickle

    from tidegate.lab.workload import Exponential, Trace, TraceRecord
    from tidegate.policy.admission import AdmissionOptions

    options = AdmissionOptions(
        classes=("critical", "standard"), queue_cap={"critical": 2, "standard": 4}
    )
    record = TraceRecord(at=0.5, latency=1.25, outcome="ok")
    spec = {"options": options, "io": Exponential(mean=0.8), "trace": Trace(records=(record,))}
    spec_list = [spec, (1, 2.0)]
    carried = pickle.loads(pickle.dumps(tune_module._plain(spec_list)))
    assert tune_module._built(carried) == spec_list
