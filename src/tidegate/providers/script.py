"""The fake-model script: how each fake model answers, and which attempts fail and how.

One script drives both fakes: :mod:`tidegate.providers.fake_upstream` (a real HTTP server) and
:meth:`tidegate.providers.fake.FakeProvider.from_script` (in-process). Both ask
:class:`ScriptRunner` for a :class:`Plan` per attempt, so a fault means the same thing in each.
Planning is pure: it reads no clock, and its only randomness is the script's seeded
``random.Random``.

A fault rule applies when every condition it has holds: ``on_attempts`` lists the attempt
number (counted per model, from 1), and ``probability`` wins a draw from the seeded generator
(drawn only when ``on_attempts`` matched). A rule with neither condition always applies. The
first rule that applies is the fault of that attempt.

The ``raw`` fault sends a body exactly as written, whatever the request asked for: a 200 that is
not an answer, an error body echoing a credential, a hand-written event stream. It is how the
tests show what the providers do with bodies no well-behaved server sends.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

import orjson
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tidegate.errors import ConfigError
from tidegate.providers.base import JSONObject, MalformedChunk
from tidegate.providers.fake_answers import choices_asked, content_for, tool_call_for
from tidegate.providers.wire import (
    EncodingFormat,
    chat_chunk,
    chat_completion,
    embeddings_response,
    openai_error,
    usage,
)

__all__ = [
    "WILDCARD",
    "ContentFilterFault",
    "ContextLengthFault",
    "CutAfterFault",
    "FakeScript",
    "Fault",
    "HttpFault",
    "MalformedChunkFault",
    "MissingDoneFault",
    "ModelScript",
    "NoResponseFault",
    "Pause",
    "Plan",
    "PlanStep",
    "RawFault",
    "RefusePrefillFault",
    "ResetFault",
    "ScriptRunner",
    "StallAfterFault",
    "count_prompt_tokens",
    "format_validation_error",
    "generate_tokens",
    "load_script",
    "parse_script",
]

#: The model entry that answers for every model name the script does not list.
WILDCARD = "*"

#: What the fake sends in place of a chunk for ``malformed_chunk``.
MALFORMED_DATA = '{"id": "chatcmpl-fake", "choices": [{"delta": {"content": "unterminated'

NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


#: The longest vector a fake writes (a request's ``dimensions`` above it is not honoured).
MAX_FAKE_DIMENSIONS = 4096


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Rule(_Strict):
    on_attempts: tuple[Annotated[int, Field(ge=1)], ...] | None = None
    probability: Annotated[float, Field(ge=0, le=1)] | None = None


class HttpFault(_Rule):
    """Answer with ``status`` and an OpenAI error body (or ``body`` verbatim)."""

    kind: Literal["http"]
    status: Annotated[int, Field(ge=400, le=599)]
    retry_after: NonNegativeFloat | str | None = None
    code: str | None = None
    message: str | None = None
    body: dict[str, Any] | None = None


class RawFault(_Rule):
    """Answer ``status`` with ``headers`` and ``body`` exactly as given, on any endpoint and
    whether or not a stream was asked for: a string body is sent as it is (UTF-8), any other
    value as JSON, with ``content_type``."""

    kind: Literal["raw"]
    status: Annotated[int, Field(ge=200, le=599)] = 200
    body: Any = ""
    content_type: str = "application/json"
    headers: dict[str, str] = Field(default_factory=dict)


class ResetFault(_Rule):
    """Close the connection before any response header."""

    kind: Literal["reset"]


class NoResponseFault(_Rule):
    """Accept the request and never answer."""

    kind: Literal["no_response"]


class CutAfterFault(_Rule):
    """Send ``tokens`` tokens, then drop the connection without finishing the body."""

    kind: Literal["cut_after"]
    tokens: Annotated[int, Field(ge=0)]


class StallAfterFault(_Rule):
    """Send ``tokens`` tokens, then send nothing more while keeping the connection open."""

    kind: Literal["stall_after"]
    tokens: Annotated[int, Field(ge=0)]


class MalformedChunkFault(_Rule):
    """Make the ``chunk``-th ``data:`` event of the stream unparsable (the real ones follow)."""

    kind: Literal["malformed_chunk"]
    chunk: Annotated[int, Field(ge=1)] = 1


class MissingDoneFault(_Rule):
    """Finish the stream cleanly but without ``data: [DONE]``."""

    kind: Literal["missing_done"]


class ContextLengthFault(_Rule):
    """Answer 400 with OpenAI's ``context_length_exceeded`` error."""

    kind: Literal["context_length_exceeded"]


