"""Step 11, degrade: when no model can answer and nothing was sent yet, answer from what the
gateway has (a stale cached answer, else cited excerpts of the document corpus), clearly
labelled; otherwise the call's honest error, with its ``retryable`` flag.

The kill switch's ``degraded`` mode answers the same way, before anything is spent (the flags
step calls :func:`answer_degraded` directly).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import structlog

from tidegate.errors import StoreError
from tidegate.gateway.degraded import Excerpt, degraded_answer, degraded_chunks, question_of
from tidegate.gateway.http import send_bytes, start_stream
from tidegate.gateway.pipeline.answer import sse
from tidegate.gateway.pipeline.cache import cache_key
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.steps import Outcome
from tidegate.gateway.pipeline.version import select_version

__all__ = ["answer_degraded", "completion_chunks", "degrade"]

log = structlog.get_logger("tidegate")


def degrade(request: Request) -> Outcome:
    """After a call that failed with a degradable error: a degraded answer, or the error."""
    if request.failure is None:
        return False
    return _degrade(request, request.failure)


async def _degrade(request: Request, failure: Exception) -> bool:
    if await answer_degraded(request, failure):
        return True
    raise failure


async def answer_degraded(request: Request, cause: Exception) -> bool:
    """Answer without a model: a stale cached answer, else cited excerpts; False if neither."""
    if "messages" not in request.body:
        return False  # only a chat completion has an answer to stand in for
    if request.canary is None:
        select_version(request)  # the kill switch acts before the version step
    rt, ex = request.rt, request.ex
    answer = await _cached(request)
    source = "stale_cache"
    hits: list[Excerpt] = []
    question = question_of(request.body)
    if answer is None:
        config = rt.config.degraded
        if rt.corpus is not None:
            hits = rt.corpus.search(
                question, limit_per_doc=config.limit_per_doc, limit=config.limit
            )
        if not hits:
            return False
        source = "corpus"
    rt.metrics.degraded.labels(source).inc()
    log.warning("degraded_answer", request_id=ex.request_id, source=source, cause=str(cause))
    ex.outcome, ex.status, ex.served_by = f"degraded_{source}", 200, "degraded"
    ex.cache = "stale" if source == "stale_cache" else ""
    request.served = False  # nothing billable was produced: the reservation is refunded
    request.stored = None  # and an idempotent retry may still get a real answer
    if answer is None:
        await _send_excerpts(request, question, hits)
    else:
        await _send(request, answer, completion_chunks)
    return True


async def _cached(request: Request) -> dict[str, Any] | None:
    """The cached answer to this very request, fresh or stale, marked degraded; or None."""
    rt = request.rt
    if not (rt.config.degraded.stale_cache and rt.config.cache.enabled):
        return None
    key = cache_key(request.identity, f"{request.alias}@{request.ex.version}", request.body)
    try:
        entry = await rt.stores.cache.get(key, allow_stale=True)
    except StoreError:
        rt.metrics.store_errors.labels("cache", "fail_open").inc()
        return None
    if entry is None:
        return None
    answer: dict[str, Any] = orjson.loads(entry.value)
    answer["tidegate"] = {"degraded": True, "source": "stale_cache", "stored_at": entry.stored_at}
    return answer


async def _send_excerpts(request: Request, question: str, hits: list[Excerpt]) -> None:
    rt, ex = request.rt, request.ex
    shown: dict[str, Any] = {
        "model_alias": request.alias,
        "output_filter": rt.output_filter,
        "id": f"chatcmpl-{ex.request_id}",
        "created": int(rt.clock.wall()),
    }
    if not request.stream:
        await _send(request, degraded_answer(question, hits, **shown), completion_chunks)
        return

    def excerpt_chunks(_: Mapping[str, Any], *, include_usage: bool) -> list[dict[str, Any]]:
        return degraded_chunks(question, hits, **shown, include_usage=include_usage)

    await _send(request, {}, excerpt_chunks)


async def _send(request: Request, answer: dict[str, Any], chunks_of: Any) -> None:
    """The degraded answer as JSON, or (a streaming request) as its chunks and ``[DONE]``."""
    ex = request.ex
    headers = [*ex.answer_headers(), ("x-tidegate-degraded", "true")]
    if not request.stream:
        payload = request.dialect.payload(orjson.dumps(answer))
        await send_bytes(request.send, 200, payload, headers)
        return
    want_usage = bool((request.body.get("stream_options") or {}).get("include_usage"))
    chunks = chunks_of(answer, include_usage=want_usage)
    await start_stream(request.send, headers)
    if request.dialect.stream is not None:  # another API's events
        shape = request.dialect.stream()
        payload = b"".join(shape.chunk(chunk) for chunk in chunks) + shape.end(None)
    else:
        payload = b"".join(sse(orjson.dumps(chunk)) for chunk in chunks) + sse(b"[DONE]")
    await request.send({"type": "http.response.body", "body": payload, "more_body": False})


def completion_chunks(answer: Mapping[str, Any], *, include_usage: bool) -> list[dict[str, Any]]:
    """A stored ``chat.completion`` replayed as ``chat.completion.chunk`` dicts."""
    base = {
        "id": answer.get("id"),
        "object": "chat.completion.chunk",
        "created": answer.get("created"),
        "model": answer.get("model"),
    }
    choice = (answer.get("choices") or [{}])[0]
    content = (choice.get("message") or {}).get("content") or ""
    finish = choice.get("finish_reason") or "stop"
    chunks: list[dict[str, Any]] = [
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        },
        {**base, "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]},
        {
            **base,
            "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
            "tidegate": answer.get("tidegate"),
        },
    ]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": answer.get("usage")})
    return chunks
