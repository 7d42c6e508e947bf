"""``tidegate admin ...``: the operator's client for a running gateway's admin API.

Every command makes one or two HTTP requests to the gateway at ``--url`` (or
``TIDEGATE_ADMIN_URL``) with the admin key read from ``--key-file`` (or
``TIDEGATE_ADMIN_KEY_FILE``): a file holding the key itself, never the key on the command line,
where the shell history and the process list would keep it.

==========================================  ===================================================
``flags get [NAME]``                        every flag (or one): value, default, type
``flags set NAME VALUE --who --why``        change a flag; VALUE is a YAML scalar (``true``,
                                            ``3``, ``0.5``, ``v2``; quote ``'"3"'`` for a string)
``audit [--flag NAME] [--limit N]``         who changed what, when and why, newest first
``kill-switch on|off|degraded --who --why`` ``on`` refuses every model call (``unavailable``),
                                            ``off`` answers normally (``full``), ``degraded``
                                            answers without models
``breakers``                                each provider's circuit breaker
``queues``                                  admission: in flight, waiting and refused by class
``actions propose|get|approve|reject``      pending actions, decided exactly once
``rollout status [ROUTE]``                  each canary: state, share, schedule, its windows
``rollout start|pause|resume|abort ROUTE``  operate a canary (``--who``, ``--why``)
``rollout evaluate ROUTE --who --why``      let the gate judge the current windows now
==========================================  ===================================================

Output is a table, or the server's JSON with ``--json`` (before or after the command name).
Exit codes: ``0`` done; ``1`` the gateway refused (its HTTP status, error code and message are
printed); ``2`` a usage error, an unreadable key file, or a gateway that could not be reached.
The client uses only the standard library's HTTP client, so it runs inside the gateway's image.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final, NoReturn, TypeVar
from urllib.parse import quote, urlencode, urlsplit

import typer
import yaml
from rich.console import Console
from rich.table import Table

__all__ = [
    "ADMIN_KEY_FILE_ENV",
    "ADMIN_URL_ENV",
    "AdminClient",
    "AdminRefused",
    "AdminUnreachable",
    "KillSwitch",
    "RolloutAction",
    "admin_app",
    "ask",
    "connect",
    "fail",
    "parse_value",
    "read_admin_key",
]

T = TypeVar("T")

ADMIN_URL_ENV: Final = "TIDEGATE_ADMIN_URL"
ADMIN_KEY_FILE_ENV: Final = "TIDEGATE_ADMIN_KEY_FILE"

#: Exit codes: the gateway refused; the command could not be carried out at all.
REFUSED: Final = 1
USAGE: Final = 2


# --------------------------------------------------------------------------- the HTTP client


class AdminRefused(Exception):
    """The gateway answered with an error: its HTTP status, error code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class AdminUnreachable(Exception):
    """No usable answer: the connection failed, timed out, or the answer was not JSON."""


def _refusal(status: int, raw: bytes, reason: str) -> AdminRefused:
    """The error body ``{"error": {"code", "message"}}``, or the raw text of a foreign answer."""
    try:
        error = json.loads(raw).get("error")
        return AdminRefused(status, str(error["code"]), str(error["message"]))
    except (ValueError, AttributeError, KeyError, TypeError):
        text = raw.decode("utf-8", "replace").strip().splitlines()
        return AdminRefused(status, f"http_{status}", text[0][:200] if text else reason)


