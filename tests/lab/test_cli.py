"""Tests for ``tidegate lab``: every sub-command's table, JSON and plot, via typer's runner."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import tidegate.lab.cli as cli_module
from tidegate.lab.cli import lab_app

runner = CliRunner()


def run(*args: str) -> str:
    result = runner.invoke(lab_app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def run_json(*args: str) -> object:
    return json.loads(run(*args, "--json"))


def test_the_app_exports_only_lab_app() -> None:
    """The module's public API is the typer app the main command mounts."""
    assert cli_module.__all__ == ["lab_app"]


def test_help_lists_every_scenario() -> None:
    """``tidegate lab --help`` names every sub-command."""
    output = run("--help")
    for command in (
        "capacity",
        "load",
        "backpressure",
        "storm",
        "surge",
        "gameday",
        "autoscale",
        "plan",
        "replay",
        "recovery",
        "placement",
    ):
        assert command in output


def test_capacity_prints_the_binding_limit(tmp_path: Path) -> None:
    """capacity prints each shape's ceiling and which limit binds, and can plot it."""
    output = run("capacity", "--shape", "1x8", "--shape", "1x64", "--plot", str(tmp_path / "c.png"))
    assert "slots" in output
    assert "cores" in output
    assert (tmp_path / "c.png").exists()
    data = run_json(
        "capacity", "--shape", "2x4", "--cpu", "0", "--io", "1", "--check", "--replications", "3"
    )
    assert isinstance(data, dict)
    (shape,) = data["shapes"]
    assert shape["ceiling"] == 8.0
    assert shape["simulated"]["n"] == 3
    assert shape["simulated"]["mean"] == pytest.approx(8.0, rel=0.1)


def test_load_sweeps_rates_with_theory() -> None:
    """load prints one row per rate, and JSON with intervals, Little's law from both sides,
    the checks and the theory."""
    output = run(
        "load", "--rate", "4", "--rate", "12", "--horizon", "60", "--warmup", "5",
        "--replications", "3",
    )  # fmt: skip
    assert "lambda_eff*W" in output
    assert "±" in output
    data = run_json(
        "load", "--rate", "5", "--cpu", "0", "--theory", "--horizon", "60", "--replications", "3",
    )  # fmt: skip
    assert isinstance(data, dict)
    (point,) = data["points"]
    assert point["littles_law"]["holds"] is True
    assert point["L"]["n"] == 3
    assert point["stationarity"]["stationary"] is True
    assert point["warmup"] >= 0
    assert point["theory"]["shed_share"] >= 0.0


def test_load_warns_when_arrivals_exceed_capacity() -> None:
    """An unbounded queue past its ceiling is flagged, in the table and in JSON."""
    args = ("load", "--rate", "12", "--cpu", "0", "--waiting", "-1", "--horizon", "300")
    result = runner.invoke(lab_app, [*args, "--replications", "3"])
    assert result.exit_code == 0
    assert "not stationary: arrivals exceed capacity" in result.stderr
    data = run_json(*args, "--replications", "3")
    assert isinstance(data, dict)
    (point,) = data["points"]
    assert point["stationarity"]["stationary"] is False
    assert point["littles_law"]["holds"] is False


def test_backpressure_compares_three_shapes(tmp_path: Path) -> None:
    """backpressure prints the three admission shapes and writes its plot."""
    args = ("backpressure", "--horizon", "30", "--replications", "3")
    output = run(*args, "--plot", str(tmp_path / "b.png"))
    for shape in ("no waiting room", "bounded waiting room", "unbounded, deadline"):
        assert shape in output
    assert "±" in output
    data = run_json(*args)
    assert isinstance(data, dict)
    assert data["replications"] == 3
    unbounded = data["shapes"]["unbounded, deadline"]
    assert unbounded["shed"]["mean"] == 0
    assert unbounded["on_time"]["n"] == 3


def test_storm_reports_each_strategy() -> None:
    """storm prints calls, peak, served and gave up for each retry strategy."""
    output = run("storm", "--duration", "40", "--replications", "3")
    assert "retry at once" in output
    assert "backoff + full jitter" in output
    data = run_json("storm", "--duration", "40", "--replications", "3")
    assert isinstance(data, dict)
    strategies = data["strategies"]
    assert [d["strategy"] for d in strategies] == ["naive", "backoff", "budget", "breaker"]
    assert all(d["calls"]["n"] == 3 for d in strategies)


def test_surge_sweeps_multipliers_and_shares(tmp_path: Path) -> None:
    """surge prints a ladder per (multiplier, share) point; JSON has every rung."""
    output = run(
        "surge",
        "--multiplier",
        "2",
        "--multiplier",
        "5",
        "--slots",
        "2",
        "--duration",
        "30",
        "--deadline",
        "5",
        "--replications",
        "2",
        "--plot",
        str(tmp_path / "s.png"),
    )
    assert output.count("priority_at_admission") == 2
    assert (tmp_path / "s.png").exists()
    data = run_json(
        "surge",
        "--slots",
        "2",
        "--duration",
        "20",
        "--rung",
        "unbounded_fifo",
        "--replications",
        "2",
    )
    assert isinstance(data, dict)
    (point,) = data["points"]
    assert [r["rung"] for r in point["rungs"]] == ["unbounded_fifo"]
    assert point["rungs"][0]["goodput"]["n"] == 2


