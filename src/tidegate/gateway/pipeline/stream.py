"""Streams that never lie: open a provider's stream, relay its chunks, and rescue a stream that
breaks mid-answer.

Before the first chunk reaches the client, failover is transparent: the attempts policy tries
candidates until one starts talking. After it, the stream is committed, and a failure (a cut
connection, a stall past the limit, an end without ``finish_reason``) is handled in this order of
preference:

1. **continuation**: a fallback that accepts an assistant prefill gets the original messages plus
   the text already sent as an assistant message, and its text is streamed on. A refusal of the
   prefill is not the caller's error: the next strategy is tried.
2. **restart and splice**: a fallback restarts without prefill; if its text begins with exactly
   what the client already has, that prefix is skipped and the remainder streamed.
3. **reset** (only when the client sent ``X-Tidegate-Stream-Reset: allow``): an ``event: reset``
   and then the fallback's whole answer.
4. otherwise an **explicit end**: an in-band SSE error event in OpenAI's error shape, code
   ``stream_incomplete``, and no ``[DONE]``, never a success-looking terminator over missing text.

A stream that broke after part of a tool call went out is not rescued: neither a prefill nor a
restart can be relied on to finish those arguments as one well-formed call, so it ends
explicitly.

Which strategy rescued a stream is counted in ``tidegate_stream_rescues_total{strategy}`` and
named in the final chunk's ``tidegate`` field. A stream's breaker permit ends with the stream
(through its :class:`~tidegate.policy.attempts.Attempts`, by the same evidence rule as any call).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog

from tidegate.errors import (
    ProviderError,
    ProviderErrorKind,
    ShuttingDown,
    TidegateError,
    error_body,
)
from tidegate.gateway.http import DRAIN_ENDED
from tidegate.gateway.pipeline.answer import close
from tidegate.gateway.pipeline.attempt import attempt
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.spend import account_usage, price, usage_of
from tidegate.gateway.pipeline.stream_writer import StreamWriter, content_of, finish_of
from tidegate.policy.attempts import Attempts, Call
from tidegate.policy.routing import ProviderSpec
from tidegate.providers.base import MalformedChunk, RawChunks, RelayItem, StreamEnd, StreamItem
from tidegate.state.base import StoredResponse

__all__ = ["OpenStream", "open_stream", "stream_answer"]

log = structlog.get_logger("tidegate")
RESET_HEADER = "x-tidegate-stream-reset"


#: What a provider stream yields: an item at a time (``stream``), or a read's items together
#: (``stream_raw``, its chunks as :class:`RawChunks`).
Items = AsyncIterator[StreamItem | list[RelayItem]]


@dataclass(slots=True)
class OpenStream:
    """A provider stream that has produced its first chunk (the point of commitment)."""

    spec: ProviderSpec
    items: Items
    #: The items read up to the first content chunk (the rest of its read with it).
    first: list[RelayItem]
    #: The attempts that opened it: the stream's permit ends through them, with the stream.
    attempts: Attempts
    #: The caller's deadline is the stream's tighter limit: a timeout says nothing of the provider.
    cut_short: bool


@dataclass(slots=True)
class Pumped:
    """How a relayed stream ended: complete, or the error that broke it."""

    complete: bool
    error: ProviderError | None = None


class _Mismatch(Exception):
    """A restarted fallback said something other than what the client already has."""


async def stream_answer(request: Request) -> None:
    """Stream the answer: open it, relay it (rescued if it breaks), bill what was streamed."""
    rt, ex, body = request.rt, request.ex, request.body
    started = rt.clock.now()
    opened = await open_stream(request, body)
    ex.served_by = opened.spec.name
    ex.served_model = rt.provider_configs[opened.spec.name].model
    shape = request.dialect.stream
    writer = StreamWriter(
        request.send,
        want_usage=shape is None and bool((body.get("stream_options") or {}).get("include_usage")),
        clean=rt.output_filter.clean,
        shape=None if shape is None else shape(),
        authors=[(opened.spec.name, 0)],
        plain_is_clean=not rt.output_filter.patterns,
    )
    await writer.start(ex.answer_headers())
    ex.first_token_s = rt.clock.now() - started
    rt.metrics.ttft.labels(ex.route, ex.served_by).observe(ex.first_token_s)
    request.served = True  # from here the caller receives (and is billed for) what is streamed
    try:
        await _relay_to_the_end(request, writer, opened)
    finally:
        # Also on a disconnect: the caller is billed for what was streamed to it.
        _bill(request, writer)
    if writer.finished:
        request.stored = StoredResponse(
            200, writer.transcript(), {"content-type": "text/event-stream; charset=utf-8"}
        )


def _bill(request: Request, writer: StreamWriter) -> None:
    """Bill what was streamed, each provider's part at its own model's price: the last
    provider's by its reported usage, an earlier one's (cut short, it reports none) by its text.
    The log and the metrics name every provider that served."""
    rt, ex = request.rt, request.ex
    authors = writer.authors
    ends = [at for _, at in authors[1:]] + [len(writer.text)]
    shares: list[tuple[str, dict[str, int]]] = []
    for i, (name, at) in enumerate(authors):
        reported = {"usage": writer.usage} if writer.usage and i == len(authors) - 1 else {}
        shares.append((rt.model_ids[name], usage_of(reported, request.body, max(0, ends[i] - at))))
    ex.usage = {
        key: sum(usage[key] for _, usage in shares)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    ex.cost = 0.0
    for model, usage in shares:
        cost = price(rt, model, usage["prompt_tokens"], usage["completion_tokens"])
        account_usage(rt, model, cost, usage)
        ex.cost += cost
    if len(authors) > 1:
        ex.served_by = ",".join(name for name, _ in authors)
        ex.served_model = ",".join(model for model, _ in shares)


async def open_stream(
    request: Request, body: dict[str, Any], *, only: ProviderSpec | None = None
) -> OpenStream:
    """The first provider stream that starts talking (with ``only``, that provider's, with its
    retries): failover is transparent until the first content chunk."""
    rt, route = request.rt, request.route

    def first_token_limit(spec: ProviderSpec) -> float:
        first = rt.provider_configs[spec.name].stream.first_token_timeout_s
        return min(route.per_try_timeout_s, first)

    attempts = rt.attempts.start(
        request.plan, request.deadline, first_token_limit, request.ex.tried, only=only
    )
    opener = _Opener(body)
    step, (items, first) = await attempt(request, attempts, opener, settle=False)
    return OpenStream(step.spec, items, first, attempts, opener.cut_short)


class _Opener:
    """One attempt at a stream: the request to the provider, up to its first content chunk."""

    __slots__ = ("body", "cut_short")

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.cut_short = False

    async def __call__(self, request: Request, step: Call) -> tuple[Items, list[RelayItem]]:
        rt, name, body = request.rt, step.spec.name, self.body
        config = rt.provider_configs[name]
        provider = rt.providers[name]
        # OpenAI's own stream (no other API's events): relayed from the bytes as received.
        relay = request.dialect.stream is None and hasattr(type(provider), "stream_raw")
        upstream = {
            **body,
            "model": config.model,
            "stream": True,
            "stream_options": {**(body.get("stream_options") or {}), "include_usage": True},
        }
        remaining = request.deadline.remaining()
        self.cut_short = remaining < config.stream.max_duration_s
        opener = provider.stream_raw if relay else provider.stream  # type: ignore[attr-defined]
        items: Items = opener(
            upstream,
            timeout=step.timeout,
            chunk_timeout=config.stream.stall_timeout_s,
            total_timeout=min(remaining, config.stream.max_duration_s),
        )
        first: list[RelayItem] = []
        try:
            await _first_chunks(items, first)
        except BaseException:
            await close(items)
            raise
        return items, first


async def _first_chunks(items: Items, first: list[RelayItem]) -> None:
    """Read a stream up to its first content chunk (the point of commitment)."""
    async for item in items:
        if isinstance(item, list):
            first += item
            if any(_begins(each) for each in item):
                return
        elif isinstance(item, dict):
            first.append(item)
            if _has_content(item):
                return
        elif isinstance(item, StreamEnd):
            return


def _begins(item: RelayItem) -> bool:
    """Whether ``item`` commits the stream: content (or its end) has come."""
    if isinstance(item, RawChunks):
        return any(_has_content(chunk) for chunk in item.chunks)
    return isinstance(item, StreamEnd) or (isinstance(item, dict) and _has_content(item))


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or choice.get("finish_reason"):
            return True
    return False


class _Forward:
    """Sends a stream's chunks on; ``skip`` is a prefix the client already has (a restarted
    fallback's answer must begin with exactly it)."""

    __slots__ = ("continuing", "malformed", "pending", "writer")

    def __init__(
        self, writer: StreamWriter, malformed: Callable[[], None], *, continuing: bool, skip: str
    ) -> None:
        self.writer = writer
        self.malformed = malformed
        self.continuing = continuing
        self.pending = skip

    async def items(self, items: Iterable[RelayItem]) -> bool:
        """Forward ``items``, a read's chunks in one write; True once the stream has ended."""
        for item in items:
            if isinstance(item, RawChunks):
                if not self.pending:
                    await self.writer.chunks(item, continuing=self.continuing)
                    continue
                for chunk in item.chunks:
                    await self(chunk)
            elif isinstance(item, dict):
                await self(item)
            elif isinstance(item, MalformedChunk):
                self.writer.malformed += 1
                self.malformed()
            else:
                return True
        return False

    async def __call__(self, chunk: dict[str, Any]) -> None:
        writer = self.writer
        if not self.pending:
            await writer.chunk(chunk, continuing=self.continuing)
            return
        text = content_of(chunk)
        if text:
            pending = self.pending
            if not pending.startswith(text) and not text.startswith(pending):
                raise _Mismatch
            cut = min(len(pending), len(text))
            self.pending = pending[cut:]
            if text[cut:]:
                await writer.text_chunk(text[cut:], chunk)
        finish = finish_of(chunk)
        if finish or (chunk.get("usage") and not chunk.get("choices")):
            if self.pending:
                raise _Mismatch
            if not text:
                await writer.chunk(chunk, continuing=True)
            elif finish:
                ended = {"index": 0, "delta": {}, "finish_reason": finish}
                await writer.chunk({**chunk, "choices": [ended]}, continuing=True)


