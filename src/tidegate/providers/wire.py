"""Builders for the OpenAI Chat Completions wire shapes, the lingua franca inside tidegate.

The providers translate into these shapes, the fakes answer with them, and tests compare
against them; having one builder per shape keeps every producer byte-for-byte consistent.
"""

from __future__ import annotations

import array
import base64
import binascii
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from tidegate.providers.base import JSONObject

__all__ = [
    "EncodingFormat",
    "assemble_completion",
    "chat_chunk",
    "chat_completion",
    "completion_chunks",
    "decode_vector",
    "embeddings_response",
    "encode_vector",
    "openai_error",
    "usage",
]


def usage(prompt_tokens: int, completion_tokens: int) -> JSONObject:
    """An OpenAI ``usage`` object; ``total_tokens`` is the sum."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_completion(
    *,
    id: str,
    model: str,
    created: int,
    content: str | None,
    finish_reason: str | None = "stop",
    usage: JSONObject | None = None,
    n: int = 1,
    tool_calls: Sequence[JSONObject] | None = None,
) -> JSONObject:
    """A ``chat.completion`` with ``n`` alike choices; with ``tool_calls`` each choice calls
    them (its content ``None``, its finish reason ``tool_calls``)."""
    message: JSONObject = {"role": "assistant", "content": content}
    if tool_calls:
        message = {"role": "assistant", "content": None, "tool_calls": list(tool_calls)}
        finish_reason = "tool_calls"
    body: JSONObject = {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "message": dict(message),
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            for index in range(n)
        ],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def chat_chunk(
    *,
    id: str,
    model: str,
    created: int,
    delta: JSONObject | None = None,
    finish_reason: str | None = None,
    usage: JSONObject | None = None,
) -> JSONObject:
    """A ``chat.completion.chunk``; with ``delta=None`` it is the usage-only chunk (no choices)."""
    chunk: JSONObject = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def openai_error(
    message: str, *, type: str, code: str | None = None, param: str | None = None
) -> JSONObject:
    """An OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


#: How an embeddings request may ask for its vectors (OpenAI's ``encoding_format``).
EncodingFormat = Literal["float", "base64"]


def encode_vector(vector: Sequence[float]) -> str:
    """A vector as ``encoding_format: base64`` carries it: its float32 values, little-endian,
    in base64 (what the OpenAI SDKs decode with ``Float32Array`` / ``numpy.frombuffer``)."""
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def decode_vector(text: str) -> list[float] | None:
    """The vector :func:`encode_vector` wrote, or None if ``text`` is not one."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(raw) % 4:
        return None
    values = array.array("f", raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def embeddings_response(
    *,
    model: str,
    vectors: Sequence[Sequence[float]],
    prompt_tokens: int,
    encoding_format: EncodingFormat = "float",
) -> JSONObject:
    """An OpenAI embeddings ``list`` with one ``embedding`` object per input, in order."""
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": list(vector) if encoding_format == "float" else encode_vector(vector),
            }
            for index, vector in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def completion_chunks(completion: JSONObject) -> list[JSONObject]:
    """The chunks a server would have streamed for ``completion``: role, content, finish, usage.

    The usage chunk is included only if the completion has ``usage``.
    """
    choice: dict[str, Any] = (completion.get("choices") or [{}])[0]
    message: dict[str, Any] = choice.get("message") or {}
    common: dict[str, Any] = {
        "id": completion.get("id", ""),
        "model": completion.get("model", ""),
        "created": completion.get("created", 0),
    }
    chunks = [chat_chunk(**common, delta={"role": message.get("role", "assistant"), "content": ""})]
    if message.get("content"):
        chunks.append(chat_chunk(**common, delta={"content": message["content"]}))
    chunks.append(chat_chunk(**common, delta={}, finish_reason=choice.get("finish_reason")))
    if completion.get("usage") is not None:
        chunks.append(chat_chunk(**common, usage=completion["usage"]))
    return chunks


def assemble_completion(chunks: Iterable[JSONObject]) -> JSONObject:
    """The ``chat.completion`` that a stream of chunks adds up to (first choice only).

    Content deltas are concatenated; the last ``finish_reason`` and the last ``usage`` win.
    """
    id_, model, created = "", "", 0
    parts: list[str] = []
    finish_reason: str | None = None
    total: JSONObject | None = None
    seen_content = False
    for chunk in chunks:
        id_ = chunk.get("id") or id_
        model = chunk.get("model") or model
        created = chunk.get("created") or created
        if chunk.get("usage") is not None:
            total = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            content = (choice.get("delta") or {}).get("content")
            if isinstance(content, str):
                seen_content = True
                parts.append(content)
            if choice.get("finish_reason") is not None:
                finish_reason = choice["finish_reason"]
    return chat_completion(
        id=id_,
        model=model,
        created=created,
        content="".join(parts) if seen_content else None,
        finish_reason=finish_reason,
        usage=total,
    )