def test_gameday_prints_outcomes_and_gated_steps(tmp_path: Path) -> None:
    """gameday prints each strategy with the gate off and on, then the gated steps."""
    output = run("gameday", "--replications", "2")
    assert "canary, gate on, first replication: step by step" in output
    assert "rollback" in output
    scenario = tmp_path / "release.json"
    scenario.write_text(
        json.dumps(
            {
                "baseline": {"error_rate": 0.01},
                "candidate": {"error_rate": 0.01},
                "duration": 1800,
            }
        )
    )
    data = run_json("gameday", "--scenario", str(scenario), "--replications", "2")
    assert isinstance(data, dict)
    releases = data["releases"]
    # A candidate as good as the baseline is never rolled back; rolling needs more windows.
    assert {d["outcome"] for d in releases if d["gated"]} == {"completed", "held"}
    assert all(d["rolled_back_at"] is None for d in releases if d["gated"])


def test_autoscale_compares_the_laws() -> None:
    """autoscale prints both laws with direction changes and cold starts."""
    args = (
        "--surge-start",
        "30",
        "--surge-end",
        "150",
        "--duration",
        "240",
        "--lead-time",
        "30",
        "--replications",
        "3",
    )
    output = run("autoscale", *args)
    assert "proportional" in output
    assert "damped" in output
    data = run_json("autoscale", *args)
    assert isinstance(data, dict)
    assert [d["law"] for d in data["laws"]] == ["proportional", "damped"]
    assert all(d["cold_starts"]["n"] == 3 for d in data["laws"])


def test_plan_sizes_the_fleet_and_the_bill() -> None:
    """plan prints the mean-value law and the monthly cost split; with the simulation, the
    smallest fleets at the peak and the spike with intervals."""
    output = run("plan", "--no-check")
    assert "mean-value law" in output
    assert "tokens per month" in output
    data = run_json(
        "plan", "--peak", "20", "--cpu", "0", "--io", "1", "--slots", "10", "--no-check"
    )
    assert isinstance(data, dict)
    assert data["plan"]["workers"] == 5
    data = run_json(
        "plan", "--peak", "8", "--spike", "1.5", "--slots", "4", "--waiting", "0",
        "--horizon", "100", "--replications", "3", "--theory",
    )  # fmt: skip
    assert isinstance(data, dict)
    assert set(data["sizes"]) == {"peak", "spike"}
    peak, spike = data["sizes"]["peak"], data["sizes"]["spike"]
    assert peak["workers"] <= spike["workers"]
    chosen = peak["chosen"]["shed_share"]
    assert chosen["mean"] < 0.01
    assert chosen["n"] == 3
    assert peak["one_fewer"]["shed_share"]["mean"] >= 0.01
    assert peak["theory_workers"] is not None
    assert data["workers"] == max(data["plan"]["workers"], spike["workers"])


def test_plan_gives_the_same_bytes_on_one_or_two_pool_workers() -> None:
    args = ("plan", "--peak", "8", "--slots", "4", "--horizon", "60", "--replications", "4")
    assert run_json(*args, "--jobs", "1") == run_json(*args, "--jobs", "2")


SMALL_RUNS = {
    "backpressure": ("--horizon", "20"),
    "storm": ("--duration", "20", "--outage-start", "5", "--outage-length", "5"),
    "surge": ("--slots", "2", "--duration", "20", "--deadline", "5", "--multiplier", "3"),
    "gameday": (),
    "autoscale": ("--surge-start", "20", "--surge-end", "60", "--duration", "90",
                  "--lead-time", "20"),
    "capacity": ("--shape", "1x4", "--check", "--cpu", "0", "--io", "1"),
}  # fmt: skip


@pytest.mark.parametrize("command", sorted(SMALL_RUNS))
def test_replications_give_the_same_bytes_on_one_or_two_pool_workers(command: str) -> None:
    """Every replicated command prints the same bytes, as JSON and as a table, with one pool
    worker or two, and its JSON figures are intervals over the replications."""
    args = (command, *SMALL_RUNS[command], "--replications", "3", "--seed", "7")
    one = run(*args, "--jobs", "1", "--json")
    assert one == run(*args, "--jobs", "2", "--json")
    assert '"half_width"' in one
    assert '"n": 3' in one
    assert run(*args, "--jobs", "1") == run(*args, "--jobs", "2")
    assert one != run(*args[:-1], "8", "--jobs", "1", "--json")


@pytest.mark.parametrize("command", sorted(SMALL_RUNS))
@pytest.mark.parametrize("option", ["--replications", "--jobs"])
def test_a_bad_pool_option_is_refused_by_name(command: str, option: str) -> None:
    """``--replications 0`` and ``--jobs 0`` exit with status 2 naming the option, as load and
    plan do."""
    result = runner.invoke(lab_app, [command, option, "0"])
    assert result.exit_code == 2
    assert option in result.output