class ContentFilterFault(_Rule):
    """Refuse the prompt (400, code ``content_filter``), or with ``after_tokens`` stop the answer
    there with ``finish_reason: content_filter``."""

    kind: Literal["content_filter"]
    after_tokens: Annotated[int, Field(ge=0)] | None = None


class RefusePrefillFault(_Rule):
    """Answer 400 when the last message is the assistant's (a prefill)."""

    kind: Literal["refuse_prefill"]


Fault: TypeAlias = Annotated[
    HttpFault
    | RawFault
    | ResetFault
    | NoResponseFault
    | CutAfterFault
    | StallAfterFault
    | MalformedChunkFault
    | MissingDoneFault
    | ContextLengthFault
    | ContentFilterFault
    | RefusePrefillFault,
    Field(discriminator="kind"),
]


class ModelScript(_Strict):
    """How one fake model answers. Times are seconds."""

    #: Before the response headers (and before a refusal or a reset).
    latency: NonNegativeFloat = 0.0
    #: From the headers to the first token of a stream.
    ttft: NonNegativeFloat = 0.0
    #: Pace of the tokens after the first; ``None`` sends them all at once.
    tokens_per_second: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    #: The answer; split into tokens at whitespace. Without it: ``token1 token2 ...``.
    text: str | None = None
    #: How many generated tokens when there is no ``text``.
    tokens: Annotated[int, Field(ge=0)] = 5
    #: Prompt tokens (whitespace-separated words) plus ``max_tokens`` above this are refused.
    context_window: Annotated[int, Field(ge=1)] | None = None
    #: Whether a request ending with an assistant message is answered.
    accepts_prefill: bool = True
    #: Whether the model calls a function when tools are offered (off: it answers in text).
    call_tools: bool = True
    #: Whether the answer follows ``response_format`` (off: a model that ignores it).
    honour_response_format: bool = True
    #: Length of the vectors ``/v1/embeddings`` returns.
    embedding_dimensions: Annotated[int, Field(ge=1, le=MAX_FAKE_DIMENSIONS)] = 8
    faults: tuple[Fault, ...] = ()

    @model_validator(mode="after")
    def _text_or_tokens(self) -> ModelScript:
        if self.text is not None and "tokens" in self.model_fields_set:
            raise ValueError("set either text or tokens, not both")
        return self


class FakeScript(_Strict):
    """A whole script: the seed of the probability draws, and the models by name."""

    seed: int = 0
    models: dict[str, ModelScript] = Field(default_factory=dict)


def format_validation_error(error: ValidationError) -> str:
    """One line per problem, each naming the key by its dotted path."""
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key")
        else:
            lines.append(f"{loc}: {item['msg']}")
    return "; ".join(lines)


def parse_script(data: Any, *, source: str = "script") -> FakeScript:
    """Validate ``data`` (a mapping) as a :class:`FakeScript`; :class:`ConfigError` if it is not."""
    try:
        return FakeScript.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {format_validation_error(exc)}") from exc


def load_script(path: str | Path) -> FakeScript:
    """Read a YAML (or JSON) script file; :class:`ConfigError` names the key that is wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the script: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text) if path.suffix != ".json" else orjson.loads(text)
    except (yaml.YAMLError, orjson.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid YAML/JSON: {exc}") from exc
    return parse_script({} if data is None else data, source=str(path))


def generate_tokens(model: ModelScript) -> list[str]:
    """The answer's tokens; joined, they give back ``text`` exactly."""
    if model.text is not None:
        return re.findall(r"\s*\S+|\s+$", model.text)
    return [f"{' ' if i > 1 else ''}token{i}" for i in range(1, model.tokens + 1)]


def _continue_after(tokens: list[str], prefix: str) -> list[str]:
    """The tokens left after an assistant prefill, as a model continuing its own text would.

    When the prefill is a prefix of the answer, only the rest is produced (the first remaining
    token cut at the boundary if the prefill ends inside it); otherwise the whole answer.
    """
    text = "".join(tokens)
    if not prefix or not text.startswith(prefix):
        return tokens
    rest: list[str] = []
    position = 0
    for token in tokens:
        end = position + len(token)
        if end > len(prefix):
            rest.append(token[max(0, len(prefix) - position) :])
        position = end
    return rest


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [str(p.get("text", "")) for p in content if isinstance(p, dict)]
    return []


def count_prompt_tokens(messages: Any) -> int:
    """A crude, deterministic token count: whitespace-separated words in every message."""
    if not isinstance(messages, list):
        return 0
    return sum(
        len(text.split())
        for message in messages
        if isinstance(message, dict)
        for text in _texts(message.get("content"))
    )


