"""The provider protocol and Retry-After parsing."""

from __future__ import annotations

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.providers.anthropic import AnthropicProvider
from tidegate.providers.base import Provider, parse_retry_after
from tidegate.providers.fake import FakeProvider
from tidegate.providers.openai import OpenAIProvider

NOW = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def test_delay_seconds_are_taken_as_they_are() -> None:
    """A delay-seconds value is the wait in seconds, fractions included."""
    assert parse_retry_after("7", NOW) == 7.0
    assert parse_retry_after(" 0.25 ", NOW) == 0.25
    assert parse_retry_after("0", NOW) == 0.0


def test_http_date_is_measured_from_now() -> None:
    """An HTTP-date gives the seconds from the given wall time until that date."""
    assert parse_retry_after("Thu, 01 Jan 2026 00:00:30 GMT", NOW) == 30.0


def test_http_date_in_the_past_means_no_wait() -> None:
    """A date that has already passed gives zero, not a negative wait."""
    assert parse_retry_after("Wed, 31 Dec 2025 23:59:00 GMT", NOW) == 0.0


@pytest.mark.parametrize("value", [None, "", "soon", "-3", "nan", "inf", "Thu, 99 Foo 2026"])
def test_unusable_values_give_none(value: str | None) -> None:
    """A missing, negative, non-finite or unparsable value gives None rather than a guess."""
    assert parse_retry_after(value, NOW) is None


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=10**6))
def test_any_whole_number_of_seconds_round_trips(seconds: int) -> None:
    """Every non-negative integer header value parses to that many seconds."""
    assert parse_retry_after(str(seconds), NOW) == float(seconds)


@pytest.mark.asyncio
async def test_every_provider_satisfies_the_protocol() -> None:
    """The OpenAI, Anthropic and fake providers all match the Provider protocol."""
    async with aiohttp.ClientSession() as session:
        providers = [
            OpenAIProvider("o", "http://127.0.0.1:1/v1", None, session),
            AnthropicProvider("a", "http://127.0.0.1:1", "key", session),
            FakeProvider("f", lambda body, n: {}),
        ]
        for provider in providers:
            assert isinstance(provider, Provider)
