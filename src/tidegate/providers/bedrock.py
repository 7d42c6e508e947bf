"""The ``bedrock`` provider type: Amazon Bedrock's Converse and ConverseStream APIs, translated
to and from the OpenAI wire format (docs/providers/bedrock.md).

Requests go to ``POST {endpoint}/model/{modelId}/converse`` (``/converse-stream`` for a stream),
where the endpoint is ``base_url`` when set and else ``https://bedrock-runtime.{region}
.amazonaws.com``. They are signed with SigV4 by botocore (``botocore.auth.SigV4Auth``), with
credentials from botocore's standard chain (environment variables, the shared credentials and
config files, a profile, a role); or, when the provider has an ``api_key_file``, sent with that
Bedrock API key as ``Authorization: Bearer``. A stream's answer is AWS event-stream framing,
decoded by botocore's own parser (``botocore.eventstream.EventStreamBuffer``, which checks every
frame's CRCs).

botocore is an optional extra (``tidegate[bedrock]``): it is imported only when a provider of
this type is built, and its absence is a :class:`~tidegate.errors.ConfigError` naming the extra.

Errors map by the error type (the ``X-Amzn-ErrorType`` header, else the body's ``__type``; a
stream's ``:exception-type``), and by the status when the type is unknown:

=================================================================  ==================
error type / status                                                kind
=================================================================  ==================
``ThrottlingException`` (429)                                      ``rate_limited``
``ServiceQuotaExceededException``                                  ``rate_limited``,
                                                                   not retryable
``ServiceUnavailableException`` (503), ``ModelNotReadyException``  ``overloaded``
``ModelTimeoutException`` (408)                                    ``timeout``
``InternalServerException`` (500), ``ModelErrorException`` (424),
``modelStreamErrorException``, any other 5xx                       ``server``
``ValidationException`` saying the input is too long               ``context_length``
``ValidationException`` (400), any other 4xx                       ``bad_request``
``AccessDeniedException``, ``UnrecognizedClientException``,
an invalid or expired signature or token (401, 403)                ``auth``
``ResourceNotFoundException`` (404)                                ``not_found``
a 2xx that is not a Converse answer                                ``malformed``
=================================================================  ==================

A guardrail's intervention is an answer, not an error: ``stopReason`` ``guardrail_intervened``
or ``content_filtered`` becomes ``finish_reason: content_filter`` (with the guardrail's text as
the content), as OpenAI reports a filtered answer. ``malformed_model_output`` and
``malformed_tool_use`` are ``malformed`` errors (retryable).

Bedrock has no OpenAI-style embeddings through Converse: :meth:`BedrockProvider.embed` raises
``ProviderError(kind="bad_request")`` without a call.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator
from yarl import URL

from tidegate.clock import Clock, SystemClock
from tidegate.errors import ConfigError, ProviderError, ProviderErrorKind
from tidegate.providers.base import JSONObject, MalformedChunk, Provider, StreamEnd, StreamItem
from tidegate.providers.redact import NO_SECRETS, Redactor
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
    NO_CLIENT_TIMEOUT,
    HTTPAnswer,
    answer_object,
    exception_to_error,
    kind_for_status,
    not_an_answer,
    parse_json_object,
    retry_after_from,
)
from tidegate.providers.wire import chat_chunk
from tidegate.timers import timeout_after, timeout_at

__all__ = [
    "EVENT_STREAM",
    "SIGNING_NAME",
    "BedrockErrorReport",
    "BedrockOptions",
    "BedrockProvider",
    "BedrockTarget",
    "ConverseStreamTranslator",
    "bedrock_error",
    "bedrock_error_for",
    "build",
    "converse_response_problem",
    "default_endpoint",
    "error_type_of",
    "finish_reason_for",
    "from_converse_response",
    "to_converse_request",
]

#: The service name SigV4 signs bedrock-runtime's requests for.
SIGNING_NAME = "bedrock"
#: The content type of ConverseStream's answer.
EVENT_STREAM = "application/vnd.amazon.eventstream"

K = ProviderErrorKind

_EXTRA = "botocore is not installed: install the extra with `pip install 'tidegate[bedrock]'`"


class BedrockOptions(BaseModel):
    """The ``bedrock:`` section of a provider of this type."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The AWS region; default: ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile's region.
    region: str | None = Field(default=None, min_length=1)
    #: A named profile of the shared files; default: ``AWS_PROFILE``, else ``default``.
    profile: str | None = Field(default=None, min_length=1)
    #: The shared credentials file (relative to the config file's folder); default: botocore's.
    credentials_file: Path | None = None
    #: The shared config file (profiles with roles, SSO, regions), relative likewise.
    config_file: Path | None = None
    #: A guardrail applied to every call: its identifier (id or ARN) and its version.
    guardrail_identifier: str | None = Field(default=None, min_length=1)
    guardrail_version: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _guardrail_whole(self) -> BedrockOptions:
        if (self.guardrail_identifier is None) != (self.guardrail_version is None):
            raise ValueError("guardrail_identifier and guardrail_version go together")
        return self


