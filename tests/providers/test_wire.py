"""The OpenAI wire-shape builders."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.providers.wire import (
    assemble_completion,
    chat_chunk,
    chat_completion,
    completion_chunks,
    embeddings_response,
    openai_error,
    usage,
)


def test_usage_total_is_the_sum() -> None:
    """``total_tokens`` is prompt plus completion tokens."""
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_a_usage_chunk_has_no_choices() -> None:
    """A chunk built without a delta is the usage-only chunk: empty choices, usage present."""
    chunk = chat_chunk(id="c", model="m", created=1, usage=usage(1, 2))
    assert chunk["choices"] == []
    assert chunk["usage"]["total_tokens"] == 3
    assert chunk["object"] == "chat.completion.chunk"


def test_error_and_embeddings_shapes() -> None:
    """The error body and the embeddings list have OpenAI's field names."""
    assert openai_error("no", type="invalid_request_error", code="x") == {
        "error": {"message": "no", "type": "invalid_request_error", "param": None, "code": "x"}
    }
    body = embeddings_response(model="e", vectors=[[0.5], [1.0]], prompt_tokens=2)
    assert [item["index"] for item in body["data"]] == [0, 1]
    assert body["data"][1]["embedding"] == [1.0]


@settings(max_examples=50, deadline=None)
@given(
    st.one_of(st.none(), st.text(max_size=30)),
    st.sampled_from(["stop", "length", "content_filter"]),
    st.booleans(),
)
def test_chunks_add_back_up_to_the_completion(
    content: str | None, finish: str, with_usage: bool
) -> None:
    """Splitting a completion into chunks and assembling them again gives the same completion."""
    completion = chat_completion(
        id="c1",
        model="m",
        created=5,
        content=content or None,
        finish_reason=finish,
        usage=usage(2, 3) if with_usage else None,
    )
    rebuilt = assemble_completion(completion_chunks(completion))
    assert rebuilt["choices"][0]["message"]["content"] == (content or "")
    assert rebuilt["choices"][0]["finish_reason"] == finish
    assert rebuilt.get("usage") == completion.get("usage")
    assert (rebuilt["id"], rebuilt["model"], rebuilt["created"]) == ("c1", "m", 5)
