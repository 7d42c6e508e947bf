"""A chat completion's stream as Anthropic's Messages event stream: ``message_start`` and a
``ping``, then per content block ``content_block_start``, its deltas (``text_delta``,
``input_json_delta`` for a tool call's arguments) and ``content_block_stop``; at the end
``message_delta`` (the stop reason and the usage) and ``message_stop``. An error in the stream
is Anthropic's ``error`` event.

One :class:`MessageStream` per response, fed the OpenAI chunks the stream writer relays (after
a rescue too: they are already relabelled as one answer).
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["STOP_REASONS", "MessageStream", "stream_error_type"]

#: Anthropic's ``stop_reason`` for a chat completion's ``finish_reason``.
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}
#: Anthropic's error type for tidegate's error family.
_ERROR_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "conflict_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
    "overloaded_error": "overloaded_error",
    "unavailable_error": "overloaded_error",
    "timeout_error": "timeout_error",
}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def stream_error_type(family: str, status: int | None = None) -> str:
    """Anthropic's error type for an OpenAI-shaped error's ``type`` (and, when there is one, its
    status: a body or a head too large is ``request_too_large``)."""
    if status in (413, 431):
        return "request_too_large"
    return _ERROR_TYPES.get(family, "api_error")


class MessageStream:
    """Translates one stream's chunks into Messages events (see the module docstring)."""

    def __init__(self) -> None:
        self._started = False
        #: The open content block's index (-1: none open), and the blocks begun so far.
        self._open = -1
        self._blocks = 0
        #: The open block is the tool call of this OpenAI index (None: a text block).
        self._tool: int | None = None
        self._stop_reason: str | None = None
        #: The usage a usage-only chunk carried.
        self._usage: dict[str, Any] | None = None

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The events of one ``chat.completion.chunk`` (a usage-only chunk has none: the usage
        goes out with ``message_delta``)."""
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        if not chunk.get("choices"):
            return b""
        out = b"" if self._started else self._start(chunk)
        for choice in chunk["choices"][:1]:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._tool_call(call)
            if choice.get("finish_reason"):
                self._stop_reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
        return out

    def end(self, usage: dict[str, Any] | None) -> bytes:
        """The events that end a complete message."""
        out = b"" if self._started else self._start({})
        out += self._close()
        counts = usage or self._usage or {}
        out += _event(
            "message_delta",
            {
                "delta": {"stop_reason": self._stop_reason or "end_turn", "stop_sequence": None},
                "usage": {
                    "input_tokens": counts.get("prompt_tokens", 0),
                    "output_tokens": counts.get("completion_tokens", 0),
                },
            },
        )
        return out + _event("message_stop", {})

    def error(self, payload: dict[str, Any]) -> bytes:
        """An in-band error (OpenAI-shaped ``payload``) as Anthropic's ``error`` event."""
        error = payload.get("error") or {}
        kind = stream_error_type(str(error.get("type", "")))
        return _event("error", {"error": {"type": kind, "message": str(error.get("message", ""))}})

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self._started = True
        message = {
            "id": f"msg_{chunk.get('id', '')}",
            "type": "message",
            "role": "assistant",
            "model": chunk.get("model", ""),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _event("message_start", {"message": message}) + _event("ping", {})

    def _text(self, text: str) -> bytes:
        out = b""
        if self._open < 0 or self._tool is not None:
            out = self._close() + self._begin({"type": "text", "text": ""}, tool=None)
        return out + _event(
            "content_block_delta",
            {"index": self._open, "delta": {"type": "text_delta", "text": text}},
        )

    def _tool_call(self, call: dict[str, Any]) -> bytes:
        out = b""
        index = call.get("index", 0)
        function = call.get("function") or {}
        if self._open < 0 or self._tool != index:
            block = {
                "type": "tool_use",
                "id": call.get("id", ""),
                "name": function.get("name", ""),
                "input": {},
            }
            out = self._close() + self._begin(block, tool=index)
        arguments = function.get("arguments")
        if arguments:
            out += _event(
                "content_block_delta",
                {
                    "index": self._open,
                    "delta": {"type": "input_json_delta", "partial_json": arguments},
                },
            )
        return out

    def _begin(self, block: dict[str, Any], *, tool: int | None) -> bytes:
        self._open, self._tool = self._blocks, tool
        self._blocks += 1
        return _event("content_block_start", {"index": self._open, "content_block": block})

    def _close(self) -> bytes:
        if self._open < 0:
            return b""
        index, self._open = self._open, -1
        return _event("content_block_stop", {"index": index})
