"""A local fake of Azure OpenAI's wire protocol (an aiohttp app), for the azure_openai tests.

It serves ``POST /openai/deployments/{deployment}/chat/completions`` and ``/embeddings``, asks
for ``api-version``, checks the ``api-key`` header or the bearer token as Azure does (401 with
Azure's body otherwise), answers 404 ``DeploymentNotFound`` for a deployment it does not have,
and validates every request body against the request types the ``openai`` SDK publishes (a body
that does not fit is a 400 ``invalid_schema``, and is listed in :attr:`FakeAzure.problems`).
Answers are Azure's shapes: ``prompt_filter_results`` and ``content_filter_results`` on a whole
answer, and a stream that opens with a chunk without choices. :meth:`FakeAzure.then` queues
other replies (an error, a stream of hand-written events), used in order.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from openai.types import EmbeddingCreateParams
from openai.types.chat import CompletionCreateParams
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming
from pydantic import TypeAdapter, ValidationError

from tidegate.clock import SystemClock

__all__ = ["FakeAzure", "Reply", "azure_error", "chunk", "filter_results"]

_CHAT_SCHEMA: TypeAdapter[Any] = TypeAdapter(CompletionCreateParams)
_EMBEDDINGS_SCHEMA: TypeAdapter[Any] = TypeAdapter(EmbeddingCreateParams)
_CHAT_KEYS = frozenset(typing.get_type_hints(CompletionCreateParamsNonStreaming))
_EMBEDDINGS_KEYS = frozenset(typing.get_type_hints(EmbeddingCreateParams))
SERVED_MODEL = "gpt-4o-2024-08-06"


def filter_results(*filtered: str) -> dict[str, Any]:
    """Azure's per-category verdicts, ``filtered`` ones marked so."""
    return {
        name: {"filtered": name in filtered, "severity": "medium" if name in filtered else "safe"}
        for name in ("hate", "self_harm", "sexual", "violence")
    }


def azure_error(
    message: str, code: str, *, inner: dict[str, Any] | None = None, param: str | None = None
) -> dict[str, Any]:
    """An Azure error body: ``{"error": {"message", "type", "param", "code", "status"}}``."""
    error: dict[str, Any] = {"message": message, "type": None, "param": param, "code": code}
    if inner is not None:
        error["innererror"] = inner
    return {"error": error}


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    """One ``chat.completion.chunk`` as Azure writes it."""
    return {
        "id": "chatcmpl-az1",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": SERVED_MODEL,
        "system_fingerprint": "fp_az",
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "finish_reason": finish,
                "logprobs": None,
                "content_filter_results": {} if finish else filter_results(),
            }
        ],
        **extra,
    }


@dataclass(frozen=True)
class Reply:
    """One queued answer: JSON ``body`` with ``status``, or the server-sent ``events``."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    events: list[Any] | None = None


@dataclass
class Seen:
    """One request as the fake received it."""

    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: dict[str, Any]
    #: When it arrived (the system clock's ``now()``).
    at: float = field(default_factory=SystemClock().now)


def _force(value: Any) -> Any:
    """Walk a validated value: the SDK's ``Iterable`` fields validate only when iterated."""
    if isinstance(value, dict):
        return {key: _force(item) for key, item in value.items()}
    if isinstance(value, list | tuple | Iterator):
        return [_force(item) for item in value]
    return value


def schema_problem(body: dict[str, Any], operation: str) -> str | None:
    """Why ``body`` does not fit the SDK's request type for ``operation``, or ``None``."""
    schema, keys = (
        (_CHAT_SCHEMA, _CHAT_KEYS)
        if operation == "chat"
        else (_EMBEDDINGS_SCHEMA, _EMBEDDINGS_KEYS)
    )
    unknown = sorted(set(body) - keys)
    if unknown:
        return f"unknown keys {unknown}"
    try:
        _force(schema.validate_python(body))
    except ValidationError as exc:
        return str(exc)
    return None