@dataclass(frozen=True, slots=True)
class BedrockTarget:
    """Where and what a provider calls: the endpoint, the region, the model, a guardrail."""

    endpoint: str
    region: str
    model: str
    guardrail: JSONObject | None = None


# --------------------------------------------------------------------------- the request

_SYSTEM_ROLES = frozenset({"system", "developer"})
_IMAGE_FORMATS: Mapping[str, str] = {
    "png": "png",
    "jpeg": "jpeg",
    "jpg": "jpeg",
    "gif": "gif",
    "webp": "webp",
}


def _refuse(what: str, provider: str) -> ProviderError:
    return ProviderError(
        K.BAD_REQUEST, f"the Bedrock translation does not support {what}", provider=provider
    )


def _unsupported(body: JSONObject, provider: str) -> None:
    refused = refused_features(body, ("functions", "audio", "prediction"))
    if body.get("parallel_tool_calls") is False and body.get("tools"):
        refused.append("parallel_tool_calls: false")
    if refused:
        raise _refuse(", ".join(refused), provider)
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if isinstance(value, int | float) and not 0 <= value <= 1:
            raise ProviderError(
                K.BAD_REQUEST,
                f"Bedrock takes {key} between 0 and 1, got {value!r}",
                provider=provider,
            )


def _image_block(url: str, provider: str) -> JSONObject:
    """An image part as Converse has it: bytes from a base64 data URL, or an S3 location."""
    if url.startswith("data:"):
        media_type, base64, data = data_url(url)
        fmt = _IMAGE_FORMATS.get(media_type.removeprefix("image/").lower())
        if not base64 or not media_type.startswith("image/") or fmt is None:
            raise ProviderError(
                K.BAD_REQUEST,
                "an image data URL must be base64 PNG, JPEG, GIF or WebP",
                provider=provider,
            )
        return {"image": {"format": fmt, "source": {"bytes": data}}}
    if url.startswith("s3://"):
        fmt = _IMAGE_FORMATS.get(url.rpartition(".")[2].lower())
        if fmt is None:
            raise _refuse("an S3 image whose name does not end in its format", provider)
        return {"image": {"format": fmt, "source": {"s3Location": {"uri": url}}}}
    raise _refuse("image URLs on the web (send a base64 data URL or an s3:// URI)", provider)


def _blocks(content: Any, provider: str) -> list[JSONObject]:
    """Message content as Converse content blocks (empty text is left out: Bedrock refuses it)."""
    blocks: list[JSONObject] = []
    for kind, value in content_parts(content, provider, "Bedrock"):
        if kind == "image_url":
            blocks.append(_image_block(value, provider))
        elif text := str(value or ""):
            blocks.append({"text": text})
    return blocks


def _text_of(blocks: list[JSONObject]) -> str:
    return "".join(str(block["text"]) for block in blocks if "text" in block)


def _tool_use(call: Any, provider: str) -> JSONObject:
    """An OpenAI tool call as a ``toolUse`` block (its arguments must be a JSON object)."""
    function, arguments = tool_call_function(call, provider)
    return {
        "toolUse": {
            "toolUseId": str(call.get("id", "")),
            "name": str(function.get("name", "")),
            "input": arguments,
        }
    }


def _tool_result(message: JSONObject) -> JSONObject:
    return {
        "toolResult": {
            "toolUseId": str(message.get("tool_call_id", "")),
            "content": [{"text": tool_result_text(message)}],
        }
    }


def _turns(messages: Any, provider: str) -> tuple[list[JSONObject], list[JSONObject]]:
    """``system`` blocks and the alternating ``messages`` of a Converse request."""
    system: list[JSONObject] = []
    turns: list[JSONObject] = []
    for message in messages or []:
        role = message.get("role") if isinstance(message, dict) else None
        if role in _SYSTEM_ROLES:
            text = _text_of(_blocks(message.get("content"), provider))
            if text:
                system.append({"text": text})
            continue
        if role == "tool":  # a tool's result: the user's turn, as Converse has it
            role, blocks = "user", [_tool_result(message)]
        elif role in ("user", "assistant"):
            blocks = _blocks(message.get("content"), provider)
            blocks += [_tool_use(call, provider) for call in message.get("tool_calls") or ()]
        else:
            raise _refuse(f"{role!r} messages", provider)
        if blocks:
            append_turn(turns, role, blocks, "content")
    return system, turns


