"""The check and eval commands: output and exit codes (0 clean, 1 on an error finding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tests.ops.conftest import FIXTURES, Copier, edit_yaml
from tidegate.ops.cli import check_app, eval_command

runner = CliRunner()


def _eval_app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """A group, so that eval is invoked by name as the lead mounts it."""

    app.command("eval")(eval_command)
    return app


def _eval(*args: str) -> tuple[int, str]:
    config = str(FIXTURES / "eval" / "tidegate.yaml")
    result = runner.invoke(_eval_app(), ["eval", "--config", config, *args])
    return result.exit_code, result.output


def test_envs_exits_0_on_the_passing_fixture() -> None:
    """Every environment passes: exit 0 and one summary line naming them."""
    result = runner.invoke(check_app, ["envs", str(FIXTURES / "envs" / "good")])
    assert result.exit_code == 0, result.output
    assert result.output == "check envs: ok, dev, production, staging pass every rule\n"


def test_envs_exits_1_and_prints_each_finding() -> None:
    """The failing fixture exits 1 with one line per finding and a count."""
    result = runner.invoke(check_app, ["envs", str(FIXTURES / "envs" / "bad")])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert any(
        line.startswith("ERROR   ENV008 production/tidegate.yaml [providers.fake-chat]:")
        for line in lines
    )
    assert lines[-1].startswith("check envs: ")
    assert lines[-1].endswith("error(s), 0 warning(s)")


def test_envs_on_an_empty_folder_exits_1(tmp_path: Path) -> None:
    """No environment to check is an error, not a silent pass."""
    result = runner.invoke(check_app, ["envs", str(tmp_path)])
    assert result.exit_code == 1
    assert "ENV018" in result.output


def test_drift_prints_a_table_of_differences() -> None:
    """drift lists each differing key with both values, then how many differ; exit 0."""
    envs = FIXTURES / "envs" / "good"
    result = runner.invoke(check_app, ["drift", str(envs / "staging"), str(envs / "production")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["setting", "staging", "production"]
    assert ["deploy.replicas", "2", "3"] in [line.split() for line in lines]
    assert lines[-1].endswith("setting(s) differ")


def test_drift_exits_1_when_a_side_does_not_load(copy_fixture: Copier) -> None:
    """A side that does not load is printed as a finding and the command exits 1."""
    root = copy_fixture("envs/good")
    (root / "staging" / "tidegate.yaml").write_text("providers: [\n")
    result = runner.invoke(check_app, ["drift", str(root / "staging"), str(root / "production")])
    assert result.exit_code == 1
    assert "ENV001" in result.output


def test_drift_of_an_environment_with_itself_says_so() -> None:
    """Comparing an environment with itself reports the same settings; exit 0."""
    prod = str(FIXTURES / "envs" / "good" / "production")
    result = runner.invoke(check_app, ["drift", prod, prod])
    assert (result.exit_code, result.output) == (
        0,
        "production and production have the same settings\n",
    )


def _timeouts(root: Path) -> list[str]:
    return [
        "timeouts",
        "--config",
        str(root / "tidegate.yaml"),
        "--compose",
        str(root / "docker-compose.yml"),
        "--kubernetes",
        str(root / "kubernetes"),
    ]


def test_timeouts_exits_0_when_the_chain_nests() -> None:
    """The passing fixture exits 0 with a one-line verdict."""
    result = runner.invoke(check_app, _timeouts(FIXTURES / "timeouts" / "good"))
    assert result.exit_code == 0, result.output
    assert result.output == "check timeouts: ok, each layer gives up before the one above\n"


def test_timeouts_exits_1_when_a_layer_outlives_its_caller() -> None:
    """The failing fixture exits 1 and names the layers in words."""
    result = runner.invoke(check_app, _timeouts(FIXTURES / "timeouts" / "bad"))
    assert result.exit_code == 1
    assert "stream limit of provider primary (300s) outlives gateway request (60s)" in result.output
    assert "TMO003" in result.output
    assert "TMO004" in result.output


def test_timeouts_warnings_alone_exit_0(copy_fixture: Copier) -> None:
    """A missing client timeout is a warning: printed, counted, and the exit code stays 0."""
    root = copy_fixture("timeouts/good")
    edit_yaml(root / "docker-compose.yml", lambda d: d["services"]["nginx"].pop("labels"))
    result = runner.invoke(check_app, _timeouts(root))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].startswith("WARNING TMO008")
    assert result.output.splitlines()[-1] == "check timeouts: 0 error(s), 1 warning(s)"


def test_timeouts_needs_the_config_option() -> None:
    """--config is required: a usage error exits 2."""
    result = runner.invoke(check_app, ["timeouts"])
    assert result.exit_code == 2


def test_rollback_exits_0_on_a_checked_plan_and_1_on_a_broken_one() -> None:
    """The passing plan exits 0; the failing plan exits 1 listing its findings."""
    good = runner.invoke(
        check_app, ["rollback", str(FIXTURES / "rollback" / "good" / "rollback.yaml")]
    )
    assert good.exit_code == 0, good.output
    bad = runner.invoke(
        check_app, ["rollback", str(FIXTURES / "rollback" / "bad" / "rollback.yaml")]
    )
    assert bad.exit_code == 1
    assert "RBK005" in bad.output
    assert "no rollback step for config" in bad.output


def test_eval_go_exits_0_and_records_the_verdict(tmp_path: Path) -> None:
    """A provider that passes every case is go, exits 0, and its verdict is stored."""
    store = tmp_path / "verdicts.json"
    suite = str(FIXTURES / "eval" / "golden.jsonl")
    code, output = _eval("--suite", suite, "--target", "steady", "--store", str(store))
    assert code == 0, output
    assert "target steady: 5/5 passed (100.0%) -> go" in output
    assert json.loads(store.read_text())["verdicts"][0]["verdict"] == "go"


def test_eval_block_exits_1(tmp_path: Path) -> None:
    """A provider that fails the suite is block and exits 1, with a line per failed case."""
    store = str(tmp_path / "verdicts.json")
    suite = str(FIXTURES / "eval" / "golden.jsonl")
    code, output = _eval("--suite", suite, "--target", "wayward", "--store", store)
    assert code == 1
    assert "FAIL capital-json: the answer is not JSON" in output
    assert "-> block" in output


@pytest.mark.parametrize(("fail_on", "code"), [("block", 0), ("review", 1)])
def test_eval_review_exits_by_fail_on(fail_on: str, code: int) -> None:
    """4 of 5 is review: exit 0 by default, 1 with --fail-on review."""
    suite = str(FIXTURES / "eval" / "mixed.jsonl")
    got, output = _eval("--suite", suite, "--target", "steady", "--no-record", "--fail-on", fail_on)
    assert got == code, output
    assert "4/5 passed (80.0%) -> review" in output
    assert "recorded" not in output


def test_eval_thresholds_are_options() -> None:
    """--go-at 0.8 turns 4 of 5 into go."""
    suite = str(FIXTURES / "eval" / "mixed.jsonl")
    code, output = _eval("--suite", suite, "--target", "steady", "--no-record", "--go-at", "0.8")
    assert code == 0
    assert "-> go (go at >= 80%, block below 80%)" in output


def test_eval_records_into_sqlite(tmp_path: Path) -> None:
    """--store sqlite:///path puts the verdict in that SQLite file."""
    from tidegate.ops.eval import EvalVerdict, latest_verdicts

    url = f"sqlite:///{tmp_path}/state.db"
    suite = str(FIXTURES / "eval" / "golden.jsonl")
    code, output = _eval("--suite", suite, "--target", "broken", "--store", url)
    assert code == 1
    assert "the provider failed (overloaded)" in output
    assert latest_verdicts(url) == {"broken": EvalVerdict.BLOCK}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "nope"], "no provider 'nope'"),
        (["--target", "steady", "--go-at", "0.5"], "block_below (0.8) must not be above go_at"),
    ],
)
def test_eval_usage_problems_exit_2(args: list[str], message: str) -> None:
    """An unknown target or impossible thresholds exit 2 with the reason."""
    suite = str(FIXTURES / "eval" / "golden.jsonl")
    code, output = _eval("--suite", suite, "--no-record", *args)
    assert code == 2
    assert message in output


def test_eval_with_an_unreadable_suite_exits_2(tmp_path: Path) -> None:
    """A suite that does not exist is a usage problem, not a block."""
    code, output = _eval("--suite", str(tmp_path / "none.jsonl"), "--target", "steady")
    assert code == 2
    assert "cannot read the suite" in output
