"""The OpenAI stream relay's fast path: chunks sent on as the provider wrote them, a read's
chunks in one write, and everything else (the first chunk, the finish, the usage, a rescue after
the fast path) as before.

The provider is of type ``openai`` in front of the fake upstream on loopback, so that the
stream goes through ``stream_raw``: the fake upstream's raw fault writes the whole event stream
at once (its chunks arrive in one read or a few), its scripted streams one write a chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import orjson
import pytest

from tests.gateway.conftest import AppFactory
from tests.gateway.test_streaming import events, text_of
from tests.gateway.upstream import RunningUpstream, openai_provider, running_upstream
from tidegate.gateway.app import Gateway

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

CHAT = {
    "model": "chat",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "tell me"}],
}
WORDS = [f" w{i}" for i in range(1, 121)]
HEAD = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 1, "model": "up-1"}
USAGE = {"prompt_tokens": 3, "completion_tokens": 120, "total_tokens": 123}


def _event(chunk: dict[str, Any], *, spaced: bool = False) -> str:
    """One event as an upstream may write it; ``spaced``: as Python's json module does."""
    if spaced:
        return "data: " + orjson.dumps(chunk).decode().replace('":', '": ').replace(",", ", ")
    return "data: " + orjson.dumps(chunk).decode()


def _content(text: str) -> dict[str, Any]:
    return {**HEAD, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


def _stream_body(*, spaced: bool) -> tuple[str, list[str]]:
    """A whole answer written at once, and the content events as the upstream wrote them."""
    role = {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    finish = {**HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    contents = [_event(_content(word), spaced=spaced) for word in WORDS]
    lines = [
        _event(role),
        *contents,
        _event(finish),
        _event({**HEAD, "choices": [], "usage": USAGE}),
    ]
    return "".join(f"{line}\n\n" for line in [*lines, "data: [DONE]"]), contents


@contextmanager
def _upstream(body: str) -> Iterator[RunningUpstream]:
    raw = {"kind": "raw", "body": body, "content_type": "text/event-stream"}
    with running_upstream({"models": {"up-1": {"faults": [raw]}}}) as up:
        yield up


@asynccontextmanager
async def _gateway(
    gateway_client: AppFactory, providers: dict[str, Any]
) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    config = {
        "providers": providers,
        "models": {"chat": {"providers": list(providers)}},
        "cache": {"enabled": False},
    }
    async with gateway_client(config) as (client, app):
        yield client, app


@pytest.mark.parametrize("spaced", [False, True], ids=["compact", "spaced"])
async def test_a_burst_of_chunks_goes_on_as_the_upstream_wrote_them(
    gateway_client: AppFactory, spaced: bool
) -> None:
    """A whole answer in one write (many chunks a read): each content chunk reaches the client
    byte for byte as the upstream wrote it, the text is whole, and the usage of the last chunk
    is the client's usage and the exchange's."""
    body, contents = _stream_body(spaced=spaced)
    with _upstream(body) as up:
        async with _gateway(gateway_client, {"p": openai_provider(up, "up-1")}) as (client, _):
            response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    raw = response.content
    at = 0
    for event in contents:  # in order, unchanged
        found = raw.find(event.encode() + b"\n\n", at)
        assert found >= 0, event
        at = found
    items = events(raw)
    assert text_of(items) == "".join(WORDS)
    assert items[-1] == "[DONE]"
    assert items[-2]["usage"] == USAGE
    assert items[-3]["choices"][0]["finish_reason"] == "stop"


async def test_chunks_split_across_reads_are_relayed_whole(gateway_client: AppFactory) -> None:
    """A scripted stream (one write a chunk, paced) relays every chunk once, in order."""
    script = {"models": {"up-1": {"tokens": 60, "tokens_per_second": 2000}}}
    with running_upstream(script) as up:
        async with _gateway(gateway_client, {"p": openai_provider(up, "up-1")}) as (client, _):
            response = await client.post("/v1/chat/completions", json=CHAT)
    items = events(response.content)
    assert text_of(items) == "".join(f"{' ' if i > 1 else ''}token{i}" for i in range(1, 61))
    assert items[-2]["usage"]["completion_tokens"] == 60
    assert items[-1] == "[DONE]"


async def test_text_the_output_filter_changes_is_not_passed_through(
    gateway_client: AppFactory,
) -> None:
    """A chunk whose text holds an invisible character is relabelled and cleaned, not sent on
    as the upstream wrote it; the chunks around it still are."""
    body, contents = _stream_body(spaced=False)
    hidden = _event(_content(" w\u200b7"))
    body = body.replace(contents[6], hidden)
    with _upstream(body) as up:
        async with _gateway(gateway_client, {"p": openai_provider(up, "up-1")}) as (client, _):
            response = await client.post("/v1/chat/completions", json=CHAT)
    raw = response.content
    assert hidden.encode() not in raw
    assert "\u200b".encode() not in raw
    assert contents[5].encode() in raw
    assert contents[7].encode() in raw
    assert text_of(events(raw)) == "".join(WORDS)


async def test_a_chunk_under_another_id_is_relabelled(gateway_client: AppFactory) -> None:
    """A chunk whose id differs from the stream's first goes out under the first id."""
    body, contents = _stream_body(spaced=False)
    other = _event({**_content(" w9"), "id": "chatcmpl-other"})
    body = body.replace(contents[8], other)
    with _upstream(body) as up:
        async with _gateway(gateway_client, {"p": openai_provider(up, "up-1")}) as (client, _):
            response = await client.post("/v1/chat/completions", json=CHAT)
    assert b"chatcmpl-other" not in response.content
    assert {item["id"] for item in events(response.content) if isinstance(item, dict)} == {
        HEAD["id"]
    }


async def test_a_malformed_chunk_in_a_burst_is_skipped(gateway_client: AppFactory) -> None:
    """A chunk that is not JSON among the others of a read is skipped, not sent on."""
    body, contents = _stream_body(spaced=False)
    body = body.replace(contents[3], 'data: {"id": "chatcmpl-r", "choi')
    with _upstream(body) as up:
        async with _gateway(gateway_client, {"p": openai_provider(up, "up-1")}) as (client, app):
            response = await client.post("/v1/chat/completions", json=CHAT)
            assert app.runtime is not None
            exposition = app.runtime.metrics.exposition().decode()
    assert b'"choi\n' not in response.content
    assert text_of(events(response.content)) == "".join(WORDS[:3] + WORDS[4:])
    assert 'tidegate_malformed_chunks_total{provider="p"} 1.0' in exposition


@pytest.mark.parametrize("strategy", ["continuation", "splice"])
async def test_a_cut_after_the_fast_path_is_rescued(
    gateway_client: AppFactory, strategy: str
) -> None:
    """A stream relayed on the fast path and cut after 40 of 60 tokens is finished by the
    fallback from the text the client has (continued from it, or spliced after it): the fast
    path kept that text."""
    script = {
        "models": {
            "up-p": {"tokens": 60, "faults": [{"kind": "cut_after", "tokens": 40}]},
            "up-b": {"tokens": 60},
        }
    }
    with running_upstream(script) as up:
        fallback = openai_provider(up, "up-b", accepts_prefill=strategy == "continuation")
        providers = {"p": openai_provider(up, "up-p"), "b": fallback}
        async with _gateway(gateway_client, providers) as (client, _):
            response = await client.post("/v1/chat/completions", json=CHAT)
    assert f'"rescued_by":"{strategy}"'.encode() in response.content
    items = events(response.content)
    assert text_of(items) == "".join(f"{' ' if i > 1 else ''}token{i}" for i in range(1, 61))
    assert items[-1] == "[DONE]"
