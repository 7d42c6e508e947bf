"""Model providers behind one small async protocol, speaking the OpenAI wire format.

:class:`OpenAIProvider` talks to any OpenAI-compatible endpoint, :class:`AnthropicProvider` to
Anthropic's Messages API (translated both ways), :class:`FakeProvider` answers in-process from a
function or a script, and :class:`FakeUpstream` is a scriptable OpenAI-compatible HTTP server.
"""

from tidegate.providers.anthropic import AnthropicProvider
from tidegate.providers.base import (
    JSONObject,
    MalformedChunk,
    Provider,
    StreamEnd,
    StreamItem,
    parse_retry_after,
)
from tidegate.providers.fake import Delay, FakeAttempt, FakeProvider, Pause
from tidegate.providers.fake_upstream import (
    FakeUpstream,
    create_app,
    load_script,
    run_fake_upstream,
)
from tidegate.providers.openai import OpenAIProvider
from tidegate.providers.script import FakeScript, ModelScript

__all__ = [
    "AnthropicProvider",
    "Delay",
    "FakeAttempt",
    "FakeProvider",
    "FakeScript",
    "FakeUpstream",
    "JSONObject",
    "MalformedChunk",
    "ModelScript",
    "OpenAIProvider",
    "Pause",
    "Provider",
    "StreamEnd",
    "StreamItem",
    "create_app",
    "load_script",
    "parse_retry_after",
    "run_fake_upstream",
]