def _tool_spec(function: JSONObject) -> JSONObject:
    spec: JSONObject = {
        "name": str(function.get("name", "")),
        "inputSchema": {"json": function.get("parameters") or {"type": "object"}},
    }
    if function.get("description"):
        spec["description"] = str(function["description"])
    if function.get("strict") is True:
        spec["strict"] = True
    return {"toolSpec": spec}


def _has_tool_blocks(turns: list[JSONObject]) -> bool:
    return any(
        "toolUse" in block or "toolResult" in block for turn in turns for block in turn["content"]
    )


def _tool_config(body: JSONObject, turns: list[JSONObject], provider: str) -> JSONObject | None:
    """``toolConfig`` for ``tools`` and ``tool_choice`` (``None``: no tools offered)."""
    refusal = "the Bedrock translation does not support tools other than functions"
    tools = [_tool_spec(function) for function in function_tools(body, provider, refusal=refusal)]
    choice = body.get("tool_choice")
    if choice == "none":
        # Converse has no "none": the tools are not offered, unless the turns already use them
        # (Bedrock then requires toolConfig, and would let the model call them).
        if tools and _has_tool_blocks(turns):
            raise _refuse("tool_choice 'none' in a conversation that uses tools", provider)
        return None
    if not tools:
        return None
    config: JSONObject = {"tools": tools}
    if choice == "auto":
        config["toolChoice"] = {"auto": {}}
    elif choice == "required":
        config["toolChoice"] = {"any": {}}
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        config["toolChoice"] = {"tool": {"name": str(choice["function"].get("name", ""))}}
    elif choice is not None:
        raise _refuse(f"tool_choice {choice!r}", provider)
    return config


def _inference_config(body: JSONObject) -> JSONObject:
    config: JSONObject = {}
    max_tokens = max_tokens_of(body)
    if max_tokens is not None:
        config["maxTokens"] = max_tokens
    if body.get("temperature") is not None:
        config["temperature"] = body["temperature"]
    if body.get("top_p") is not None:
        config["topP"] = body["top_p"]
    stop = stop_sequences(body)
    if stop:
        config["stopSequences"] = [str(item) for item in stop]
    return config


def to_converse_request(
    body: JSONObject, *, provider: str = "", guardrail: JSONObject | None = None
) -> JSONObject:
    """The Converse request body for an OpenAI chat body (``modelId`` travels in the path).

    Refused as ``bad_request`` before any call: what Converse cannot carry faithfully (see
    :func:`_unsupported`). Ignored: ``user``, ``seed``, the penalties, ``logit_bias``.
    """
    _unsupported(body, provider)
    system, turns = _turns(body.get("messages"), provider)
    request: JSONObject = {"messages": turns}
    if system:
        request["system"] = system
    inference = _inference_config(body)
    if inference:
        request["inferenceConfig"] = inference
    tools = _tool_config(body, turns, provider)
    if tools is not None:
        request["toolConfig"] = tools
    if guardrail:
        request["guardrailConfig"] = dict(guardrail)
    return request


# --------------------------------------------------------------------------- the answer

_FINISH: Mapping[str, str] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "guardrail_intervened": "content_filter",
    "content_filtered": "content_filter",
}
_MALFORMED_STOPS = frozenset({"malformed_model_output", "malformed_tool_use"})


def finish_reason_for(stop_reason: Any) -> str | None:
    """OpenAI's ``finish_reason`` for a Converse ``stopReason`` (unknown ones become stop)."""
    if stop_reason is None:
        return None
    return _FINISH.get(str(stop_reason), "stop")


def _check_stop(stop_reason: Any, provider: str) -> None:
    if stop_reason in _MALFORMED_STOPS:
        raise ProviderError(
            K.MALFORMED, f"Bedrock stopped with {stop_reason}", provider=provider, status=200
        )


def converse_response_problem(data: JSONObject) -> str | None:
    """Why ``data`` is not a usable Converse response, or ``None`` when it is one."""
    output = data.get("output")
    if not isinstance(output, dict):
        return "no output" if output is None else "output is not an object"
    message = output.get("message")
    if not isinstance(message, dict):
        return "no output message"
    content = message.get("content")
    if not isinstance(content, list):
        return "content is not a list"
    if not all(isinstance(block, dict) for block in content):
        return "a content block that is not an object"
    usage = data.get("usage")
    if usage is not None and not isinstance(usage, dict):
        return "usage is not an object"
    return None


