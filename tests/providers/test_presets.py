"""OpenAI-compatible presets: the URL and auth sent, and each request-field rule, against a
fake upstream on loopback that records what it received."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.providers.openai import OpenAIProvider
from tidegate.providers.presets import PRESETS, Preset, preset_named

from .conftest import Serve

pytestmark = pytest.mark.slow

ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
STREAM = (
    b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}'
    b"\n\ndata: [DONE]\n\n"
)
KEY = "sk-preset-test"


class Recorder:
    """An OpenAI-compatible fake that keeps each request's path, headers and body."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, dict(request.headers), body))
        if body.get("stream"):
            return web.Response(body=STREAM, content_type="text/event-stream")
        return web.json_response(ANSWER)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.handle)
        return app


async def _provider(
    serve: Serve, session: aiohttp.ClientSession, preset: Preset, *, key: str | None = KEY
) -> tuple[OpenAIProvider, Recorder]:
    """A provider for ``preset`` whose base URL is the fake's, with the preset's own path."""
    recorder = Recorder()
    root = await serve(recorder.app())
    path = urlsplit(preset.base_url or "/v1").path
    provider = OpenAIProvider(preset.name, root + path, key, session, preset=preset)
    return provider, recorder


def _chat(model: str = "m", **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}


DEFAULT_URLS = {
    "vllm": "http://localhost:8000/v1",
    "ollama": "http://localhost:11434/v1",
    "llamacpp": "http://localhost:8080/v1",
    "mistral": "https://api.mistral.ai/v1",
    "groq": "https://api.groq.com/openai/v1",
    "together": "https://api.together.ai/v1",
    "deepseek": "https://api.deepseek.com",
    "openrouter": "https://openrouter.ai/api/v1",
}
BEARER = {"mistral", "groq", "together", "deepseek", "openrouter"}


def test_the_table_has_the_documented_presets_and_urls() -> None:
    assert {name: p.base_url for name, p in PRESETS.items()} == DEFAULT_URLS
    assert {name for name, p in PRESETS.items() if p.auth == "bearer"} == BEARER


def test_an_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown preset 'nope'; known presets: deepseek, groq"):
        preset_named("nope")


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(PRESETS))
async def test_url_path_and_bearer_key_sent(
    name: str, serve: Serve, session: aiohttp.ClientSession
) -> None:
    provider, recorder = await _provider(serve, session, PRESETS[name])
    answer = await provider.complete(_chat(), timeout=5.0)
    assert answer["choices"][0]["message"]["content"] == "ok"
    [(path, headers, body)] = recorder.seen
    assert path == urlsplit(DEFAULT_URLS[name]).path.rstrip("/") + "/chat/completions"
    assert headers["Authorization"] == f"Bearer {KEY}"
    assert body == {**_chat(), "stream": False}  # a plain body is sent unchanged


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["vllm", "ollama", "llamacpp"])
async def test_a_local_server_without_a_key_gets_no_auth_header(
    name: str, serve: Serve, session: aiohttp.ClientSession
) -> None:
    provider, recorder = await _provider(serve, session, PRESETS[name], key=None)
    await provider.complete(_chat(), timeout=5.0)
    [(_, headers, _)] = recorder.seen
    assert "Authorization" not in headers


# (preset, model, fields sent by the caller, fields the upstream must see instead)
CHANGED: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "ollama-user": ("ollama", "m", {"user": "u1"}, {}),
    "ollama-n-1": ("ollama", "m", {"n": 1}, {}),
    "ollama-empty-logit-bias": ("ollama", "m", {"logit_bias": {}}, {}),
    "llamacpp-n-1": ("llamacpp", "m", {"n": 1}, {}),
    "mistral-seed": ("mistral", "m", {"seed": 7}, {"random_seed": 7}),
    "mistral-max-completion": ("mistral", "m", {"max_completion_tokens": 9}, {"max_tokens": 9}),
    "mistral-same-max": (
        "mistral",
        "m",
        {"max_completion_tokens": 9, "max_tokens": 9},
        {"max_tokens": 9},
    ),
    "mistral-user": ("mistral", "m", {"user": "u1"}, {}),
    "mistral-logprobs-false": ("mistral", "m", {"logprobs": False}, {}),
    "mistral-n-kept": ("mistral", "m", {"n": 2}, {"n": 2}),
    "groq-logprobs-false": ("groq", "m", {"logprobs": False}, {}),
    "groq-n-1": ("groq", "m", {"n": 1}, {}),
    "groq-null-top-logprobs": ("groq", "m", {"top_logprobs": None}, {}),
    "groq-temperature-kept": ("groq", "m", {"temperature": 0}, {"temperature": 0}),
    "deepseek-reasoner-sampling": (
        "deepseek",
        "deepseek-reasoner",
        {"temperature": 0.2, "top_p": 0.9, "presence_penalty": 1, "frequency_penalty": 1},
        {},
    ),
    "deepseek-chat-sampling-kept": (
        "deepseek",
        "deepseek-chat",
        {"temperature": 0.2, "top_p": 0.9, "logprobs": True},
        {"temperature": 0.2, "top_p": 0.9, "logprobs": True},
    ),
    "vllm-passes-all": ("vllm", "m", {"n": 3, "logprobs": True, "user": "u"}, None),  # type: ignore[dict-item]
    "together-passes-all": ("together", "m", {"n": 2, "logit_bias": {"1": 5}}, None),  # type: ignore[dict-item]
    "openrouter-passes-all": ("openrouter", "m", {"n": 2, "seed": 3}, None),  # type: ignore[dict-item]
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(CHANGED))
async def test_fields_dropped_or_renamed(
    case: str, serve: Serve, session: aiohttp.ClientSession
) -> None:
    name, model, sent, expected = CHANGED[case]
    provider, recorder = await _provider(serve, session, PRESETS[name])
    await provider.complete(_chat(model, **sent), timeout=5.0)
    [(_, _, body)] = recorder.seen
    wanted = sent if expected is None else expected
    assert body == {**_chat(model), **wanted, "stream": False}


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["groq", "mistral"])
async def test_message_names_are_dropped_but_tool_results_keep_theirs(
    name: str, serve: Serve, session: aiohttp.ClientSession
) -> None:
    messages = [
        {"role": "system", "content": "be brief", "name": "ops"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "tool", "content": "42", "tool_call_id": "t1", "name": "lookup"},
    ]
    body = {"model": "m", "messages": messages}
    provider, recorder = await _provider(serve, session, PRESETS[name])
    await provider.complete(body, timeout=5.0)
    [(_, _, sent)] = recorder.seen
    assert sent["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "tool", "content": "42", "tool_call_id": "t1", "name": "lookup"},
    ]
    assert messages[0]["name"] == "ops"  # the caller's body is not changed


