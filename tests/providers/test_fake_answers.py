"""The fakes' answers to tools, ``response_format`` and ``n``: values that fit the schemas SDKs
write (pydantic's, with ``$defs``), the tool a request names, text after a tool's result."""

from __future__ import annotations

import json
from typing import Literal

import pydantic

from tidegate.providers.fake_answers import (
    choices_asked,
    content_for,
    json_instance,
    tool_call_for,
)


class Place(pydantic.BaseModel):
    name: str
    kind: Literal["city", "town"]


class Trip(pydantic.BaseModel):
    stops: list[Place] = pydantic.Field(min_length=2)
    nights: int = pydantic.Field(ge=3)
    rainy: bool
    note: str | None
    next: Trip | None = None


def test_an_instance_fits_a_pydantic_schema_with_refs_enums_and_recursion() -> None:
    schema = Trip.model_json_schema()
    value = json_instance(schema, "x")
    trip = Trip.model_validate(value)  # fits: pydantic checks every constraint used
    assert len(trip.stops) == 2
    assert trip.stops[0] == Place(name="x", kind="city")
    assert trip.nights == 3


def test_response_formats() -> None:
    assert content_for({}, "hi") == "hi"
    assert content_for({"response_format": {"type": "text"}}, "hi") == "hi"
    assert json.loads(content_for({"response_format": {"type": "json_object"}}, "hi")) == {
        "answer": "hi"
    }
    schema = {"type": "object", "properties": {"a": {"const": 7}}, "required": ["a"]}
    asked = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    assert json.loads(content_for(asked, "hi")) == {"a": 7}


def _tool(name: str) -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def test_the_tool_called_and_when_none_is() -> None:
    user = [{"role": "user", "content": "q"}]
    body = {"messages": user, "tools": [_tool("a"), _tool("b")]}
    call = tool_call_for(body, "1", "x")
    assert call is not None
    assert call["function"] == {"name": "a", "arguments": "{}"}
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "b"}}}
    named_call = tool_call_for(named, "1", "x")
    assert named_call is not None
    assert named_call["function"]["name"] == "b"
    assert tool_call_for({**body, "tool_choice": "none"}, "1", "x") is None
    answered = {**body, "messages": [*user, {"role": "tool", "content": "{}"}]}
    assert tool_call_for(answered, "1", "x") is None
    assert tool_call_for({"messages": user}, "1", "x") is None


def test_choices_asked() -> None:
    assert [choices_asked({"n": n}) for n in (None, 1, 3, 0, True, 2.0, 500)] == [
        1,
        1,
        3,
        1,
        1,
        1,
        1,
    ]