@dataclass(frozen=True, slots=True)
class AdminClient:
    """One gateway's admin API: ``url`` is its base URL, ``key`` the admin key."""

    url: str
    key: str
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"url must be http(s)://host[:port], got {self.url!r}")
        if not self.key:
            raise ValueError("key must not be empty")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    def call(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        query: Mapping[str, str] | None = None,
    ) -> Any:
        """Send one request and return its decoded JSON; raise on a refusal or no answer."""
        target = self.url.rstrip("/") + path + (f"?{urlencode(query)}" if query else "")
        headers = {"Authorization": f"Bearer {self.key}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(dict(body)).encode("utf-8")
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(target, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload: bytes = response.read()
        except urllib.error.HTTPError as exc:
            raise _refusal(exc.code, exc.read(), str(exc.reason)) from None
        except urllib.error.URLError as exc:
            raise AdminUnreachable(f"cannot reach {self.url}: {exc.reason}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise AdminUnreachable(f"cannot reach {self.url}: {exc}") from None
        try:
            return json.loads(payload) if payload else None
        except ValueError:
            raise AdminUnreachable(f"{method} {target}: the answer is not JSON") from None

    def flags(self) -> dict[str, Any]:
        """Every flag: ``{name: {value, default, type, description}}``."""
        found: dict[str, Any] = self.call("GET", "/admin/flags")
        return found

    def set_flag(self, name: str, value: Any, *, who: str, why: str) -> dict[str, Any]:
        """Change one flag; the answer is its audit record (``flag, old, new, who, why, at``)."""
        record: dict[str, Any] = self.call(
            "PUT",
            f"/admin/flags/{quote(name, safe='')}",
            body={"value": value, "who": who, "why": why},
        )
        return record

    def audit(self, *, flag: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        """The audit history, newest first."""
        query = {"limit": str(limit), **({"flag": flag} if flag else {})}
        records: list[dict[str, Any]] = self.call("GET", "/admin/audit", query=query)
        return records

    def kill_switch(self, mode: str, *, who: str, why: str) -> dict[str, Any]:
        """Set ``answer.mode`` (``full``, ``degraded`` or ``unavailable``)."""
        record: dict[str, Any] = self.call(
            "POST", "/admin/kill-switch", body={"mode": mode, "who": who, "why": why}
        )
        return record

    def breakers(self) -> dict[str, Any]:
        found: dict[str, Any] = self.call("GET", "/admin/breakers")
        return found

    def admission(self) -> dict[str, Any]:
        found: dict[str, Any] = self.call("GET", "/admin/admission")
        return found

    def propose(
        self, kind: str, payload: Mapping[str, Any], *, ttl_s: float, who: str
    ) -> dict[str, Any]:
        action: dict[str, Any] = self.call(
            "POST",
            "/v1/actions",
            body={"kind": kind, "payload": dict(payload), "ttl_s": ttl_s, "who": who},
        )
        return action

    def action(self, action_id: str) -> dict[str, Any]:
        found: dict[str, Any] = self.call("GET", f"/v1/actions/{quote(action_id, safe='')}")
        return found

    def decide(self, action_id: str, decision: str, *, who: str) -> dict[str, Any]:
        """``decision`` is ``approve`` or ``reject``; a second decision is refused (409)."""
        if decision not in ("approve", "reject"):
            raise ValueError(f"decision must be approve or reject, got {decision!r}")
        found: dict[str, Any] = self.call(
            "POST", f"/v1/actions/{quote(action_id, safe='')}/{decision}", body={"who": who}
        )
        return found

    def rollouts(self, route: str | None = None) -> Any:
        """Every canary's status by route, or one route's status."""
        if route is None:
            return self.call("GET", "/admin/rollouts")
        return self.call("GET", f"/admin/rollouts/{quote(route, safe='')}")

    def rollout(self, route: str, action: str, *, who: str, why: str) -> dict[str, Any]:
        """``start``, ``pause``, ``resume``, ``abort`` (the route's status back) or ``evaluate``
        (the gate's decision back)."""
        if action not in ("start", "pause", "resume", "abort", "evaluate"):
            raise ValueError(f"action must be start, pause, resume, abort or evaluate: {action!r}")
        found: dict[str, Any] = self.call(
            "POST",
            f"/admin/rollouts/{quote(route, safe='')}/{action}",
            body={"who": who, "why": why},
        )
        return found


def read_admin_key(path: Path) -> str:
    """The admin key in ``path`` (surrounding whitespace dropped); ``ValueError`` says why not."""
    try:
        key = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read the admin key file {path} ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"the admin key file {path} is not text") from None
    if not key:
        raise ValueError(f"the admin key file {path} is empty")
    if len(key.split()) != 1:
        raise ValueError(f"the admin key file {path} must hold one key and nothing else")
    return key


def parse_value(text: str) -> bool | int | float | str:
    """A flag value from the command line, read as a YAML scalar (``'"3"'`` is the string)."""
    try:
        value = yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        return text
    if isinstance(value, bool | int | float | str):
        return value
    raise ValueError(
        f"VALUE must be a string, a number or true/false, got {text!r} "
        "(quote it to send it as a string)"
    )


# --------------------------------------------------------------------------- the commands


class KillSwitch(StrEnum):
    """The kill switch as an operator says it; :data:`MODES` maps it to ``answer.mode``."""

    ON = "on"
    OFF = "off"
    DEGRADED = "degraded"


class RolloutAction(StrEnum):
    """What an operator can do to a canary rollout."""

    START = "start"
    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"


MODES: Final = {
    KillSwitch.ON: "unavailable",
    KillSwitch.OFF: "full",
    KillSwitch.DEGRADED: "degraded",
}


@dataclass(frozen=True, slots=True)
class _Settings:
    url: str | None
    key_file: Path | None
    json_output: bool
    timeout_s: float


_HELP = "Talk to a running gateway's admin API: flags, audit, kill switch, breakers, queues."

admin_app = typer.Typer(
    name="admin",
    help=_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
flags_app = typer.Typer(help="Read and change flags.", no_args_is_help=True)
actions_app = typer.Typer(help="Propose and decide pending actions.", no_args_is_help=True)
rollout_app = typer.Typer(help="Canary rollouts.", no_args_is_help=True)
admin_app.add_typer(flags_app, name="flags")
admin_app.add_typer(actions_app, name="actions")
admin_app.add_typer(rollout_app, name="rollout")

JsonOption = Annotated[bool, typer.Option("--json", help="Print the server's JSON.")]
WhoOption = Annotated[str, typer.Option("--who", help="Who makes the change (for the audit).")]
WhyOption = Annotated[str, typer.Option("--why", help="Why (for the audit).")]
UrlOption = Annotated[
    str | None,
    typer.Option("--url", envvar=ADMIN_URL_ENV, help="The gateway's base URL.", show_default=False),
]
KeyFileOption = Annotated[
    Path | None,
    typer.Option(
        "--key-file",
        envvar=ADMIN_KEY_FILE_ENV,
        help="A file holding the admin key.",
        show_default=False,
    ),
]
TimeoutOption = Annotated[float, typer.Option(help="Seconds to wait for the gateway.")]


def fail(command: str, message: str, code: int) -> NoReturn:
    """End ``tidegate COMMAND`` with ``message`` on standard error and the exit ``code``."""
    typer.echo(f"tidegate {command}: {message}", err=True)
    raise typer.Exit(code)


def connect(command: str, url: str | None, key_file: Path | None, timeout_s: float) -> AdminClient:
    """The client of the gateway at ``url`` with the admin key in ``key_file``; a missing URL or
    key file, or an unusable one, ends ``tidegate COMMAND`` as a usage error."""
    if not url:
        fail(command, f"give the gateway's URL: --url or {ADMIN_URL_ENV}", USAGE)
    if key_file is None:
        fail(command, f"give the admin key file: --key-file or {ADMIN_KEY_FILE_ENV}", USAGE)
    try:
        return AdminClient(url, read_admin_key(key_file), timeout_s)
    except ValueError as exc:
        fail(command, str(exc), USAGE)


def refused(command: str, exc: AdminRefused) -> NoReturn:
    """End ``tidegate COMMAND`` with the gateway's refusal."""
    fail(command, f"the gateway refused: HTTP {exc.status} {exc.code}: {exc.message}", REFUSED)


def ask(command: str, call: Callable[[], T]) -> T:
    """One admin API call; a refusal or an unreachable gateway ends ``tidegate COMMAND`` with
    its code."""
    try:
        return call()
    except AdminRefused as exc:
        refused(command, exc)
    except AdminUnreachable as exc:
        fail(command, str(exc), USAGE)


@admin_app.callback()
def _root(
    ctx: typer.Context,
    url: UrlOption = None,
    key_file: KeyFileOption = None,
    json_output: JsonOption = False,
    timeout: TimeoutOption = 10.0,
) -> None:
    ctx.obj = _Settings(url, key_file, json_output, timeout)


def _fail(message: str, code: int) -> NoReturn:
    fail("admin", message, code)


def _settings(ctx: typer.Context) -> _Settings:
    settings = ctx.find_object(_Settings)
    return settings if settings is not None else _Settings(None, None, False, 10.0)


def _client(ctx: typer.Context) -> AdminClient:
    settings = _settings(ctx)
    return connect("admin", settings.url, settings.key_file, settings.timeout_s)


def _ask(ctx: typer.Context, call: Callable[[AdminClient], T]) -> T:
    """One admin API call; a refusal or an unreachable gateway ends the command with its code."""
    client = _client(ctx)
    return ask("admin", lambda: call(client))


def _wants_json(ctx: typer.Context, flag: bool) -> bool:
    return flag or _settings(ctx).json_output


def _emit_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True))


def _console() -> Console:
    # Built per call so that it writes to the current stdout (a test runner swaps it).
    return Console(highlight=False, soft_wrap=False)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


def _when(at: Any) -> str:
    """A stored Unix time as UTC, to the second."""
    if not isinstance(at, int | float) or isinstance(at, bool):
        return _cell(at)
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for index, column in enumerate(columns):
        # The first column names the row: never cut it; the others fold rather than shorten.
        table.add_column(column, no_wrap=index == 0, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def _change_line(record: Mapping[str, Any]) -> str:
    return (
        f"{record.get('flag')}: {_cell(record.get('old'))} -> {_cell(record.get('new'))} "
        f"(by {record.get('who')}: {record.get('why')})"
    )


@flags_app.command("get")
def flags_get(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(help="One flag; all of them when left out.")] = None,
    json_output: JsonOption = False,
) -> None:
    """Show every flag (or one): its value, default, type and description."""
    flags = _ask(ctx, lambda client: client.flags())
    if name is not None:
        if name not in flags:
            _fail(f"no flag named {name!r} (flags: {', '.join(sorted(flags))})", REFUSED)
        flags = {name: flags[name]}
    if _wants_json(ctx, json_output):
        _emit_json(flags)
        return
    rows = [
        [
            flag,
            _cell(spec.get("value")),
            _cell(spec.get("default")),
            _cell(spec.get("type")),
            _cell(spec.get("description")),
        ]
        for flag, spec in sorted(flags.items())
    ]
    _console().print(_table(None, ["flag", "value", "default", "type", "description"], rows))


@flags_app.command("set")
def flags_set(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The flag to change.")],
    value: Annotated[str, typer.Argument(help="The new value, as a YAML scalar.")],
    who: WhoOption,
    why: WhyOption,
    json_output: JsonOption = False,
) -> None:
    """Change one flag; the change and its reason go to the audit history."""
    try:
        parsed = parse_value(value)
    except ValueError as exc:
        _fail(str(exc), USAGE)
    record = _ask(ctx, lambda client: client.set_flag(name, parsed, who=who, why=why))
    if _wants_json(ctx, json_output):
        _emit_json(record)
        return
    typer.echo(_change_line(record))


@admin_app.command("audit")
def audit(
    ctx: typer.Context,
    flag: Annotated[str | None, typer.Option(help="Only this flag's changes.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many records.")] = 20,
    json_output: JsonOption = False,
) -> None:
    """Show the audit history of flag changes, newest first."""
    records = _ask(ctx, lambda client: client.audit(flag=flag, limit=limit))
    if _wants_json(ctx, json_output):
        _emit_json(records)
        return
    rows = [
        [
            _when(r.get("at")),
            _cell(r.get("flag")),
            _cell(r.get("old")),
            _cell(r.get("new")),
            _cell(r.get("who")),
            _cell(r.get("why")),
        ]
        for r in records
    ]
    if not rows:
        typer.echo("no changes recorded" + (f" for {flag}" if flag else ""))
        return
    _console().print(_table(None, ["at (UTC)", "flag", "old", "new", "who", "why"], rows))


@admin_app.command("kill-switch")
def kill_switch(
    ctx: typer.Context,
    state: Annotated[
        KillSwitch,
        typer.Argument(
            help="on: refuse model calls; off: answer; degraded: answer without models."
        ),
    ],
    who: WhoOption,
    why: WhyOption,
    json_output: JsonOption = False,
) -> None:
    """Turn answering off (on), back on (off), or to degraded mode; every replica follows."""
    mode = MODES[state]
    record = _ask(ctx, lambda client: client.kill_switch(mode, who=who, why=why))
    if _wants_json(ctx, json_output):
        _emit_json(record)
        return
    typer.echo(f"kill switch {state.value}: {_change_line(record)}")


@admin_app.command("breakers")
def breakers(ctx: typer.Context, json_output: JsonOption = False) -> None:
    """Show each provider's circuit breaker."""
    found = _ask(ctx, lambda client: client.breakers())
    if _wants_json(ctx, json_output):
        _emit_json(found)
        return
    rows = [
        [
            name,
            _cell(b.get("state")),
            _cell(b.get("consecutive_failures")),
            f"{_cell(b.get('window_failures'))}/{_cell(b.get('window_calls'))}",
            f"{b['retry_after']:g}s" if isinstance(b.get("retry_after"), int | float) else "-",
        ]
        for name, b in sorted(found.items())
    ]
    columns = ["provider", "state", "failures in a row", "failed/calls (window)", "retry after"]
    _console().print(_table(None, columns, rows))


def _refused_by_class(refused: Any, klass: str) -> str:
    reasons = refused.get(klass) if isinstance(refused, Mapping) else None
    if not isinstance(reasons, Mapping) or not reasons:
        return "0"
    return ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))


