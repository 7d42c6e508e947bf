"""What the translating providers share: reading an OpenAI chat body for a wire format of
another kind (Anthropic's Messages, Bedrock's Converse, Gemini's generateContent), and writing
the OpenAI shapes of what comes back.

Each provider keeps its own blocks, tables and refusals; what is here reads OpenAI's side the
same way for all of them: content parts, data URLs, tool calls and their results, function
tools, stop sequences, the usage a stream was asked for, and the tool calls of an answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple

import orjson

from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.providers.base import JSONObject
from tidegate.providers.wire import chat_completion, usage

__all__ = [
    "DataURL",
    "append_turn",
    "completion_with_calls",
    "content_parts",
    "data_url",
    "function_tools",
    "includes_usage",
    "max_tokens_of",
    "refused_features",
    "stop_sequences",
    "token_count",
    "tool_arguments_delta",
    "tool_call",
    "tool_call_delta",
    "tool_call_function",
    "tool_result_text",
    "usage_with_cache",
]

K = ProviderErrorKind


def _bad_request(message: str, provider: str) -> ProviderError:
    return ProviderError(K.BAD_REQUEST, message, provider=provider)


# --------------------------------------------------------------------------- the request


def refused_features(body: JSONObject, keys: Sequence[str]) -> list[str]:
    """What of ``body`` a translation cannot carry: each of ``keys`` that is set, ``n`` above
    1, ``logprobs``, a ``response_format`` other than text (in that order)."""
    refused = [key for key in keys if body.get(key)]
    if body.get("n") not in (None, 1):
        refused.append("n")
    if body.get("logprobs") or body.get("top_logprobs"):
        refused.append("logprobs")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        refused.append("response_format")
    return refused


def content_parts(
    content: Any, provider: str, translation: str
) -> Iterator[tuple[Literal["text", "image_url"], Any]]:
    """A message's content, one part at a time: ``("text", the text as given)`` or
    ``("image_url", the URL as a string)``.

    A string is one text part and ``None`` none; anything else but a list, or a part of another
    type, is ``bad_request`` (naming ``translation``) when it is reached, so that an earlier
    part's own refusal comes first.
    """
    if content is None:
        return
    if isinstance(content, str):
        yield "text", content
        return
    if not isinstance(content, list):
        raise _bad_request("message content must be text or parts", provider)
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            yield "text", part.get("text", "")
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            yield "image_url", str(url)
        else:
            raise _bad_request(
                f"the {translation} translation does not support {kind!r} content parts", provider
            )


class DataURL(NamedTuple):
    """The pieces of a ``data:`` URL: its media type, whether it says ``;base64``, its data."""

    media_type: str
    base64: bool
    data: str


def data_url(url: str) -> DataURL:
    """``url`` (one that starts with ``data:``) taken apart."""
    header, _, data = url.partition(",")
    return DataURL(header[len("data:") :].split(";")[0], ";base64" in header, data)


def tool_call_function(
    call: Any, provider: str, *, named: bool = False
) -> tuple[JSONObject, JSONObject]:
    """An OpenAI tool call's ``function`` and its arguments, which must be a JSON object
    (``named``: the function must have a name too)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or (named and not function.get("name")):
        missing = "a function name" if named else "a function"
        raise _bad_request(f"a tool call without {missing}", provider)
    try:
        arguments = orjson.loads(function.get("arguments") or "{}")
    except orjson.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise _bad_request("a tool call's arguments must be a JSON object", provider)
    return function, arguments


def tool_result_text(message: JSONObject) -> str:
    """The text of a ``tool`` message (the text of its parts, joined, when it has parts)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def append_turn(turns: list[JSONObject], role: str, items: list[JSONObject], key: str) -> None:
    """Add a turn's ``items`` (under ``key``) to the last turn when it has the same role: the
    wire formats translated to alternate roles."""
    if turns and turns[-1]["role"] == role:
        turns[-1][key].extend(items)
    else:
        turns.append({"role": role, key: items})


def function_tools(body: JSONObject, provider: str, *, refusal: str) -> list[JSONObject]:
    """The ``function`` of each of the body's ``tools``; a tool of another type is refused with
    ``refusal``."""
    given = body.get("tools") or ()
    if not isinstance(given, list | tuple):
        raise _bad_request("tools must be a list", provider)
    functions = []
    for tool in given:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise _bad_request(refusal, provider)
        functions.append(function)
    return functions


def max_tokens_of(body: JSONObject) -> Any:
    """``max_completion_tokens``, else ``max_tokens`` (``None`` when neither is set)."""
    return body.get("max_completion_tokens") or body.get("max_tokens")


def stop_sequences(body: JSONObject) -> list[Any]:
    """``stop`` as a list (empty when there is none)."""
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and stop:
        return list(stop)
    return []


def includes_usage(body: JSONObject) -> bool:
    """Whether a stream was asked for its usage (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


# --------------------------------------------------------------------------- the answer


def token_count(value: Any) -> int:
    """A token count as given; one that is not a number counts as none (``int("many")`` would
    be a crash, not an answer)."""
    return int(value) if isinstance(value, int | float) and 0 <= value < 2**53 else 0


def usage_with_cache(prompt: int, completion: int, cached: int) -> JSONObject:
    """OpenAI's ``usage``, with ``prompt_tokens_details.cached_tokens`` when some were cached."""
    result = usage(prompt, completion)
    if cached:
        result["prompt_tokens_details"] = {"cached_tokens": cached}
    return result


def tool_call(call_id: str, name: str, arguments: Any) -> JSONObject:
    """An OpenAI tool call of an answer; ``arguments`` is encoded as JSON text."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
    }


def tool_call_delta(index: int, call_id: str, name: str) -> JSONObject:
    """The ``tool_calls`` delta that starts a streamed call (its arguments follow in pieces)."""
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }


def tool_arguments_delta(index: int, piece: str) -> JSONObject:
    """The ``tool_calls`` delta that carries a piece of a streamed call's arguments."""
    return {"index": index, "function": {"arguments": piece}}


def completion_with_calls(
    *,
    id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    usage: JSONObject,
    calls: list[JSONObject],
) -> JSONObject:
    """The ``chat.completion`` of one answer; text that came before tool calls is kept beside
    them."""
    completion = chat_completion(
        id=id,
        model=model,
        created=created,
        content=text,
        finish_reason=finish_reason,
        usage=usage,
        tool_calls=calls or None,
    )
    if calls and text:
        completion["choices"][0]["message"]["content"] = text
    return completion