def _usage(raw: Mapping[str, Any]) -> JSONObject:
    cached = token_count(raw.get("cacheReadInputTokens"))
    # OpenAI's prompt_tokens includes cached input; Converse counts cache reads and writes apart.
    prompt = token_count(raw.get("inputTokens")) + cached
    prompt += token_count(raw.get("cacheWriteInputTokens"))
    return usage_with_cache(prompt, token_count(raw.get("outputTokens")), cached)


def from_converse_response(data: JSONObject, *, id: str, model: str, created: int) -> JSONObject:
    """The ``chat.completion`` for a Converse response that
    :func:`converse_response_problem` accepted."""
    blocks = [block for block in data["output"]["message"]["content"] if isinstance(block, dict)]
    calls = []
    for block in blocks:
        use = block.get("toolUse")
        if isinstance(use, dict):
            name = str(use.get("name", ""))
            calls.append(tool_call(str(use.get("toolUseId", "")), name, use.get("input") or {}))
    text = "".join(str(block["text"]) for block in blocks if isinstance(block.get("text"), str))
    return completion_with_calls(
        id=id,
        model=model,
        created=created,
        text=text,
        finish_reason=finish_reason_for(data.get("stopReason")),
        usage=_usage(data.get("usage") or {}),
        calls=calls,
    )


# --------------------------------------------------------------------------- errors

