"""The model catalogue's data, its lookups, and the token counts of OpenAI's models."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from tidegate.catalogue import load, parse, section_for
from tidegate.catalogue import tokens as tokens_module
from tidegate.catalogue.tokens import (
    encoding_for,
    estimate_prompt_tokens,
    input_counter,
    prompt_counter,
    token_count,
)

CATALOGUE = load()


def test_every_entry_has_a_source_a_date_and_sane_figures() -> None:
    """Every model names its pricing page and the compile date; prices are non-negative,
    windows positive, and the longest answer fits in the window."""
    assert CATALOGUE.models
    assert CATALOGUE.compiled == "2026-12-01"
    for model in CATALOGUE.models:
        where = f"{model.provider}/{model.id}"
        assert model.source.startswith("https://"), where
        assert model.compiled == CATALOGUE.compiled, where
        assert model.input_per_token >= 0, where
        assert model.output_per_token >= 0, where
        assert model.cached_input_per_token is None or model.cached_input_per_token >= 0, where
        assert model.context_window > 0, where
        assert model.max_output_tokens is None or model.max_output_tokens > 0, where
        if model.max_output_tokens is not None:
            assert model.max_output_tokens <= model.context_window, where
    for info in CATALOGUE.providers.values():
        assert info.source.startswith("https://"), info.name


def test_the_catalogue_names_each_provider_asked_for() -> None:
    assert set(CATALOGUE.providers) >= {
        "openai",
        "azure_openai",
        "anthropic",
        "bedrock",
        "gemini",
        "mistral",
        "groq",
        "deepseek",
    }


def test_lookups_by_id_alias_azure_and_cross_region() -> None:
    gpt4o = CATALOGUE.lookup("openai", "gpt-4o")
    assert gpt4o is not None
    assert gpt4o.per_1k == pytest.approx((0.0025, 0.01))
    assert CATALOGUE.lookup("openai", "gpt-4o-2024-08-06") is gpt4o
    assert CATALOGUE.lookup("azure_openai", "gpt-4o") is gpt4o
    # a snapshot priced differently from its alias is not guessed
    assert CATALOGUE.lookup("openai", "gpt-4o-2024-05-13") is None
    nova = CATALOGUE.lookup("bedrock", "amazon.nova-pro-v1:0")
    assert nova is not None
    assert CATALOGUE.lookup("bedrock", "us.amazon.nova-pro-v1:0") is nova
    assert CATALOGUE.lookup("openai", "us.amazon.nova-pro-v1:0") is None
    assert CATALOGUE.lookup("anthropic", "no-such-model") is None
    assert CATALOGUE.find("gpt-4o") is gpt4o


def test_an_openai_type_provider_reads_the_section_of_its_host() -> None:
    assert section_for("openai", "https://api.groq.com/openai/v1") == "groq"
    assert section_for("openai", "https://api.openai.com/v1") == "openai"
    assert section_for("openai", None, preset="deepseek") == "deepseek"
    assert section_for("fake", None) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("input", -1), ("context_window", 0), ("max_output_tokens", 10**9)],
)
def test_a_bad_entry_is_refused_naming_it(field: str, value: Any) -> None:
    model = {
        "provider": "p",
        "id": "m",
        "input": 1,
        "output": 1,
        "context_window": 100,
        "max_output_tokens": 10,
        "tools": True,
        "vision": False,
        "json_mode": False,
        "prefill": False,
    }
    data = {
        "compiled": "2026-12-01",
        "providers": {"p": {"source": "https://example.invalid/pricing"}},
        "models": [{**model, field: value}],
    }
    with pytest.raises(ValueError, match="p/m"):
        parse(data)


# --------------------------------------------------------------------------- token counts


def test_openai_models_get_their_encoding_and_the_rest_the_estimate() -> None:
    assert encoding_for("openai", "gpt-4o") == "o200k_base"
    assert encoding_for("azure_openai", "gpt-4.1-mini") == "o200k_base"
    assert encoding_for("openai", "o1-preview") == "o200k_base"
    assert encoding_for("openai", "gpt-5.4") == "o200k_base"
    assert encoding_for("openai", "gpt-4-0314") == "cl100k_base"
    assert encoding_for("openai", "gpt-3.5-turbo") == "cl100k_base"
    assert encoding_for("openai", "text-embedding-3-small") == "cl100k_base"
    assert (
        encoding_for("openai", "llama-3.3-70b-versatile", "https://api.groq.com/openai/v1") is None
    )
    assert encoding_for("anthropic", "gpt-4o") is None
    assert encoding_for("openai", "my-local-model") is None
    assert prompt_counter("anthropic", "claude-sonnet-4-5") is estimate_prompt_tokens
    assert prompt_counter("openai", "my-local-model") is estimate_prompt_tokens


def test_counting_needs_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tables ship in the package: with every socket refused, an encoding still loads."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise OSError("the network is off in this test")

    tokens_module._encoding.cache_clear()
    monkeypatch.setattr(socket, "socket", refused)
    monkeypatch.setattr(socket, "create_connection", refused)
    assert token_count("o200k_base", "hello world") == 2
    assert token_count("cl100k_base", "hello world") == 2
    count = prompt_counter("openai", "gpt-4o")
    assert count({"messages": [{"role": "user", "content": "hello world"}]}) == 3 + 2 + 3


def test_a_long_non_english_prompt_is_counted_by_the_encoding() -> None:
    """Japanese is about a token a character or two, not four characters a token."""
    text = "東京の天気は晴れです。明日は雨が降るでしょう。" * 3000  # 69,000 characters
    body = {
        "messages": [
            {"role": "system", "content": "Answer in Japanese."},
            {"role": "user", "content": [{"type": "text", "text": text}]},
        ]
    }
    counted = prompt_counter("openai", "gpt-4o")(body)
    expected = 3 + (3 + token_count("o200k_base", "Answer in Japanese.")) + 3
    expected += token_count("o200k_base", text)
    assert counted == expected
    assert counted > 2 * estimate_prompt_tokens(body)
    assert token_count("o200k_base", text) > len(text) // 2


def test_embeddings_inputs_are_counted_by_the_encoding() -> None:
    count = input_counter("openai", "text-embedding-3-small")
    assert count("hello world") == 2
    assert count(["hello world", "hello"]) == 3
    assert count([1, 2, 3]) == 3
    assert input_counter("openai", "my-local-model")("abcdefgh") == 2
