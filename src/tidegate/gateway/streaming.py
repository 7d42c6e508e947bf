"""Streams that never lie: relay a provider's chunks, and rescue a stream that breaks mid-answer.

Before the first chunk reaches the client, failover is transparent (``pipeline.open_stream``).
After it, the stream is committed, and a failure (a cut connection, a stall past the limit, an
end without ``finish_reason``) is handled in this order of preference:

1. **continuation** — a fallback that accepts an assistant prefill gets the original messages plus
   the text already sent as an assistant message, and its text is streamed on. A refusal of the
   prefill is not the caller's error: the next strategy is tried.
2. **restart and splice** — a fallback restarts without prefill; if its text begins with exactly
   what the client already has, that prefix is skipped and the remainder streamed.
3. **reset** (only when the client sent ``X-Tidegate-Stream-Reset: allow``) — an ``event: reset``
   and then the fallback's whole answer.
4. otherwise an **explicit end**: an in-band SSE error event in OpenAI's error shape, code
   ``stream_incomplete``, and no ``[DONE]`` — never a success-looking terminator over missing text.

Which strategy rescued a stream is counted in ``tidegate_stream_rescues_total{strategy}`` and
named in the final chunk's ``tidegate`` field.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import structlog

from tidegate.errors import ProviderError, ProviderErrorKind, ShuttingDown, error_body
from tidegate.gateway.http import DRAIN_ENDED, Send, start_stream
from tidegate.gateway.pipeline import NOT_EVIDENCE
from tidegate.providers.base import MalformedChunk, StreamEnd, StreamItem

if TYPE_CHECKING:
    from tidegate.gateway.pipeline import Exchange, OpenStream
    from tidegate.gateway.runtime import Route, Runtime
    from tidegate.policy.deadline import Deadline
    from tidegate.policy.routing import ProviderSpec, RoutePlan

__all__ = ["StreamWriter", "relay"]

log = structlog.get_logger("tidegate")


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def _content(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        text += (choice.get("delta") or {}).get("content") or ""
    return text


def _finish(chunk: dict[str, Any]) -> str | None:
    for choice in chunk.get("choices") or ():
        if choice.get("finish_reason"):
            return str(choice["finish_reason"])
    return None


@dataclass
class StreamWriter:
    """Writes SSE to the client and remembers what it said: the text, usage, the transcript."""

    send: Send
    want_usage: bool
    clean: Callable[[str], str] = str
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    chunk_id: str | None = None
    model: str | None = None
    finished: bool = False
    malformed: int = 0
    events: list[bytes] = field(default_factory=list)

    async def start(self, headers: list[tuple[str, str]]) -> None:
        await start_stream(self.send, headers)

    async def _write(self, data: bytes, *, last: bool = False) -> None:
        self.events.append(data)
        await self.send({"type": "http.response.body", "body": data, "more_body": not last})

    async def chunk(self, chunk: dict[str, Any], *, continuing: bool = False) -> None:
        """Forward one provider chunk (after a rescue: under the first stream's id, no new role)."""
        if self.chunk_id is None:
            self.chunk_id = chunk.get("id")
            self.model = chunk.get("model")
        else:
            chunk["id"] = self.chunk_id
        if self.model is not None:
            chunk["model"] = self.model
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if continuing:
                delta.pop("role", None)
            if delta.get("content"):
                delta["content"] = self.clean(delta["content"])
        added = _content(chunk)
        finish = _finish(chunk)
        if continuing and not added and not finish and not chunk.get("usage"):
            return  # a rescuer's opening role chunk: the client already has one
        self.text += added
        self.finish_reason = finish or self.finish_reason
        if chunk.get("usage"):
            self.usage = chunk["usage"]
            if not self.want_usage:
                if not chunk.get("choices"):
                    return
                chunk = {k: v for k, v in chunk.items() if k != "usage"}
        await self._write(sse(orjson.dumps(chunk)))

    async def text_chunk(self, text: str, template: dict[str, Any]) -> None:
        """Send ``text`` as one content chunk shaped like ``template``."""
        chunk = {
            "id": template.get("id"),
            "object": "chat.completion.chunk",
            "created": template.get("created"),
            "model": template.get("model"),
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        }
        await self.chunk(chunk, continuing=True)

    async def reset(self, reason: str) -> None:
        """Tell an opted-in client to discard what it has: the whole answer follows."""
        await self._write(b"event: reset\n" + sse(orjson.dumps({"reason": reason})))
        self.text = ""
        self.finish_reason = None

    async def done(self, tidegate: dict[str, Any]) -> None:
        if self.want_usage and self.usage is None:
            usage = {"prompt_tokens": 0, "completion_tokens": max(1, len(self.text) // 4)}
            usage["total_tokens"] = usage["completion_tokens"]
            self.usage = usage
            await self._write(
                sse(
                    orjson.dumps(
                        {
                            "id": self.chunk_id,
                            "object": "chat.completion.chunk",
                            "model": self.model,
                            "choices": [],
                            "usage": usage,
                            "tidegate": tidegate,
                        }
                    )
                )
            )
        elif tidegate:
            await self._write(f": tidegate {orjson.dumps(tidegate).decode()}\n\n".encode())
        await self._write(sse(b"[DONE]"), last=True)
        self.finished = True

    async def fail(self, payload: dict[str, Any]) -> None:
        await self._write(sse(orjson.dumps(payload)), last=True)

    def transcript(self) -> bytes:
        return b"".join(self.events)


@dataclass
class Pumped:
    """How a relayed stream ended: complete, or the error that broke it (None: it just ended)."""

    complete: bool
    error: ProviderError | None = None


async def _close(items: AsyncIterator[StreamItem]) -> None:
    closer = getattr(items, "aclose", None)
    if closer is not None:
        with contextlib.suppress(Exception):
            await closer()


async def pump(
    rt: Runtime,
    writer: StreamWriter,
    opened: OpenStream,
    *,
    continuing: bool,
    skip: str = "",
) -> Pumped:
    """Relay ``opened`` to the client until it ends; ``skip`` is a prefix the client already has.

    The breaker permit of the stream ends here: success for a complete stream, failure for a
    broken one, release when the caller went away.
    """
    pending = skip

    async def forward(chunk: dict[str, Any]) -> None:
        nonlocal pending
        if not pending:
            await writer.chunk(chunk, continuing=continuing)
            return
        text = _content(chunk)
        if text:
            if not pending.startswith(text) and not text.startswith(pending):
                raise _Mismatch
            cut = min(len(pending), len(text))
            rest = text[cut:]
            pending = pending[cut:]
            if rest:
                await writer.text_chunk(rest, chunk)
        finish = _finish(chunk)
        if finish or (chunk.get("usage") and not chunk.get("choices")):
            if pending:
                raise _Mismatch
            if not text:
                await writer.chunk(chunk, continuing=True)
            elif finish:
                await writer.chunk(
                    {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                    continuing=True,
                )

    try:
        for chunk in opened.first:
            await forward(chunk)
        async for item in opened.items:
            if isinstance(item, dict):
                await forward(item)
            elif isinstance(item, MalformedChunk):
                writer.malformed += 1
                rt.metrics.malformed_chunks.labels(opened.spec.name).inc()
            elif isinstance(item, StreamEnd):
                break
    except ProviderError as error:
        opened.permit.release() if error.kind in NOT_EVIDENCE else opened.permit.failure()
        await _close(opened.items)
        return Pumped(False, error)
    except BaseException:
        opened.permit.release()
        await _close(opened.items)
        raise
    if writer.finish_reason is None:
        opened.permit.failure()
        return Pumped(False, None)
    opened.permit.success()
    return Pumped(True)


class _Mismatch(Exception):
    """A restarted fallback said something other than what the client already has."""


async def relay(
    rt: Runtime,
    ex: Exchange,
    writer: StreamWriter,
    opened: OpenStream,
    *,
    route: Route,
    body: dict[str, Any],
    deadline: Deadline,
    plan: RoutePlan,
    reset_allowed: bool,
) -> None:
    """Relay the committed stream; rescue it if it breaks; end it honestly either way.

    The gateway's cancellation when the drain time is nearly up (:data:`DRAIN_ENDED`) ends the
    stream the same way as a break nothing rescued: an in-band ``stream_incomplete`` event and
    the end of the body, instead of a connection cut mid-chunk.
    """
    try:
        await _relay(
            rt,
            ex,
            writer,
            opened,
            route=route,
            body=body,
            deadline=deadline,
            plan=plan,
            reset_allowed=reset_allowed,
        )
    except asyncio.CancelledError as cancel:
        task = asyncio.current_task()
        if cancel.args != (DRAIN_ENDED,) or task is None or task.uncancel() > 0:
            raise
        payload = error_body(ShuttingDown("the replica is shutting down"))
        payload["error"]["code"] = "stream_incomplete"
        payload["error"]["message"] = "the answer is incomplete: the replica is shutting down"
        ex.outcome = "stream_incomplete"
        await writer.fail(payload)


async def _relay(
    rt: Runtime,
    ex: Exchange,
    writer: StreamWriter,
    opened: OpenStream,
    *,
    route: Route,
    body: dict[str, Any],
    deadline: Deadline,
    plan: RoutePlan,
    reset_allowed: bool,
) -> None:
    from tidegate.gateway.pipeline import open_stream

    served = [opened.spec.name]
    result = await pump(rt, writer, opened, continuing=False)
    _note(rt, ex, opened.spec, result)
    failed = opened.spec
    strategy = ""
    if not result.complete:
        for spec in _fallbacks(rt, plan, failed):
            strategy, result = await _rescue(
                rt, ex, writer, spec, route, body, deadline, plan, reset_allowed, open_stream
            )
            if strategy:
                served.append(spec.name)
                break
    if result.complete:
        tidegate: dict[str, Any] = {}
        if strategy:
            tidegate = {"rescued_by": strategy, "served_by": served}
            rt.metrics.stream_rescues.labels(strategy).inc()
            ex.outcome = f"rescued_{strategy}"
        await writer.done(tidegate)
        return
    rt.metrics.stream_rescues.labels("none").inc()
    error = result.error or ProviderError(
        ProviderErrorKind.MALFORMED,
        "the provider's stream ended before the answer was complete",
        provider=failed.name,
    )
    payload = error_body(error)
    payload["error"]["code"] = "stream_incomplete"
    payload["error"]["message"] = f"the answer is incomplete: {error.message}"
    ex.outcome = "stream_incomplete"
    await writer.fail(payload)


def _fallbacks(rt: Runtime, plan: RoutePlan, failed: ProviderSpec) -> list[ProviderSpec]:
    names = [c.name for c in plan.candidates]
    after = plan.candidates[names.index(failed.name) + 1 :] if failed.name in names else ()
    return [c for c in after if rt.breakers[c.name].would_admit()]


def _note(rt: Runtime, ex: Exchange, spec: ProviderSpec, result: Pumped) -> None:
    if result.complete:
        ex.tried.append((spec.name, None))
    else:
        kind = result.error.kind if result.error else ProviderErrorKind.MALFORMED
        ex.tried.append((spec.name, kind))
        rt.metrics.attempts.labels(spec.name, kind.value).inc()


async def _rescue(
    rt: Runtime,
    ex: Exchange,
    writer: StreamWriter,
    spec: ProviderSpec,
    route: Route,
    body: dict[str, Any],
    deadline: Deadline,
    plan: RoutePlan,
    reset_allowed: bool,
    open_stream: Any,
) -> tuple[str, Pumped]:
    """Try continuation, then restart-and-splice (or reset), on one fallback."""
    sent = writer.text
    if rt.provider_configs[spec.name].accepts_prefill and sent:
        prefilled = {
            **body,
            "messages": [*body["messages"], {"role": "assistant", "content": sent}],
        }
        try:
            opened = await open_stream(rt, ex, route, prefilled, deadline, plan, only=spec)
        except ProviderError as error:
            log.info("continuation_refused", provider=spec.name, kind=error.kind.value)
        else:
            result = await pump(rt, writer, opened, continuing=True)
            _note(rt, ex, spec, result)
            if result.complete:
                return "continuation", result
            if writer.text != sent:
                return "", result  # it added text and broke again: nothing clean is left to try
    try:
        opened = await open_stream(rt, ex, route, body, deadline, plan, only=spec)
    except ProviderError:
        return "", Pumped(False)
    try:
        result = await pump(rt, writer, opened, continuing=True, skip=sent)
    except _Mismatch:
        # pump() already released the permit (a different answer says nothing about health).
        ex.tried.append((spec.name, None))
        if not reset_allowed:
            return "", Pumped(False)
        try:
            opened = await open_stream(rt, ex, route, body, deadline, plan, only=spec)
        except ProviderError:
            return "", Pumped(False)
        await writer.reset(f"{spec.name} restarted the answer")
        result = await pump(rt, writer, opened, continuing=True)
        _note(rt, ex, spec, result)
        return ("reset" if result.complete else ""), result
    _note(rt, ex, spec, result)
    return ("splice" if result.complete else ""), result