async def pump(
    request: Request, writer: StreamWriter, opened: OpenStream, *, continuing: bool, skip: str = ""
) -> Pumped:
    """Relay ``opened`` to the client until it ends. Its permit ends here: a success for a
    complete stream, a failure for a broken one (by the evidence rule), a release when the
    caller went away or a restarted fallback said something else."""
    rt, attempts = request.rt, opened.attempts

    def malformed() -> None:
        rt.metrics.malformed_chunks.labels(opened.spec.name).inc()

    forward = _Forward(writer, malformed, continuing=continuing, skip=skip)
    try:
        if not await forward.items(opened.first):
            async for item in opened.items:
                if isinstance(item, list):
                    if len(item) == 1 and isinstance(item[0], RawChunks) and not forward.pending:
                        await writer.chunks(item[0], continuing=continuing)  # the usual read
                    elif await forward.items(item):
                        break
                elif await forward.items((item,)):
                    break
    except ProviderError as error:
        return await _broke(request, opened, error)
    except _Mismatch:
        attempts.abandoned(answered=True)  # it answered, only not the same: nothing of health
        await close(opened.items)
        raise
    except BaseException:
        attempts.abandoned()
        await close(opened.items)
        raise
    if writer.finish_reason is None:
        ended = ProviderError(
            ProviderErrorKind.MALFORMED,
            "the provider's stream ended before the answer was complete",
            provider=opened.spec.name,
        )
        return await _broke(request, opened, ended)
    attempts.succeeded()
    rt.metrics.attempts.labels(opened.spec.name, "ok").inc()
    return Pumped(True)


