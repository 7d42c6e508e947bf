"""A provider for Anthropic's Messages API, translated to and from the OpenAI wire format.

``base_url`` is the host without the API version (``https://api.anthropic.com``); requests go to
``POST {base_url}/v1/messages`` with ``x-api-key`` and ``anthropic-version: 2023-06-01``.

Request translation: ``system``/``developer`` messages become ``system`` (joined by blank
lines); consecutive messages of one role are merged, because Messages alternates roles; text and
image parts are carried over; ``max_completion_tokens`` or ``max_tokens`` becomes the required
``max_tokens`` (``default_max_tokens`` when neither is set); ``stop`` becomes
``stop_sequences``; ``temperature`` and ``top_p`` pass through unchanged (Anthropic refuses a
temperature above 1, and that refusal is reported as it comes); ``user`` becomes
``metadata.user_id``. Features the translation cannot keep faithfully (tools and function
calls, audio, ``n`` above 1, ``logprobs``, a JSON ``response_format``, tool messages) are refused
with ``ProviderError(kind="bad_request")`` before any call is made, rather than silently
dropped. Sampling knobs that Messages lacks (``presence_penalty``, ``frequency_penalty``,
``seed``, ``logit_bias``) are ignored.

Errors map by status, and by the error ``type`` in the body when the status says nothing (an
``error`` event inside a stream):

===========================================  ==================
status / ``error.type``                      kind
===========================================  ==================
429 ``rate_limit_error``                     ``rate_limited``
529 ``overloaded_error``, 503                ``overloaded``
408, 504 ``timeout_error``                   ``timeout``
500 ``api_error``, any other 5xx             ``server``
400 ``invalid_request_error``, prompt
too long / over the context limit            ``context_length``
400, 413, 422, other 4xx                     ``bad_request``
401 ``authentication_error``,
403 ``permission_error``                     ``auth``
404 ``not_found_error``                      ``not_found``
===========================================  ==================

A 2xx is an answer only when :func:`messages_response_problem` finds nothing wrong with it: a
``"type": "message"`` object whose ``content`` is a list of objects and whose ``usage``, if any,
is an object. Anything else, an ``{"type": "error"}`` body included, is ``malformed``
(retryable), never a success. Messages are cleaned by
:class:`~tidegate.providers.redact.Redactor` and carry the status, the error type, the
``request-id`` and a short text.

Embeddings are not offered by Anthropic: :meth:`AnthropicProvider.embed` raises
``ProviderError(kind="bad_request")`` without a call.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from typing import Any

import aiohttp
import orjson

from tidegate.clock import Clock, SystemClock
from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.providers.base import JSONObject, MalformedChunk, StreamEnd, StreamItem
from tidegate.providers.redact import NO_SECRETS, Redactor, secret_header_values
from tidegate.providers.translate import (
    append_turn,
    completion_with_calls,
    content_parts,
    data_url,
    function_tools,
    includes_usage,
    max_tokens_of,
    refused_features,
    stop_sequences,
    token_count,
    tool_arguments_delta,
    tool_call,
    tool_call_delta,
    tool_call_function,
    tool_result_text,
    usage_with_cache,
)
from tidegate.providers.transport import (
    HeadersSeen,
    HTTPAnswer,
    answer_object,
    error_info,
    error_message,
    json_events,
    kind_for_status,
    post_json,
    retry_after_from,
    stream_events,
)
from tidegate.providers.wire import chat_chunk

__all__ = [
    "ANTHROPIC_VERSION",
    "AnthropicProvider",
    "AnthropicStreamTranslator",
    "anthropic_error_for",
    "finish_reason_for",
    "from_messages_response",
    "messages_response_problem",
    "to_messages_request",
]

#: The ``anthropic-version`` header this translation is written against.
ANTHROPIC_VERSION = "2023-06-01"

K = ProviderErrorKind

_STATUS_OF_TYPE: Mapping[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
_TOO_LONG = re.compile(r"prompt is too long|exceeds? (the )?context|context (window|limit)", re.I)
_FINISH: Mapping[str, str] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
_SYSTEM_ROLES = frozenset({"system", "developer"})


def anthropic_error_for(
    answer: HTTPAnswer,
    *,
    provider: str,
    now_wall: float,
    redactor: Redactor = NO_SECRETS,
) -> ProviderError:
    """The :class:`ProviderError` for an unsuccessful Messages API answer (see the table); the
    message is cleaned by ``redactor``."""
    info = error_info(answer.body)
    status = answer.status
    if status < 300:
        status = _STATUS_OF_TYPE.get(info.type, 500 if info.type or info.message else 0)
    message = error_message(answer, info, redactor)
    kind = kind_for_status(status, info.message, _TOO_LONG)
    if kind is K.MALFORMED:
        message = f"HTTP {answer.status} with a body that is not the expected JSON"
    return ProviderError(
        kind,
        message,
        provider=provider,
        retry_after=retry_after_from(answer.headers, now_wall),
        status=status or answer.status,
    )


def messages_response_problem(data: JSONObject) -> str | None:
    """Why ``data`` is not a usable Messages API response, or ``None`` when it is one.

    On every answer, so only a few type checks on what the translation reads. An empty
    ``content`` list is an answer: Anthropic sends one when the model had nothing to add.
    """
    kind = data.get("type")
    if kind == "error" or data.get("error"):
        return "an error object"
    if kind != "message":
        return "not a message"
    content = data.get("content")
    if not isinstance(content, list):
        return "no content" if content is None else "content is not a list"
    for block in content:
        if not isinstance(block, dict):
            return "a content block that is not an object"
    usage = data.get("usage")
    if usage is not None and not isinstance(usage, dict):
        return "usage is not an object"
    return None


def finish_reason_for(stop_reason: str | None) -> str | None:
    """OpenAI's ``finish_reason`` for an Anthropic ``stop_reason`` (unknown ones become stop)."""
    if stop_reason is None:
        return None
    return _FINISH.get(stop_reason, "stop")


