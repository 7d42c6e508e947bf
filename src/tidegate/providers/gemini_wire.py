"""The Gemini ``generateContent`` wire format, translated to and from OpenAI's chat format.

Pure functions and one stream translator, no I/O: :mod:`tidegate.providers.gemini` sends what
:func:`to_generate_request` builds and reads the answers back with
:func:`from_generate_response`, :class:`GeminiStreamTranslator` and :func:`gemini_error_for`.
The same wire format serves the Gemini API and Vertex AI. docs/providers/gemini.md has the
tables.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

import orjson

from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.ids import new_id
from tidegate.providers.base import JSONObject
from tidegate.providers.redact import NO_SECRETS, Redactor, request_id_of
from tidegate.providers.translate import (
    append_turn,
    content_parts,
    data_url,
    function_tools,
    max_tokens_of,
    stop_sequences,
    token_count,
    tool_call,
    tool_call_function,
    tool_result_text,
    usage_with_cache,
)
from tidegate.providers.transport import (
    HTTPAnswer,
    kind_for_status,
    parse_json_object,
    retry_after_from,
)
from tidegate.providers.wire import chat_chunk, chat_completion

__all__ = [
    "BLOCKING_FINISH_REASONS",
    "GeminiStreamTranslator",
    "finish_reason_for",
    "from_generate_response",
    "gemini_error_for",
    "generate_response_problem",
    "retry_delay_of",
    "to_generate_request",
]

K = ProviderErrorKind

#: Candidate finish reasons that mean a safety system withheld the answer.
BLOCKING_FINISH_REASONS: Final = frozenset(
    {
        "SAFETY",
        "RECITATION",
        "BLOCKLIST",
        "PROHIBITED_CONTENT",
        "SPII",
        "IMAGE_SAFETY",
        "IMAGE_PROHIBITED_CONTENT",
        "IMAGE_RECITATION",
        "MODEL_ARMOR",
    }
)
#: Finish reasons that mean the model produced no usable answer this time (worth a retry).
_BROKEN_FINISH_REASONS: Final = frozenset(
    {"MALFORMED_FUNCTION_CALL", "UNEXPECTED_TOOL_CALL", "TOO_MANY_TOOL_CALLS", "MALFORMED_RESPONSE"}
)
_SYSTEM_ROLES = frozenset({"system", "developer"})
_TOO_LONG = re.compile(
    r"input token count|exceeds the max(imum)? number of tokens|(context|token) (limit|window)"
    r"|context length|prompt is too long",
    re.IGNORECASE,
)
_BAD_KEY = re.compile(r"api key not valid|api_key_invalid", re.IGNORECASE)
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)s\s*")
_STATUS_OF_NAME: Mapping[str, int] = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "INTERNAL": 500,
    "UNKNOWN": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
#: A tool call id made here: ``call_`` and a unique hex id, then ``-`` and the part's thought
#: signature (URL-safe base64) when it had one, so that the signature comes back with the call.
_CALL_PREFIX = "call_"


def _refuse(message: str, provider: str) -> ProviderError:
    return ProviderError(K.BAD_REQUEST, message, provider=provider)


# --------------------------------------------------------------------------- request


def _unsupported(body: JSONObject, provider: str) -> None:
    refused = [key for key in ("functions", "function_call", "audio") if body.get(key)]
    if body.get("logprobs") or body.get("top_logprobs"):
        refused.append("logprobs")
    modalities = body.get("modalities")
    if isinstance(modalities, list) and any(m != "text" for m in modalities):
        refused.append("modalities")
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict)
        or response_format.get("type") not in ("text", "json_object", "json_schema")
    ):
        refused.append("response_format")
    if refused:
        raise _refuse(f"the Gemini translation does not support {', '.join(refused)}", provider)


def _inline_data(url: str, provider: str) -> JSONObject:
    """A ``data:`` URL as an ``inlineData`` part; web URLs are refused (Gemini fetches none)."""
    if not url.startswith("data:"):
        raise _refuse("the Gemini translation takes images as base64 data: URLs only", provider)
    mime_type, is_base64, data = data_url(url)
    if not is_base64 or not mime_type or not data:
        raise _refuse("an image data URL must be base64 with a media type", provider)
    return {"inlineData": {"mimeType": mime_type, "data": data}}


def _parts(content: Any, provider: str) -> list[JSONObject]:
    parts: list[JSONObject] = []
    for kind, value in content_parts(content, provider, "Gemini"):
        if kind == "image_url":
            parts.append(_inline_data(value, provider))
        elif text := str(value):
            parts.append({"text": text})
    return parts


def _signature_of(call_id: str) -> str | None:
    """The thought signature carried in a tool call id made by :func:`_call_id`, if any."""
    if not call_id.startswith(_CALL_PREFIX) or "-" not in call_id:
        return None
    encoded = call_id.partition("-")[2]
    try:
        raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except (binascii.Error, ValueError):
        return None
    return base64.b64encode(raw).decode("ascii") if raw else None


def _call_id(signature: Any) -> str:
    ident = _CALL_PREFIX + new_id()
    if not isinstance(signature, str) or not signature:
        return ident
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        return ident
    return f"{ident}-{base64.urlsafe_b64encode(raw).decode('ascii').rstrip('=')}"


def _function_call_part(call: Any, provider: str) -> tuple[str, JSONObject]:
    """An OpenAI tool call as a ``functionCall`` part, and the call's id."""
    function, arguments = tool_call_function(call, provider, named=True)
    call_id = str(call.get("id", ""))
    part: JSONObject = {"functionCall": {"name": str(function["name"]), "args": arguments}}
    signature = _signature_of(call_id)
    if signature:
        part["thoughtSignature"] = signature
    return call_id, part


