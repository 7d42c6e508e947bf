"""How many tokens a request's prompt is, before a provider has said.

For OpenAI's models (reached as ``openai`` or ``azure_openai``) the prompt is counted with the
model's own encoding: ``o200k_base`` for gpt-4o, gpt-4.1, gpt-4.5, gpt-5 and the o-series,
``cl100k_base`` for gpt-4, gpt-3.5 and the text-embedding models. The encodings come from the
``bpe-openai`` package, which ships their tables (nothing is downloaded, ever). A chat prompt is
its messages' text plus OpenAI's framing: three tokens a message and three that prime the
reply. Images, tool definitions and other parts that are not text are not counted.

Every other model keeps the documented estimate: about four characters a token
(:func:`estimate_prompt_tokens`). Either way the count is what a budget reserves and what
``/v1/messages/count_tokens`` answers; what is billed is always the provider's reported usage.

A counter is chosen once per provider when the runtime is built (:func:`prompt_counter`,
:func:`input_counter`); the encoding behind it is loaded once per process.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from tidegate.catalogue import find, section_for

__all__ = [
    "InputCounter",
    "PromptCounter",
    "encoding_for",
    "estimate_input_tokens",
    "estimate_prompt_tokens",
    "input_counter",
    "prompt_counter",
    "token_count",
]

#: A chat body's prompt tokens, and an embeddings ``input``'s tokens.
PromptCounter = Callable[[Mapping[str, Any]], int]
InputCounter = Callable[[Any], int]

#: Provider types whose models are OpenAI's own.
OPENAI_TYPES = frozenset({"openai", "azure_openai"})
#: OpenAI model ids by family, for the ids the catalogue does not list.
_O200K = re.compile(r"^(chatgpt-4o|gpt-4o|gpt-4\.1|gpt-4\.5|gpt-5|o[134])(\b|[-.])")
_CL100K = re.compile(r"^(gpt-4|gpt-3\.5|gpt-35|text-embedding-3|text-embedding-ada-002)")
#: OpenAI's framing of a chat prompt: tokens per message, and the tokens that prime the reply.
TOKENS_PER_MESSAGE = 3
REPLY_PRIMING = 3
#: Text is encoded this many characters at a time: a character is at most four bytes, so a
#: slice stays within the encoder's limit of 200,000 tokens a call.
SLICE_CHARS = 50_000


class _Encoding(Protocol):
    def encode_ordinary(self, text: str) -> list[int]: ...


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """About four characters a token: good enough to reserve a budget, never to bill."""
    chars = 0
    for message in body.get("messages", ()):
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(
                len(str(part.get("text", ""))) for part in content if isinstance(part, dict)
            )
    return max(1, chars // 4)


def estimate_input_tokens(value: str | list[Any]) -> int:
    """The tokens of an embeddings ``input`` (checked to be one of OpenAI's four shapes): token
    ids count as they are, text as about four characters a token."""
    if isinstance(value, str):
        return max(1, len(value) // 4)
    if all(isinstance(item, int) for item in value):
        return len(value)
    return sum(max(1, len(item) // 4) if isinstance(item, str) else len(item) for item in value)


def encoding_for(provider_type: str, model: str, base_url: str | None = None) -> str | None:
    """The encoding of ``model`` when it is one of OpenAI's, else ``None``: an ``openai``-type
    provider pointed at another catalogued provider's API (Groq, say) serves that one's models."""
    if section_for(provider_type, base_url) not in OPENAI_TYPES:
        return None
    entry = find(provider_type, model, base_url)
    if entry is not None:
        return entry.encoding
    if _O200K.match(model):
        return "o200k_base"
    if _CL100K.match(model):
        return "cl100k_base"
    return None


@functools.cache
def _encoding(name: str) -> _Encoding:
    with warnings.catch_warnings():
        # Its import reads its shipped tables with importlib.resources.open_binary, which is
        # deprecated since 3.11: imported here, when an OpenAI model first needs counting.
        warnings.simplefilter("ignore", DeprecationWarning)
        import bpe_openai  # type: ignore[import-untyped]

        encoding: _Encoding = bpe_openai.get_encoding(name)
    return encoding


def token_count(encoding: str, text: str) -> int:
    """The tokens of ``text`` in ``encoding`` (special-token text counts as plain text)."""
    encode = _encoding(encoding).encode_ordinary
    if len(text) <= SLICE_CHARS:
        return len(encode(text))
    return sum(len(encode(text[i : i + SLICE_CHARS])) for i in range(0, len(text), SLICE_CHARS))


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def _chat_counter(encoding: str) -> PromptCounter:
    _encoding(encoding)  # loaded now, at build time, not on a request

    def count(body: Mapping[str, Any]) -> int:
        messages = body.get("messages", ())
        tokens = REPLY_PRIMING
        for message in messages:
            tokens += TOKENS_PER_MESSAGE + token_count(encoding, _text_of(message.get("content")))
        return tokens

    return count


def _input_counter(encoding: str) -> InputCounter:
    _encoding(encoding)

    def count(value: Any) -> int:
        if isinstance(value, str):
            return max(1, token_count(encoding, value))
        if all(isinstance(item, int) for item in value):
            return len(value)
        return sum(
            max(1, token_count(encoding, item)) if isinstance(item, str) else len(item)
            for item in value
        )

    return count


def prompt_counter(provider_type: str, model: str, base_url: str | None = None) -> PromptCounter:
    """The counter of a chat prompt for this provider's model, chosen once."""
    encoding = encoding_for(provider_type, model, base_url)
    return estimate_prompt_tokens if encoding is None else _chat_counter(encoding)


def input_counter(provider_type: str, model: str, base_url: str | None = None) -> InputCounter:
    """The counter of an embeddings ``input`` for this provider's model, chosen once."""
    encoding = encoding_for(provider_type, model, base_url)
    return estimate_input_tokens if encoding is None else _input_counter(encoding)
