"""Anthropic's Messages API (``POST /v1/messages``) on the same steps as chat completions.

A request is translated into the OpenAI chat body the steps work on (system prompt, turns, text,
image, ``tool_use`` and ``tool_result`` blocks, tools and ``tool_choice``, ``stop_sequences``),
so that any provider may serve it with the same limits, budget, idempotency, admission,
deadline and failover; the answer is translated back (``content`` blocks, ``stop_reason``,
``usage``), and errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}`` with
the statuses Anthropic uses (529 ``overloaded_error`` for every overload refusal).

A stream is Anthropic's event sequence (:mod:`~.message_stream`), rescued as any stream is.
"""

from __future__ import annotations

import json
from typing import Any

from tidegate.errors import InvalidRequest
from tidegate.gateway.http import send_json
from tidegate.gateway.pipeline.checks import MAX_INTEGER, listed
from tidegate.gateway.pipeline.dialect import Dialect, ErrorBody
from tidegate.gateway.pipeline.identify import identify_chat
from tidegate.gateway.pipeline.message_stream import STOP_REASONS, MessageStream, stream_error_type
from tidegate.gateway.pipeline.request import Request

__all__ = [
    "ANTHROPIC",
    "chat_body",
    "count_tokens",
    "identify_count",
    "identify_messages",
    "message_of",
]

#: Request fields passed on as they are (the rest of the body is translated or not sent).
_SAME = ("temperature", "top_p")


def _error(status: int, body: dict[str, Any]) -> ErrorBody:
    """Anthropic's status and body for an error: its type from tidegate's error family; every
    overload refusal (admission, breakers, the kill switch, an overloaded provider, the store)
    is ``overloaded_error`` with Anthropic's 529, which its SDKs retry."""
    error = body["error"]
    kind = stream_error_type(str(error.get("type", "")), status)
    shown = 529 if kind == "overloaded_error" else status
    return shown, {
        "type": "error",
        "error": {"type": kind, "message": str(error.get("message", ""))},
    }


def message_of(completion: dict[str, Any]) -> dict[str, Any]:
    """The Messages API answer for a ``chat.completion`` (its first choice)."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    blocks: list[dict[str, Any]] = []
    if isinstance(message.get("content"), str) and message["content"]:
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id", ""),
                "name": function.get("name", ""),
                "input": _arguments(function.get("arguments")),
            }
        )
    usage = completion.get("usage") or {}
    return {
        "id": f"msg_{completion.get('id', '')}",
        "type": "message",
        "role": "assistant",
        "model": completion.get("model", ""),
        "content": blocks,
        "stop_reason": STOP_REASONS.get(str(choice.get("finish_reason")), "end_turn"),
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
        },
    }


def _arguments(raw: Any) -> dict[str, Any]:
    """A tool call's arguments as the object ``tool_use.input`` is (a model that wrote
    something else has it kept whole under ``arguments``)."""
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": raw}


#: ``POST /v1/messages``: Anthropic's shapes, the key also in ``x-api-key``.
ANTHROPIC = Dialect(
    "anthropic", answer=message_of, error=_error, key_header="x-api-key", stream=MessageStream
)


# --------------------------------------------------------------------------- the request


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat body for a Messages API request, or ``InvalidRequest`` naming the field."""
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise InvalidRequest("max_tokens: Field required")
    if type(max_tokens) is not int or not 0 < max_tokens <= MAX_INTEGER:
        raise InvalidRequest(f"max_tokens: an integer from 1 to {MAX_INTEGER} is required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: a non-empty list is required")
    chat: dict[str, Any] = {"model": body.get("model"), "max_tokens": max_tokens}
    turns = _system(body.get("system"))
    for i, message in enumerate(messages):
        turns += _turn(i, message)
    chat["messages"] = turns
    chat.update(_options(body))
    if body.get("stream") is True:  # the usage goes out with message_delta
        chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    return chat


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if isinstance(system, list):
        return [{"role": "system", "content": _text("system", system)}]
    raise InvalidRequest("system: a string or a list of text blocks is required")