#: Kind and status of each error type, by its lower-cased name (stream exceptions are camelCase).
_ERROR_TYPES: Mapping[str, tuple[ProviderErrorKind, int]] = {
    "throttlingexception": (K.RATE_LIMITED, 429),
    "toomanyrequestsexception": (K.RATE_LIMITED, 429),
    "servicequotaexceededexception": (K.RATE_LIMITED, 400),
    "serviceunavailableexception": (K.OVERLOADED, 503),
    "modelnotreadyexception": (K.OVERLOADED, 429),
    "modeltimeoutexception": (K.TIMEOUT, 408),
    "internalserverexception": (K.SERVER, 500),
    "internalfailure": (K.SERVER, 500),
    "modelerrorexception": (K.SERVER, 424),
    "modelstreamerrorexception": (K.SERVER, 424),
    "validationexception": (K.BAD_REQUEST, 400),
    "accessdeniedexception": (K.AUTH, 403),
    "unrecognizedclientexception": (K.AUTH, 403),
    "invalidsignatureexception": (K.AUTH, 403),
    "signaturedoesnotmatchexception": (K.AUTH, 403),
    "incompletesignatureexception": (K.AUTH, 403),
    "missingauthenticationtokenexception": (K.AUTH, 403),
    "expiredtokenexception": (K.AUTH, 403),
    "resourcenotfoundexception": (K.NOT_FOUND, 404),
}
_TOO_LONG = re.compile(
    r"too long|too many (input )?tokens|context (length|window|limit)|exceeds? (the )?"
    r"(maximum |max )?(context|input (length|tokens?))|max(imum)? input tokens",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class BedrockErrorReport:
    """What Bedrock said of a failure: the bare error type (``ThrottlingException``, or ``""``),
    its raw text, the HTTP status (0 for an exception event inside a stream), the headers."""

    type: str
    text: str
    status: int
    headers: Mapping[str, str]


def bedrock_error(
    report: BedrockErrorReport,
    *,
    provider: str,
    now_wall: float,
    redactor: Redactor = NO_SECRETS,
) -> ProviderError:
    """The :class:`ProviderError` for one Bedrock error (see the module table); the message is
    cleaned by ``redactor``, and a ``Retry-After`` is kept (Bedrock seldom sends one)."""
    status, error_type = report.status, report.type
    known = _ERROR_TYPES.get(error_type.lower())
    if known is not None:
        kind, status = known[0], status or known[1]
        if kind is K.BAD_REQUEST and _TOO_LONG.search(report.text):
            kind = K.CONTEXT_LENGTH
    else:
        status = status or (500 if error_type else 0)
        kind = kind_for_status(status, report.text, _TOO_LONG, overloaded=(503,))
    if kind is K.MALFORMED:
        message = f"HTTP {status} with a body that is not the expected JSON"
    else:
        head = " ".join(part for part in (f"HTTP {status}", redactor.code(error_type)) if part)
        request_id = report.headers.get("x-amzn-requestid", "")
        message = redactor.message(report.text, head=head, request_id=request_id)
    return ProviderError(
        kind,
        message,
        provider=provider,
        retryable=False if error_type.lower() == "servicequotaexceededexception" else None,
        retry_after=retry_after_from(report.headers, now_wall),
        status=status,
    )


def error_type_of(headers: Mapping[str, str], data: JSONObject | None) -> str:
    """The bare error type of an answer: ``X-Amzn-ErrorType`` (``Name:uri``), else the body's
    ``__type`` (``namespace#Name``), else ``code``."""
    raw = headers.get("x-amzn-errortype") or ""
    if not raw and data is not None:
        found = data.get("__type") or data.get("code") or ""
        raw = found if isinstance(found, str) else ""
    return raw.split(":", 1)[0].rsplit("#", 1)[-1].strip()


def bedrock_error_for(
    answer: HTTPAnswer, *, provider: str, now_wall: float, redactor: Redactor = NO_SECRETS
) -> ProviderError:
    """The :class:`ProviderError` for an unsuccessful Converse answer (see the module table)."""
    data = parse_json_object(answer.body)
    text = ""
    if data is not None:
        found = data.get("message") or data.get("Message")
        text = found if isinstance(found, str) else ""
    elif answer.body:
        text = answer.body[:4096].decode("utf-8", errors="replace")
    report = BedrockErrorReport(
        error_type_of(answer.headers, data), text, answer.status, answer.headers
    )
    return bedrock_error(report, provider=provider, now_wall=now_wall, redactor=redactor)


# --------------------------------------------------------------------------- the stream


class _Event(NamedTuple):
    """One event-stream message: ``:message-type``, the event or exception type, payload."""

    message_type: str
    event_type: str
    payload: bytes
    headers: Mapping[str, Any]


class ConverseStreamTranslator:
    """Turns ConverseStream events into ``chat.completion.chunk`` dicts, one event at a time.

    ``done`` turns true at ``messageStop`` (the answer is whole); ``finished`` at ``metadata``,
    the last event, which carries the usage (a usage-only chunk when ``include_usage``).
    """

    __slots__ = (
        "_created",
        "_id",
        "_model",
        "_provider",
        "_tools",
        "done",
        "finished",
        "include_usage",
    )

    def __init__(
        self, *, id: str, model: str, created: int, include_usage: bool = False, provider: str = ""
    ) -> None:
        self._id, self._model, self._created = id, model, created
        self._provider = provider
        #: Tool-call index (OpenAI's) of each ``toolUse`` block, by content block index.
        self._tools: dict[Any, int] = {}
        self.include_usage = include_usage
        self.done = False
        self.finished = False

    def _chunk(self, **fields: Any) -> JSONObject:
        return chat_chunk(id=self._id, model=self._model, created=self._created, **fields)

    def feed(self, event_type: str, data: JSONObject) -> list[JSONObject]:
        """The chunks for one event (often none)."""
        if event_type == "messageStart":
            return [self._chunk(delta={"role": "assistant", "content": ""})]
        if event_type == "contentBlockStart":
            start = data.get("start")
            use = start.get("toolUse") if isinstance(start, dict) else None
            return self._tool_start(data.get("contentBlockIndex"), use)
        if event_type == "contentBlockDelta":
            delta = data.get("delta")
            if not isinstance(delta, dict):
                return []
            if isinstance(delta.get("toolUse"), dict):
                return self._tool_piece(data.get("contentBlockIndex"), delta["toolUse"])
            text = delta.get("text")
            return [self._chunk(delta={"content": text})] if isinstance(text, str) and text else []
        if event_type == "messageStop":
            stop_reason = data.get("stopReason")
            _check_stop(stop_reason, self._provider)
            self.done = True
            finish = finish_reason_for(stop_reason) or "stop"
            return [self._chunk(delta={}, finish_reason=finish)]
        if event_type == "metadata":
            self.finished = True
            usage = data.get("usage")
            if self.include_usage and isinstance(usage, dict):
                return [self._chunk(usage=_usage(usage))]
        return []  # contentBlockStop, and event types added after this was written

    def _tool_start(self, position: Any, use: Any) -> list[JSONObject]:
        if not isinstance(use, dict):
            return []
        index = self._tools[position] = len(self._tools)
        call = tool_call_delta(index, str(use.get("toolUseId", "")), str(use.get("name", "")))
        return [self._chunk(delta={"tool_calls": [call]})]

    def _tool_piece(self, position: Any, use: JSONObject) -> list[JSONObject]:
        piece = use.get("input")
        if position not in self._tools or not isinstance(piece, str) or not piece:
            return []
        call = tool_arguments_delta(self._tools[position], piece)
        return [self._chunk(delta={"tool_calls": [call]})]


@dataclass(frozen=True, slots=True)
class _Limits:
    """A stream's three time limits, and the deadline that applies next."""

    timeout: float
    chunk_timeout: float | None
    total_timeout: float | None
    started: float

    def next(self, now: float, *, first: bool) -> tuple[float | None, str]:
        if first:
            candidates = [(self.started + self.timeout, f"no first chunk within {self.timeout:g}s")]
        elif self.chunk_timeout is not None:
            candidates = [(now + self.chunk_timeout, f"no chunk for {self.chunk_timeout:g}s")]
        else:
            candidates = []
        if self.total_timeout is not None:
            candidates.append(
                (self.started + self.total_timeout, f"the stream ran past {self.total_timeout:g}s")
            )
        if not candidates:
            return None, ""
        return min(candidates, key=lambda pair: pair[0])


def _decoded(buffer: Any, provider: str) -> list[_Event]:
    """The whole messages in botocore's event-stream buffer; a bad frame is ``malformed``."""
    from botocore.eventstream import ParserError  # type: ignore[import-untyped]

    events: list[_Event] = []
    try:
        for message in buffer:
            headers: Mapping[str, Any] = message.headers
            message_type = str(headers.get(":message-type", "event"))
            name = headers.get(":exception-type") or headers.get(":event-type") or ""
            if message_type == "error":
                name = headers.get(":error-code") or ""
            events.append(_Event(message_type, str(name), bytes(message.payload), headers))
    except ParserError as exc:
        raise ProviderError(
            K.MALFORMED, f"a damaged event-stream frame ({type(exc).__name__})", provider=provider
        ) from None
    return events


# --------------------------------------------------------------------------- the provider


class _Signer:
    """SigV4 with botocore: ``credentials`` is botocore's (refreshed off the event loop)."""

    __slots__ = ("_credentials", "_region")

    def __init__(self, credentials: Any, region: str) -> None:
        self._credentials = credentials
        self._region = region

    async def frozen(self) -> Any:
        """The current access key, secret and token (a refresh runs in a worker thread)."""
        refresh_needed = getattr(self._credentials, "refresh_needed", None)
        if callable(refresh_needed) and refresh_needed():
            return await asyncio.to_thread(self._credentials.get_frozen_credentials)
        return self._credentials.get_frozen_credentials()

    def sign(
        self, frozen: Any, url: str, body: bytes, headers: Mapping[str, str]
    ) -> dict[str, str]:
        from botocore.auth import SigV4Auth  # type: ignore[import-untyped]
        from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]

        request = AWSRequest(method="POST", url=url, data=body, headers=dict(headers))
        SigV4Auth(frozen, SIGNING_NAME, self._region).add_auth(request)
        return {str(name): str(value) for name, value in request.headers.items()}