def _function_response_part(
    message: JSONObject, names: Mapping[str, str], provider: str
) -> JSONObject:
    call_id = str(message.get("tool_call_id", ""))
    name = names.get(call_id)
    if name is None:
        raise _refuse(
            "a tool message answers no earlier tool call (Gemini needs its name)", provider
        )
    text = tool_result_text(message)
    result = parse_json_object(text) if text.startswith("{") else None
    return {"functionResponse": {"name": name, "response": result or {"output": text}}}


def _contents(messages: Iterable[Any], provider: str) -> tuple[list[JSONObject], list[JSONObject]]:
    """The system parts and the ``contents`` turns for OpenAI ``messages``."""
    system: list[JSONObject] = []
    turns: list[JSONObject] = []
    names: dict[str, str] = {}  # tool call id -> function name, for the tool messages
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role in _SYSTEM_ROLES:
            system += _parts(message.get("content"), provider)
            continue
        if role == "user":
            parts = _parts(message.get("content"), provider)
        elif role == "assistant":
            role, parts = "model", _parts(message.get("content"), provider)
            for call in message.get("tool_calls") or ():
                call_id, part = _function_call_part(call, provider)
                names[call_id] = part["functionCall"]["name"]
                parts.append(part)
        elif role == "tool":
            role, parts = "user", [_function_response_part(message, names, provider)]
        else:
            raise _refuse(f"the Gemini translation does not support {role!r} messages", provider)
        if parts:
            append_turn(turns, role, parts, "parts")
    if any("text" not in part for part in system):
        raise _refuse("system messages must be text", provider)
    return system, turns


def _generation_config(body: JSONObject) -> JSONObject:
    config: JSONObject = {}
    max_tokens = max_tokens_of(body)
    if max_tokens is not None:
        config["maxOutputTokens"] = max_tokens
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_p", "topP"),
        ("seed", "seed"),
        ("presence_penalty", "presencePenalty"),
        ("frequency_penalty", "frequencyPenalty"),
    ):
        if body.get(ours) is not None:
            config[theirs] = body[ours]
    stop = stop_sequences(body)
    if stop:
        config["stopSequences"] = stop
    if body.get("n") not in (None, 1):
        config["candidateCount"] = body["n"]
    response_format = body.get("response_format") or {}
    if response_format.get("type") in ("json_object", "json_schema"):
        config["responseMimeType"] = "application/json"
        schema = (response_format.get("json_schema") or {}).get("schema")
        if isinstance(schema, dict):
            # JSON Schema as it is: responseSchema takes only an OpenAPI subset of it.
            config["responseJsonSchema"] = schema
    return config


def _declarations(body: JSONObject, provider: str) -> list[JSONObject]:
    """OpenAI function tools as ``functionDeclarations`` (the parameters' JSON Schema as it is)."""
    declarations = []
    refusal = "the Gemini translation takes function tools only"
    for function in function_tools(body, provider, refusal=refusal):
        entry: JSONObject = {"name": str(function.get("name", ""))}
        if function.get("description"):
            entry["description"] = str(function["description"])
        if isinstance(function.get("parameters"), dict):
            entry["parametersJsonSchema"] = function["parameters"]
        declarations.append(entry)
    return declarations


