"""``tidegate keys ...``: virtual API keys, through a running gateway's ``/admin/keys``.

Like ``tidegate admin``, every command talks to the gateway at ``--url`` (or
``TIDEGATE_ADMIN_URL``) with the admin key read from ``--key-file`` (or
``TIDEGATE_ADMIN_KEY_FILE``); the admin key's name is who the audit records.

==============================================  ===============================================
``create --tenant T --user U [options]``        a new key: printed once, stored as a digest
``list``                                        every key: the store's and the keys file's
``show ID [--audit]``                           one key (and its changes: who, when, what)
``rotate ID [--grace-s N]``                     a new secret; the old one works N seconds more
``revoke ID [--why]``                           refused (401 ``key_revoked``) on every replica
==============================================  ===============================================

``create`` takes ``--id``, ``--class`` (the admission class), ``--data-class``, ``--model``
(repeat it; ``*`` for all), ``--rate-per-s`` with ``--burst`` (the key's own rate limit),
``--budget-calls``, ``--budget-tokens``, ``--budget-cost-usd`` (its own daily budget),
``--expires-in-s``, ``--meta key=value`` (repeat it) and ``--why``. Exit codes as ``tidegate
admin``'s: 0 done, 1 the gateway refused, 2 a usage error or an unreachable gateway.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, NoReturn
from urllib.parse import quote

import typer

from tidegate.ops.admin_client import (
    USAGE,
    JsonOption,
    KeyFileOption,
    TimeoutOption,
    UrlOption,
    WhyOption,
    ask,
    connect,
    fail,
)

__all__ = ["keys_app"]

keys_app = typer.Typer(
    name="keys",
    help="Virtual API keys in the durable store: create, list, show, rotate, revoke.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@keys_app.callback()
def _root(
    ctx: typer.Context,
    url: UrlOption = None,
    key_file: KeyFileOption = None,
    timeout: TimeoutOption = 10.0,
) -> None:
    ctx.obj = (url, key_file, timeout)


def _fail(message: str) -> NoReturn:
    fail("keys", message, USAGE)


def _call(ctx: typer.Context, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    url, key_file, timeout = ctx.obj or (None, None, 10.0)
    client = connect("keys", url, key_file, timeout)
    return ask("keys", lambda: client.call(method, "/admin/keys" + path, body=body))


def _emit(data: Any, as_json: bool, summary: str) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        typer.echo(summary)


def _line(key: dict[str, Any]) -> str:
    models = ",".join(key.get("models") or ())
    extra = []
    if key.get("rate_limit"):
        extra.append(
            f"rate {key['rate_limit']['rate_per_s']:g}/s burst {key['rate_limit']['burst']:g}"
        )
    if key.get("budget"):
        extra.append("budget " + ",".join(f"{k}={v:g}" for k, v in sorted(key["budget"].items())))
    if key.get("expires_at") is not None:
        extra.append(f"expires {key['expires_at']:.0f}")
    tail = f" ({'; '.join(extra)})" if extra else ""
    return (
        f"{key['id']}  {key.get('state', '-')}  {key.get('source', 'store')}  "
        f"{key['tenant']}/{key['user']}  class={key.get('priority')}  models={models}{tail}"
    )


def _meta(pairs: list[str]) -> dict[str, str]:
    found = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            _fail(f"--meta takes key=value, got {pair!r}")
        found[name] = value
    return found


@keys_app.command("create")
def create(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Option(help="The key's tenant.")],
    user: Annotated[str, typer.Option(help="The key's user.")],
    key_id: Annotated[str | None, typer.Option("--id", help="A name (default: random).")] = None,
    klass: Annotated[str | None, typer.Option("--class", help="The admission class.")] = None,
    data_class: Annotated[str | None, typer.Option(help="What providers may see.")] = None,
    model: Annotated[list[str] | None, typer.Option(help="An allowed model; repeat.")] = None,
    rate_per_s: Annotated[float | None, typer.Option(help="Its own rate limit.")] = None,
    burst: Annotated[float | None, typer.Option(help="Its own burst (with --rate-per-s).")] = None,
    budget_calls: Annotated[int | None, typer.Option(help="Calls per UTC day.")] = None,
    budget_tokens: Annotated[int | None, typer.Option(help="Tokens per UTC day.")] = None,
    budget_cost_usd: Annotated[float | None, typer.Option(help="Cost per UTC day.")] = None,
    expires_in_s: Annotated[float | None, typer.Option(help="Seconds until it expires.")] = None,
    meta: Annotated[list[str] | None, typer.Option(help="key=value metadata; repeat.")] = None,
    why: WhyOption = "",
    json_output: JsonOption = False,
) -> None:
    """Create a key; it is printed once (the store keeps only its digest)."""
    body: dict[str, Any] = {"tenant": tenant, "user": user, "why": why}
    optional = {"id": key_id, "priority": klass, "data_class": data_class}
    body.update({k: v for k, v in optional.items() if v is not None})
    if model:
        body["models"] = model
    if (rate_per_s is None) != (burst is None):
        _fail("--rate-per-s and --burst go together")
    if rate_per_s is not None:
        body["rate_limit"] = {"rate_per_s": rate_per_s, "burst": burst}
    budget = {"calls": budget_calls, "tokens": budget_tokens, "cost_usd": budget_cost_usd}
    if any(v is not None for v in budget.values()):
        body["budget"] = {k: v for k, v in budget.items() if v is not None}
    if expires_in_s is not None:
        body["expires_in_s"] = expires_in_s
    if meta:
        body["metadata"] = _meta(meta)
    made = _call(ctx, "POST", "", body)
    summary = f"{_line(made)}\nkey (shown once, store it now): {made['key']}"
    _emit(made, json_output, summary)


@keys_app.command("list")
def list_keys(ctx: typer.Context, json_output: JsonOption = False) -> None:
    """List every key, the keys file's and the store's, with its state."""
    found = _call(ctx, "GET", "")["keys"]
    _emit(found, json_output, "\n".join(_line(k) for k in found) or "no keys")


@keys_app.command("show")
def show(
    ctx: typer.Context,
    key_id: Annotated[str, typer.Argument(help="The key's id.")],
    audit: Annotated[bool, typer.Option(help="Also its changes, newest first.")] = False,
    json_output: JsonOption = False,
) -> None:
    """Show one key of the store (and, with --audit, who changed what when)."""
    found = _call(ctx, "GET", f"/{quote(key_id, safe='')}")
    lines = [_line(found)]
    if audit:
        changes = _call(ctx, "GET", f"/{quote(key_id, safe='')}/audit")
        found = {**found, "audit": changes}
        lines += [
            f"  {c['at']:.3f} {c['action']} by {c['who']}: {c['why'] or '-'} "
            f"{json.dumps(c['detail'], sort_keys=True)}"
            for c in changes
        ]
    _emit(found, json_output, "\n".join(lines))


@keys_app.command("rotate")
def rotate(
    ctx: typer.Context,
    key_id: Annotated[str, typer.Argument(help="The key's id.")],
    grace_s: Annotated[float, typer.Option(help="Seconds the old secret keeps working.")] = 0.0,
    why: WhyOption = "",
    json_output: JsonOption = False,
) -> None:
    """Give a key a new secret (printed once); the old one lapses after --grace-s."""
    made = _call(ctx, "POST", f"/{quote(key_id, safe='')}/rotate", {"grace_s": grace_s, "why": why})
    _emit(made, json_output, f"{_line(made)}\nnew key (shown once, store it now): {made['key']}")


@keys_app.command("revoke")
def revoke(
    ctx: typer.Context,
    key_id: Annotated[str, typer.Argument(help="The key's id.")],
    why: WhyOption = "",
    json_output: JsonOption = False,
) -> None:
    """Revoke a key: every replica refuses it (401 key_revoked) within a second."""
    done = _call(ctx, "POST", f"/{quote(key_id, safe='')}/revoke", {"why": why})
    _emit(done, json_output, _line(done))