def _unsupported(body: JSONObject, provider: str) -> None:
    # The legacy ``functions`` (and ``function_call``) are refused: ``tools`` is their form.
    refused = refused_features(body, ("functions", "audio"))
    if refused:
        raise ProviderError(
            K.BAD_REQUEST,
            f"the Anthropic translation does not support {', '.join(refused)}",
            provider=provider,
        )


def _image_block(url: str, provider: str) -> JSONObject:
    if url.startswith("data:"):
        media_type, base64, data = data_url(url)
        if not base64 or not media_type:
            raise ProviderError(
                K.BAD_REQUEST,
                "an image data URL must be base64 with a media type",
                provider=provider,
            )
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": data},
        }
    return {"type": "image", "source": {"type": "url", "url": url}}


def _blocks(content: Any, provider: str) -> list[JSONObject]:
    return [
        {"type": "text", "text": str(value)} if kind == "text" else _image_block(value, provider)
        for kind, value in content_parts(content, provider, "Anthropic")
    ]


def _text_of(blocks: list[JSONObject]) -> str:
    return "".join(str(block.get("text", "")) for block in blocks if block.get("type") == "text")


def to_messages_request(
    body: JSONObject, *, default_max_tokens: int, provider: str = ""
) -> JSONObject:
    """The Messages API request for an OpenAI chat body (``stream`` is copied when present)."""
    _unsupported(body, provider)
    system: list[str] = []
    turns: list[JSONObject] = []
    for message in body.get("messages") or []:
        role = message.get("role")
        if role in _SYSTEM_ROLES:
            system.append(_text_of(_blocks(message.get("content"), provider)))
            continue
        if role == "tool":  # a tool's result: the user's turn, as Anthropic has it
            role, blocks = "user", [_tool_result(message)]
        elif role in ("user", "assistant"):
            blocks = _blocks(message.get("content"), provider)
            blocks += [_tool_use(call, provider) for call in message.get("tool_calls") or ()]
        else:
            raise ProviderError(
                K.BAD_REQUEST,
                f"the Anthropic translation does not support {role!r} messages",
                provider=provider,
            )
        append_turn(turns, role, blocks, "content")
    for turn in turns:
        blocks = turn["content"]
        if all(block["type"] == "text" for block in blocks):
            turn["content"] = _text_of(blocks)  # the plain form, as a person would write it
    max_tokens = max_tokens_of(body) or default_max_tokens
    request: JSONObject = {"model": body.get("model"), "max_tokens": max_tokens, "messages": turns}
    if system:
        request["system"] = "\n\n".join(system)
    stop = stop_sequences(body)
    if stop:
        request["stop_sequences"] = stop
    for key in ("temperature", "top_p", "stream"):
        if body.get(key) is not None:
            request[key] = body[key]
    if body.get("user"):
        request["metadata"] = {"user_id": str(body["user"])}
    request.update(_tools(body, provider))
    return request


