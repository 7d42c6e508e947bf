"""``/admin/spend``: the spend ledger summed by key, user, tenant or model, as JSON or CSV.

=======  ==========================================================  ==============================
GET      /admin/spend?group_by=key|user|tenant|model&from=&to=        the spend by group, in range
GET      /admin/spend/rows?from=&to=&limit=                          the ledger's rows themselves
=======  ==========================================================  ==============================

``from`` and ``to`` are a UTC date (``2026-01-31``: its midnight), an ISO date and time (UTC
unless it names its offset) or Unix seconds; the range is ``[from, to)``. Without them the range
is today (UTC) so far. ``format=csv`` (or ``Accept: text/csv``) answers CSV instead of JSON.
The functions that read the query and render the answers are also ``tidegate spend``'s.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, cast
from urllib.parse import parse_qsl

from tidegate.errors import InvalidRequest, NotFound
from tidegate.gateway.http import Scope, Send, request_headers, send_bytes, send_json
from tidegate.state.ledger import COLUMNS, GROUPS, GroupBy, LedgerRow, LedgerStore, SpendGroup

__all__ = [
    "GROUP_COLUMNS",
    "groups_csv",
    "handle_spend",
    "is_spend_path",
    "parse_when",
    "report",
    "rows_csv",
    "spend_range",
]

#: The columns of a summary, in the JSON's and the CSV's order.
GROUP_COLUMNS = (
    "key",
    "requests",
    "calls",
    "prompt_tokens",
    "completion_tokens",
    "tokens",
    "cost_usd",
)
#: The most rows ``/admin/spend/rows`` answers with.
MAX_ROWS = 100_000


def is_spend_path(path: str) -> bool:
    return path.rstrip("/") in ("/admin/spend", "/admin/spend/rows")


def parse_when(text: str) -> float:
    """Unix seconds from a UTC date, an ISO date and time, or a number of seconds."""
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise InvalidRequest(f"not a time: {text!r}")
        return value
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(
            f"not a time: {text!r} (a date, an ISO date and time, or Unix seconds)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def spend_range(start: str | None, end: str | None, now: float) -> tuple[float, float]:
    """``[from, to)`` from the query's text; today (UTC) so far by default."""
    midnight = now - now % 86_400
    low = midnight if not start else parse_when(start)
    high = now + 1.0 if not end else parse_when(end)
    if high < low:
        raise InvalidRequest("'to' is before 'from'")
    return low, high


def _group_row(group: SpendGroup) -> list[Any]:
    return [
        group.key,
        group.requests,
        group.calls,
        group.prompt_tokens,
        group.completion_tokens,
        group.tokens,
        round(group.cost_usd, 8),
    ]


def report(groups: Sequence[SpendGroup], group_by: str, start: float, end: float) -> dict[str, Any]:
    """The JSON answer: the groups and their total."""
    total = SpendGroup(
        "total",
        sum(g.requests for g in groups),
        sum(g.calls for g in groups),
        sum(g.prompt_tokens for g in groups),
        sum(g.completion_tokens for g in groups),
        sum(g.cost_usd for g in groups),
    )
    return {
        "group_by": group_by,
        "from": start,
        "to": end,
        "groups": [dict(zip(GROUP_COLUMNS, _group_row(g), strict=True)) for g in groups],
        "total": dict(zip(GROUP_COLUMNS, _group_row(total), strict=True)),
    }


def _csv(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def groups_csv(groups: Sequence[SpendGroup], group_by: str) -> str:
    """The summary as CSV, its first column named by the grouping."""
    return _csv((group_by, *GROUP_COLUMNS[1:]), [_group_row(g) for g in groups])


def rows_csv(rows: Sequence[LedgerRow]) -> str:
    """The ledger's rows as CSV, with every column."""
    return _csv(COLUMNS, [list(r) for r in rows])


def _wants_csv(query: Mapping[str, str], headers: Mapping[str, str]) -> bool:
    wanted = query.get("format", "")
    if wanted and wanted not in ("csv", "json"):
        raise InvalidRequest("format must be csv or json")
    return wanted == "csv" or (not wanted and "text/csv" in headers.get("accept", ""))


def _query(scope: Scope) -> dict[str, str]:
    return dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))


async def handle_spend(ledger: LedgerStore, now: float, scope: Scope, send: Send) -> None:
    """Answer one ``/admin/spend`` request (the caller checked the admin key)."""
    if scope["method"] != "GET":
        raise NotFound(f"no admin route {scope['method']} {scope['path']}")
    query, headers = _query(scope), request_headers(scope)
    start, end = spend_range(query.get("from"), query.get("to"), now)
    as_csv = _wants_csv(query, headers)
    if scope["path"].rstrip("/").endswith("/rows"):
        try:
            limit = int(query.get("limit", "10000"))
        except ValueError:
            raise InvalidRequest("limit must be a whole number") from None
        rows = await ledger.rows(start, end, limit=max(1, min(limit, MAX_ROWS)))
        if as_csv:
            await send_bytes(send, 200, rows_csv(rows).encode(), content_type="text/csv")
            return
        await send_json(send, 200, {"from": start, "to": end, "rows": [r._asdict() for r in rows]})
        return
    group_by = query.get("group_by", "user")
    if group_by not in GROUPS:
        raise InvalidRequest(f"group_by must be one of {', '.join(GROUPS)}")
    groups = await ledger.summary(cast("GroupBy", group_by), start, end)
    if as_csv:
        await send_bytes(send, 200, groups_csv(groups, group_by).encode(), content_type="text/csv")
        return
    await send_json(send, 200, report(groups, group_by, start, end))