@dataclass(frozen=True, slots=True)
class Pause:
    """Inside a planned stream: wait ``seconds`` before the next item."""

    seconds: float


#: One planned stream item: a chunk, a broken chunk, or a wait.
PlanStep: TypeAlias = JSONObject | MalformedChunk | Pause


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do for one attempt.

    ``action`` is one of ``"reset"``, ``"no_response"``, ``"error"`` (send ``status``, ``body``
    and ``headers``), ``"raw"`` (send ``status``, ``headers`` and the bytes ``raw``), ``"answer"``
    (a 200 with ``body``) or ``"stream"`` (a 200 event stream of ``steps``). ``latency`` comes
    before anything is sent. For ``"answer"``, ``body_fault`` may damage the body (``"cut"``,
    ``"stall"``, ``"malformed"``); for ``"stream"``, ``ending`` says how it finishes:
    ``"done"``, ``"missing_done"``, ``"cut"`` or ``"stall"``. ``endpoint`` is the one asked.
    """

    model: str
    attempt: int
    fault: str | None
    action: Literal["reset", "no_response", "error", "raw", "answer", "stream"]
    latency: float = 0.0
    status: int = 200
    body: JSONObject | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    steps: tuple[PlanStep, ...] = ()
    ending: Literal["done", "missing_done", "cut", "stall"] = "done"
    body_fault: Literal["cut", "stall", "malformed"] | None = None
    raw: bytes = b""
    endpoint: Literal["chat", "embeddings"] = "chat"


_ERROR_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 429: "requests"}


def _http_error(fault: HttpFault) -> tuple[JSONObject, dict[str, str]]:
    headers = {} if fault.retry_after is None else {"Retry-After": _header_value(fault.retry_after)}
    if fault.body is not None:
        return dict(fault.body), headers
    kind = _ERROR_TYPE.get(
        fault.status, "server_error" if fault.status >= 500 else "invalid_request_error"
    )
    message = fault.message or f"fake upstream answered {fault.status}"
    return openai_error(message, type=kind, code=fault.code), headers


def _raw(fault: RawFault) -> dict[str, Any]:
    body = fault.body
    raw = body.encode() if isinstance(body, str) else orjson.dumps(body)
    headers = {"Content-Type": fault.content_type, **fault.headers}
    return {"action": "raw", "status": fault.status, "headers": headers, "raw": raw}


def _header_value(value: float | str) -> str:
    if isinstance(value, str):
        return value
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _fake_id(model: str, attempt: int) -> str:
    return f"chatcmpl-fake-{model}-{attempt}"


def _vector(text: str, dimensions: int) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round(digest[i % len(digest)] / 255.0 * 2.0 - 1.0, 6) for i in range(dimensions)]


class ScriptRunner:
    """Counts attempts per model and plans each one from the script."""

    __slots__ = ("_attempts", "_rng", "script")

    def __init__(self, script: FakeScript) -> None:
        self.script = script
        self._rng = random.Random(script.seed)
        self._attempts: dict[str, int] = {}

    def reset(self, script: FakeScript | None = None) -> None:
        """Forget the attempt counts and reseed (optionally with a new script)."""
        if script is not None:
            self.script = script
        self._rng = random.Random(self.script.seed)
        self._attempts.clear()

    def model(self, name: str) -> ModelScript | None:
        """The entry that answers for ``name``: its own, else the wildcard, else ``None``."""
        return self.script.models.get(name) or self.script.models.get(WILDCARD)

    def _fault(self, model: ModelScript, attempt: int) -> Fault | None:
        for rule in model.faults:
            if rule.on_attempts is not None and attempt not in rule.on_attempts:
                continue
            if rule.probability is not None and not self._rng.random() < rule.probability:
                continue
            return rule
        return None

    def plan(
        self, body: JSONObject, *, endpoint: Literal["chat", "embeddings"], created: int
    ) -> Plan:
        """The plan for one request to ``endpoint`` (counted as the next attempt of its model)."""
        name = str(body.get("model", ""))
        attempt = self._attempts[name] = self._attempts.get(name, 0) + 1
        model = self.model(name)
        if model is None:
            return Plan(
                model=name,
                attempt=attempt,
                fault=None,
                action="error",
                endpoint=endpoint,
                status=404,
                body=openai_error(
                    f"The model `{name}` does not exist or you do not have access to it.",
                    type="invalid_request_error",
                    code="model_not_found",
                ),
            )
        fault = self._fault(model, attempt)

        def make(**fields: Any) -> Plan:
            fields.setdefault("latency", model.latency)
            return Plan(model=name, attempt=attempt, endpoint=endpoint, **fields)

        if isinstance(fault, RawFault):
            return make(fault=fault.kind, **_raw(fault))
        if endpoint == "embeddings":
            return self._embeddings(model, body, fault, make, name)
        messages = body.get("messages")
        prefill = (
            isinstance(messages, list)
            and bool(messages)
            and messages[-1].get("role") == "assistant"
        )
        if isinstance(fault, RefusePrefillFault) and not prefill:
            fault = None  # the rule matched, but there is no prefill to refuse
        kind = None if fault is None else fault.kind
        if isinstance(fault, ResetFault | NoResponseFault):
            return make(fault=kind, action=fault.kind)
        if isinstance(fault, HttpFault):
            error, headers = _http_error(fault)
            return make(
                fault=kind, action="error", status=fault.status, body=error, headers=headers
            )
        prompt_tokens = count_prompt_tokens(messages)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        requested = prompt_tokens + (max_tokens if isinstance(max_tokens, int) else 0)
        window = model.context_window
        if isinstance(fault, ContextLengthFault) or (window is not None and requested > window):
            shown = window if window is not None else max(1, prompt_tokens - 1)
            return make(
                fault=kind,
                action="error",
                status=400,
                body=openai_error(
                    f"This model's maximum context length is {shown} tokens. However, you "
                    f"requested {requested} tokens ({prompt_tokens} in the messages, "
                    f"{requested - prompt_tokens} in the completion). Please reduce the length "
                    "of the messages or completion.",
                    type="invalid_request_error",
                    code="context_length_exceeded",
                    param="messages",
                ),
            )
        if isinstance(fault, ContentFilterFault) and fault.after_tokens is None:
            return make(
                fault=kind,
                action="error",
                status=400,
                body=openai_error(
                    "The prompt was refused by the content filter.",
                    type="invalid_request_error",
                    code="content_filter",
                    param="prompt",
                ),
            )
        if prefill and (isinstance(fault, RefusePrefillFault) or not model.accepts_prefill):
            return make(
                fault=kind,
                action="error",
                status=400,
                body=openai_error(
                    "This model does not support assistant message prefill.",
                    type="invalid_request_error",
                    code="prefill_not_supported",
                    param="messages",
                ),
            )
        tokens = generate_tokens(model)
        if prefill and isinstance(messages, list):
            tokens = _continue_after(tokens, "".join(_texts(messages[-1].get("content"))))
        finish = "stop"
        if isinstance(max_tokens, int) and max_tokens < len(tokens):
            tokens, finish = tokens[:max_tokens], "length"
        if isinstance(fault, ContentFilterFault) and fault.after_tokens is not None:
            tokens, finish = tokens[: fault.after_tokens], "content_filter"
        text = "".join(tokens)
        # JSON when response_format asks for it (and the model honours it)
        shaped = content_for(body, text) if model.honour_response_format else text
        if shaped != text:
            tokens = _pieces(shaped)
        gap = 0.0 if model.tokens_per_second is None else 1.0 / model.tokens_per_second
        ident = _fake_id(name, attempt)
        call = tool_call_for(body, ident, text) if model.call_tools else None
        # A stream sends one choice (the fake streams no ``n``); a whole answer has ``n``.
        choices = 1 if body.get("stream") else choices_asked(body)
        tally = usage(prompt_tokens, len(tokens) * choices)
        if body.get("stream"):
            if call is not None:  # the call's arguments are what is streamed
                tokens, finish = _pieces(call["function"]["arguments"]), "tool_calls"
                tally = usage(prompt_tokens, len(tokens))
            return self._stream(
                model, body, fault, make, name, tokens, finish, gap, ident, created, tally, call
            )
        body_fault: Literal["cut", "stall", "malformed"] | None = None
        if isinstance(fault, CutAfterFault):
            body_fault = "cut"
        elif isinstance(fault, StallAfterFault):
            body_fault = "stall"
        elif isinstance(fault, MalformedChunkFault):
            body_fault = "malformed"
        elif isinstance(fault, MissingDoneFault):
            kind = None  # nothing to leave out of a non-streamed answer
        return make(
            latency=model.latency + model.ttft + gap * max(0, len(tokens) - 1),
            fault=kind,
            action="answer",
            body=chat_completion(
                id=ident,
                model=name,
                created=created,
                content="".join(tokens),
                finish_reason=finish,
                usage=tally,
                n=choices,
                tool_calls=None if call is None else [call],
            ),
            body_fault=body_fault,
        )

    def _stream(
        self,
        model: ModelScript,
        body: JSONObject,
        fault: Fault | None,
        make: Callable[..., Plan],
        name: str,
        tokens: list[str],
        finish: str,
        gap: float,
        ident: str,
        created: int,
        tally: JSONObject,
        call: JSONObject | None = None,
    ) -> Plan:
        """A stream of ``tokens``: the text, or (with ``call``) the call's arguments in pieces."""
        common: dict[str, Any] = {"id": ident, "model": name, "created": created}
        data: list[JSONObject | MalformedChunk] = [
            chat_chunk(**common, delta={"role": "assistant", "content": ""})
        ]
        if call is not None:
            header = {**call, "index": 0, "function": {**call["function"], "arguments": ""}}
            data.append(chat_chunk(**common, delta={"tool_calls": [header]}))
        ending: Literal["done", "missing_done", "cut", "stall"] = "done"
        stop_at = len(tokens)
        if isinstance(fault, CutAfterFault | StallAfterFault):
            stop_at = min(fault.tokens, len(tokens))
            ending = "cut" if isinstance(fault, CutAfterFault) else "stall"
        data += [chat_chunk(**common, delta=_delta(token, call)) for token in tokens[:stop_at]]
        if ending == "done":
            data.append(chat_chunk(**common, delta={}, finish_reason=finish))
            options = body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage"):
                data.append(chat_chunk(**common, usage=tally))
        if isinstance(fault, MissingDoneFault):
            ending = "missing_done"
        if isinstance(fault, MalformedChunkFault):
            data.insert(min(fault.chunk - 1, len(data)), MalformedChunk(MALFORMED_DATA))
        steps: list[PlanStep] = [Pause(model.ttft)] if model.ttft else []
        sent_tokens = 0
        for item in data:
            is_token = isinstance(item, dict) and _is_token_chunk(item)
            if is_token and sent_tokens and gap:
                steps.append(Pause(gap))
            sent_tokens += is_token
            steps.append(item)
        kind = None if fault is None else fault.kind
        return make(fault=kind, action="stream", steps=tuple(steps), ending=ending)

    def _embeddings(
        self,
        model: ModelScript,
        body: JSONObject,
        fault: Fault | None,
        make: Callable[..., Plan],
        name: str,
    ) -> Plan:
        if isinstance(fault, ResetFault | NoResponseFault):
            return make(fault=fault.kind, action=fault.kind)
        if isinstance(fault, HttpFault):
            error, headers = _http_error(fault)
            return make(
                fault=fault.kind,
                action="error",
                status=fault.status,
                body=error,
                headers=headers,
            )
        raw = body.get("input")
        inputs = [raw] if isinstance(raw, str) else [str(item) for item in raw or []]
        # As OpenAI does: ``dimensions`` shortens the vectors, ``encoding_format`` is honoured.
        dimensions = body.get("dimensions")
        size = (
            dimensions
            if type(dimensions) is int and 0 < dimensions <= MAX_FAKE_DIMENSIONS
            else None
        )
        encoding: EncodingFormat = "base64" if body.get("encoding_format") == "base64" else "float"
        body_fault: Literal["cut", "stall", "malformed"] | None = None
        if isinstance(fault, CutAfterFault):
            body_fault = "cut"
        elif isinstance(fault, StallAfterFault):
            body_fault = "stall"
        elif isinstance(fault, MalformedChunkFault):
            body_fault = "malformed"
        return make(
            fault=fault.kind if body_fault is not None and fault is not None else None,
            action="answer",
            body=embeddings_response(
                model=name,
                vectors=[_vector(text, size or model.embedding_dimensions) for text in inputs],
                prompt_tokens=sum(len(text.split()) for text in inputs),
                encoding_format=encoding,
            ),
            body_fault=body_fault,
        )


def _delta(token: str, call: JSONObject | None) -> JSONObject:
    """A stream's delta for ``token``: text, or a piece of ``call``'s arguments."""
    if call is None:
        return {"content": token}
    return {"tool_calls": [{"index": 0, "function": {"arguments": token}}]}


def _pieces(text: str, size: int = 4) -> list[str]:
    """``text`` in pieces of about a token each (what a stream of JSON is sent in)."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _is_token_chunk(chunk: JSONObject) -> bool:
    choices: Sequence[Any] = chunk.get("choices") or []
    return (
        bool(choices)
        and "content" in choices[0].get("delta", {})
        and bool(choices[0]["delta"]["content"])
    )
