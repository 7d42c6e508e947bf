"""OpenAIRelayDecoder: a read's chunks together, each beside its bytes, with the outcomes of
``openai_chunks`` for everything that is not a chunk."""

from __future__ import annotations

import orjson
import pytest

from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.providers.base import MalformedChunk, RawChunks, StreamEnd
from tidegate.providers.openai import OpenAIRelayDecoder
from tidegate.providers.transport import HTTPAnswer


def _error_for(answer: HTTPAnswer) -> ProviderError:
    return ProviderError(ProviderErrorKind.SERVER, answer.body.decode(), provider="p")


def _chunk(text: str) -> bytes:
    return orjson.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": text}}]})


def test_one_chunk_a_read_comes_with_its_bytes() -> None:
    decoder = OpenAIRelayDecoder(_error_for)
    (item,) = decoder.feed(b"data: " + _chunk("hi") + b"\n\n")
    assert isinstance(item, RawChunks)
    assert item.data == [_chunk("hi")]
    assert item.chunks == [orjson.loads(_chunk("hi"))]


def test_the_chunks_of_a_read_come_together_until_something_else() -> None:
    """Many chunks in one read are one RawChunks; a malformed event splits them; [DONE] ends
    the stream and nothing after it is read."""
    decoder = OpenAIRelayDecoder(_error_for)
    body = b"".join(b"data: " + _chunk(f"w{i}") + b"\n\n" for i in range(5))
    body += b"data: {not json\n\n" + b"data: " + _chunk("w5") + b"\n\ndata: [DONE]\n\n"
    body += b"data: " + _chunk("after") + b"\n\n"
    items = decoder.feed(body)
    assert [type(item) for item in items] == [RawChunks, MalformedChunk, RawChunks, StreamEnd]
    first, bad, second, end = items
    assert isinstance(first, RawChunks)
    assert isinstance(second, RawChunks)
    assert first.data == [_chunk(f"w{i}") for i in range(5)]
    assert bad == MalformedChunk("{not json")
    assert second.data == [_chunk("w5")]
    assert end == StreamEnd(done_seen=True)
    assert decoder.feed(b"data: " + _chunk("more") + b"\n\n") == []
    assert decoder.end() == []


def test_a_chunk_cut_across_reads_comes_once_whole() -> None:
    decoder = OpenAIRelayDecoder(_error_for)
    raw = b"data: " + _chunk("split") + b"\n\n"
    assert decoder.feed(raw[:20]) == []
    (item,) = decoder.feed(raw[20:])
    assert isinstance(item, RawChunks)
    assert item.data == [_chunk("split")]


def test_an_error_event_is_raised_after_the_chunks_before_it() -> None:
    decoder = OpenAIRelayDecoder(_error_for)
    with pytest.raises(ProviderError, match="overloaded"):
        decoder.feed(b'data: {"error": {"message": "overloaded"}}\n\n')


def test_the_end_without_done_is_a_stream_end_without_it() -> None:
    decoder = OpenAIRelayDecoder(_error_for)
    assert decoder.feed(b"data: " + _chunk("a")) == []
    items = decoder.end()
    assert isinstance(items[0], RawChunks)
    assert items[0].data == [_chunk("a")]
    assert items[1:] == [StreamEnd(done_seen=False)]


def test_data_that_is_not_utf8_is_read_with_replacements() -> None:
    """As openai_chunks reads it: a chunk, decoded (not passed on as its bytes)."""
    decoder = OpenAIRelayDecoder(_error_for)
    raw = b'{"id": "c", "choices": [{"index": 0, "delta": {"content": "a\xffb"}}]}'
    (item,) = decoder.feed(b"data: " + raw + b"\n\n")
    assert isinstance(item, dict)
    assert item["choices"][0]["delta"]["content"] == "a\ufffdb"
