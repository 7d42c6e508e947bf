"""The ``tidegate`` command: one entry point with sub-commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tidegate import __version__
from tidegate.errors import ConfigError

__all__ = ["app", "main"]

app = typer.Typer(
    name="tidegate",
    help="A gateway for services that call LLMs, and a lab that runs its policies in virtual time.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def serve(
    config: Annotated[Path, typer.Option("--config", "-c", help="The YAML config file.")],
    host: Annotated[str | None, typer.Option(help="Override server.host.")] = None,
    port: Annotated[int | None, typer.Option(help="Override server.port.")] = None,
    workers: Annotated[int | None, typer.Option(help="Override server.workers.")] = None,
) -> None:
    """Start the gateway (uvicorn with uvloop and httptools)."""
    from tidegate.gateway.server import run

    try:
        run(config, host=host, port=port, workers=workers)
    except ConfigError as exc:
        typer.echo(f"tidegate: refusing to start: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command("fake-upstream")
def fake_upstream(
    script: Annotated[Path, typer.Option("--script", "-s", help="The fake's YAML script.")],
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 9100,
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
) -> None:
    """Run a scriptable OpenAI-compatible upstream for tests and demos."""
    from tidegate.providers.fake_upstream import run_fake_upstream

    try:
        run_fake_upstream(host, port, script)
    except ConfigError as exc:
        typer.echo(f"tidegate: {exc}", err=True)
        raise typer.Exit(2) from None


def _mount() -> None:
    """Attach the sub-commands that live beside their code."""
    from tidegate.lab.cli import lab_app
    from tidegate.ops.admin_client import admin_app
    from tidegate.ops.cli import check_app, eval_command
    from tidegate.ops.keys_cli import keys_app
    from tidegate.ops.loadtest import loadtest_command
    from tidegate.ops.models import models_command
    from tidegate.ops.readiness import readiness_command
    from tidegate.ops.spend import spend_command

    app.add_typer(check_app, name="check", help="Offline checks: environments, timeouts, rollback.")
    app.add_typer(
        lab_app, name="lab", help="Virtual-time simulations that drive the real policies."
    )
    app.command("eval")(eval_command)
    app.command("loadtest")(loadtest_command)
    app.command("models")(models_command)
    app.command("readiness")(readiness_command)
    app.command("spend")(spend_command)
    app.add_typer(admin_app, name="admin", help="Talk to a running gateway's admin API.")
    app.add_typer(
        keys_app, name="keys", help="Virtual API keys: create, list, show, rotate, revoke."
    )


_mount()


@app.command("hash-key")
def hash_key_command(
    key: Annotated[str, typer.Argument(help="The API key to hash for a keys file.")],
) -> None:
    """Print the SHA-256 digest a keys file stores for KEY."""
    from tidegate.gateway.auth import hash_key

    typer.echo(hash_key(key))


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


def main() -> None:
    app(prog_name="tidegate")


if __name__ == "__main__":  # pragma: no cover
    main()