class BedrockProvider:
    """Chat completions and streams from Bedrock's Converse API, in the OpenAI wire format.

    ``session`` is the process's shared ``aiohttp.ClientSession``, borrowed and never closed.
    ``credentials`` are botocore's (from ``Session().get_credentials()``), used to sign every
    request with SigV4; ``api_key`` instead is a Bedrock API key sent as a bearer token. The
    model is the body's ``model`` when it is a string, else ``target.model``. ``clock`` stamps
    ``created``.
    """

    def __init__(
        self,
        name: str,
        target: BedrockTarget,
        session: aiohttp.ClientSession,
        *,
        credentials: Any = None,
        api_key: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        if credentials is None and not api_key:
            raise ValueError("a Bedrock provider needs AWS credentials or an API key")
        self.name = name
        self.target = target
        self._session = session
        self._clock: Clock = clock or SystemClock()
        self._api_key = api_key
        self._signer = None if api_key else _Signer(credentials, target.region)
        self._secrets: tuple[str | None, ...] = (api_key,)
        self._redactor = Redactor(self._secrets)

    def __repr__(self) -> str:
        return f"BedrockProvider(name={self.name!r}, endpoint={self.target.endpoint!r})"

    async def complete(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """POST ``/model/{modelId}/converse`` and translate the answer."""
        model, url, payload = self._request(body, "converse")
        headers = await self._headers(url, payload, accept="application/json")
        answer = await self._post(url, payload, headers, timeout)
        data = answer_object(
            answer,
            converse_response_problem,
            error_for=self._error_for,
            provider=self.name,
            redactor=self._redactor,
        )
        _check_stop(data.get("stopReason"), self.name)
        return from_converse_response(
            data,
            id=self._completion_id(answer.headers),
            model=model,
            created=int(self._clock.wall()),
        )

    async def stream(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
        chunk_timeout: float | None = None,
        total_timeout: float | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """POST ``/model/{modelId}/converse-stream`` and yield OpenAI chunks.

        ``StreamEnd(done_seen=True)`` follows a stream that reached ``messageStop``; an event
        whose payload is not a JSON object is yielded as :class:`MalformedChunk`; an exception
        event is raised as the :class:`ProviderError` it describes.
        """
        model, url, payload = self._request(body, "converse-stream")
        headers = await self._headers(url, payload, accept=EVENT_STREAM)
        include_usage = includes_usage(body)
        loop = asyncio.get_running_loop()
        limits = _Limits(timeout, chunk_timeout, total_timeout, loop.time())
        translator: ConverseStreamTranslator | None = None
        events = self._events(url, payload, headers, limits)
        async with aclosing(events):
            async for response_headers, event in events:
                if translator is None:
                    translator = ConverseStreamTranslator(
                        id=self._completion_id(response_headers),
                        model=model,
                        created=int(self._clock.wall()),
                        include_usage=include_usage,
                        provider=self.name,
                    )
                if event.message_type != "event":
                    raise self._stream_error(event)
                data = parse_json_object(event.payload)
                if data is None:
                    yield MalformedChunk(event.payload.decode("utf-8", errors="replace"))
                    continue
                for chunk in translator.feed(event.event_type, data):
                    yield chunk
                if translator.finished:
                    break
        yield StreamEnd(done_seen=translator is not None and translator.done)

    async def embed(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """Converse has no embeddings: always ``ProviderError(kind="bad_request")``."""
        raise ProviderError(
            K.BAD_REQUEST,
            "the bedrock provider type does not offer embeddings (Converse has none)",
            provider=self.name,
        )

    async def aclose(self) -> None:
        """Nothing to release: the session belongs to whoever created it."""

    # ------------------------------------------------------------------ plumbing

    def _request(self, body: JSONObject, operation: str) -> tuple[str, str, bytes]:
        """The model, the URL and the body bytes of one call (translation errors raise here)."""
        from botocore.utils import percent_encode  # type: ignore[import-untyped]

        model = body.get("model")
        model = model if isinstance(model, str) and model else self.target.model
        request = to_converse_request(body, provider=self.name, guardrail=self.target.guardrail)
        url = f"{self.target.endpoint}/model/{percent_encode(model)}/{operation}"
        return model, url, orjson.dumps(request)

    async def _headers(self, url: str, payload: bytes, *, accept: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": accept}
        if self._signer is None:
            headers["Authorization"] = f"Bearer {self._api_key}"
            return headers
        try:
            frozen = await self._signer.frozen()
        except Exception as exc:  # botocore's refresh failed: tidegate's credentials, not a bug
            message = self._redactor.message(str(exc), head="cannot refresh the AWS credentials")
            raise ProviderError(K.AUTH, message, provider=self.name) from None
        secrets = (self._api_key, frozen.secret_key, frozen.token)
        if secrets != self._secrets:  # new credentials: keep them out of messages too
            self._secrets, self._redactor = secrets, Redactor(secrets)
        return self._signer.sign(frozen, url, payload, headers)

    def _error_for(self, answer: HTTPAnswer) -> ProviderError:
        return bedrock_error_for(
            answer, provider=self.name, now_wall=self._clock.wall(), redactor=self._redactor
        )

    def _completion_id(self, headers: Mapping[str, str]) -> str:
        request_id = self._redactor.request_id(headers.get("x-amzn-requestid", ""))
        return f"chatcmpl-{request_id or 'bedrock'}"

    def _error(self, exc: Exception, reason: str) -> NoReturn:
        """Raise the :class:`ProviderError` for a client-side failure (or ``exc`` itself)."""
        error = exception_to_error(
            exc, provider=self.name, timeout_message=reason, redactor=self._redactor
        )
        if error is None or error is exc:
            raise exc
        raise error from exc

    async def _post(
        self,
        url: str,
        payload: bytes,
        headers: Mapping[str, str],
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> HTTPAnswer:
        """POST the exact bytes that were signed, and read the whole answer within timeout."""
        try:
            async with (
                timeout_after(timeout),
                self._session.post(
                    URL(url, encoded=True),
                    data=payload,
                    headers=headers,
                    timeout=NO_CLIENT_TIMEOUT,
                ) as response,
            ):
                return HTTPAnswer(response.status, response.headers, await response.read())
        except Exception as exc:
            self._error(exc, f"no answer within {timeout:g}s")

    async def _events(
        self, url: str, payload: bytes, headers: Mapping[str, str], limits: _Limits
    ) -> AsyncGenerator[tuple[Mapping[str, str], _Event], None]:
        """POST and yield the event-stream messages of the answer, with its headers."""
        from botocore.eventstream import EventStreamBuffer

        loop = asyncio.get_running_loop()
        deadline, reason = limits.next(loop.time(), first=True)
        response: aiohttp.ClientResponse | None = None
        try:
            async with timeout_at(deadline):
                response = await self._session.post(
                    URL(url, encoded=True), data=payload, headers=headers, timeout=NO_CLIENT_TIMEOUT
                )
                content_type = response.headers.get("content-type", "")
                if response.status >= 300 or not content_type.startswith(EVENT_STREAM):
                    answer = HTTPAnswer(response.status, response.headers, await response.read())
                    raise self._not_a_stream(answer)
            buffer = EventStreamBuffer()
            while True:
                async with timeout_at(deadline):
                    data = await response.content.readany()
                if not data:
                    return
                buffer.add_data(data)
                for event in _decoded(buffer, self.name):
                    yield response.headers, event
                    deadline, reason = limits.next(loop.time(), first=False)
        except Exception as exc:
            self._error(exc, reason)
        finally:
            if response is not None and not response.closed:
                with suppress(Exception):
                    if response.content.at_eof():
                        response.release()  # the body is complete: the connection may be reused
                    else:
                        response.close()

    def _not_a_stream(self, answer: HTTPAnswer) -> ProviderError:
        if answer.status >= 300:
            return self._error_for(answer)
        return not_an_answer(
            answer,
            f"not an event stream ({answer.headers.get('content-type', 'no content type')})",
            provider=self.name,
            redactor=self._redactor,
            data=parse_json_object(answer.body),
        )

    def _stream_error(self, event: _Event) -> ProviderError:
        """The error an ``exception`` (or ``error``) message inside the stream describes."""
        data = parse_json_object(event.payload) or {}
        text = data.get("message") or data.get("Message") or event.headers.get(":error-message")
        report = BedrockErrorReport(event.event_type, text if isinstance(text, str) else "", 0, {})
        return bedrock_error(
            report, provider=self.name, now_wall=self._clock.wall(), redactor=self._redactor
        )


# --------------------------------------------------------------------------- building one


def default_endpoint(region: str) -> str:
    """bedrock-runtime's regional endpoint."""
    suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"https://bedrock-runtime.{region}.{suffix}"


def _aws_session(name: str, options: BedrockOptions, base_dir: Path) -> Any:
    """A botocore session with the configured profile and files (botocore imported here)."""
    try:
        import botocore.session  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(f"providers.{name}: type bedrock needs botocore; {_EXTRA}") from None
    from botocore.exceptions import BotoCoreError  # type: ignore[import-untyped]

    try:
        aws = botocore.session.Session(profile=options.profile)
        for key in ("credentials_file", "config_file"):
            path: Path | None = getattr(options, key)
            if path is not None:
                aws.set_config_variable(key, str(path if path.is_absolute() else base_dir / path))
        aws.get_scoped_config()  # a missing profile fails here, at start-up
    except BotoCoreError as exc:
        raise ConfigError(f"providers.{name}.bedrock: {NO_SECRETS.clean(str(exc))}") from None
    return aws


def _credentials(name: str, aws: Any) -> Any:
    from botocore.exceptions import BotoCoreError

    try:
        credentials = aws.get_credentials()
    except BotoCoreError as exc:
        raise ConfigError(
            f"providers.{name}.bedrock: cannot read AWS credentials: {NO_SECRETS.clean(str(exc))}"
        ) from None
    if credentials is None:
        raise ConfigError(
            f"providers.{name}: no AWS credentials found (environment variables, the shared "
            "credentials file, bedrock.profile, bedrock.credentials_file), and no api_key_file "
            "with a Bedrock API key"
        )
    return credentials


def build(
    name: str,
    *,
    model: str,
    base_url: str | None,
    api_key: str | None,
    options: BedrockOptions | None,
    session: aiohttp.ClientSession,
    clock: Clock,
    base_dir: Path,
) -> Provider:
    """The provider for one config section (files named in ``options`` relative to base_dir).

    With ``api_key`` (``api_key_file``: a Bedrock API key) requests carry it as a bearer token;
    otherwise they are signed with the credentials of botocore's chain, found here at start-up.
    """
    options = options or BedrockOptions()
    aws = _aws_session(name, options, base_dir)
    region = options.region or os.environ.get("AWS_REGION") or aws.get_config_variable("region")
    if not region:
        raise ConfigError(
            f"providers.{name}.bedrock.region: no AWS region (set it, or AWS_REGION, or a "
            "region in the profile)"
        )
    guardrail = None
    if options.guardrail_identifier and options.guardrail_version:
        guardrail = {
            "guardrailIdentifier": options.guardrail_identifier,
            "guardrailVersion": options.guardrail_version,
        }
    target = BedrockTarget(
        endpoint=(base_url or default_endpoint(region)).rstrip("/"),
        region=region,
        model=model,
        guardrail=guardrail,
    )
    credentials = None if api_key else _credentials(name, aws)
    return BedrockProvider(
        name, target, session, credentials=credentials, api_key=api_key, clock=clock
    )