def _calling_config(choice: Any, provider: str) -> JSONObject | None:
    """``tool_choice`` as a ``functionCallingConfig`` (``None`` when the request has none)."""
    if choice is None:
        return None
    if choice in ("auto", "none"):
        return {"mode": str(choice).upper()}
    if choice == "required":
        return {"mode": "ANY"}
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        return {"mode": "ANY", "allowedFunctionNames": [str(choice["function"].get("name", ""))]}
    raise _refuse("tool_choice must be auto, none, required or a function", provider)


def _tools(body: JSONObject, provider: str) -> JSONObject:
    """``tools`` and ``tool_choice`` as ``tools`` / ``toolConfig``."""
    declarations = _declarations(body, provider)
    mode = _calling_config(body.get("tool_choice"), provider)
    options: JSONObject = {}
    if declarations:
        options["tools"] = [{"functionDeclarations": declarations}]
        if mode is not None:
            options["toolConfig"] = {"functionCallingConfig": mode}
    return options


def to_generate_request(body: JSONObject, *, provider: str = "") -> JSONObject:
    """The ``generateContent`` request for an OpenAI chat body (the model goes in the URL)."""
    _unsupported(body, provider)
    messages = body.get("messages") or []
    if not isinstance(messages, list):
        raise _refuse("messages must be a list", provider)
    system, contents = _contents(messages, provider)
    request: JSONObject = {"contents": contents}
    if system:
        request["systemInstruction"] = {"parts": system}
    config = _generation_config(body)
    if config:
        request["generationConfig"] = config
    request.update(_tools(body, provider))
    return request


# --------------------------------------------------------------------------- answers


def usage_from(meta: Mapping[str, Any]) -> JSONObject:
    """OpenAI ``usage`` for ``usageMetadata``: thinking counts as completion, tool-use prompt
    tokens as prompt; Gemini's own total when it gives one."""
    prompt = token_count(meta.get("promptTokenCount"))
    prompt += token_count(meta.get("toolUsePromptTokenCount"))
    thoughts = token_count(meta.get("thoughtsTokenCount"))
    completion = token_count(meta.get("candidatesTokenCount")) + thoughts
    result = usage_with_cache(prompt, completion, token_count(meta.get("cachedContentTokenCount")))
    result["total_tokens"] = token_count(meta.get("totalTokenCount")) or prompt + completion
    if thoughts:
        result["completion_tokens_details"] = {"reasoning_tokens": thoughts}
    return result


def finish_reason_for(reason: Any, *, called: bool = False) -> str | None:
    """OpenAI's ``finish_reason`` for a candidate's ``finishReason`` (``None`` while going)."""
    if not isinstance(reason, str) or not reason or reason == "FINISH_REASON_UNSPECIFIED":
        return None
    if reason in BLOCKING_FINISH_REASONS:
        return "content_filter"
    if reason == "MAX_TOKENS":
        return "length"
    return "tool_calls" if called else "stop"


def _blocked(reason: str, where: str, provider: str) -> ProviderError:
    return ProviderError(
        K.CONTENT_FILTER,
        f"Gemini's safety filter blocked the {where} ({reason})",
        provider=provider,
    )


def candidate_error(candidate: Mapping[str, Any], provider: str) -> ProviderError | None:
    """The error a candidate's finish reason stands for: a safety block, or a broken answer."""
    reason = candidate.get("finishReason")
    if reason in BLOCKING_FINISH_REASONS:
        return _blocked(str(reason), "answer", provider)
    if reason in _BROKEN_FINISH_REASONS:
        return ProviderError(
            K.MALFORMED, f"the model produced no usable answer ({reason})", provider=provider
        )
    return None


def prompt_block(data: Mapping[str, Any], provider: str) -> ProviderError | None:
    """The ``content_filter`` error for a blocked prompt (``promptFeedback.blockReason``)."""
    feedback = data.get("promptFeedback")
    reason = feedback.get("blockReason") if isinstance(feedback, dict) else None
    if not reason or reason == "BLOCKED_REASON_UNSPECIFIED":
        return None
    return _blocked(str(reason), "prompt", provider)


def generate_response_problem(data: JSONObject) -> str | None:
    """Why ``data`` is not a usable ``GenerateContentResponse``, or ``None`` when it is one."""
    if data.get("error"):
        return "an error object"
    candidates = data.get("candidates")
    if not isinstance(candidates, list) or not candidates:
        return "no candidates"
    for candidate in candidates:
        if not isinstance(candidate, dict):
            return "a candidate that is not an object"
        content = candidate.get("content")
        if content is not None and not (
            isinstance(content, dict) and isinstance(content.get("parts", []), list)
        ):
            return "a candidate whose content is not an object with a parts list"
    usage = data.get("usageMetadata")
    if usage is not None and not isinstance(usage, dict):
        return "usageMetadata is not an object"
    return None


