"""Raw ASGI plumbing: read a bounded body, send JSON, errors and server-sent events.

The gateway speaks ASGI directly instead of through a web framework: the request path is a
handful of routes, and every microsecond it adds is latency on every model call.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from enum import Enum
from typing import Any

import orjson

from tidegate.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType, http_error

__all__ = [
    "DRAIN_ENDED",
    "MAX_JSON_DEPTH",
    "ClientDisconnected",
    "Receive",
    "Scope",
    "Send",
    "json_bytes",
    "plain",
    "read_body",
    "read_json",
    "request_headers",
    "send_bytes",
    "send_error",
    "send_json",
    "send_raw",
    "start_stream",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


#: How deeply a request body may nest objects and arrays (the top-level object is level 1).
#: orjson parses up to 1,024 levels but writes back only 254, and the gateway writes the body
#: again (the cache key, the idempotency fingerprint, the upstream request): a deeper body would
#: be a 500 after the fact. 64 leaves room for JSON Schemas in ``tools`` and ``response_format``
#: and for what a provider's translation adds.
MAX_JSON_DEPTH = 64


class ClientDisconnected(Exception):
    """The client went away before its request body arrived."""


#: The message of the cancellation with which the gateway ends the requests still running when
#: the drain time is nearly up (see ``Gateway.begin_drain``): told apart from uvicorn's own and
#: from a disconnect, it is answered rather than passed on.
DRAIN_ENDED = "tidegate: the drain time is up"


#: ``bytes.decode(b, "latin-1")`` as a C callable, for ``map``.
_latin1 = operator.methodcaller("decode", "latin-1")


def request_headers(scope: Scope) -> dict[str, str]:
    """Lower-case header names to values (a repeated header keeps its last value)."""
    pairs = scope["headers"]
    if not pairs:
        return {}
    # Decoded in C, a constant cost a request: a comprehension cost ~25 bytecodes a header
    # (``benchmarks/opcodes.py``: 116 a request for wrk's four).
    names, values = zip(*pairs, strict=True)
    return dict(zip(map(_latin1, names), map(_latin1, values), strict=True))


async def read_body(receive: Receive, headers: Mapping[str, str], limit: int) -> bytes:
    """The whole body, refusing with 413 as soon as it is known to be over ``limit`` bytes."""
    _check_length(headers, limit)
    return await _body_from(receive, await receive(), limit)


def _check_length(headers: Mapping[str, str], limit: int) -> None:
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("Content-Length is not a number")
        if int(declared) > limit:
            raise PayloadTooLarge(f"the body is {declared} bytes; the limit is {limit}")


async def _body_from(receive: Receive, message: Message, limit: int) -> bytes:
    """The body whose first message is ``message``; the rest is received here."""
    chunks: list[bytes] = []
    size = 0
    while True:
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the {limit}-byte limit")
        if not message.get("more_body", False):
            if not chunks:
                return chunk  # the whole body in one message
            chunks.append(chunk)
            return b"".join(chunks)
        chunks.append(chunk)
        message = await receive()


async def read_json(receive: Receive, headers: Mapping[str, str], limit: int) -> dict[str, Any]:
    """The body as a JSON object, or the documented 4xx for anything else."""
    # No Content-Type is refused too: the SDKs and httpx's json= send application/json, and a
    # body sent without one (or as curl -d's form encoding) was not written as JSON on purpose.
    declared = headers.get("content-type", "")
    if declared != "application/json":  # else the usual exact spelling: nothing to take apart
        content_type = declared.split(";")[0].strip().lower()
        if content_type != "application/json" and not content_type.endswith("+json"):
            got = repr(content_type) if content_type else "missing"
            raise UnsupportedMediaType(f"Content-Type must be application/json; it was {got}")
    _check_length(headers, limit)
    message = await receive()
    body: bytes = message.get("body", b"")
    if message.get("more_body", False) or message["type"] != "http.request" or len(body) > limit:
        body = await _body_from(receive, message, limit)  # the general case, and its refusals
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    # Every level opens a bracket: a body with fewer brackets than the limit cannot be too deep,
    # and counting them (in C) costs a request next to nothing; only the rare rest is walked.
    if body.count(b"{") + body.count(b"[") > MAX_JSON_DEPTH and _too_deep(data, MAX_JSON_DEPTH):
        raise InvalidRequest(
            f"the body nests objects and arrays deeper than {MAX_JSON_DEPTH} levels"
        )
    return data


def _too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests containers more than ``limit`` levels deep, walked a level at a
    time (no recursion: the depth is what is in question)."""
    level: list[Any] = [value]
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        inner: list[Any] = []
        for item in level:
            children = item.values() if isinstance(item, dict) else item
            inner.extend(c for c in children if isinstance(c, (dict, list)))
        level = inner
    return False


def json_bytes(value: Any) -> bytes:
    return orjson.dumps(value)


def plain(value: Any) -> Any:
    """``value`` as JSON holds it: dataclasses as objects, enums as their values, mappings with
    string keys, tuples as lists (the admin API answers with the policies' own records)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def _header_list(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    headers: Iterable[tuple[str, str]] = (),
    *,
    content_type: str = "application/json",
) -> None:
    await send_raw(send, status, body, _header_list(headers), content_type.encode("latin-1"))


async def send_raw(
    send: Send,
    status: int,
    body: bytes,
    raw: list[tuple[bytes, bytes]],
    content_type: bytes = b"application/json",
) -> None:
    """:func:`send_bytes` with the headers already as ASGI takes them (``raw`` is added to)."""
    raw.append((b"content-type", content_type))
    raw.append((b"content-length", b"%d" % len(body)))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, value: Any, headers: Iterable[tuple[str, str]] = ()
) -> None:
    await send_bytes(send, status, orjson.dumps(value), headers)


async def send_error(
    send: Send, error: BaseException, headers: Iterable[tuple[str, str]] = ()
) -> int:
    """Answer with ``error``'s one status and body; returns the status."""
    status, body, extra = http_error(error)
    await send_json(send, status, body, [*headers, *extra.items()])
    return status


async def start_stream(send: Send, headers: Iterable[tuple[str, str]] = ()) -> None:
    """Begin a ``text/event-stream`` response; events follow as body chunks."""
    raw = _header_list(headers)
    raw += [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": raw})