@admin_app.command("queues")
def queues(ctx: typer.Context, json_output: JsonOption = False) -> None:
    """Show admission: requests in flight, waiting and refused, per priority class."""
    snap = _ask(ctx, lambda client: client.admission())
    if _wants_json(ctx, json_output):
        _emit_json(snap)
        return
    depth = snap.get("depth") or {}
    counters = ("admitted", "finished", "cancelled", "expired")
    rows = [
        [
            klass,
            _cell(waiting),
            *(_cell((snap.get(c) or {}).get(klass, 0)) for c in counters),
            _refused_by_class(snap.get("refused"), klass),
        ]
        for klass, waiting in depth.items()
    ]
    title = (
        f"in flight {_cell(snap.get('in_flight'))}, load {_fmt(snap.get('load'))}, "
        f"service rate {_fmt(snap.get('service_rate'))}/s"
    )
    _console().print(_table(title, ["class", "waiting", *counters, "refused"], rows))


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) and not isinstance(value, bool) else "-"


def _show_action(ctx: typer.Context, action: Mapping[str, Any], json_output: bool) -> None:
    if _wants_json(ctx, json_output):
        _emit_json(action)
        return
    rows = [
        ["id", _cell(action.get("id"))],
        ["kind", _cell(action.get("kind"))],
        ["status", _cell(action.get("status"))],
        ["payload", _cell(action.get("payload"))],
        ["proposed by", _cell(action.get("proposed_by"))],
        ["created", _when(action.get("created_at"))],
        ["expires", _when(action.get("expires_at"))],
        ["decided by", _cell(action.get("decided_by"))],
        ["decided", _when(action.get("decided_at"))],
    ]
    _console().print(_table(None, ["", "action"], rows))


