"""schemathesis hooks for the OpenAPI tests (test_openapi.py): requests aimed at the route the
test gateway has. Imported by the tests, and named by ``SCHEMATHESIS_HOOKS`` for the CLI run.
"""

from __future__ import annotations

import zlib
from typing import Any

import schemathesis
from schemathesis import Case, HookContext

#: The one route of the test gateway.
ALIAS = "chat"
#: A deadline the in-process fake always meets. A shorter one is refused by admission (503
#: deadline_unmeetable) or runs out (504): documented answers, but 5xx, which the tests forbid.
LONG_DEADLINE_MS = 60_000


def aim(case: Case[Any]) -> None:
    """Give three generated model names in four the test gateway's alias, and make any deadline
    long enough to meet.

    Random model names are nearly all unknown (404), which would stop every request before its
    other fields and headers are checked and its answer's schema validated. Only a name the
    document accepts (a non-empty string) is replaced, so an invalid body stays invalid; which
    names are replaced depends on the name alone, so a run is repeatable.
    """
    body = case.body
    if isinstance(body, dict):
        model = body.get("model")
        if isinstance(model, str) and model and zlib.crc32(model.encode("utf-8", "replace")) % 4:
            body["model"] = ALIAS
    headers = case.headers
    deadline = headers.get("X-Tidegate-Deadline-Ms") if headers else None
    digits = isinstance(deadline, str) and deadline.isascii() and deadline.isdigit()
    if headers and digits and 0 < int(str(deadline)) < LONG_DEADLINE_MS:
        headers["X-Tidegate-Deadline-Ms"] = str(LONG_DEADLINE_MS)


@schemathesis.hook
def before_call(context: HookContext, case: Case[Any], kwargs: Any) -> None:
    """Aim every request, in every phase (schemathesis checks the edited case, not the drawn)."""
    aim(case)
