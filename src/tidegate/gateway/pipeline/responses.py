"""OpenAI's Responses API (``POST /v1/responses``) on the same steps as chat completions.

A request is translated into the chat body the steps work on: ``instructions`` and ``input`` (a
string, or items: messages with text and image parts, ``function_call`` and
``function_call_output`` items), function ``tools`` and ``tool_choice``, ``text.format``
(``json_schema`` / ``json_object``), ``max_output_tokens``. The answer is a ``response`` object
(``message`` and ``function_call`` output items, usage), streamed as the Responses events.
Errors keep OpenAI's shape. Nothing is stored: ``store`` is accepted either way and
``previous_response_id`` is refused with a 400 that says so.
"""

from __future__ import annotations

from typing import Any

import orjson

from tidegate.errors import InvalidRequest
from tidegate.gateway.pipeline.checks import listed
from tidegate.gateway.pipeline.dialect import Dialect
from tidegate.gateway.pipeline.identify import identify_chat
from tidegate.gateway.pipeline.request import Request

__all__ = ["RESPONSES", "ResponseStream", "chat_body", "identify_response", "response_of"]

_SAME = ("temperature", "top_p", "user", "parallel_tool_calls")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body for a Responses API request, or ``InvalidRequest`` naming the field."""
    if body.get("previous_response_id") is not None:
        raise InvalidRequest(
            "previous_response_id: responses are not stored by this gateway; send the whole "
            "conversation in input"
        )
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            _item(messages, i, item)
    else:
        raise InvalidRequest("input: a string or a non-empty list of items is required")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    chat.update({key: body[key] for key in _SAME if body.get(key) is not None})
    chat.update(_tools(body))
    chat.update(_format(body.get("text")))
    if body.get("stream") is True:
        chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    return chat


def _item(messages: list[dict[str, Any]], i: int, item: Any) -> None:
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "message":
        messages.append(_message(i, item))
    elif kind == "function_call":
        call = {
            "id": str(item.get("call_id", "")),
            "type": "function",
            "function": {
                "name": str(item.get("name", "")),
                "arguments": str(item.get("arguments", "")),
            },
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)  # several calls of one turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append(
            {
                "role": "tool",
                "tool_call_id": str(item.get("call_id", "")),
                "content": output if isinstance(output, str) else orjson.dumps(output).decode(),
            }
        )
    else:
        raise InvalidRequest(f"input.{i}: {kind!r} items are not supported")


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidRequest(f"input.{i}.role: user, assistant, system or developer is required")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidRequest(f"input.{i}.content: a string or a list of parts is required")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise InvalidRequest(f"input.{i}.content.{j}: {kind!r} parts are not supported")
    if role == "assistant":  # an assistant's earlier answer: its text
        return {"role": role, "content": "".join(p["text"] for p in parts if "text" in p)}
    return {"role": role, "content": parts}


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    tools = listed(body, "tools")
    if tools:
        options["tools"] = [_tool(i, tool) for i, tool in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        options["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        options["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    return options


def _tool(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequest(f"tools.{i}: only function tools are supported")
    function = {
        key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool
    }
    return {"type": "function", "function": function}


def _format(text: Any) -> dict[str, Any]:
    wanted = text.get("format") if isinstance(text, dict) else None
    kind = wanted.get("type") if isinstance(wanted, dict) else None
    if kind == "json_schema":
        assert isinstance(wanted, dict)
        schema = {key: wanted[key] for key in ("name", "schema", "strict") if key in wanted}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    return {}


# --------------------------------------------------------------------------- the answer


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _response(
    ident: str, model: str, created: Any, output: list[Any], status: str
) -> dict[str, Any]:
    return {
        "id": f"resp_{ident}",
        "object": "response",
        "created_at": created if isinstance(created, int) else 0,
        "status": status,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "usage": None,
    }


def _text_item(ident: str, text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{ident}",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    call_id = str(call.get("id", ""))
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": call_id,
        "name": function.get("name", ""),
        "arguments": function.get("arguments", ""),
        "status": "completed",
    }


def response_of(completion: dict[str, Any]) -> dict[str, Any]:
    """The ``response`` object for a ``chat.completion`` (its first choice)."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    ident = str(completion.get("id", ""))
    output = []
    if isinstance(message.get("content"), str) and message["content"]:
        output.append(_text_item(ident, message["content"]))
    output += [_call_item(call) for call in message.get("tool_calls") or ()]
    cut = choice.get("finish_reason") == "length"
    model, created = str(completion.get("model", "")), completion.get("created")
    answer = _response(ident, model, created, output, "incomplete" if cut else "completed")
    if cut:
        answer["incomplete_details"] = {"reason": "max_output_tokens"}
    answer["usage"] = _usage(completion.get("usage") or {})
    return answer


