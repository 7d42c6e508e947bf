"""Embeddings in both encodings: what the SDKs ask for by default (``base64``) decodes to the
same vectors as ``float``, whatever encoding the provider answers in; ``dimensions`` reaches
the provider; a bad ``encoding_format`` or ``dimensions`` is 400; vectors that are not numbers
are the provider's ``malformed`` error and fail over."""

from __future__ import annotations

import array
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from tests.gateway.harness import KEY, fake, in_process_gateway, running_gateway
from tidegate.providers.wire import decode_vector, embeddings_response, encode_vector

INPUTS = ["the tide", "turns at noon"]
CONFIG = {
    "providers": {"p": fake(model="embed-1", embedding_dimensions=12)},
    "models": {"embed": {"providers": ["p"]}},
}


def float32(vector: list[float]) -> list[float]:
    """``vector`` as float32 values (what base64 carries)."""
    return array.array("f", vector).tolist()


def test_the_codec_is_float32_little_endian() -> None:
    """The bytes are the vector's float32 values, little-endian, as the SDKs read them."""
    vector = [0.5, -1.25, 3.0]
    text = encode_vector(vector)
    assert base64.b64decode(text) == b"\x00\x00\x00?\x00\x00\xa0\xbf\x00\x00@@"
    assert decode_vector(text) == vector
    assert decode_vector("not base64!") is None
    assert decode_vector(base64.b64encode(b"abc").decode()) is None  # not whole floats


def test_the_sdk_default_base64_and_float_give_the_same_vectors(tmp_path: Path) -> None:
    with running_gateway(tmp_path, CONFIG) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        by_default = client.embeddings.create(model="embed", input=INPUTS)  # asks base64
        as_floats = client.embeddings.create(model="embed", input=INPUTS, encoding_format="float")
        as_base64 = client.embeddings.create(model="embed", input=INPUTS, encoding_format="base64")
        shorter = client.embeddings.create(model="embed", input=INPUTS, dimensions=5)
        client.close()
    floats = [item.embedding for item in as_floats.data]
    assert [len(v) for v in floats] == [12, 12]
    assert floats[0] != floats[1]
    assert [item.embedding for item in by_default.data] == [float32(v) for v in floats]
    encoded = [item.embedding for item in as_base64.data]
    assert all(isinstance(text, str) for text in encoded)
    assert [decode_vector(str(text)) for text in encoded] == [float32(v) for v in floats]
    assert [len(item.embedding) for item in shorter.data] == [5, 5]
    assert as_floats.model == "embed-1"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("encoding_format", "int8"),
        ("encoding_format", 1),
        ("dimensions", 0),
        ("dimensions", -3),
        ("dimensions", "8"),
        ("dimensions", 2**40),
    ],
)
def test_a_bad_encoding_or_dimensions_is_400(tmp_path: Path, field: str, value: Any) -> None:
    with running_gateway(tmp_path, CONFIG) as (base, _):
        reply = httpx.post(
            f"{base}/v1/embeddings",
            json={"model": "embed", "input": "x", field: value},
            headers={"Authorization": f"Bearer {KEY}"},
            trust_env=False,
        )
    assert reply.status_code == 400, reply.text
    assert field in reply.json()["error"]["message"]


# --------------------------------------------------------------------------- providers' answers


class Upstream:
    """An embeddings provider answering with the ``embedding`` values a test sets."""

    def __init__(self, embedding: Any) -> None:
        self.embedding = embedding
        self.bodies: list[Any] = []

    def __call__(self, body: Any, number: int) -> Any:
        self.bodies.append(body)
        answer = embeddings_response(model="m", vectors=[[0.0]], prompt_tokens=1)
        answer["data"][0]["embedding"] = self.embedding
        return answer


@pytest_asyncio.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Upstream, Upstream]]:
    config = {
        "providers": {"first": fake(), "second": fake()},
        "models": {"embed": {"providers": ["first", "second"]}},
        "retry": {"attempts": 1},
    }
    first, second = Upstream([0.5, 0.25]), Upstream([1.0, 2.0])
    async with in_process_gateway(tmp_path, config, {"first": first, "second": second}) as (
        client,
        _,
    ):
        yield client, first, second


@pytest.mark.asyncio
async def test_the_provider_is_asked_for_floats_and_its_base64_is_decoded(
    gateway: tuple[httpx.AsyncClient, Upstream, Upstream],
) -> None:
    """The caller's encoding is the gateway's to write: the provider never sees the field, and
    a provider that answers base64 anyway gives a float caller floats."""
    client, first, _ = gateway
    first.embedding = encode_vector([0.5, 0.25])
    reply = await client.post("/v1/embeddings", json={"model": "embed", "input": "x"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["data"][0]["embedding"] == [0.5, 0.25]
    asked = await client.post(
        "/v1/embeddings", json={"model": "embed", "input": "x", "encoding_format": "base64"}
    )
    assert asked.json()["data"][0]["embedding"] == encode_vector([0.5, 0.25])
    assert all("encoding_format" not in body for body in first.bodies)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "embedding", [["0.5", 1], [True, False], "%%%", None, {"values": [1.0]}], ids=str
)
async def test_vectors_that_are_not_numbers_fail_over(
    gateway: tuple[httpx.AsyncClient, Upstream, Upstream], embedding: Any
) -> None:
    client, first, _ = gateway
    first.embedding = embedding
    reply = await client.post("/v1/embeddings", json={"model": "embed", "input": "x"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["data"][0]["embedding"] == [1.0, 2.0]
    assert reply.headers["x-tidegate-tried"] == "first=malformed, second=ok"