def _parts_of(candidate: Mapping[str, Any]) -> list[JSONObject]:
    content = candidate.get("content")
    parts = content.get("parts") if isinstance(content, dict) else None
    return [part for part in parts or () if isinstance(part, dict)]


def _text_and_calls(parts: Iterable[JSONObject]) -> tuple[str, list[JSONObject]]:
    """The answer's text (thought summaries left out) and its function calls, OpenAI-shaped."""
    text: list[str] = []
    calls: list[JSONObject] = []
    for part in parts:
        if isinstance(part.get("text"), str) and not part.get("thought"):
            text.append(part["text"])
        call = part.get("functionCall")
        if isinstance(call, dict):
            arguments = call.get("args") if isinstance(call.get("args"), dict) else {}
            call_id = _call_id(part.get("thoughtSignature"))
            calls.append(tool_call(call_id, str(call.get("name", "")), arguments))
    return "".join(text), calls


def _choice(candidate: Mapping[str, Any], position: int, provider: str) -> JSONObject:
    text, calls = _text_and_calls(_parts_of(candidate))
    message: JSONObject = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    finish = finish_reason_for(candidate.get("finishReason"), called=bool(calls))
    if finish is None or candidate.get("finishReason") in _BROKEN_FINISH_REASONS:
        finish = "tool_calls" if calls else "stop"
    index = candidate.get("index")
    return {
        "index": index if isinstance(index, int) else position,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
    }


def from_generate_response(
    data: JSONObject, *, created: int, model: str, provider: str = ""
) -> JSONObject:
    """The ``chat.completion`` for a response :func:`generate_response_problem` accepted.

    A blocked prompt, or candidates that are all blocked or broken, raise; with several
    candidates the blocked ones become choices with ``finish_reason: content_filter``.
    """
    candidates: list[JSONObject] = data.get("candidates") or []
    errors = [candidate_error(candidate, provider) for candidate in candidates]
    if errors and all(error is not None for error in errors):
        raise errors[0] or ProviderError(K.MALFORMED, "no usable candidate", provider=provider)
    completion = chat_completion(
        id=str(data.get("responseId") or "chatcmpl-" + new_id()),
        model=str(data.get("modelVersion") or model),
        created=created,
        content=None,
        usage=usage_from(data.get("usageMetadata") or {}),
    )
    completion["choices"] = [
        _choice(candidate, position, provider) for position, candidate in enumerate(candidates)
    ]
    return completion


class GeminiStreamTranslator:
    """Turns ``streamGenerateContent`` events (each a ``GenerateContentResponse``) into
    ``chat.completion.chunk`` dicts.

    The first event gives the role chunk of each candidate; text parts become content deltas
    and function calls ``tool_calls`` deltas (whole: Gemini streams a call in one piece); a
    ``finishReason`` becomes the finish chunk. A blocked prompt or answer, a broken answer and
    an ``error`` event raise. ``done`` is true once every candidate seen has finished.
    """

    __slots__ = (
        "_calls",
        "_created",
        "_finished",
        "_id",
        "_model",
        "_provider",
        "_redactor",
        "_started",
        "_usage",
        "include_usage",
    )

    def __init__(
        self,
        *,
        created: int,
        model: str,
        include_usage: bool = False,
        provider: str = "",
        redactor: Redactor = NO_SECRETS,
    ) -> None:
        self._created = created
        self._model = model
        self._provider = provider
        self._redactor = redactor
        self._id = ""
        self._usage: JSONObject | None = None
        self._started: set[int] = set()
        self._finished: set[int] = set()
        #: Tool calls streamed so far, by candidate index.
        self._calls: dict[int, int] = {}
        self.include_usage = include_usage

    @property
    def done(self) -> bool:
        return bool(self._started) and self._started <= self._finished

    def _chunk(self, index: int, **fields: Any) -> JSONObject:
        chunk = chat_chunk(id=self._id, model=self._model, created=self._created, **fields)
        if chunk["choices"]:
            chunk["choices"][0]["index"] = index
        return chunk

    def feed(self, event: JSONObject) -> list[JSONObject]:
        """The chunks for one event."""
        if event.get("error"):
            raise gemini_error_for(
                HTTPAnswer(200, {}, orjson.dumps(event)),
                provider=self._provider,
                now_wall=0.0,
                redactor=self._redactor,
            )
        blocked = prompt_block(event, self._provider)
        if blocked is not None:
            raise blocked
        self._id = self._id or str(event.get("responseId") or "chatcmpl-" + new_id())
        self._model = str(event.get("modelVersion") or self._model)
        if isinstance(event.get("usageMetadata"), dict):
            self._usage = usage_from(event["usageMetadata"])
        chunks: list[JSONObject] = []
        for position, candidate in enumerate(event.get("candidates") or ()):
            if isinstance(candidate, dict):
                chunks += self._candidate(candidate, position)
        return chunks

    def _candidate(self, candidate: JSONObject, position: int) -> list[JSONObject]:
        index = candidate["index"] if isinstance(candidate.get("index"), int) else position
        chunks: list[JSONObject] = []
        if index not in self._started:
            self._started.add(index)
            chunks.append(self._chunk(index, delta={"role": "assistant", "content": ""}))
        text, calls = _text_and_calls(_parts_of(candidate))
        if text:
            chunks.append(self._chunk(index, delta={"content": text}))
        if calls:
            first = self._calls.get(index, 0)
            self._calls[index] = first + len(calls)
            numbered = [{"index": first + n, **call} for n, call in enumerate(calls)]
            chunks.append(self._chunk(index, delta={"tool_calls": numbered}))
        error = candidate_error(candidate, self._provider)
        if error is not None:
            raise error
        finish = finish_reason_for(candidate.get("finishReason"), called=index in self._calls)
        if finish is not None:
            self._finished.add(index)
            chunks.append(self._chunk(index, delta={}, finish_reason=finish))
        return chunks

    def finish(self) -> list[JSONObject]:
        """The chunks after the last event: the usage-only chunk when it was asked for."""
        if not self.include_usage or self._usage is None:
            return []
        return [
            chat_chunk(id=self._id, model=self._model, created=self._created, usage=self._usage)
        ]


