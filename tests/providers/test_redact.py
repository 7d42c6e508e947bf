"""Cleaning upstream error text: no configured secret and nothing key-shaped survives."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.providers.redact import (
    MAX_MESSAGE,
    NO_SECRETS,
    REDACTED,
    Redactor,
    cut,
    request_id_of,
    secret_header_values,
)

SECRET = "tidegate-upstream-secret-7f3a"  # not shaped like any known key
OTHER_KEY = "sk-proj-Zx81Qw0PlmN4bV7cX2sA9dF3gH6jK1"


@pytest.mark.parametrize(
    "text",
    [
        f"Incorrect API key provided: {SECRET}.",
        f"key {SECRET.upper()} is wrong",
        f'{{"error": {orjson.dumps("a " + SECRET + " b").decode()}}}',
        f"refused{SECRET}glued",
        f"line one\n{SECRET[:10]}\u200b{SECRET[10:]}",
    ],
)
def test_the_configured_secret_is_removed_wherever_it_stands(text: str) -> None:
    """The exact secret goes, whatever its case, inside a token, JSON-escaped or split by an
    invisible character."""
    cleaned = Redactor([SECRET]).clean(text)
    assert SECRET.lower() not in cleaned.lower()
    assert REDACTED in cleaned


def test_a_percent_encoded_secret_is_removed() -> None:
    """A secret with characters a URL escapes is removed in its percent-encoded form too."""
    secret = "p@ss/word+with=odd&chars"
    redactor = Redactor([secret])
    cleaned = redactor.clean("https://host/cb?x=1&s=p%40ss%2Fword%2Bwith%3Dodd%26chars")
    assert "p%40ss" not in cleaned


def test_a_short_secret_is_removed_only_as_a_whole_token() -> None:
    """A secret under eight characters goes where it stands alone, not out of ordinary words."""
    redactor = Redactor(["key1"])
    assert redactor.clean("bad key1 given; keys differ") == f"bad {REDACTED} given; keys differ"


@pytest.mark.parametrize(
    ("text", "gone"),
    [
        (f"Incorrect API key provided: {OTHER_KEY}", OTHER_KEY),
        ("Incorrect API key provided: sk-abc1*****************xyz9.", "sk-abc1"),
        ("bad x-api-key sk-ant-api03-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", "sk-ant-api03"),
        ("Authorization: Bearer abc.DEF-ghi_jkl~mno", "abc.DEF"),
        ("header api-key: 0123456789abcdef0123456789abcdef", "0123456789abcdef"),
        ("GET https://x.example/v1/m?key=AIzaSyA-0123456789abcdefghijklmnopqrs", "AIzaSy"),
        ("POST https://h.example/x?api-key=hunter2hunter2&v=1", "hunter2"),
        ("proxy https://bob:s3cr3t-pass@proxy.example:8080 refused", "s3cr3t"),
        ("token ghp_0123456789abcdefghijABCDEFGHIJabcdef", "ghp_0123"),
        ("aws AKIAIOSFODNN7EXAMPLE denied", "AKIAIOSF"),
        ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.sig", "eyJhbGci"),
        ("blob 4f9a2b7c81d3e6f0a5b8c2d7e1f4a9b3c6d8e2f5", "4f9a2b7c81d3"),
        ("b64 Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MA== trailing", "Zm9vYmFy"),
    ],
)
def test_key_shaped_strings_are_replaced(text: str, gone: str) -> None:
    """Keys nobody configured are replaced by their shape: prefixed keys, labelled values, URL
    passwords, JWTs and long random runs."""
    cleaned = NO_SECRETS.clean(text)
    assert gone not in cleaned
    assert REDACTED in cleaned


@pytest.mark.parametrize(
    "text",
    [
        "The model `meta-llama/Meta-Llama-3-70B-Instruct-Turbo` does not exist",
        "request 123e4567-e89b-12d3-a456-426614174000 failed",
        "This model's maximum context length is 4096 tokens.",
        "Bearer authentication is required for this endpoint",
        "You exceeded your current quota, please check your plan and billing details.",
    ],
)
def test_ordinary_error_text_is_kept(text: str) -> None:
    """Model names, UUIDs and ordinary sentences are not mistaken for keys."""
    assert NO_SECRETS.clean(text) == text


def test_invisible_characters_go_and_line_breaks_become_single_spaces() -> None:
    """A message is one line of printable text: bidi marks and tag characters are deleted,
    controls and runs of blanks become one space."""
    assert NO_SECRETS.clean("a\u202eb\r\n\tc  \x00 d\U000e0041") == "ab c d"


def test_message_leads_with_the_head_and_ends_with_a_checked_request_id() -> None:
    """The message is ``head: text (request id ...)`` and never longer than MAX_MESSAGE."""
    redactor = Redactor([SECRET])
    message = redactor.message("word " * 200, head="HTTP 401 invalid_api_key", request_id="req_7")
    assert message.startswith("HTTP 401 invalid_api_key: word word")
    assert message.endswith("… (request id req_7)")
    assert len(message) <= MAX_MESSAGE


@pytest.mark.parametrize(
    "request_id", [SECRET, OTHER_KEY, "id with spaces", "x" * 200, "req\u202e1", "<script>"]
)
def test_a_request_id_that_is_not_plainly_an_id_is_dropped(request_id: str) -> None:
    """A request id carrying the secret, a key, or odd characters is left out of the message."""
    message = Redactor([SECRET]).message("boom", request_id=request_id)
    assert message == "boom"


def test_a_long_hex_request_id_is_kept() -> None:
    """Request ids are often long random runs: the long-run rule does not apply to them."""
    ident = "req_011CSHoEeqs5C35K2UUqR7Fy4f9a2b7c81d3e6f0"
    assert NO_SECRETS.message("boom", request_id=ident) == f"boom (request id {ident})"


def test_a_code_is_kept_only_when_it_is_a_plain_identifier() -> None:
    """An error code is shown when it is a short identifier that is not a secret."""
    redactor = Redactor([SECRET])
    assert redactor.code("invalid_api_key") == "invalid_api_key"
    assert redactor.code(SECRET) == ""
    assert redactor.code("two words") == ""
    assert redactor.code(401) == ""


def test_the_raw_cut_drops_a_token_cut_in_two() -> None:
    """Cutting text not yet cleaned drops a half token, so no fragment of a secret is left."""
    assert cut("abc " + SECRET, 12, whole_tokens=True) == "abc…"
    assert cut("abc " + SECRET, 12) == "abc tidegat…"
    assert cut("short", 12) == "short"


def test_request_id_comes_from_the_headers_then_the_body() -> None:
    """``x-request-id`` wins over ``request-id``, which wins over a ``request_id`` in the body."""
    assert request_id_of({"x-request-id": "a", "request-id": "b"}, {"request_id": "c"}) == "a"
    assert request_id_of({"request-id": "b"}, {"request_id": "c"}) == "b"
    assert request_id_of({}, {"request_id": "c"}) == "c"
    assert request_id_of({}, {"error": {"request_id": "d"}}) == "d"
    assert request_id_of({}, None) == ""


def test_secret_headers_are_the_ones_named_like_credentials() -> None:
    """Values of auth, key and token headers are secrets (and a scheme's credential alone)."""
    values = secret_header_values(
        {"api-key": "azure-key-1", "Authorization": "Bearer tok-2", "OpenAI-Organization": "org"}
    )
    assert set(values) == {"azure-key-1", "Bearer tok-2", "tok-2"}
    assert secret_header_values(None) == []


def test_empty_secrets_are_ignored() -> None:
    """No key configured (None or empty) leaves only the shape rules."""
    assert Redactor([None, ""]).clean("plain text") == "plain text"


@given(st.text(max_size=300))
def test_cleaning_twice_changes_nothing(text: str) -> None:
    """clean is idempotent: its own output, replacement included, is left as it is."""
    redactor = Redactor([SECRET, "abc"])
    once = redactor.clean(text)
    assert redactor.clean(once) == once


@given(st.text(max_size=80), st.text(max_size=80))
def test_the_secret_never_survives_any_surrounding_text(before: str, after: str) -> None:
    """Whatever text surrounds it, the configured secret is not in the message."""
    message = Redactor([SECRET]).message(before + SECRET + after, head="HTTP 401")
    assert SECRET not in message