class ResponseStream:
    """A chat completion's stream as the Responses API's events: ``response.created``; per
    output item, in the order they begin, ``response.output_item.added`` and its deltas
    (``response.output_text.delta``, ``response.function_call_arguments.delta``); at the end
    each item's ``.done`` events and ``response.completed`` with the whole response."""

    def __init__(self) -> None:
        self._number = 0
        self._ident = ""
        self._model = ""
        self._created: Any = 0
        self._text: str | None = None
        #: The output items in the order they began: ``None`` the text, else a call's index.
        self._order: list[int | None] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._usage: dict[str, Any] | None = None

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        self._number += 1
        body = orjson.dumps({"type": kind, "sequence_number": self._number, **data})
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        choices = chunk.get("choices") or ()
        if not choices:
            return b""
        out = b""
        if self._number == 0:
            self._ident, self._model = str(chunk.get("id", "")), str(chunk.get("model", ""))
            self._created = chunk.get("created", 0)
            created = _response(self._ident, self._model, self._created, [], "in_progress")
            out += self._event("response.created", {"response": created})
        delta = choices[0].get("delta") or {}
        if delta.get("content"):
            out += self._text_delta(delta["content"])
        for call in delta.get("tool_calls") or ():
            out += self._call_delta(call)
        return out

    def _text_delta(self, text: str) -> bytes:
        out = b""
        if self._text is None:
            self._text = ""
            self._order.append(None)
            item = {**_text_item(self._ident, ""), "status": "in_progress", "content": []}
            out += self._event(
                "response.output_item.added", {"output_index": self._position(None), "item": item}
            )
            part = {"type": "output_text", "text": "", "annotations": []}
            out += self._event(
                "response.content_part.added",
                {**self._where(None), "content_index": 0, "part": part},
            )
        self._text += text
        return out + self._event(
            "response.output_text.delta", {**self._where(None), "content_index": 0, "delta": text}
        )

    def _call_delta(self, call: dict[str, Any]) -> bytes:
        index = call.get("index", 0)
        function = call.get("function") or {}
        out = b""
        known = self._calls.get(index)
        if known is None:
            known = self._calls[index] = {
                "id": call.get("id", ""),
                "function": {"name": function.get("name") or "", "arguments": ""},
            }
            self._order.append(index)
            item = {**_call_item(known), "status": "in_progress"}
            out += self._event(
                "response.output_item.added", {"output_index": self._position(index), "item": item}
            )
        elif function.get("name"):
            known["function"]["name"] = function["name"]
        piece = function.get("arguments") or ""
        if piece:
            known["function"]["arguments"] += piece
            out += self._event(
                "response.function_call_arguments.delta", {**self._where(index), "delta": piece}
            )
        return out

    def _position(self, key: int | None) -> int:
        return self._order.index(key)

    def _where(self, key: int | None) -> dict[str, Any]:
        """The ``item_id`` and ``output_index`` of the text (None) or of a call."""
        item_id = f"msg_{self._ident}" if key is None else f"fc_{self._calls[key].get('id', '')}"
        return {"item_id": item_id, "output_index": self._position(key)}

    def end(self, usage: dict[str, Any] | None) -> bytes:
        out = b""
        output: list[dict[str, Any]] = []
        for key in self._order:
            where = self._where(key)
            if key is None:
                item = _text_item(self._ident, self._text or "")
                done = {**where, "content_index": 0}
                out += self._event(
                    "response.output_text.done", {**done, "text": item["content"][0]["text"]}
                )
                out += self._event(
                    "response.content_part.done", {**done, "part": item["content"][0]}
                )
            else:
                item = _call_item(self._calls[key])
                out += self._event(
                    "response.function_call_arguments.done",
                    {**where, "arguments": item["arguments"]},
                )
            out += self._event(
                "response.output_item.done", {"output_index": where["output_index"], "item": item}
            )
            output.append(item)
        whole = _response(self._ident, self._model, self._created, output, "completed")
        whole["usage"] = _usage(usage or self._usage or {})
        return out + self._event("response.completed", {"response": whole})

    def error(self, payload: dict[str, Any]) -> bytes:
        error = payload.get("error") or {}
        return self._event(
            "error",
            {"code": error.get("code"), "message": str(error.get("message", "")), "param": None},
        )


#: ``POST /v1/responses``: OpenAI's errors, the Responses API's answers and events.
RESPONSES = Dialect("responses", answer=response_of, stream=ResponseStream)


def identify_response(request: Request) -> bool:
    """A Responses API request: translated, then checked as a chat completion is."""
    request.body = chat_body(request.body)
    return identify_chat(request)