async def _broke(request: Request, opened: OpenStream, error: ProviderError) -> Pumped:
    opened.attempts.broke(error, cut_short=opened.cut_short)
    request.rt.metrics.attempts.labels(opened.spec.name, error.kind.value).inc()
    await close(opened.items)
    return Pumped(False, error)


async def _relay_to_the_end(request: Request, writer: StreamWriter, opened: OpenStream) -> None:
    """Relay the committed stream; rescue it if it breaks; end it honestly either way.

    The gateway's cancellation when the drain time is nearly up (:data:`DRAIN_ENDED`) ends the
    stream the same way as a break nothing rescued: an in-band ``stream_incomplete`` event and
    the end of the body, instead of a connection cut mid-chunk.
    """
    try:
        await _relay(request, writer, opened)
    except asyncio.CancelledError as cancel:
        task = asyncio.current_task()
        if cancel.args != (DRAIN_ENDED,) or task is None or task.uncancel() > 0:
            raise
        await _incomplete(request, writer, ShuttingDown("the replica is shutting down"))


async def _relay(request: Request, writer: StreamWriter, opened: OpenStream) -> None:
    rt, ex = request.rt, request.ex
    served = [opened.spec.name]
    result = await pump(request, writer, opened, continuing=False)
    strategy = ""
    if not result.complete and not writer.tool_call_sent:
        # What the client has so far, as the usage it is shown will count it.
        writer.carried = usage_of({}, request.body, len(writer.text))
        at = len(writer.text)
        for spec in _fallbacks(request, opened.spec):
            strategy, result = await _rescue(request, writer, spec)
            if strategy:
                served.append(spec.name)
                writer.handed_over(spec.name, 0 if strategy == "reset" else at)
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
        provider=opened.spec.name,
    )
    await _incomplete(request, writer, error)


