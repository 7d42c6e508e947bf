"""``tidegate spend``: the spend ledger summed by key, user, tenant or model, or its rows.

It reads the ledger straight from the durable store (``--state-url``, the gateway's
``state.url``) or through a running gateway's admin API (``--url`` and ``--key-file``, or
``TIDEGATE_ADMIN_URL`` and ``TIDEGATE_ADMIN_KEY_FILE``). ``--from`` and ``--to`` take a UTC date,
an ISO date and time or Unix seconds (``[from, to)``; today so far by default). Output is a
table, ``--csv`` or ``--json``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.console import Console
from rich.table import Table

from tidegate.clock import SystemClock
from tidegate.errors import ConfigError, StoreError, TidegateError
from tidegate.gateway.spend_api import GROUP_COLUMNS, groups_csv, report, rows_csv, spend_range
from tidegate.ops.admin_client import ADMIN_KEY_FILE_ENV, ADMIN_URL_ENV, ask, connect
from tidegate.state.ledger import COLUMNS, GROUPS, GroupBy, LedgerRow, SpendGroup
from tidegate.state.url import store_from_url

__all__ = ["from_store", "spend_command"]


async def from_store(
    url: str, group_by: GroupBy, start: float, end: float, *, rows: bool = False
) -> dict[str, Any]:
    """What ``/admin/spend`` (or ``/admin/spend/rows``) would answer, read from the store."""
    async with await store_from_url(url, clock=SystemClock(), timeout_s=10.0) as stores:
        if rows:
            found = await stores.ledger.rows(start, end, limit=1_000_000)
            return {"from": start, "to": end, "rows": [r._asdict() for r in found]}
        groups = await stores.ledger.summary(group_by, start, end)
    return report(groups, group_by, start, end)


def _from_gateway(
    url: str, key_file: Path | None, query: dict[str, str], rows: bool
) -> dict[str, Any]:
    if key_file is None:
        raise typer.BadParameter(f"give the admin key file: --key-file or {ADMIN_KEY_FILE_ENV}")
    client = connect("spend", url, key_file, 10.0)
    path = "/admin/spend/rows" if rows else "/admin/spend"
    return cast("dict[str, Any]", ask("spend", lambda: client.call("GET", path, query=query)))


def _print(data: dict[str, Any], *, rows: bool, as_csv: bool, group_by: str) -> None:
    if rows:
        found = [LedgerRow(**r) for r in data["rows"]]
        if as_csv:
            typer.echo(rows_csv(found), nl=False)
            return
        table = Table(*COLUMNS, title="spend ledger rows", title_justify="left")
        for r in found:
            table.add_row(*(str(v) for v in r))
    else:
        groups = data["groups"]
        header = (group_by, *GROUP_COLUMNS[1:])
        if as_csv:
            typer.echo(groups_csv([_group(g) for g in groups], group_by), nl=False)
            return
        table = Table(*header, title=f"spend by {group_by}", title_justify="left")
        for g in [*groups, data["total"]]:
            table.add_row(*(_text(g[c]) for c in GROUP_COLUMNS))
    Console(highlight=False, soft_wrap=False).print(table)


def _group(data: dict[str, Any]) -> SpendGroup:
    fields = ("key", "requests", "calls", "prompt_tokens", "completion_tokens", "cost_usd")
    return SpendGroup(*(data[f] for f in fields))


def _text(value: Any) -> str:
    return f"{value:.6f}" if isinstance(value, float) else str(value)


def spend_command(
    group_by: Annotated[
        str, typer.Option("--group-by", "-g", help="key, user, tenant or model.")
    ] = "user",
    start: Annotated[
        str | None, typer.Option("--from", help="Start (UTC date, ISO time, Unix s).")
    ] = None,
    end: Annotated[str | None, typer.Option("--to", help="End, left out of the range.")] = None,
    state_url: Annotated[
        str | None, typer.Option("--state-url", help="Read the durable store at this URL.")
    ] = None,
    url: Annotated[
        str | None, typer.Option("--url", envvar=ADMIN_URL_ENV, help="Or a gateway's base URL.")
    ] = None,
    key_file: Annotated[
        Path | None,
        typer.Option("--key-file", envvar=ADMIN_KEY_FILE_ENV, help="Its admin key's file."),
    ] = None,
    rows: Annotated[bool, typer.Option("--rows", help="The rows, not their sums.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="CSV instead of a table.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
) -> None:
    """The spend ledger: who spent what, by key, user, tenant or model (or its rows)."""
    if group_by not in GROUPS:
        typer.echo(f"tidegate spend: --group-by must be one of {', '.join(GROUPS)}", err=True)
        raise typer.Exit(2)
    try:
        low, high = spend_range(start, end, SystemClock().wall())
        if state_url:
            data = asyncio.run(
                from_store(state_url, cast("GroupBy", group_by), low, high, rows=rows)
            )
        elif url:
            query = {"from": repr(low), "to": repr(high), "group_by": group_by}
            data = _from_gateway(url, key_file, query, rows)
        else:
            typer.echo(f"tidegate spend: give --state-url, or --url ({ADMIN_URL_ENV})", err=True)
            raise typer.Exit(2)
    except (TidegateError, ConfigError, StoreError, ValueError) as exc:
        typer.echo(f"tidegate spend: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    _print(data, rows=rows, as_csv=as_csv, group_by=group_by)