def _tool_use(call: Any, provider: str) -> JSONObject:
    """An OpenAI tool call as a ``tool_use`` block (its arguments must be a JSON object)."""
    function, arguments = tool_call_function(call, provider)
    return {
        "type": "tool_use",
        "id": str(call.get("id", "")),
        "name": str(function.get("name", "")),
        "input": arguments,
    }


def _tool_result(message: JSONObject) -> JSONObject:
    return {
        "type": "tool_result",
        "tool_use_id": str(message.get("tool_call_id", "")),
        "content": tool_result_text(message),
    }


def _tools(body: JSONObject, provider: str) -> JSONObject:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as Anthropic has them."""
    options: JSONObject = {}
    tools = []
    refusal = "the Anthropic translation takes function tools only"
    for function in function_tools(body, provider, refusal=refusal):
        entry: JSONObject = {
            "name": function.get("name"),
            "input_schema": function.get("parameters") or {"type": "object"},
        }
        if function.get("description"):
            entry["description"] = function["description"]
        tools.append(entry)
    if tools:
        options["tools"] = tools
    choice = body.get("tool_choice")
    chosen: JSONObject | None = None
    if choice in ("auto", "none"):
        chosen = {"type": choice}
    elif choice == "required":
        chosen = {"type": "any"}
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        chosen = {"type": "tool", "name": choice["function"].get("name")}
    if body.get("parallel_tool_calls") is False and tools:
        chosen = {**(chosen or {"type": "auto"}), "disable_parallel_tool_use": True}
    if chosen is not None and (tools or chosen["type"] == "none"):
        options["tool_choice"] = chosen
    return options


def _usage(raw: Mapping[str, Any]) -> JSONObject:
    cached = token_count(raw.get("cache_read_input_tokens"))
    # OpenAI's prompt_tokens includes cached input; Anthropic counts cache reads and writes apart.
    prompt = token_count(raw.get("input_tokens")) + cached
    prompt += token_count(raw.get("cache_creation_input_tokens"))
    return usage_with_cache(prompt, token_count(raw.get("output_tokens")), cached)


def from_messages_response(data: JSONObject, *, created: int) -> JSONObject:
    """The ``chat.completion`` for a Messages API response (text blocks only); ``data`` is one
    that :func:`messages_response_problem` accepted."""
    blocks = [block for block in data.get("content") or [] if isinstance(block, dict)]
    calls = [
        tool_call(str(block.get("id", "")), str(block.get("name", "")), block.get("input") or {})
        for block in blocks
        if block.get("type") == "tool_use"
    ]
    return completion_with_calls(
        id=str(data.get("id", "")),
        model=str(data.get("model", "")),
        created=created,
        text=_text_of(blocks),
        finish_reason=finish_reason_for(data.get("stop_reason")),
        usage=_usage(data.get("usage") or {}),
        calls=calls,
    )


class AnthropicStreamTranslator:
    """Turns Messages stream events into ``chat.completion.chunk`` dicts, one event at a time.

    ``include_usage`` mirrors OpenAI's ``stream_options.include_usage``: a final chunk with no
    choices and the whole ``usage`` is emitted at ``message_stop``. ``done`` turns true at
    ``message_stop``. An ``error`` event is raised as a :class:`ProviderError`.
    """

    __slots__ = (
        "_created",
        "_id",
        "_model",
        "_provider",
        "_redactor",
        "_tools",
        "_usage",
        "done",
        "include_usage",
    )

    def __init__(
        self,
        *,
        created: int,
        include_usage: bool = False,
        provider: str = "",
        redactor: Redactor = NO_SECRETS,
    ) -> None:
        self._created = created
        self._provider = provider
        self._redactor = redactor
        self._id = ""
        self._model = ""
        self._usage: dict[str, Any] = {}
        #: Tool-call index (OpenAI's) of each ``tool_use`` block, by block index.
        self._tools: dict[int, int] = {}
        self.include_usage = include_usage
        self.done = False

    def _chunk(self, **fields: Any) -> JSONObject:
        return chat_chunk(id=self._id, model=self._model, created=self._created, **fields)

    def feed(self, event: JSONObject) -> list[JSONObject]:
        """The chunks for one event (often none)."""
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            self._id = str(message.get("id", ""))
            self._model = str(message.get("model", ""))
            self._usage.update(message.get("usage") or {})
            return [self._chunk(delta={"role": "assistant", "content": ""})]
        if kind in ("content_block_start", "content_block_delta"):
            block = event.get("content_block") or event.get("delta") or {}
            if block.get("type") in ("tool_use", "input_json_delta"):
                return self._tool_chunk(event, block)
            text = block.get("text") if block.get("type") in ("text", "text_delta") else None
            return [self._chunk(delta={"content": text})] if text else []
        if kind == "message_delta":
            self._usage.update(
                {
                    key: value
                    for key, value in (event.get("usage") or {}).items()
                    if value is not None
                }
            )
            stop_reason = (event.get("delta") or {}).get("stop_reason")
            if stop_reason is None:
                return []
            return [self._chunk(delta={}, finish_reason=finish_reason_for(stop_reason))]
        if kind == "message_stop":
            self.done = True
            return [self._chunk(usage=_usage(self._usage))] if self.include_usage else []
        if kind == "error":
            raise anthropic_error_for(
                HTTPAnswer(200, {}, orjson.dumps(event)),
                provider=self._provider,
                now_wall=0.0,
                redactor=self._redactor,
            )
        return []  # ping, content_block_stop, and event types added after this was written

    def _tool_chunk(self, event: JSONObject, block: JSONObject) -> list[JSONObject]:
        """A ``tool_use`` block's start, or a piece of its input, as a ``tool_calls`` delta."""
        position = event.get("index", 0)
        if block.get("type") == "tool_use":
            index = self._tools[position] = len(self._tools)
            call = tool_call_delta(index, str(block.get("id", "")), str(block.get("name", "")))
            return [self._chunk(delta={"tool_calls": [call]})]
        piece = block.get("partial_json")
        if position not in self._tools or not piece:
            return []
        call = tool_arguments_delta(self._tools[position], piece)
        return [self._chunk(delta={"tool_calls": [call]})]


