"""What a streaming answer writes: server-sent events to the client, and what it has said (the
text, the finish reason, the usage, the transcript an idempotency key replays)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from tidegate.gateway.http import Send, start_stream
from tidegate.gateway.pipeline.answer import sse
from tidegate.gateway.pipeline.dialect import StreamShape
from tidegate.providers.base import RawChunks

__all__ = ["StreamWriter", "Template", "content_of", "finish_of"]

#: A content chunk's bytes before and after its text, and where its text begins.
Template = tuple[bytes, bytes, int]


def content_of(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        text += (choice.get("delta") or {}).get("content") or ""
    return text


def finish_of(chunk: dict[str, Any]) -> str | None:
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
    #: Another API's events for the chunks (None: OpenAI's own ``data:`` events).
    shape: StreamShape | None = None
    #: Who wrote the answer: each provider whose text reached the client, and where in
    #: :attr:`text` its part begins (a rescue adds one).
    authors: list[tuple[str, int]] = field(default_factory=list)
    #: The tokens of the parts before a rescuer's, added to the usage the client is shown (the
    #: rescuer reports only its own); :attr:`usage` stays the last provider's.
    carried: dict[str, int] | None = None
    #: Part of a tool call went out: a rescue could not make it whole (see stream.py).
    tool_call_sent: bool = False
    #: ``clean`` leaves printable ASCII as it is (no deny patterns): such text needs no call.
    plain_is_clean: bool = False
    #: A content chunk's bytes around its text (:func:`_template`), once one has been seen.
    template: Template | None = field(default=None, repr=False)
    #: Where a body message that is not the last goes: ``send``'s ``body_send`` if it has one.
    _body: Send = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._body = getattr(self.send, "body_send", self.send)

    async def start(self, headers: list[tuple[str, str]]) -> None:
        await start_stream(self.send, headers)

    async def _write(self, data: bytes, *, last: bool = False) -> None:
        self.events.append(data)
        await self.send({"type": "http.response.body", "body": data, "more_body": not last})

    async def chunk(self, chunk: dict[str, Any], *, continuing: bool = False) -> None:
        """Forward one provider chunk (after a rescue: under the first stream's id, no new role)."""
        events = self._events(chunk, continuing=continuing)
        if events:
            await self._write(events)

    async def chunks(self, run: RawChunks, *, continuing: bool = False) -> None:
        """Forward the chunks of one read in one write. A chunk the client is to see as the
        provider sent it (:meth:`_as_sent`) goes on as its bytes, unparsed again; any other as
        :meth:`chunk` makes it."""
        chunks, raw = run
        if len(chunks) == 1 and not continuing and self._as_sent_fast(chunks[0], raw[0]):
            body = b"data: " + raw[0] + b"\n\n"  # a read of one chunk, as a paced stream's are
        else:
            out: list[bytes] = []
            for chunk, data in zip(chunks, raw, strict=True):
                if not continuing and self._as_sent_fast(chunk, data):
                    out.append(b"data: " + data + b"\n\n")
                else:
                    events = self._events(chunk, continuing=continuing)
                    if events:
                        out.append(events)
            if not out:
                return
            body = b"".join(out)
        self.events.append(body)
        await self._body({"type": "http.response.body", "body": body, "more_body": True})

    def _as_sent_fast(self, chunk: dict[str, Any], data: bytes) -> bool:
        """:meth:`_as_sent` for a chunk in the shape of the stream's content chunks (its bytes
        those of :attr:`template` around a plain text): only its text is looked at."""
        if self.template is None:
            return self._as_sent(chunk, data)
        head, tail, start = self.template
        end = len(data) - len(tail)
        if not (
            end >= start
            and data.startswith(head)
            and data.endswith(tail)
            and _PLAIN.fullmatch(data, start, end)
        ):
            return self._as_sent(chunk, data)
        text = data[start:end].decode("ascii")  # printable, no quote or escape: itself
        if not self.plain_is_clean and self.clean(text) != text:
            return False
        self.text += text
        return True

    def _as_sent(self, chunk: dict[str, Any], data: bytes = b"") -> bool:
        """Whether the client is to see ``chunk`` exactly as the provider sent it, as nearly
        every chunk of an answer is (its text is added to :attr:`text` then): one choice, no
        finish reason, no tool call, no usage, the stream's id and model, and text the output
        filter leaves as it is. Anything else is relabelled, cleaned or counted by
        :meth:`chunk`."""
        choices = chunk.get("choices")
        if (
            type(choices) is not list
            or len(choices) != 1
            or chunk.get("usage")
            or chunk.get("id") != self.chunk_id
            or chunk.get("model") != self.model
        ):
            return False
        choice = choices[0]
        if type(choice) is not dict or choice.get("finish_reason"):
            return False
        delta = choice.get("delta")
        if type(delta) is not dict or delta.get("tool_calls"):
            return False
        text = delta.get("content")
        if text:
            if type(text) is not str or self.clean(text) != text:
                return False
            self.text += text
            if self.template is None and data:
                self.template = _template(chunk, data, text)
        return True

    def _events(self, chunk: dict[str, Any], *, continuing: bool) -> bytes | None:
        """What the client is to receive for one provider chunk (None: nothing), its text,
        finish reason, tool call and usage noted."""
        self._relabel(chunk, continuing=continuing)
        added = content_of(chunk)
        finish = finish_of(chunk)
        if continuing and not added and not finish and not chunk.get("usage"):
            return None  # a rescuer's opening role chunk: the client already has one
        self.text += added
        self.finish_reason = finish or self.finish_reason
        self.tool_call_sent = self.tool_call_sent or _has_tool_call(chunk)
        if chunk.get("usage"):
            shown = self._usage_shown(chunk)
            if shown is None:
                return None
            chunk = shown
        if self.shape is None:
            return sse(orjson.dumps(chunk))
        return self.shape.chunk(chunk) or None

    def _usage_shown(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """A chunk with usage as the client is to see it (its earlier parts' tokens added),
        without the usage unless asked for; None when nothing of it is left to send."""
        self.usage = chunk["usage"]
        if self.carried is not None:
            chunk["usage"] = _added(self.carried, chunk["usage"])
        if self.want_usage:
            return chunk
        if not chunk.get("choices"):
            return None
        return {k: v for k, v in chunk.items() if k != "usage"}

    def _relabel(self, chunk: dict[str, Any], *, continuing: bool) -> None:
        """The chunk under the stream's first id, its text cleaned, and (continuing a rescued
        stream) without a second role; its ``model`` is the model that wrote it."""
        if self.chunk_id is None:
            self.chunk_id = chunk.get("id")
            self.model = chunk.get("model")
        else:
            chunk["id"] = self.chunk_id
        if self.model is not None and not continuing:
            chunk["model"] = self.model
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if continuing:
                delta.pop("role", None)
            if delta.get("content"):
                delta["content"] = self.clean(delta["content"])

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
        if self.shape is not None:
            await self._write(self.shape.end(self.usage), last=True)
            self.finished = True
            return
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
        events = sse(orjson.dumps(payload)) if self.shape is None else self.shape.error(payload)
        await self._write(events, last=True)

    def handed_over(self, provider: str, at: int) -> None:
        """``provider`` rescued the answer: its part begins at ``at`` in :attr:`text`."""
        self.authors.append((provider, at))

    def transcript(self) -> bytes:
        return b"".join(self.events)


#: A plain text in a JSON string: printable ASCII but for the quote and the backslash (so no
#: escape), and no DEL, which ``clean`` strips.
_PLAIN = re.compile(rb"[ !#-\[\]-~]*")


def _template(chunk: dict[str, Any], data: bytes, text: str) -> Template | None:
    """The bytes of ``data`` (a chunk :meth:`StreamWriter._as_sent` passed, its text ``text``)
    before and after its text, and where its text begins.

    A chunk whose bytes are these around a plain text (:data:`_PLAIN`), and which decoded as a
    JSON object, is this chunk with another text: the same single choice without finish reason
    or tool call, no usage, the same id and model, since a plain text cannot end the string it
    is in. The pattern is proved by decoding this chunk's bytes around another text. None when
    the text is not plain or not found once.
    """
    encoded = text.encode()
    if _PLAIN.fullmatch(encoded) is None:
        return None
    for key in (b'"content":"', b'"content": "'):
        needle = key + encoded + b'"'
        at = data.find(needle)
        if at != -1 and data.count(needle) == 1:
            head = data[: at + len(key)]
            tail = data[at + len(key) + len(encoded) :]
            if _proves(chunk, head + b"x" + tail):
                return head, tail, len(head)
    return None


def _proves(chunk: dict[str, Any], probe: bytes) -> bool:
    """Whether ``probe`` decodes as ``chunk`` with the text ``x``."""
    try:
        decoded = orjson.loads(probe)
    except orjson.JSONDecodeError:
        return False
    expected = orjson.loads(orjson.dumps(chunk))
    expected["choices"][0]["delta"]["content"] = "x"
    return bool(decoded == expected)


def _has_tool_call(chunk: dict[str, Any]) -> bool:
    return any(
        (choice.get("delta") or {}).get("tool_calls") for choice in chunk.get("choices") or ()
    )


def _added(earlier: dict[str, int], usage: dict[str, Any]) -> dict[str, Any]:
    """``usage`` with ``earlier``'s token counts added."""
    total = dict(usage)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if isinstance(total.get(key), int):
            total[key] += earlier.get(key, 0)
    return total