@actions_app.command("propose")
def actions_propose(
    ctx: typer.Context,
    kind: Annotated[str, typer.Argument(help="What the action does, e.g. refund.")],
    who: WhoOption,
    payload: Annotated[str, typer.Option(help="The action's details, a JSON object.")] = "{}",
    ttl: Annotated[
        float, typer.Option(min=1, max=604800, help="Seconds it may be decided in.")
    ] = 3600.0,
    json_output: JsonOption = False,
) -> None:
    """Propose an action that a person must approve or reject, once."""
    try:
        details = json.loads(payload)
    except ValueError as exc:
        _fail(f"--payload is not JSON: {exc}", USAGE)
    if not isinstance(details, dict):
        _fail("--payload must be a JSON object", USAGE)
    action = _ask(ctx, lambda client: client.propose(kind, details, ttl_s=ttl, who=who))
    _show_action(ctx, action, json_output)


@actions_app.command("get")
def actions_get(
    ctx: typer.Context,
    action_id: Annotated[str, typer.Argument(metavar="ID", help="The action's id.")],
    json_output: JsonOption = False,
) -> None:
    """Show one action as it stands."""
    action = _ask(ctx, lambda client: client.action(action_id))
    _show_action(ctx, action, json_output)


def _decide(ctx: typer.Context, action_id: str, decision: str, who: str, json_output: bool) -> None:
    action = _ask(ctx, lambda client: client.decide(action_id, decision, who=who))
    _show_action(ctx, action, json_output)


