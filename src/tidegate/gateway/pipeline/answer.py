"""How a request is answered: a JSON body, an error with its one status, server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import structlog

from tidegate.errors import StoreError
from tidegate.gateway.http import send_bytes, send_raw
from tidegate.gateway.pipeline.dialect import OPENAI, render_error
from tidegate.gateway.pipeline.request import Request
from tidegate.state.base import StoredResponse

__all__ = ["answer_error", "answer_json", "close", "complete_idempotency", "sse"]

log = structlog.get_logger("tidegate")


def sse(data: bytes) -> bytes:
    """One server-sent event carrying ``data``."""
    return b"data: " + data + b"\n\n"


async def close(items: AsyncIterator[Any]) -> None:
    """Close a provider stream left early (it gives its connection back at once)."""
    closer = getattr(items, "aclose", None)
    if closer is not None:
        await closer()


async def answer_json(request: Request, payload: bytes) -> None:
    """Answer 200 with ``payload``: a billable answer, kept for its idempotency key first."""
    ex = request.ex
    headers = ex.raw_answer_headers()
    if request.dialect is not OPENAI:  # another API's answer, from the chat.completion
        payload = request.dialect.payload(payload)
    if request.idempotency is not None:  # what the key replays
        request.stored = StoredResponse(200, payload, {"content-type": "application/json"})
    request.served = True
    ex.status = 200
    # Recorded before it is sent: a replica that dies between the two then leaves a key that
    # replays this answer, not one stuck "in progress" whose answer the caller already holds.
    if request.stored is not None:
        await complete_idempotency(request)
    await send_raw(request.send, 200, payload, headers)


async def complete_idempotency(request: Request) -> None:
    """Store the answer under the request's idempotency key now, if it has one. On a store
    error the key stays owed, and the settlement tries again (or abandons it)."""
    if request.idempotency is None or request.stored is None:
        return
    rt = request.rt
    key, token = request.idempotency
    try:
        await rt.stores.idempotency.complete(
            key, token, request.stored, ttl_s=rt.config.idempotency.ttl_s
        )
    except StoreError as exc:
        log.warning(
            "idempotency_complete_deferred", request_id=request.ex.request_id, error=str(exc)
        )
        return
    request.idempotency = None


async def answer_error(request: Request, error: Exception) -> None:
    """Answer ``error`` with its one status and body; a stream whose headers are gone ends with
    it as an in-band error event instead (the only honest signal left)."""
    ex = request.ex
    status, body, extra, ex.outcome = render_error(request.dialect, error)
    ex.status = status
    if status == 500:  # not an error tidegate raised on purpose: a bug worth its traceback
        log.exception("internal_error", request_id=ex.request_id)
    if ex.first_token_s is not None:
        event = sse(orjson.dumps(body))
        if request.dialect.stream is not None:  # another API's error event
            event = b"event: error\n" + event
        await request.send({"type": "http.response.body", "body": event, "more_body": False})
        return
    await send_bytes(
        request.send, status, orjson.dumps(body), [*ex.answer_headers(), *extra.items()]
    )