class AnthropicProvider:
    """Chat completions and streams from Anthropic's Messages API, in the OpenAI wire format.

    ``session`` is the process's shared ``aiohttp.ClientSession``, borrowed and never closed.
    ``default_max_tokens`` fills the ``max_tokens`` that Messages requires when the request has
    none. ``model_map`` renames models on the way out; ``headers`` are added to every request
    (for example ``anthropic-beta``). ``clock`` stamps ``created`` and reads HTTP-date
    ``Retry-After`` values.
    """

    #: Told every answer's headers (the headroom it reports), when the gateway watches them.
    headers_seen: HeadersSeen | None = None
    headroom_dialect = "anthropic"

    def __init__(
        self,
        name: str,
        base_url: str,
        api_key: str | None,
        session: aiohttp.ClientSession,
        *,
        default_max_tokens: int = 4096,
        model_map: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        clock: Clock | None = None,
    ) -> None:
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens!r}")
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.default_max_tokens = default_max_tokens
        self._session = session
        self._model_map = dict(model_map or {})
        self._clock: Clock = clock or SystemClock()
        self._headers = {
            "Content-Type": "application/json",
            "anthropic-version": ANTHROPIC_VERSION,
            **(headers or {}),
        }
        if api_key:
            self._headers["x-api-key"] = api_key
        self._redactor = Redactor([api_key, *secret_header_values(headers)])

    def __repr__(self) -> str:
        return f"AnthropicProvider(name={self.name!r}, base_url={self.base_url!r})"

    async def complete(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """POST ``/v1/messages`` and translate the answer into a ``chat.completion``."""
        answer = await post_json(
            self._session,
            f"{self.base_url}/v1/messages",
            headers=self._headers,
            payload=self._payload(body, stream=False),
            timeout=timeout,
            provider=self.name,
            redactor=self._redactor,
            observe=self.headers_seen,
        )
        data = answer_object(
            answer,
            messages_response_problem,
            error_for=self._error_for,
            provider=self.name,
            redactor=self._redactor,
        )
        return from_messages_response(data, created=int(self._clock.wall()))

    async def stream(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
        chunk_timeout: float | None = None,
        total_timeout: float | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """POST ``/v1/messages`` with ``stream: true`` and yield OpenAI chunks.

        ``StreamEnd(done_seen=True)`` follows ``message_stop``; an event whose data is not a
        JSON object is yielded as :class:`MalformedChunk`.
        """
        translator = AnthropicStreamTranslator(
            created=int(self._clock.wall()),
            include_usage=includes_usage(body),
            provider=self.name,
            redactor=self._redactor,
        )
        events = stream_events(
            self._session,
            f"{self.base_url}/v1/messages",
            headers={**self._headers, "Accept": "text/event-stream"},
            payload=self._payload(body, stream=True),
            provider=self.name,
            timeout=timeout,
            chunk_timeout=chunk_timeout,
            total_timeout=total_timeout,
            error_for=self._error_for,
            redactor=self._redactor,
            observe=self.headers_seen,
        )
        async with aclosing(json_events(events)) as items:
            async for item in items:
                if isinstance(item, MalformedChunk):
                    yield item
                    continue
                name, data = item
                data.setdefault("type", name)
                for chunk in translator.feed(data):
                    yield chunk
                if translator.done:
                    yield StreamEnd(done_seen=True)
                    return
        yield StreamEnd(done_seen=False)

    async def embed(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """Anthropic has no embeddings endpoint: always ``ProviderError(kind="bad_request")``."""
        raise ProviderError(
            K.BAD_REQUEST, "Anthropic does not offer embeddings", provider=self.name
        )

    async def aclose(self) -> None:
        """Nothing to release: the session belongs to whoever created it."""

    def _payload(self, body: JSONObject, *, stream: bool) -> JSONObject:
        model = body.get("model")
        if isinstance(model, str):
            body = {**body, "model": self._model_map.get(model, model)}
        request = to_messages_request(
            body, default_max_tokens=self.default_max_tokens, provider=self.name
        )
        request["stream"] = stream
        return request

    def _error_for(self, answer: HTTPAnswer) -> ProviderError:
        return anthropic_error_for(
            answer, provider=self.name, now_wall=self._clock.wall(), redactor=self._redactor
        )