@actions_app.command("approve")
def actions_approve(
    ctx: typer.Context,
    action_id: Annotated[str, typer.Argument(metavar="ID", help="The action's id.")],
    who: WhoOption,
    json_output: JsonOption = False,
) -> None:
    """Approve a pending action (refused if it was decided before or expired)."""
    _decide(ctx, action_id, "approve", who, json_output)


@actions_app.command("reject")
def actions_reject(
    ctx: typer.Context,
    action_id: Annotated[str, typer.Argument(metavar="ID", help="The action's id.")],
    who: WhoOption,
    json_output: JsonOption = False,
) -> None:
    """Reject a pending action (refused if it was decided before or expired)."""
    _decide(ctx, action_id, "reject", who, json_output)


def _generic_rows(data: Any) -> tuple[list[str], list[list[str]]] | None:
    """Columns and rows for a list of objects or an object of objects; ``None`` otherwise."""
    if isinstance(data, Mapping) and data and all(isinstance(v, Mapping) for v in data.values()):
        items = [{"name": name, **value} for name, value in data.items()]
    elif isinstance(data, list) and data and all(isinstance(v, Mapping) for v in data):
        items = list(data)
    else:
        return None
    columns: list[str] = []
    for item in items:
        columns += [str(k) for k in item if str(k) not in columns]
    rows = [[_cell(item.get(c)) for c in columns] for item in items]
    return columns, rows