async def _incomplete(request: Request, writer: StreamWriter, error: TidegateError) -> None:
    """End the stream with the in-band ``stream_incomplete`` event (no ``[DONE]``)."""
    payload = error_body(error)
    payload["error"]["code"] = "stream_incomplete"
    payload["error"]["message"] = f"the answer is incomplete: {error.message}"
    request.ex.outcome = "stream_incomplete"
    await writer.fail(payload)


def _fallbacks(request: Request, failed: ProviderSpec) -> list[ProviderSpec]:
    """The candidates after ``failed`` whose breakers would admit a call now."""
    candidates = request.plan.candidates
    names = [c.name for c in candidates]
    after = candidates[names.index(failed.name) + 1 :] if failed.name in names else ()
    return [c for c in after if request.rt.breakers[c.name].would_admit()]


async def _rescue(request: Request, writer: StreamWriter, spec: ProviderSpec) -> tuple[str, Pumped]:
    """Try continuation, then restart-and-splice (or reset), on one fallback."""
    sent, body = writer.text, request.body
    if request.rt.provider_configs[spec.name].accepts_prefill and sent:
        prefilled = {
            **body,
            "messages": [*body["messages"], {"role": "assistant", "content": sent}],
        }
        try:
            opened = await open_stream(request, prefilled, only=spec)
        except ProviderError as error:
            log.info("continuation_refused", provider=spec.name, kind=error.kind.value)
        else:
            result = await pump(request, writer, opened, continuing=True)
            if result.complete:
                return "continuation", result
            if writer.text != sent:
                return "", result  # it added text and broke again: nothing clean is left to try
    return await _restart(request, writer, spec, sent)


async def _restart(
    request: Request, writer: StreamWriter, spec: ProviderSpec, sent: str
) -> tuple[str, Pumped]:
    """Restart on ``spec`` and splice its answer after what the client has; with the client's
    leave, reset it and stream the whole answer when the restart says something else."""
    try:
        opened = await open_stream(request, request.body, only=spec)
    except ProviderError:
        return "", Pumped(False)
    try:
        result = await pump(request, writer, opened, continuing=True, skip=sent)
    except _Mismatch:
        if request.headers.get(RESET_HEADER, "").lower() != "allow":
            return "", Pumped(False)
        try:
            opened = await open_stream(request, request.body, only=spec)
        except ProviderError:
            return "", Pumped(False)
        await writer.reset(f"{spec.name} restarted the answer")
        result = await pump(request, writer, opened, continuing=True)
        return ("reset" if result.complete else ""), result
    return ("splice" if result.complete else ""), result