def _text(where: str, blocks: list[Any]) -> str:
    if not all(isinstance(b, dict) and b.get("type") == "text" for b in blocks):
        raise InvalidRequest(f"{where}: only text blocks are allowed here")
    return "".join(str(b.get("text", "")) for b in blocks)


def _turn(i: int, message: Any) -> list[dict[str, Any]]:
    """The chat messages of one Messages API turn."""
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise InvalidRequest(f"messages.{i}.role: 'user' or 'assistant' is required")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"messages.{i}.content: a string or a list of blocks is required")
    if role == "assistant":
        return [_assistant(i, content)]
    return _user(i, content)


def _assistant(i: int, blocks: list[Any]) -> dict[str, Any]:
    text, calls = "", []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text += str(block.get("text", ""))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {
                        "name": str(block.get("name", "")),
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        else:
            raise InvalidRequest(f"messages.{i}.content.{j}: {kind!r} blocks are not supported")
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _user(i: int, blocks: list[Any]) -> list[dict[str, Any]]:
    """A user turn: its tool results first (each a ``tool`` message, answering the calls of the
    turn before), then what else it says."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image":
            parts.append(_image(f"messages.{i}.content.{j}", block.get("source")))
        elif kind == "tool_result":
            content = block.get("content")
            text = content if isinstance(content, str) else _text("tool_result", content or [])
            results.append(
                {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text}
            )
        else:
            raise InvalidRequest(f"messages.{i}.content.{j}: {kind!r} blocks are not supported")
    if parts:
        results.append({"role": "user", "content": parts})
    return results


def _image(where: str, source: Any) -> dict[str, Any]:
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', '')};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise InvalidRequest(f"{where}.source: a base64 or url image source is required")
    return {"type": "image_url", "image_url": {"url": url}}


def _options(body: dict[str, Any]) -> dict[str, Any]:
    """Sampling, stop sequences, the caller's user id, tools and the tool choice."""
    options = {key: body[key] for key in _SAME if body.get(key) is not None}
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise InvalidRequest("stop_sequences: a list of strings is required")
    if stop:
        options["stop"] = stop
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        options["user"] = metadata["user_id"]
    tools = listed(body, "tools")
    if tools:
        options["tools"] = [_tool(i, tool) for i, tool in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        options.update(_tool_choice(choice))
    return options


def _tool(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise InvalidRequest(f"tools.{i}: a tool with a name and an input_schema is required")
    function: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    chosen: dict[str, Any] = {}
    if kind == "auto":
        chosen["tool_choice"] = "auto"
    elif kind == "any":
        chosen["tool_choice"] = "required"
    elif kind == "none":
        chosen["tool_choice"] = "none"
    elif kind == "tool":
        chosen["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        raise InvalidRequest("tool_choice.type: 'auto', 'any', 'tool' or 'none' is required")
    if choice.get("disable_parallel_tool_use") is True:
        chosen["parallel_tool_calls"] = False
    return chosen


# --------------------------------------------------------------------------- the steps


def identify_messages(request: Request) -> bool:
    """A Messages API request: translated, then checked as a chat completion is."""
    request.body = chat_body(request.body)
    return identify_chat(request)


def identify_count(request: Request) -> bool:
    """A ``count_tokens`` request: a Messages API request, without the ``max_tokens`` that
    only a call needs."""
    request.body = chat_body({**request.body, "max_tokens": request.body.get("max_tokens") or 1})
    return identify_chat(request)


async def count_tokens(request: Request) -> bool:
    """``POST /v1/messages/count_tokens``: the prompt's tokens as the budget estimates them."""
    request.ex.status = 200
    tokens = request.rt.prompt_counters[request.route.specs[0].name](request.body)
    await send_json(request.send, 200, {"input_tokens": tokens}, request.ex.answer_headers())
    return True
