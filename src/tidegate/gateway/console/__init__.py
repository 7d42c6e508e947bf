"""The operators' console, on the admin listener: one server-rendered page and a small script
that polls the admin JSON API (no build step, no dependency beyond the package itself).

=======  ========================  ================================================
GET      /console                  the page, or the sign-in form without an admin key
POST     /console/login            ``key=<admin key>`` (a form): sets the session cookie
POST     /console/logout           clears it
GET      /console/stats.json       what the page draws besides the admin API's answers
GET      /console/static/NAME      the script and the style sheet
=======  ========================  ================================================

The session cookie holds the admin key itself (``HttpOnly``, ``SameSite=Strict``): on the admin
listener a request with that cookie and no ``Authorization`` header is treated as if it sent
``Authorization: Bearer <key>``, so the page's script calls the admin API as any client does,
and every change it makes is audited under the operator's key id. A cross-site request never
carries the cookie, and the admin API's writes take JSON bodies only.
"""

from __future__ import annotations

import html
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote, unquote

from tidegate import __version__
from tidegate.errors import MethodNotAllowed, NotFound, TidegateError, Unauthenticated
from tidegate.gateway.canary import CONTROLLER, share_flag, state_flag
from tidegate.gateway.http import (
    Receive,
    Scope,
    Send,
    read_body,
    request_headers,
    send_bytes,
    send_error,
    send_json,
)
from tidegate.gateway.runtime import Runtime
from tidegate.policy.flags import ANSWER_MODE

__all__ = ["COOKIE", "handle_console", "with_cookie_key"]

