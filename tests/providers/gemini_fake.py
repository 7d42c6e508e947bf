"""A small fake of the Gemini API and of Vertex AI on loopback, for socket-level tests.

It answers ``:generateContent``, ``:streamGenerateContent?alt=sse`` and ``:batchEmbedContents``
under any path, and an OAuth token endpoint at ``/token``. Every request body is checked
against the google-genai SDK's own types (camelCase field names only, unknown fields refused
where the SDK refuses them): a body that does not fit gets Google's 400 ``INVALID_ARGUMENT``,
so a test that sends one fails. The canned answers are checked against the SDK's response
type too, so the fake speaks what the real API speaks.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import orjson
from aiohttp import web
from google.genai import types
from pydantic import TypeAdapter, ValidationError

__all__ = [
    "FakeGemini",
    "Reply",
    "Seen",
    "answer",
    "error_body",
    "serving",
    "sse",
    "validate_embed_request",
    "validate_generate_request",
]

#: The fields of a generateContent request body and the SDK type each one must fit.
_REQUEST_FIELDS: dict[str, TypeAdapter[Any]] = {
    "contents": TypeAdapter(list[types.Content]),
    "systemInstruction": TypeAdapter(types.Content),
    "generationConfig": TypeAdapter(types.GenerationConfig),
    "tools": TypeAdapter(list[types.Tool]),
    "toolConfig": TypeAdapter(types.ToolConfig),
    "safetySettings": TypeAdapter(list[types.SafetySetting]),
}
_CONTENT = TypeAdapter(types.Content)
_EMBED_FIELDS = {"model", "content", "taskType", "title", "outputDimensionality"}


def _fits(adapter: TypeAdapter[Any], value: Any) -> None:
    # JSON mode, so that inlineData's base64 is decoded and checked as the API would. The
    # SDK's enums take an unknown value with a warning (for newer servers): here it is refused.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            adapter.validate_json(orjson.dumps(value), by_alias=True, by_name=False)
        except UserWarning as warning:
            raise ValueError(str(warning)) from None


def validate_generate_request(body: Any) -> None:
    """Raise ``ValueError`` (or pydantic's ``ValidationError``) unless ``body`` is a
    generateContent request the SDK's types accept, with roles ``user`` / ``model``."""
    if not isinstance(body, dict):
        raise ValueError("the body is not a JSON object")
    unknown = sorted(set(body) - set(_REQUEST_FIELDS))
    if unknown:
        raise ValueError(f"unknown fields {unknown}")
    if not body.get("contents"):
        raise ValueError("contents is required")
    for name, value in body.items():
        _fits(_REQUEST_FIELDS[name], value)
    for content in body["contents"]:
        if content.get("role") not in ("user", "model"):
            raise ValueError(f"role {content.get('role')!r} is neither user nor model")
        if not content.get("parts"):
            raise ValueError("a content without parts")


def validate_embed_request(body: Any, model: str) -> None:
    """Raise unless ``body`` is a batchEmbedContents request for ``model``."""
    requests = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(requests, list) or not requests or set(body) != {"requests"}:
        raise ValueError("requests must be a non-empty list, alone")
    for request in requests:
        if set(request) - _EMBED_FIELDS:
            raise ValueError(f"unknown fields {sorted(set(request) - _EMBED_FIELDS)}")
        if request.get("model") != f"models/{model}":
            raise ValueError(f"model {request.get('model')!r} is not models/{model}")
        _fits(_CONTENT, request["content"])


def answer(
    text: str | None = "Hello world",
    *,
    finish: str | None = "STOP",
    parts: Sequence[dict[str, Any]] | None = None,
    usage: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A GenerateContentResponse with one candidate (checked against the SDK's type)."""
    candidate: dict[str, Any] = {"index": 0}
    if parts is not None or text is not None:
        candidate["content"] = {"role": "model", "parts": list(parts or [{"text": text}])}
    if finish:
        candidate["finishReason"] = finish
    body: dict[str, Any] = {
        "candidates": [candidate],
        "usageMetadata": usage
        or {"promptTokenCount": 7, "candidatesTokenCount": 2, "totalTokenCount": 9},
        "modelVersion": "gemini-test-001",
        "responseId": "resp-1",
        **extra,
    }
    types.GenerateContentResponse.model_validate_json(
        orjson.dumps(body), by_alias=True, by_name=False
    )
    return body


def error_body(code: int, status: str, message: str, *details: dict[str, Any]) -> bytes:
    """Google's error body: ``{"error": {"code", "message", "status", "details"}}``."""
    error: dict[str, Any] = {"code": code, "message": message, "status": status}
    if details:
        error["details"] = list(details)
    return orjson.dumps({"error": error})


def sse(events: Sequence[dict[str, Any]]) -> bytes:
    """The events as the API streams them with ``alt=sse`` (CRLF line ends), each checked."""
    for event in events:
        if "error" not in event:
            types.GenerateContentResponse.model_validate_json(
                orjson.dumps(event), by_alias=True, by_name=False
            )
    return b"".join(b"data: " + orjson.dumps(event) + b"\r\n\r\n" for event in events)


@dataclass(frozen=True)
class Reply:
    """One canned answer."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, data: Any, status: int = 200, **headers: str) -> Reply:
        return cls(status, orjson.dumps(data), headers=headers)

    @classmethod
    def stream(cls, events: Sequence[dict[str, Any]]) -> Reply:
        return cls(200, sse(events), "text/event-stream")


@dataclass(frozen=True)
class Seen:
    """One request the fake received."""

    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any
    problem: str | None  # why the body failed validation, if it did


class FakeGemini:
    """Records requests; answers each with the next canned reply (the last one repeats)."""

    def __init__(self, *replies: Reply, token_lifetime: int = 3600) -> None:
        self.replies = list(replies) or [Reply.json(answer())]
        self.requests: list[Seen] = []
        self.tokens: list[dict[str, list[str]]] = []
        self.token_lifetime = token_lifetime
        self.token_status = 200
        #: Replies for one model (by the name in the URL), ahead of ``replies``.
        self.by_model: dict[str, list[Reply]] = {}

    def reply_with(self, *replies: Reply) -> None:
        self.replies = list(replies)

    def reply_for(self, model: str, *replies: Reply) -> None:
        self.by_model[model] = list(replies)

    def _next(self, model: str) -> Reply:
        queue = self.by_model.get(model) or self.replies
        return queue.pop(0) if len(queue) > 1 else queue[0]

    async def _token(self, request: web.Request) -> web.Response:
        self.tokens.append(parse_qs(await request.text()))
        if self.token_status != 200:
            return web.json_response(
                {"error": "invalid_grant", "error_description": "Invalid JWT Signature."},
                status=self.token_status,
            )
        number = len(self.tokens)
        return web.json_response(
            {
                "access_token": f"ya29.fake-access-token-{number:04d}",
                "expires_in": self.token_lifetime,
                "token_type": "Bearer",
            }
        )

    async def _api(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        method = request.path.rpartition(":")[2]
        model = request.path.rpartition("/models/")[2].partition(":")[0]
        try:
            if method == "batchEmbedContents":
                validate_embed_request(body, model)
            elif method in ("generateContent", "streamGenerateContent"):
                validate_generate_request(body)
            else:
                raise ValueError(f"no method {method!r}")
            problem = None
        except (ValueError, ValidationError) as exc:
            problem = str(exc)
        self.requests.append(
            Seen(request.path, parse_qs(request.query_string), dict(request.headers), body, problem)
        )
        if problem is not None:
            return web.Response(
                status=400,
                body=error_body(400, "INVALID_ARGUMENT", f"Invalid JSON payload: {problem}"),
                content_type="application/json",
            )
        reply = self._next(model)
        return web.Response(
            status=reply.status,
            body=reply.body,
            content_type=reply.content_type,
            headers=reply.headers,
        )

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/token", self._token)
        app.router.add_post("/{tail:.+}", self._api)
        return app


@contextmanager
def serving(app: web.Application) -> Iterator[str]:
    """Serve ``app`` on a free loopback port from a thread with its own loop; its base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-gemini", daemon=True)
    thread.start()
    runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)

    async def start() -> str:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(5)
    finally:
        try:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
            loop.close()