@pytest.mark.asyncio
async def test_mistral_stream_drops_stream_options(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    provider, recorder = await _provider(serve, session, PRESETS["mistral"])
    body = _chat(stream_options={"include_usage": True})
    async with aclosing(provider.stream(body, timeout=5.0)) as items:
        got = [item async for item in items]
    first = got[0]
    assert isinstance(first, dict)
    assert first["choices"][0]["delta"]["content"] == "ok"
    [(_, _, sent)] = recorder.seen
    assert sent == {**_chat(), "stream": True}


async def _drain(provider: OpenAIProvider, body: dict[str, Any]) -> None:
    # The refusal may come from the call or from the first item: either is before sending.
    items = provider.stream(body, timeout=5.0)
    async with aclosing(items):
        async for _ in items:
            pass


# (preset, model, fields) that must be refused, naming the field
REFUSED: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "ollama-n": ("ollama", "m", {"n": 2}, "n"),
    "ollama-logit-bias": ("ollama", "m", {"logit_bias": {"50256": -100}}, "logit_bias"),
    "llamacpp-n": ("llamacpp", "m", {"n": 3}, "n"),
    "mistral-logprobs": ("mistral", "m", {"logprobs": True}, "logprobs"),
    "mistral-top-logprobs": ("mistral", "m", {"top_logprobs": 2}, "top_logprobs"),
    "mistral-logit-bias": ("mistral", "m", {"logit_bias": {"1": 2}}, "logit_bias"),
    "mistral-seeds-disagree": ("mistral", "m", {"seed": 1, "random_seed": 2}, "seed"),
    "groq-logprobs": ("groq", "m", {"logprobs": True}, "logprobs"),
    "groq-top-logprobs": ("groq", "m", {"top_logprobs": 0}, "top_logprobs"),
    "groq-logit-bias": ("groq", "m", {"logit_bias": {"1": 2}}, "logit_bias"),
    "groq-n": ("groq", "m", {"n": 2}, "n"),
    "groq-n-true": ("groq", "m", {"n": True}, "n"),
    "deepseek-logprobs": ("deepseek", "deepseek-reasoner", {"logprobs": True}, "logprobs"),
    "deepseek-top-logprobs": ("deepseek", "deepseek-reasoner", {"top_logprobs": 1}, "top_logprobs"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_fields_refused_before_anything_is_sent(
    case: str, serve: Serve, session: aiohttp.ClientSession
) -> None:
    name, model, sent, field = REFUSED[case]
    provider, recorder = await _provider(serve, session, PRESETS[name])
    with pytest.raises(ProviderError) as raised:
        await provider.complete(_chat(model, **sent), timeout=5.0)
    error = raised.value
    assert error.kind is ProviderErrorKind.BAD_REQUEST
    assert not error.retryable
    assert f"'{field}'" in error.message
    assert f"preset {name!r}" in error.message
    with pytest.raises(ProviderError, match=f"preset {name!r}"):
        await _drain(provider, _chat(model, **sent))
    assert recorder.seen == []  # the fake was never called


@pytest.mark.asyncio
async def test_without_a_preset_nothing_is_changed(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    recorder = Recorder()
    root = await serve(recorder.app())
    provider = OpenAIProvider("plain", root + "/v1", None, session)
    fields = {"n": 2, "logprobs": True, "seed": 1, "messages": [{"role": "user", "name": "a"}]}
    await provider.complete({"model": "m", **fields}, timeout=5.0)
    [(_, _, body)] = recorder.seen
    assert body == {"model": "m", **fields, "stream": False}
    assert provider.preset is None
    assert "_payload" not in vars(provider)