def _share(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:.0%}"
    return _cell(value)


def _window(stats: Any) -> str:
    if not isinstance(stats, Mapping):
        return _cell(stats)
    text = f"{_cell(stats.get('requests'))} req, {_cell(stats.get('errors'))} err"
    p95 = stats.get("p95_latency")
    if isinstance(p95, int | float):
        text += f", p95 {p95:.2f}s"
    return text


def _rollout_rows(statuses: Mapping[str, Any]) -> list[list[str]] | None:
    """One row per canary, or ``None`` when the answer is not canary statuses."""
    rows = []
    for route, status in statuses.items():
        if not isinstance(status, Mapping) or "state" not in status:
            return None
        windows = status.get("windows") or {}
        schedule = status.get("schedule")
        steps = schedule if isinstance(schedule, list) else []
        rows.append(
            [
                str(route),
                _cell(status.get("state")),
                _share(status.get("share")),
                ", ".join(_share(step) for step in steps) or "-",
                _window(windows.get("candidate")),
                _window(windows.get("baseline")),
            ]
        )
    return rows


def _show_rollouts(ctx: typer.Context, data: Any, json_output: bool) -> None:
    if _wants_json(ctx, json_output):
        _emit_json(data)
        return
    if isinstance(data, Mapping) and not data:
        typer.echo("no canary rollouts configured")
        return
    rows = _rollout_rows(data) if isinstance(data, Mapping) else None
    if rows is not None:
        columns = ["route", "state", "share", "schedule", "candidate window", "baseline window"]
        _console().print(_table(None, columns, rows))
        return
    shaped = _generic_rows(data)
    if shaped is not None:
        _console().print(_table(None, *shaped))
    else:
        _emit_json(data)