#: The session cookie's name.
COOKIE = "tidegate_admin"
#: How often the page asks for fresh numbers, in milliseconds.
POLL_MS = 1000
_STATIC_TYPES = {
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
_PAGE_HEADERS = [
    ("cache-control", "no-store"),
    ("x-frame-options", "DENY"),
    ("x-content-type-options", "nosniff"),
    ("content-security-policy", "default-src 'self'; frame-ancestors 'none'; form-action 'self'"),
]
_static_cache: dict[str, bytes] = {}


def _cookie_key(headers: dict[str, str]) -> str | None:
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE and value:
            return unquote(value)
    return None


def with_cookie_key(scope: Scope) -> Scope:
    """``scope`` with ``Authorization: Bearer <key>`` from the session cookie, when it has the
    cookie and no Authorization header of its own."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    if any(name == b"authorization" for name, _ in headers):
        return scope
    key = _cookie_key(request_headers(scope))
    if key is None:
        return scope
    bearer = (b"authorization", b"Bearer " + key.encode("latin-1", "replace"))
    return {**scope, "headers": [*headers, bearer]}


def _operator(rt: Runtime, scope: Scope) -> str | None:
    """The admin key id of whoever sent this request, or None (no key, or not an admin's)."""
    assert rt.admin_keys is not None
    headers = request_headers(with_cookie_key(scope))
    try:
        return rt.admin_keys.identify(headers.get("authorization"))
    except Unauthenticated:
        return None


async def handle_console(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    """Route one console request; as the admin API, the console does not exist without
    ``auth.admin_keys_file``."""
    path: str = scope["path"].rstrip("/") or "/"
    method: str = scope["method"]
    try:
        if rt.admin_keys is None:
            raise NotFound(f"no route {path} (the console is off: no auth.admin_keys_file)")
        if path.startswith("/console/static/"):
            await _static(path.rpartition("/")[2], method, send)
        elif path == "/console/login":
            _only(method, "POST", path)
            await _login(rt, scope, receive, send)
        elif path == "/console/logout":
            _only(method, "POST", path)
            await _to_console(send, f"{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0")
        elif path in ("/console", "/console/stats.json"):
            _only(method, "GET", path)
            await _authorized(rt, scope, path, send)
        else:
            raise NotFound(f"no route {path} on the admin listener")
    except TidegateError as error:
        await send_error(send, error)


def _only(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise MethodNotAllowed(f"{method} is not allowed on {path}", allow=allowed)


async def _authorized(rt: Runtime, scope: Scope, path: str, send: Send) -> None:
    operator = _operator(rt, scope)
    if path == "/console/stats.json":
        if operator is None:
            raise Unauthenticated("the console needs an admin key")
        await send_json(send, 200, await stats(rt), [("cache-control", "no-store")])
    elif operator is None:
        await _html(send, 200, login_page(None))
    else:
        await _html(send, 200, console_page(rt, operator))


async def _login(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    headers = request_headers(scope)
    body = await read_body(receive, headers, 8192)
    key = (parse_qs(body.decode("utf-8", "replace")).get("key") or [""])[0].strip()
    assert rt.admin_keys is not None
    try:
        rt.admin_keys.identify(f"Bearer {key}")
    except Unauthenticated:
        await _html(send, 401, login_page("That is not an admin key."))
        return
    await _to_console(send, f"{COOKIE}={quote(key, safe='')}; HttpOnly; SameSite=Strict; Path=/")


async def _to_console(send: Send, cookie: str) -> None:
    await send_bytes(
        send,
        303,
        b"",
        [("location", "/console"), ("set-cookie", cookie)],
        content_type="text/plain",
    )


async def _html(send: Send, status: int, page: str) -> None:
    await send_bytes(
        send, status, page.encode("utf-8"), _PAGE_HEADERS, content_type="text/html; charset=utf-8"
    )


async def _static(name: str, method: str, send: Send) -> None:
    if name not in _STATIC_TYPES:
        raise NotFound(f"no console file {name!r}")
    _only(method, "GET", f"/console/static/{name}")
    body = _static_cache.get(name)
    if body is None:
        body = _static_cache[name] = (
            resources.files(__package__).joinpath("static", name).read_bytes()
        )
    headers = [("cache-control", "no-cache"), ("x-content-type-options", "nosniff")]
    await send_bytes(send, 200, body, headers, content_type=_STATIC_TYPES[name])


# --------------------------------------------------------------------------- data


async def stats(rt: Runtime) -> dict[str, Any]:
    """Counts the page turns into sparklines (it takes the differences between two polls),
    the answer mode, and each rollout's last decision by its gate (from the audit history)."""
    requests = errors = 0.0
    for labels, value in rt.metrics.requests.items():
        requests += value
        if labels[-1] != "ok":
            errors += value
    count, total = rt.metrics.latency.totals()
    return {
        "in_flight": rt.in_flight,
        "requests": requests,
        "errors": errors,
        "latency_count": count,
        "latency_sum": total,
        "answer_mode": rt.flags.get(ANSWER_MODE),
        "decisions": {alias: await _last_decision(rt, alias) for alias in sorted(rt.canaries)},
    }


async def _last_decision(rt: Runtime, alias: str) -> dict[str, Any] | None:
    """The newest change the rollout controller made to this route's rollout, if any."""
    flags = {share_flag(alias), state_flag(alias)}
    for record in await rt.stores.flags.history(None, limit=200):
        if record.flag in flags and record.who == CONTROLLER:
            return {"flag": record.flag, "new": record.new, "why": record.why, "at": record.at}
    return None


# --------------------------------------------------------------------------- pages

_HEAD = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title><link rel="stylesheet" href="/console/static/console.css"></head>
"""


def login_page(problem: str | None) -> str:
    note = f'<p class="problem" id="login-problem">{html.escape(problem)}</p>' if problem else ""
    return (
        _HEAD.format(title="tidegate console: sign in")
        + """<body class="login"><main><h1>tidegate console</h1>
<form method="post" action="/console/login">
<label>Admin key <input type="password" name="key" id="key" autocomplete="off" required></label>
<button type="submit" id="sign-in">Sign in</button></form>"""
        + note
        + "</main></body></html>\n"
    )


def console_page(rt: Runtime, operator: str) -> str:
    """The page: its frame, with what the config fixes (routes, providers, classes) drawn
    here and the live parts filled in by the script."""
    esc = html.escape
    routes = "".join(
        f"<li><b>{esc(alias)}</b>: {esc(', '.join(route.providers))}</li>"
        for alias, route in sorted(rt.config.models.items())
    )
    classes = " ".join(esc(c) for c in rt.config.admission.classes)
    panels = "\n".join(_PANELS)
    return (
        _HEAD.format(title="tidegate console")
        + f"""<body data-operator="{esc(operator)}" data-poll-ms="{POLL_MS}"
 data-classes="{classes}">
<header><h1>tidegate console</h1>
<span>version {esc(__version__)} at {esc(rt.git_sha)}</span>
<span>signed in as <b id="operator">{esc(operator)}</b></span>
<span id="updated">loading...</span>
<form method="post" action="/console/logout"><button type="submit">Sign out</button></form>
</header>
<main>
{panels}
<section id="routes-panel"><h2>Routes</h2><ul>{routes}</ul></section>
</main>
<script src="/console/static/console.js" defer></script>
</body></html>
"""
    )


_PANELS = (
    """<section id="kill-switch"><h2>Kill switch</h2>
<p>answer mode: <b id="answer-mode">?</b></p>
<div class="buttons">
<button type="button" id="mode-full" data-mode="full">full</button>
<button type="button" id="mode-degraded" data-mode="degraded">degraded</button>
<button type="button" id="mode-unavailable" data-mode="unavailable">unavailable</button>
</div>
<div id="confirm" hidden><p>Set the answer mode to <b id="confirm-mode"></b> on every replica?</p>
<label>why <input type="text" id="confirm-why" required></label>
<button type="button" id="confirm-yes">Confirm</button>
<button type="button" id="confirm-no">Cancel</button>
<p class="problem" id="confirm-problem"></p></div></section>""",
    """<section id="traffic"><h2>Traffic</h2>
<div class="spark"><span>in flight <b id="in-flight">?</b></span><svg id="spark-in-flight"></svg></div>
<div class="spark"><span>errors per poll <b id="errors">?</b></span><svg id="spark-errors"></svg></div>
<div class="spark"><span>mean latency <b id="latency">?</b></span><svg id="spark-latency"></svg></div>
</section>""",
    """<section id="breakers-panel"><h2>Breakers</h2><table id="breakers">
<thead><tr><th>provider</th><th>state</th><th>details</th></tr></thead><tbody></tbody></table>
</section>""",
    """<section id="admission-panel"><h2>Admission</h2><table id="admission">
<thead><tr><th>class</th><th>queue depth</th><th>refused</th></tr></thead><tbody></tbody></table>
<p>slots in use: <b id="slots">?</b></p></section>""",
    """<section id="rollouts-panel"><h2>Canaries</h2><table id="rollouts">
<thead><tr><th>route</th><th>state</th><th>share</th><th>gate's last decision</th></tr></thead>
<tbody></tbody></table></section>""",
    """<section id="flags-panel"><h2>Flags</h2><table id="flags">
<thead><tr><th>flag</th><th>value</th><th>default</th><th>description</th></tr></thead>
<tbody></tbody></table></section>""",
    """<section id="audit-panel"><h2>Audit history</h2><table id="audit">
<thead><tr><th>when</th><th>flag</th><th>old</th><th>new</th><th>who</th><th>why</th></tr>
</thead><tbody></tbody></table></section>""",
    """<section id="keys-panel" hidden><h2>Keys</h2><table id="keys">
<thead></thead><tbody></tbody></table></section>""",
    """<section id="spend-panel" hidden><h2>Spend by key</h2><table id="spend">
<thead></thead><tbody></tbody></table></section>""",
)
