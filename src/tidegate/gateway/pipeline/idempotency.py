"""Step 6, idempotency: an ``Idempotency-Key`` claims the request in the shared durable store.

A completed request with the same key and body is replayed as it was answered; the same key
with another body is 422; a twin still running is waited for (up to ``idempotency.wait_s``),
then 409. Keys belong to the caller (its tenant and user). A store that does not answer fails
closed (503): running a non-idempotent request twice is what idempotency exists to prevent.
"""

from __future__ import annotations

import hashlib
from typing import Final

from tidegate.errors import IdempotencyConflict, IdempotencyMismatch, InvalidRequest, StoreError
from tidegate.gateway.http import send_bytes
from tidegate.gateway.pipeline.cache import canonical
from tidegate.gateway.pipeline.dialect import OPENAI
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.steps import Outcome
from tidegate.state.base import Claim, ClaimOutcome, StoredResponse

__all__ = ["IDEMPOTENCY_POLL_S", "claim"]

#: How often a request waiting on an in-progress idempotency key looks again.
IDEMPOTENCY_POLL_S: Final = 0.05
HEADER: Final = "idempotency-key"


def claim(request: Request) -> Outcome:
    """Claim the request's key (the settle step completes or abandons the claim), or replay
    the stored answer of the request that used it."""
    key = request.headers.get(HEADER)
    if key is None:
        return False
    if not key or len(key) > 255:
        raise InvalidRequest("Idempotency-Key must be 1 to 255 characters")
    return _claim_or_replay(request, key)


async def _claim_or_replay(request: Request, key: str) -> bool:
    # The same request in another API is another request: its answer is in another shape.
    dialect = b"" if request.dialect is OPENAI else request.dialect.name.encode() + b"\0"
    fingerprint = hashlib.sha256(dialect + canonical(request.body)).hexdigest()
    scoped = request.identity.idempotency_scope + key
    found = await _claim(request, scoped, fingerprint)
    if found.outcome is ClaimOutcome.CLAIMED:
        request.idempotency = (scoped, found.token)
        return False
    assert found.response is not None
    await _replay(request, found.response)
    return True


async def _claim(request: Request, scoped: str, fingerprint: str) -> Claim:
    """The claim, or the stored answer to replay; waits (bounded) for a running twin."""
    rt = request.rt
    # A claim outlives the request it guards by a margin; a replica that died while holding it
    # blocks the key no longer than that.
    lease_s = rt.config.server.request_timeout_s + rt.config.idempotency.lease_margin_s
    waited = 0.0
    while True:
        try:
            found = await rt.stores.idempotency.claim(scoped, fingerprint, lease_s=lease_s)
        except StoreError:
            rt.metrics.store_errors.labels("idempotency", "fail_closed").inc()
            raise
        if found.outcome is ClaimOutcome.MISMATCH:
            raise IdempotencyMismatch(
                "this Idempotency-Key was already used with a different request body"
            )
        if found.outcome is not ClaimOutcome.IN_PROGRESS:
            return found
        if waited >= min(rt.config.idempotency.wait_s, request.deadline.remaining()):
            raise IdempotencyConflict(
                "a request with this Idempotency-Key is still running", retry_after=1.0
            )
        await rt.sleep(IDEMPOTENCY_POLL_S)
        waited += IDEMPOTENCY_POLL_S


async def _replay(request: Request, replay: StoredResponse) -> None:
    ex = request.ex
    ex.cache = "idempotent-replay"
    ex.status = replay.status
    stored = dict(replay.headers)
    # send_bytes writes the Content-Type: kept in the stored headers it came twice.
    content_type = stored.pop("content-type", "application/json")
    await send_bytes(
        request.send,
        replay.status,
        replay.body,
        [*ex.answer_headers(), ("idempotent-replayed", "true"), *stored.items()],
        content_type=content_type,
    )