# --------------------------------------------------------------------------- errors


def _error_object(body: bytes) -> Mapping[str, Any]:
    """The ``error`` object of a Google error body (a bare object, or a list holding one)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    if isinstance(data, list) and data:
        data = data[0]
    inner = data.get("error") if isinstance(data, dict) else None
    return inner if isinstance(inner, dict) else {}


def _details(error: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    details = error.get("details")
    return [d for d in details if isinstance(d, dict)] if isinstance(details, list) else []


def retry_delay_of(error: Mapping[str, Any]) -> float | None:
    """Seconds from a ``google.rpc.RetryInfo`` detail's ``retryDelay`` (``"12s"``), if any."""
    for detail in _details(error):
        if str(detail.get("@type", "")).endswith("google.rpc.RetryInfo"):
            delay = detail.get("retryDelay")
            match = _DURATION.fullmatch(delay) if isinstance(delay, str) else None
            if match:
                return float(match.group(1))
    return None


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _reasons(error: Mapping[str, Any]) -> str:
    return " ".join(str(detail.get("reason", "")) for detail in _details(error))


def _kind(status: int, message: str, reasons: str) -> ProviderErrorKind:
    if status == 400 and _BAD_KEY.search(f"{message} {reasons}"):
        return K.AUTH  # a refused API key comes as a 400
    return kind_for_status(status, message, _TOO_LONG)


def gemini_error_for(
    answer: HTTPAnswer,
    *,
    provider: str,
    now_wall: float,
    redactor: Redactor = NO_SECRETS,
) -> ProviderError:
    """The :class:`ProviderError` for an unsuccessful Gemini answer, or an ``error`` event in
    a stream (mapped by its ``status`` name or ``code``); the message is cleaned by
    ``redactor`` and reads ``HTTP <status> <STATUS_NAME>: <text>``."""
    error = _error_object(answer.body)
    name = _text(error.get("status"))
    status = answer.status
    if status < 300:
        code = error.get("code")
        status = code if type(code) is int and 400 <= code <= 599 else 0
        status = status or _STATUS_OF_NAME.get(name, 500 if error else 0)
    raw = _text(error.get("message"))
    if not error:
        raw = answer.body.decode("utf-8", errors="replace")
    kind = _kind(status, raw, _reasons(error))
    if kind is K.MALFORMED:
        message = f"HTTP {answer.status} with a body that is not the expected JSON"
    else:
        head = " ".join(
            part
            for part in (
                f"HTTP {answer.status}" if answer.status >= 300 else "",
                redactor.code(name),
            )
            if part
        )
        text = redactor.message(raw, head=head, request_id=request_id_of(answer.headers))
        message = text or "no message"
    retry_after = retry_after_from(answer.headers, now_wall)
    if retry_after is None:
        retry_after = retry_delay_of(error)
    return ProviderError(
        kind, message, provider=provider, retry_after=retry_after, status=status or answer.status
    )
