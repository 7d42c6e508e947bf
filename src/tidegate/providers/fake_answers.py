"""What the fakes answer to the parts of a chat request that shape an answer: a tool call when
tools are offered, JSON for ``response_format``, one choice per ``n``.

Pure functions of the request body, so the in-process fake and ``tidegate fake-upstream`` answer
alike, and the suite can test these paths through the gateway for real (an SDK's ``.parse()``
gets JSON that fits its schema, a tool round-trip gets a call and then a text answer).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tidegate.providers.base import JSONObject

__all__ = ["choices_asked", "content_for", "json_instance", "tool_call_for"]

#: Nesting a generated JSON value follows before it answers ``null`` (a recursive schema).
_MAX_DEPTH = 8


def choices_asked(body: Mapping[str, Any]) -> int:
    """The choices a request asks for (``n``; 1 when it does not say or says something else)."""
    n = body.get("n")
    return n if type(n) is int and 1 <= n <= 128 else 1


def content_for(body: Mapping[str, Any], text: str) -> str:
    """The answer's text as ``response_format`` asks: as it is, a JSON object holding it, or a
    JSON value that fits the given schema. A text that already is JSON (a scripted answer) is
    left as it is, for a script to decide what the model answers."""
    wanted = body.get("response_format")
    kind = wanted.get("type") if isinstance(wanted, dict) else None
    if kind in ("json_object", "json_schema") and _is_json(text):
        return text
    if kind == "json_object":
        return json.dumps({"answer": text})
    if kind == "json_schema":
        spec = wanted.get("json_schema") if isinstance(wanted, dict) else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return json.dumps(json_instance(schema if isinstance(schema, dict) else {}, text))
    return text


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def tool_call_for(body: Mapping[str, Any], ident: str, text: str) -> JSONObject | None:
    """The function call the answer makes, or None: a call when function tools are offered, the
    request does not say ``tool_choice: "none"``, and its last message is not a tool's result
    (that is answered in text, which ends a round-trip). ``tool_choice`` naming a function picks
    it; otherwise the first. Its arguments fit the function's parameter schema."""
    offered = body.get("tools")
    tools = [
        tool["function"]
        for tool in (offered if isinstance(offered, list) else ())
        if isinstance(tool, dict)
        and tool.get("type") == "function"
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    ]
    choice = body.get("tool_choice")
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not tools or choice == "none" or (isinstance(last, dict) and last.get("role") == "tool"):
        return None
    function = tools[0]
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        named = choice["function"].get("name")
        function = next((f for f in tools if f["name"] == named), function)
    parameters = function.get("parameters")
    arguments = json_instance(parameters if isinstance(parameters, dict) else {}, text)
    return {
        "id": f"call_{ident}",
        "type": "function",
        "function": {"name": function["name"], "arguments": json.dumps(arguments)},
    }


def json_instance(schema: Mapping[str, Any], text: str) -> Any:
    """A small JSON value that fits ``schema`` (the subset SDKs write from their models:
    ``type``, ``properties`` and ``required``, ``items`` and ``minItems``, ``enum``,
    ``const``, ``anyOf`` / ``oneOf``, and ``$ref`` into ``$defs``); strings are ``text``."""
    return _instance(schema, schema, text, 0)


def _instance(schema: Any, root: Mapping[str, Any], text: str, depth: int) -> Any:
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return _instance(target, root, text, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _instance(options[0], root, text, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties") or {}
        required = schema.get("required")
        names = required if isinstance(required, list) else list(properties)
        return {
            name: _instance(properties.get(name, {}), root, text, depth + 1)
            for name in names
            if isinstance(name, str)
        }
    if kind == "array":
        least = schema.get("minItems")
        count = least if type(least) is int and 0 < least <= 16 else 1
        return [_instance(schema.get("items", {}), root, text, depth + 1) for _ in range(count)]
    if kind == "string":
        return text
    if kind in ("integer", "number"):
        low = schema.get("minimum")
        return low if isinstance(low, int | float) and not isinstance(low, bool) else 0
    if kind == "boolean":
        return True
    return None
