"""Presets for OpenAI-compatible services: their default base URL, their auth, and what
tidegate does about the request fields each one refuses or ignores.

A provider of ``type: openai`` may name a preset (``preset: groq``). The preset is data: one
:class:`Preset` per service in :data:`PRESETS`, each with :class:`FieldRule` rows. The
:class:`~tidegate.providers.openai.OpenAIProvider` applies the rules to the body it is about to
send, after renaming the model, so a refusal is raised before any byte leaves the process.
Without a preset nothing here runs. docs/providers/presets.md has the table, with the source
of every rule.

What a rule does with a field that is present (a ``null`` value, or a value in ``neutral``, is
always dropped without a word: sending it or not asks for the same thing):

``drop``
    dropped silently: the upstream ignores it, or it only labels the request.
``drop_noted``
    dropped, and the docs say what is lost by it.
``rename``
    sent under the upstream's own name for the same thing (``seed`` to ``random_seed``).
``refuse``
    the request is refused as a bad request naming the field and the preset: dropping the field
    would change the answer (fewer choices, no log probabilities, no logit bias).

A rule whose ``field`` is ``messages[].name`` applies to the ``name`` of every message except
tool and function results, whose ``name`` is part of the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tidegate.errors import ProviderError, ProviderErrorKind

__all__ = ["PRESETS", "FieldRule", "Preset", "preset_named"]

Action = Literal["drop", "drop_noted", "rename", "refuse"]
#: The one nested field a rule may name.
MESSAGE_NAME = "messages[].name"
#: Message roles whose ``name`` belongs to the message (the function a result answers).
_NAMED_RESULTS = frozenset({"tool", "function"})


@dataclass(frozen=True, slots=True)
class FieldRule:
    """What tidegate does with one request field for one preset."""

    #: A top-level body key, or ``messages[].name``.
    field: str
    action: Action
    #: What the upstream does with the field, in a few words (used in the refusal message).
    upstream: str
    #: Where that is documented (a page name), or what else it rests on.
    source: str
    #: Values that ask for nothing more than leaving the field out (``n: 1``); dropped silently.
    neutral: tuple[Any, ...] = ()
    #: The upstream's name for the field (``rename`` only).
    rename_to: str | None = None
    #: Upstream model ids the rule is for; empty: every model.
    models: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Preset:
    """One OpenAI-compatible service."""

    name: str
    title: str
    #: The base URL when ``base_url`` is not configured; ``None``: it must be configured.
    base_url: str | None
    #: ``bearer``: the service needs ``Authorization: Bearer <key>`` (``api_key_file`` is
    #: required); ``optional``: a local server, sent a Bearer key only when one is configured.
    auth: Literal["bearer", "optional"]
    rules: tuple[FieldRule, ...] = ()
    #: Behaviour worth knowing that tidegate does nothing about.
    notes: tuple[str, ...] = ()

    def apply(self, payload: dict[str, Any], *, provider: str) -> None:
        """Change ``payload`` (the body about to be sent) in place by the rules, or raise a
        ``bad_request`` :class:`ProviderError` naming the field and the preset."""
        model = payload.get("model")
        for rule in self.rules:
            if rule.models and model not in rule.models:
                continue
            if rule.field == MESSAGE_NAME:
                _drop_message_names(payload)
                continue
            if rule.field not in payload:
                continue
            value = payload[rule.field]
            if value is None or _is_neutral(value, rule.neutral):
                del payload[rule.field]
            elif rule.action == "refuse":
                raise self._refusal(rule, provider)
            elif rule.action == "rename":
                self._rename(payload, rule, provider)
            else:
                del payload[rule.field]

    def _rename(self, payload: dict[str, Any], rule: FieldRule, provider: str) -> None:
        assert rule.rename_to is not None
        value = payload.pop(rule.field)
        if payload.get(rule.rename_to, value) != value:
            raise ProviderError(
                ProviderErrorKind.BAD_REQUEST,
                f"'{rule.field}' and '{rule.rename_to}' disagree; preset {self.name!r}"
                f" ({self.title}) sends '{rule.field}' as '{rule.rename_to}'",
                provider=provider,
            )
        payload[rule.rename_to] = value

    def _refusal(self, rule: FieldRule, provider: str) -> ProviderError:
        return ProviderError(
            ProviderErrorKind.BAD_REQUEST,
            f"'{rule.field}' is not supported with preset {self.name!r} ({self.title}):"
            f" {rule.upstream}; dropping it would change the answer, so the request is refused",
            provider=provider,
        )


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # type() as well as ==: True == 1, but ``n: true`` is not ``n: 1``.
    return any(type(value) is type(same) and value == same for same in neutral)


def _drop_message_names(payload: dict[str, Any]) -> None:
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return
    if not any(_named(message) for message in messages):
        return
    # A copy of each changed message: the caller's body is left as it was.
    payload["messages"] = [
        {k: v for k, v in message.items() if k != "name"} if _named(message) else message
        for message in messages
    ]


def _named(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and "name" in message
        and message.get("role") not in _NAMED_RESULTS
    )


# Sources, by the page names the services give them.
_GROQ = "Groq docs, 'OpenAI Compatibility' (Currently Unsupported OpenAI Features)"
_MISTRAL = (
    "Mistral API reference, chat completion request schema (as published in Mistral's"
    " Python SDK, model ChatCompletionRequest)"
)
_MISTRAL_422 = (
    "; Mistral answers a field outside its schema with 422 extra_forbidden (reported in"
    " mistralai/platform-docs-public issue 7, not stated on a documentation page)"
)
_DEEPSEEK = "DeepSeek API docs, 'Reasoning Model (deepseek-reasoner)'"
_OLLAMA = "Ollama docs, 'OpenAI compatibility' (/v1/chat/completions, supported request fields)"
_LLAMACPP = (
    "llama.cpp server source (tools/server, oaicompat_chat_params_parse); not found on a"
    " documentation page"
)
_REASONER = frozenset({"deepseek-reasoner"})


def _refuse(field: str, upstream: str, source: str, *neutral: Any, **kw: Any) -> FieldRule:
    return FieldRule(field, "refuse", upstream, source, neutral=neutral, **kw)


_PRESETS = (
    Preset(
        "vllm",
        "vLLM",
        "http://localhost:8000/v1",
        "optional",
        notes=(
            "vLLM docs, 'OpenAI-Compatible Server': `parallel_tool_calls` and `user` are"
            " ignored; tidegate passes them through.",
        ),
    ),
    Preset(
        "ollama",
        "Ollama",
        "http://localhost:11434/v1",
        "optional",
        rules=(
            _refuse("n", "Ollama answers with one choice", _OLLAMA, 1),
            _refuse("logit_bias", "Ollama does not support it", _OLLAMA, {}),
            FieldRule("user", "drop", "Ollama does not support it", _OLLAMA),
        ),
        notes=(
            "The page marks `tool_choice` unsupported in some versions and lists it in"
            " others; tidegate passes it through (not verified).",
        ),
    ),
    Preset(
        "llamacpp",
        "llama.cpp server",
        "http://localhost:8080/v1",
        "optional",
        rules=(_refuse("n", "llama-server allows only one completion choice", _LLAMACPP, 1),),
    ),
    Preset(
        "mistral",
        "Mistral AI",
        "https://api.mistral.ai/v1",
        "bearer",
        rules=(
            FieldRule(
                "seed", "rename", "Mistral calls it random_seed", _MISTRAL, rename_to="random_seed"
            ),
            FieldRule(
                "max_completion_tokens",
                "rename",
                "Mistral calls it max_tokens",
                _MISTRAL + _MISTRAL_422,
                rename_to="max_tokens",
            ),
            FieldRule(
                "stream_options",
                "drop_noted",
                "Mistral refuses it with 422",
                "reported in avante.nvim issue 2347; not in " + _MISTRAL,
            ),
            _refuse("logprobs", "not in Mistral's schema", _MISTRAL + _MISTRAL_422, False),
            _refuse("top_logprobs", "not in Mistral's schema", _MISTRAL + _MISTRAL_422),
            _refuse("logit_bias", "not in Mistral's schema", _MISTRAL + _MISTRAL_422, {}),
            FieldRule("user", "drop_noted", "not in Mistral's schema", _MISTRAL + _MISTRAL_422),
            FieldRule(
                MESSAGE_NAME,
                "drop_noted",
                "Mistral's user, system and assistant messages have no name",
                _MISTRAL + _MISTRAL_422,
            ),
        ),
    ),
    Preset(
        "groq",
        "Groq",
        "https://api.groq.com/openai/v1",
        "bearer",
        rules=(
            _refuse("logprobs", "Groq refuses it with 400", _GROQ, False),
            _refuse("top_logprobs", "Groq refuses it with 400", _GROQ),
            _refuse("logit_bias", "Groq refuses it with 400", _GROQ, {}),
            _refuse("n", "Groq accepts only n: 1", _GROQ, 1),
            FieldRule(MESSAGE_NAME, "drop_noted", "Groq refuses it with 400", _GROQ),
        ),
        notes=("Groq turns `temperature: 0` into 1e-8 (same page); tidegate sends it as it is.",),
    ),
    Preset(
        "together",
        "Together AI",
        "https://api.together.ai/v1",
        "bearer",
        notes=(
            "Together docs, 'OpenAI compatibility', list no request-field limits for chat"
            " completions; no rule is applied.",
        ),
    ),
    Preset(
        "deepseek",
        "DeepSeek",
        "https://api.deepseek.com",
        "bearer",
        rules=(
            *(
                FieldRule(
                    field,
                    "drop_noted",
                    "deepseek-reasoner accepts it and ignores it",
                    _DEEPSEEK,
                    models=_REASONER,
                )
                for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty")
            ),
            _refuse("logprobs", "deepseek-reasoner refuses it", _DEEPSEEK, False, models=_REASONER),
            _refuse("top_logprobs", "deepseek-reasoner refuses it", _DEEPSEEK, models=_REASONER),
        ),
        notes=(
            "The rules are for the model id deepseek-reasoner only. DeepSeek's 'Thinking Mode'"
            " guide gives the same ignored sampling fields for thinking mode on other models;"
            " tidegate does not apply them there.",
        ),
    ),
    Preset(
        "openrouter",
        "OpenRouter",
        "https://openrouter.ai/api/v1",
        "bearer",
        notes=(
            "OpenRouter forwards the body to the provider it routes to; which fields that"
            " provider ignores is not verified, and no rule is applied. Its optional"
            " HTTP-Referer and X-Title attribution headers are not sent.",
        ),
    ),
)

#: Every preset, by name.
PRESETS: Mapping[str, Preset] = {preset.name: preset for preset in _PRESETS}


def preset_named(name: str) -> Preset:
    """The preset called ``name``; a ``ValueError`` listing the known ones if there is none."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown preset {name!r}; known presets: {known}") from None