def test_replay_compares_recorded_and_replayed_outcomes(tmp_path: Path) -> None:
    """replay runs the sample log through the sample candidate, or given files."""
    output = run("replay")
    assert "What would have changed" in output
    log = tmp_path / "log.jsonl"
    lines = ["tidegate listening on http://0.0.0.0:8080", "INFO:     Started server process"]
    lines += [json.dumps({"at": i, "latency": 0.5}) for i in range(20)]
    log.write_text("\n".join(lines))
    config = tmp_path / "tidegate.yaml"
    config.write_text(
        "providers: {p: {type: fake, model: m}}\nmodels: {chat: {providers: [p]}}\n"
        "admission: {classes: [standard], slots: 2}\n"
    )
    data = run_json("replay", "--log", str(log), "--config", str(config))
    assert isinstance(data, dict)
    assert data["replayed"] == {"ok": 20}
    assert data["skipped"] == 2
    printed = run("replay", "--log", str(log), "--config", str(config))
    assert "2 lines skipped" in printed
    config.write_text(config.read_text() + "colour: blue\n")
    refused = runner.invoke(lab_app, ["replay", "--log", str(log), "--config", str(config)])
    assert refused.exit_code == 2
    assert "unknown key 'colour'" in refused.output


@pytest.mark.parametrize(
    "args",
    [
        ("capacity", "--shape", "eight"),
        ("load", "--io", "gamma:1"),
        ("surge", "--rung", "lifo"),
        ("storm", "--rate", "0"),
        ("gameday", "--scenario", "/nonexistent/release.json"),
        ("plan", "--peak", "0"),
        ("plan", "--peak", "-3"),
        ("plan", "--waiting", "-2"),
        ("plan", "--slots", "0"),
        ("plan", "--replications", "0"),
        ("plan", "--dispatch", "random"),
        ("load", "--waiting", "-2"),
        ("load", "--workers", "0"),
        ("load", "--rate", "-1"),
        ("load", "--replications", "0"),
        ("load", "--jobs", "0"),
        ("replay", "--log", "/nonexistent/log.jsonl"),
        ("backpressure", "--rate", "0"),
        ("surge", "--deadline", "-1"),
        ("surge", "--queue-cap", "-1"),
    ],
)
def test_bad_input_exits_with_a_message(args: tuple[str, ...]) -> None:
    """A bad option exits with status 2 and a one-line reason on standard error."""
    result = runner.invoke(lab_app, list(args))
    assert result.exit_code == 2
    assert "tidegate lab:" in result.stderr or "Error" in result.output


def test_the_same_command_prints_the_same_output() -> None:
    """A seeded command is repeatable, and another seed changes the numbers."""
    args = ("surge", "--slots", "2", "--duration", "30", "--replications", "2", "--json")
    assert run(*args, "--seed", "4") == run(*args, "--seed", "4")
    assert run(*args, "--seed", "4") != run(*args, "--seed", "5")


DOC = Path(__file__).resolve().parents[2] / "docs" / "lab.md"
DOCUMENTED = re.compile(r"```console\n\$ tidegate lab (.+?)\n```\n\n```text\n(.*?)\n```", re.DOTALL)
CHEAP = (
    "capacity",
    "backpressure",
    "storm",
    "gameday",
    "plan",
    "replay",
    "recovery",
    "placement",
)


def documented_runs() -> list[Any]:
    runs = []
    for command, output in DOCUMENTED.findall(DOC.read_text(encoding="utf-8")):
        args = shlex.split(command.replace("\\\n", " "))
        if args[0] in CHEAP:
            runs.append(pytest.param(args, output, id=args[0]))
    return runs


@pytest.mark.parametrize(("args", "expected"), documented_runs())
def test_the_documented_output_is_what_the_command_prints(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    """docs/lab.md shows what each cheap command really prints (plots go to a scratch file)."""
    if "--plot" in args:
        args[args.index("--plot") + 1] = str(tmp_path / "plot.png")
    result = runner.invoke(lab_app, args, env={"COLUMNS": "118"})
    assert result.exit_code == 0, result.output
    printed = "\n".join(line.rstrip() for line in result.stdout.rstrip("\n").splitlines())
    assert printed == expected


def test_every_scenario_is_documented_with_a_plot() -> None:
    """docs/lab.md runs every sub-command and links plots that exist."""
    text = DOC.read_text(encoding="utf-8")
    commands = {shlex.split(c)[0] for c, _ in DOCUMENTED.findall(text)}
    assert commands >= {
        "capacity",
        "load",
        "backpressure",
        "storm",
        "surge",
        "gameday",
        "autoscale",
        "plan",
        "replay",
        "recovery",
        "placement",
    }
    images = re.findall(r"\]\((img/lab-[a-z]+\.png)\)", text)
    assert len(images) >= 7
    for image in images:
        assert (DOC.parent / image).read_bytes().startswith(b"\x89PNG")
