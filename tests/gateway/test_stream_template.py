"""The writer's template fast path: a content chunk in the shape of the stream's earlier ones is
sent on after one match of its bytes, without its decoded object being walked; anything the
template cannot vouch for (an escape, a quote, DEL, another tail, a rescue) takes the full check.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import orjson
import pytest

from tidegate.gateway.pipeline.stream_writer import StreamWriter
from tidegate.gateway.redaction import OutputFilter
from tidegate.gateway.watch import _TrackedSend, _Watch
from tidegate.providers.base import RawChunks

pytestmark = pytest.mark.asyncio

HEAD = {"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 7, "model": "up-1"}


def _content(text: str, **more: Any) -> dict[str, Any]:
    delta = {"content": text, **more}
    return {**HEAD, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def _raw(chunk: dict[str, Any], *, spaced: bool = False) -> bytes:
    data = orjson.dumps(chunk)
    return data.replace(b'":', b'": ').replace(b",", b", ") if spaced else data


class Sink:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            self.bodies.append(message["body"])


def _writer(sink: Sink, **options: Any) -> StreamWriter:
    output = OutputFilter(options.pop("deny", ()))
    return StreamWriter(
        sink,
        want_usage=True,
        clean=output.clean,
        plain_is_clean=not output.patterns,
        **options,
    )


async def _one(writer: StreamWriter, data: bytes, *, continuing: bool = False) -> None:
    await writer.chunks(RawChunks([orjson.loads(data)], [data]), continuing=continuing)


async def _opened(writer: StreamWriter, *, spaced: bool = False) -> None:
    """The role chunk and a first content chunk, which teaches the template."""
    role = {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    await _one(writer, _raw(role, spaced=spaced))
    await _one(writer, _raw(_content("Hi"), spaced=spaced))


async def test_hundreds_of_chunks_go_on_as_written_after_the_first() -> None:
    sink = Sink()
    writer = _writer(sink)
    await _opened(writer)
    assert writer.template is not None
    words = [f" w{i}" for i in range(500)]
    raws = [_raw(_content(word)) for word in words]
    for data in raws:
        await _one(writer, data)
    assert sink.bodies[2:] == [b"data: " + data + b"\n\n" for data in raws]
    assert writer.text == "Hi" + "".join(words)


async def test_a_spaced_upstream_teaches_its_own_template() -> None:
    sink = Sink()
    writer = _writer(sink)
    await _opened(writer, spaced=True)
    assert writer.template is not None
    data = _raw(_content(" there"), spaced=True)
    await _one(writer, data)
    assert sink.bodies[-1] == b"data: " + data + b"\n\n"
    assert writer.text == "Hi there"


@pytest.mark.parametrize("text", ['say "x"', "a\nb", "caf\u00e9", "back\\slash", "\u4f60\u597d"])
async def test_text_with_an_escape_or_beyond_ascii_takes_the_full_check(text: str) -> None:
    sink = Sink()
    writer = _writer(sink)
    await _opened(writer)
    data = _raw(_content(text))
    await _one(writer, data)
    assert sink.bodies[-1] == b"data: " + data + b"\n\n"  # unchanged, so sent as written
    assert writer.text == "Hi" + text


async def test_text_that_closes_its_string_cannot_smuggle_a_tool_call_past() -> None:
    sink = Sink()
    writer = _writer(sink)
    await _opened(writer)
    head, tail, _ = writer.template  # type: ignore[misc]
    data = head + b'a","tool_calls":[{"index":0,"function":{"name":"f"}}],"x":"b' + tail
    chunk = orjson.loads(data)
    assert chunk["choices"][0]["delta"]["tool_calls"]
    await writer.chunks(RawChunks([chunk], [data]))
    assert writer.tool_call_sent
    assert orjson.loads(sink.bodies[-1].removeprefix(b"data: "))["choices"][0]["delta"][
        "tool_calls"
    ]


async def test_del_and_invisible_characters_are_still_stripped() -> None:
    sink = Sink()
    writer = _writer(sink)
    await _opened(writer)
    for text in ("a\x7fb", "a\u200bb"):
        await _one(writer, _raw(_content(text)))
        sent = orjson.loads(sink.bodies[-1].removeprefix(b"data: ").removesuffix(b"\n\n"))
        assert sent["choices"][0]["delta"]["content"] == "ab"
    assert writer.text == "Hiabab"


async def test_deny_patterns_still_see_every_plain_text() -> None:
    sink = Sink()
    writer = _writer(sink, deny=[r"secret"])
    await _opened(writer)
    assert writer.template is not None
    await _one(writer, _raw(_content(" the secret")))
    sent = orjson.loads(sink.bodies[-1].removeprefix(b"data: ").removesuffix(b"\n\n"))
    assert sent["choices"][0]["delta"]["content"] == " the [redacted]"
    assert writer.text == "Hi the [redacted]"


async def test_a_finish_or_another_id_is_not_in_the_template() -> None:
    sink = Sink()
    writer = _writer(sink)
    await _opened(writer)
    other = {**_content(" x"), "id": "chatcmpl-other"}
    await _one(writer, _raw(other))
    assert orjson.loads(sink.bodies[-1].removeprefix(b"data: ").removesuffix(b"\n\n"))["id"] == (
        "chatcmpl-t"
    )
    finish = {**HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    await _one(writer, _raw(finish))
    assert writer.finish_reason == "stop"


async def test_a_read_of_many_chunks_uses_the_template_for_each() -> None:
    sink = Sink()
    writer = _writer(sink)
    await _opened(writer)
    raws = [_raw(_content(f" w{i}")) for i in range(50)]
    finish = _raw({**HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks = [orjson.loads(data) for data in [*raws, finish]]
    await writer.chunks(RawChunks(chunks, [*raws, finish]))
    body = sink.bodies[-1]
    assert body.startswith(b"".join(b"data: " + data + b"\n\n" for data in raws))
    assert writer.finish_reason == "stop"
    assert writer.text == "Hi" + "".join(f" w{i}" for i in range(50))


async def test_a_rescuer_after_the_fast_path_is_relabelled() -> None:
    sink = Sink()
    writer = _writer(sink)
    await _opened(writer)
    await _one(writer, _raw(_content(" a")))
    rescuer = {**_content(" b"), "id": "chatcmpl-rescuer", "model": "other-1"}
    await _one(writer, _raw(rescuer), continuing=True)
    sent = orjson.loads(sink.bodies[-1].removeprefix(b"data: ").removesuffix(b"\n\n"))
    assert sent["id"] == "chatcmpl-t"
    assert sent["model"] == "other-1"  # the model that wrote it
    assert writer.text == "Hi a b"


async def test_a_template_is_learned_only_when_its_probe_decodes_as_the_chunk() -> None:
    sink = Sink()
    writer = _writer(sink)
    role = {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    await _one(writer, _raw(role))
    # The text also appears as the value of a key named content elsewhere: not once, not learned.
    twice = {**_content("Hi"), "extra": {"content": "Hi"}}
    await _one(writer, _raw(twice))
    assert writer.template is None
    assert writer.text == "Hi"


async def test_the_watch_sends_a_stream_body_straight_on() -> None:
    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    class _Ex:
        settling = False

    watch = _Watch(None, _Ex(), None, 0.0)  # type: ignore[arg-type]
    tracked = _TrackedSend(send, watch)
    writer = StreamWriter(tracked, want_usage=False)
    await writer.start([])
    await _opened(writer)
    assert (watch.started, watch.responded) == (True, False)
    await writer.done({})
    assert watch.responded
    assert sent[-1] == {
        "type": "http.response.body",
        "body": b"data: [DONE]\n\n",
        "more_body": False,
    }
