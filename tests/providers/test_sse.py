"""The incremental server-sent-events decoder."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.providers.sse import SSEDecoder, SSEEvent, SSELineTooLong


def decode_all(*pieces: bytes) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events = [event for piece in pieces for event in decoder.feed(piece)]
    return events + decoder.end()


def test_data_lines_become_events_at_blank_lines() -> None:
    """Each blank line ends an event; the default event type is 'message'."""
    assert decode_all(b'data: {"a":1}\n\ndata: [DONE]\n\n') == [
        SSEEvent("message", '{"a":1}'),
        SSEEvent("message", "[DONE]"),
    ]


def test_event_type_comments_and_multiline_data() -> None:
    """``event:`` names the event, comments are skipped and data lines join with LF."""
    stream = b": keep-alive\nevent: message_start\ndata: one\ndata:two\n\n"
    assert decode_all(stream) == [SSEEvent("message_start", "one\ntwo")]


def test_crlf_and_cr_line_endings() -> None:
    """CRLF and lone CR end lines as LF does."""
    assert decode_all(b"data: a\r\n\r\ndata: b\r\rdata: c\n\n") == [
        SSEEvent("message", "a"),
        SSEEvent("message", "b"),
        SSEEvent("message", "c"),
    ]


def test_crlf_split_across_reads_is_one_line_end() -> None:
    """A CR at the end of one read and an LF at the start of the next count once."""
    assert decode_all(b"data: a\r", b"\n\r", b"\n") == [SSEEvent("message", "a")]


def test_an_event_without_data_is_not_dispatched() -> None:
    """An event with only an ``event:`` line is dropped, as the SSE rules say."""
    assert decode_all(b"event: ping\n\n") == []


def test_a_pending_event_is_delivered_when_the_body_ends() -> None:
    """Data without the final blank line is still delivered at the end of the body."""
    assert decode_all(b"data: [DONE]") == [SSEEvent("message", "[DONE]")]


def test_a_line_over_the_limit_is_refused() -> None:
    """A line that grows past ``max_line`` without ending raises SSELineTooLong."""
    decoder = SSEDecoder(max_line=16)
    with pytest.raises(SSELineTooLong):
        decoder.feed(b"data: " + b"x" * 32)


def test_max_line_must_be_positive() -> None:
    """A limit below one byte is a ValueError."""
    with pytest.raises(ValueError, match="max_line"):
        SSEDecoder(max_line=0)


_payloads = st.lists(
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=20),
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(_payloads, st.sampled_from([b"\n", b"\r\n", b"\r"]), st.data())
def test_splitting_the_bytes_anywhere_gives_the_same_events(
    payloads: list[str], newline: bytes, data: st.DataObject
) -> None:
    """However the body is cut into reads, the decoded events are the same."""
    body = b"".join(b"data: " + p.encode() + newline + newline for p in payloads)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    assert decode_all(*pieces) == [SSEEvent("message", p) for p in payloads]


def data_all(*pieces: bytes) -> list[bytes]:
    decoder = SSEDecoder()
    data = [item for piece in pieces for item in decoder.feed_data(piece)]
    return data + [event.data.encode() for event in decoder.end()]


def test_feed_data_gives_each_events_data_as_bytes() -> None:
    """One event a read (the usual read), several, and one cut across reads."""
    assert data_all(b'data: {"a":1}\n\n') == [b'{"a":1}']
    assert data_all(b"data: a\n\ndata: b\n\nda", b"ta: c\n\n") == [b"a", b"b", b"c"]
    assert data_all(b"data: a", b"\n", b"\ndata: [DONE]\n\n") == [b"a", b"[DONE]"]


_lines = st.lists(
    st.one_of(
        st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=12).map(
            lambda text: "data: " + text
        ),
        st.sampled_from(["", "data:x", ": comment", "event: ping", "data: two\ndata: lines"]),
    ),
    max_size=10,
)


@settings(max_examples=100, deadline=None)
@given(_lines, st.sampled_from([b"\n", b"\r\n", b"\r"]), st.data())
def test_feed_data_gives_the_data_of_feed_however_the_bytes_are_cut(
    lines: list[str], newline: bytes, data: st.DataObject
) -> None:
    """Comments, event names, several data lines, any line ending, any cut: the data is
    :meth:`feed`'s, event for event."""
    body = b"".join(line.encode().replace(b"\n", newline) + newline for line in lines)
    body += newline
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    assert data_all(*pieces) == [event.data.encode() for event in decode_all(*pieces)]


def test_feed_data_refuses_a_line_over_the_limit() -> None:
    decoder = SSEDecoder(max_line=16)
    with pytest.raises(SSELineTooLong):
        decoder.feed_data(b"data: a\n\ndata: " + b"x" * 32)