@rollout_app.command("status")
def rollout_status(
    ctx: typer.Context,
    route: Annotated[
        str | None, typer.Argument(help="One route; all of them when left out.")
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Show the canary rollouts: state, share, schedule and the current windows."""
    client = _client(ctx)
    try:
        data = client.rollouts(route)
    except AdminRefused as exc:
        if exc.status == 404 and route is None:
            _fail(
                f"the gateway at {client.url} has no rollout status (HTTP 404 {exc.code}: "
                f"{exc.message}): it predates rollouts, or its admin API is off",
                REFUSED,
            )
        refused("admin", exc)
    except AdminUnreachable as exc:
        _fail(str(exc), USAGE)
    _show_rollouts(ctx, data if route is None else {route: data}, json_output)


def _operate(
    ctx: typer.Context, route: str, action: RolloutAction, who: str, why: str, json_output: bool
) -> None:
    status = _ask(ctx, lambda client: client.rollout(route, action.value, who=who, why=why))
    _show_rollouts(ctx, {route: status}, json_output)


def _rollout_command(action: RolloutAction, summary: str) -> None:
    """Register ``tidegate admin rollout ACTION ROUTE --who --why``."""

    def command(
        ctx: typer.Context,
        route: Annotated[str, typer.Argument(help="The canary's route.")],
        who: WhoOption,
        why: WhyOption,
        json_output: JsonOption = False,
    ) -> None:
        _operate(ctx, route, action, who, why, json_output)

    command.__doc__ = summary
    rollout_app.command(action.value)(command)


for _action, _summary in (
    (RolloutAction.START, "Start (or restart) a canary at its schedule's first share."),
    (RolloutAction.PAUSE, "Hold the canary at its share: the gate stops moving it."),
    (RolloutAction.RESUME, "Let the gate move a paused canary again."),
    (RolloutAction.ABORT, "Send all traffic back to the baseline and stop the canary."),
):
    _rollout_command(_action, _summary)


@rollout_app.command("evaluate")
def rollout_evaluate(
    ctx: typer.Context,
    route: Annotated[str, typer.Argument(help="The canary's route.")],
    who: WhoOption,
    why: WhyOption,
    json_output: JsonOption = False,
) -> None:
    """Let the gate judge the current windows now: proceed, hold or roll back."""
    decision = _ask(ctx, lambda client: client.rollout(route, "evaluate", who=who, why=why))
    if _wants_json(ctx, json_output):
        _emit_json(decision)
        return
    reasons = decision.get("reasons") or []
    typer.echo(
        f"{route}: {_cell(decision.get('verdict'))}; state {_cell(decision.get('state'))}, "
        f"share {_share(decision.get('share'))}"
    )
    for reason in reasons:
        typer.echo(f"  {reason}")