class FakeAzure:
    """The fake (see the module docstring). ``key`` is the accepted ``api-key``; ``token`` the
    accepted bearer token (change it to rotate); ``deployments`` the deployments it has."""

    def __init__(
        self,
        *,
        key: str | None = None,
        token: str | None = None,
        deployments: tuple[str, ...] = ("chat-deploy", "embed-deploy"),
        text: str = "The tide turns twice a day.",
    ) -> None:
        self.key = key
        self.token = token
        self.deployments = deployments
        self.text = text
        self.seen: list[Seen] = []
        self.problems: list[str] = []
        self.replies: list[Reply] = []

    def then(self, *replies: Reply) -> FakeAzure:
        """Queue ``replies``: each request takes the next one; when none is left, the answer."""
        self.replies.extend(replies)
        return self

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(
            "/{prefix:.*}openai/deployments/{deployment}/chat/completions", self._chat
        )
        app.router.add_post("/{prefix:.*}openai/deployments/{deployment}/embeddings", self._embed)
        return app

    async def _refusal(self, request: web.Request, operation: str) -> web.Response | None:
        body = orjson.loads(await request.read())
        self.seen.append(Seen(request.path, dict(request.query), dict(request.headers), body))
        if "api-version" not in request.query:
            return _json(404, azure_error("Resource not found", "404"))
        given_key = request.headers.get("api-key")
        bearer = request.headers.get("Authorization", "")
        if not (
            (self.key is not None and given_key == self.key)
            or (self.token is not None and bearer == f"Bearer {self.token}")
        ):
            message = (
                "Access denied due to invalid subscription key or wrong API endpoint. Make sure"
                " to provide a valid key for an active subscription."
            )
            return _json(401, azure_error(message, "401"))
        if request.match_info["deployment"] not in self.deployments:
            message = "The API deployment for this resource does not exist."
            return _json(404, azure_error(message, "DeploymentNotFound"))
        problem = schema_problem(body, operation)
        if problem is not None:
            self.problems.append(problem)
            return _json(400, azure_error(problem[:200], "invalid_schema"))
        return None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        refusal = await self._refusal(request, "chat")
        if refusal is not None:
            return refusal
        body = self.seen[-1].body
        reply = self.replies.pop(0) if self.replies else None
        if reply is None:
            reply = self._answer(body)
        if reply.events is None:
            return _json(reply.status, reply.body, reply.headers)
        response = web.StreamResponse(
            status=reply.status, headers={"Content-Type": "text/event-stream", **reply.headers}
        )
        await response.prepare(request)
        for event in reply.events:
            data = event if isinstance(event, str) else orjson.dumps(event).decode()
            await response.write(f"data: {data}\n\n".encode())
        await response.write_eof()
        return response

    async def _embed(self, request: web.Request) -> web.Response:
        refusal = await self._refusal(request, "embeddings")
        if refusal is not None:
            return refusal
        if self.replies:
            reply = self.replies.pop(0)
            return _json(reply.status, reply.body, reply.headers)
        inputs = self.seen[-1].body["input"]
        inputs = [inputs] if isinstance(inputs, str) else inputs
        data = [
            {"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]}
            for i in range(len(inputs))
        ]
        usage = {"prompt_tokens": 3, "total_tokens": 3}
        return _json(
            200, {"object": "list", "model": "text-embedding-3-small", "data": data, "usage": usage}
        )

    def _answer(self, body: dict[str, Any]) -> Reply:
        """The answer to ``body``: a call of the first offered tool, else :attr:`text`."""
        tools = body.get("tools") or []
        last = body["messages"][-1]
        call = tools and last.get("role") != "tool"
        if body.get("stream"):
            return Reply(events=self._stream(body, call=bool(call)))
        message: dict[str, Any] = {"role": "assistant", "content": self.text, "refusal": None}
        finish = "stop"
        if call:
            name = tools[0]["function"]["name"]
            arguments = '{"city": "Oslo"}'
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": "call_az1",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ]
            finish = "tool_calls"
        answer = {
            "id": "chatcmpl-az1",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": SERVED_MODEL,
            "system_fingerprint": "fp_az",
            "prompt_filter_results": [
                {"prompt_index": 0, "content_filter_results": filter_results()}
            ],
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": None,
                    "content_filter_results": filter_results(),
                }
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16},
        }
        return Reply(body=answer, headers={"x-request-id": "req-az-1"})

    def _stream(self, body: dict[str, Any], *, call: bool) -> list[Any]:
        opening = {
            "id": "",
            "object": "",
            "created": 0,
            "model": "",
            "choices": [],
            "prompt_filter_results": [
                {"prompt_index": 0, "content_filter_results": filter_results()}
            ],
        }
        events: list[Any] = [opening, chunk({"role": "assistant", "content": ""})]
        if call:
            name = body["tools"][0]["function"]["name"]
            start = {
                "index": 0,
                "id": "call_az1",
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            events.append(chunk({"tool_calls": [start]}))
            for piece in ('{"city"', ': "Oslo"}'):
                events.append(
                    chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                )
            events.append(chunk({}, "tool_calls"))
        else:
            events += [chunk({"content": word}) for word in _pieces(self.text)]
            events.append(chunk({}, "stop"))
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            usage = {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}
            events.append({**chunk({}), "choices": [], "usage": usage})
        return [*events, "[DONE]"]


def _pieces(text: str) -> list[str]:
    words = text.split(" ")
    return [word if i == 0 else f" {word}" for i, word in enumerate(words)]


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps(body),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
