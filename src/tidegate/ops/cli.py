"""The offline checks on the command line: ``tidegate check ...`` and ``tidegate eval``.

``check_app`` holds ``envs``, ``drift``, ``timeouts`` and ``rollback``; :func:`eval_command` is
the ``eval`` command on its own. Each check prints one line per finding and a summary, and exits
0 when no finding is an error, 1 when one is. ``eval`` exits 1 when the verdict is at or below
``--fail-on`` (``block`` by default) and 2 when the suite or the config cannot be read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from tidegate.errors import ConfigError, StoreError
from tidegate.gateway.config import load_config
from tidegate.ops.envs import check_envs, discover, drift
from tidegate.ops.eval import (
    EvalThresholds,
    EvalVerdict,
    default_verdict_store,
    evaluate,
    load_suite,
    record_verdict,
)
from tidegate.ops.findings import Finding, Severity, count_by_severity, format_finding, has_errors
from tidegate.ops.rollback import check_rollback
from tidegate.ops.timeouts import check_timeouts

__all__ = ["FailOn", "check_app", "eval_command"]

check_app = typer.Typer(
    name="check",
    help="Offline checks of environments, the timeout chain and the rollback plan.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _report(name: str, findings: Sequence[Finding], clean: str) -> None:
    """Print the findings and a summary; exit 1 if any is an error."""
    for finding in findings:
        typer.echo(format_finding(finding))
    counts = count_by_severity(findings)
    if not findings:
        typer.echo(f"check {name}: ok, {clean}")
    else:
        errors, warnings = counts[Severity.ERROR], counts[Severity.WARNING]
        typer.echo(f"check {name}: {errors} error(s), {warnings} warning(s)")
    if has_errors(findings):
        raise typer.Exit(1)


@check_app.command("envs")
def envs_command(
    directory: Annotated[Path, typer.Argument(help="A folder with one subfolder per environment.")],
) -> None:
    """Apply the environment rules (ENV001...) to every environment under DIRECTORY."""
    findings = check_envs(directory)
    names = ", ".join(p.name for p in discover(directory))
    _report("envs", findings, f"{names} pass every rule")


@check_app.command("drift")
def drift_command(
    a: Annotated[Path, typer.Argument(help="One environment's folder.")],
    b: Annotated[Path, typer.Argument(help="The other environment's folder.")],
) -> None:
    """List the settings that differ between two environments (secrets masked)."""
    differences, findings = drift(a, b)
    for finding in findings:
        typer.echo(format_finding(finding))
    if not differences:
        typer.echo(f"{a.name} and {b.name} have the same settings")
    else:
        width = max(len(d.key) for d in differences)
        left = max(len(a.name), *(len(d.a) for d in differences))
        typer.echo(f"{'setting':<{width}}  {a.name:<{left}}  {b.name}")
        for d in differences:
            typer.echo(f"{d.key:<{width}}  {d.a:<{left}}  {d.b}")
        typer.echo(f"{len(differences)} setting(s) differ")
    if has_errors(findings):
        raise typer.Exit(1)


@check_app.command("timeouts")
def timeouts_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="The gateway's YAML config.")],
    compose: Annotated[
        Path | None, typer.Option("--compose", help="A docker-compose file.")
    ] = None,
    kubernetes: Annotated[
        Path | None, typer.Option("--kubernetes", help="A folder of Kubernetes manifests.")
    ] = None,
) -> None:
    """Check that each timeout gives up before the layer above, and drain < grace period."""
    findings = check_timeouts(config, compose=compose, kubernetes=kubernetes)
    _report("timeouts", findings, "each layer gives up before the one above")


@check_app.command("rollback")
def rollback_command(
    plan: Annotated[Path, typer.Argument(help="The rollback plan (rollback.yaml).")],
) -> None:
    """Check the rollback plan: exact versions, flag steps, every unit kind, verify tests."""
    findings = check_rollback(plan)
    _report("rollback", findings, "every unit has an exact previous version and a check")


class FailOn(StrEnum):
    """The verdict from which ``tidegate eval`` exits 1."""

    REVIEW = "review"
    BLOCK = "block"


def eval_command(
    suite: Annotated[Path, typer.Option("--suite", help="The golden suite (JSON Lines).")],
    target: Annotated[
        str, typer.Option("--target", help="A provider name, or ALIAS@baseline | ALIAS@candidate.")
    ],
    config: Annotated[Path, typer.Option("--config", "-c", help="The gateway's YAML config.")],
    go_at: Annotated[float, typer.Option(help="A pass rate at or above this is go.")] = 0.95,
    block_below: Annotated[float, typer.Option(help="A pass rate below this is block.")] = 0.8,
    timeout: Annotated[float, typer.Option(help="Seconds allowed per case.")] = 30.0,
    store: Annotated[
        str | None,
        typer.Option(help="Where verdicts go: sqlite:///path or a JSON file (default: state)."),
    ] = None,
    record: Annotated[bool, typer.Option(help="Store the verdict.")] = True,
    fail_on: Annotated[FailOn, typer.Option(help="Exit 1 from this verdict.")] = FailOn.BLOCK,
) -> None:
    """Run a golden suite against one provider and say go, review or block."""
    try:
        thresholds = EvalThresholds(go_at=go_at, block_below=block_below)
    except ValueError as exc:
        typer.echo(f"tidegate eval: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        cfg = load_config(config)
        cases = load_suite(suite)
        report = asyncio.run(
            evaluate(cfg, config, target, cases, timeout_s=timeout, thresholds=thresholds)
        )
    except ConfigError as exc:
        typer.echo(f"tidegate eval: {exc.message}", err=True)
        raise typer.Exit(2) from None
    for result in report.results:
        if result.passed:
            typer.echo(f"PASS {result.case_id}")
        else:
            typer.echo(f"FAIL {result.case_id}: {'; '.join(result.reasons)}")
    verdict = report.verdict
    typer.echo(
        f"target {target}: {report.passed}/{report.total} passed ({report.pass_rate:.1%}) -> "
        f"{verdict.value} (go at >= {go_at:.0%}, block below {block_below:.0%})"
    )
    if record:
        where = store or default_verdict_store(cfg, config)
        try:
            record_verdict(where, target, verdict, report.details())
        except (ConfigError, StoreError) as exc:
            typer.echo(f"tidegate eval: cannot record the verdict: {exc.message}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"verdict recorded in {where}")
    failing = {
        FailOn.BLOCK: {EvalVerdict.BLOCK},
        FailOn.REVIEW: {EvalVerdict.BLOCK, EvalVerdict.REVIEW},
    }
    if verdict in failing[fail_on]:
        raise typer.Exit(1)
