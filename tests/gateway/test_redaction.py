"""Output checks: invisible characters stripped, deny patterns redacted, idempotent."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.gateway.redaction import (
    DEFAULT_REPLACEMENT,
    INVISIBLE_CHARACTERS,
    OutputFilter,
    strip_invisible,
)

# Written out independently of the module, so the property below checks it against a second list.
ZERO_WIDTH_AND_BIDI = frozenset(
    "\u180e\u200b\u200c\u200d\u2060\ufeff"
    "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)

SECRETS = OutputFilter([r"(?i)api[_-]?key\s*[:=]\s*\S+", r"\b\d{4}(?:[ -]?\d{4}){3}\b", "hunter2"])


def is_forbidden(char: str) -> bool:
    if char in "\n\t":
        return False
    return unicodedata.category(char) == "Cc" or char in ZERO_WIDTH_AND_BIDI


def test_control_characters_are_stripped_but_newline_and_tab_kept() -> None:
    """C0 (except newline and tab), DEL and C1 characters are removed; layout whitespace stays."""
    text = "a\x00b\x07c\rd\x1be\x7ff\x85g\x9fh\n\ti"
    assert OutputFilter([]).clean(text) == "abcdefgh\n\ti"


def test_zero_width_bidi_and_tag_characters_are_stripped() -> None:
    """Zero-width, bidi override/isolate and Unicode tag characters are removed."""
    text = "pay\u200b \u202eevil\u202c \u2066x\u2069 \ufeffok\U000e0041\U000e0069"
    assert strip_invisible(text) == "pay evil x ok"


def test_ordinary_unicode_is_untouched() -> None:
    """Accented letters, other scripts and emoji pass through unchanged."""
    text = "café — 東京 🌊 naïve"
    assert OutputFilter(["secret"]).clean(text) == text


def test_every_listed_invisible_character_is_removed() -> None:
    """Each character the module lists as invisible is removed by strip_invisible."""
    text = "".join(sorted(INVISIBLE_CHARACTERS))
    assert strip_invisible(text) == ""
    assert "\n" not in INVISIBLE_CHARACTERS
    assert "\t" not in INVISIBLE_CHARACTERS


def test_deny_patterns_are_replaced() -> None:
    """Every match of every deny pattern becomes the replacement."""
    text = "use API_KEY=sk-123 and card 4111 1111 1111 1111, password hunter2."
    assert SECRETS.clean(text) == (
        f"use {DEFAULT_REPLACEMENT} and card {DEFAULT_REPLACEMENT}, password {DEFAULT_REPLACEMENT}."
    )


def test_replacement_is_configurable_and_taken_literally() -> None:
    """A custom replacement is inserted as written; backslashes are not group references."""
    flt = OutputFilter([r"(sec)ret"], replacement=r"<\1>")
    assert flt.clean("a secret b") == r"a <\1> b"


def test_a_control_character_cannot_split_a_denied_word() -> None:
    """Invisible characters are stripped before matching, so 'se<ZWSP>cret' is still redacted."""
    flt = OutputFilter(["secret"])
    assert flt.clean("the se\u200bc\x00ret is out") == "the [redacted] is out"


def test_empty_matches_redact_nothing() -> None:
    """A pattern that can match the empty string replaces only non-empty matches."""
    flt = OutputFilter(["x*"])
    assert flt.clean("abc") == "abc"
    assert flt.clean("axxb") == "a[redacted]b"


def test_a_match_completed_by_a_replacement_is_redacted_too() -> None:
    """A deny match that only appears after another replacement is redacted in a later pass."""
    flt = OutputFilter([r"\]!", "secret"])
    assert flt.clean("secret!") == "[redacted[redacted]"


def test_invalid_regex_raises_naming_the_pattern() -> None:
    """A deny pattern that does not compile is a ValueError whose message quotes it."""
    with pytest.raises(ValueError, match=r"'\(unclosed'"):
        OutputFilter(["fine", "(unclosed"])


@pytest.mark.parametrize(
    ("patterns", "replacement", "message"),
    [
        ([""], DEFAULT_REPLACEMENT, "empty"),
        (["redact"], DEFAULT_REPLACEMENT, "matches the replacement"),
        (["ok"], "bad\x00", "invisible"),
    ],
)
def test_patterns_that_would_never_settle_are_refused(
    patterns: list[str], replacement: str, message: str
) -> None:
    """Empty patterns, patterns matching the replacement and unclean replacements are refused."""
    with pytest.raises(ValueError, match=message):
        OutputFilter(patterns, replacement=replacement)


def test_a_single_string_is_not_mistaken_for_a_list_of_patterns() -> None:
    """Passing one string instead of a sequence of patterns is a TypeError, not one per char."""
    with pytest.raises(TypeError):
        OutputFilter("secret")


def test_patterns_are_kept_for_inspection() -> None:
    """The filter reports its patterns and replacement as configured."""
    flt = OutputFilter(["a", "b"], replacement="#")
    assert flt.patterns == ("a", "b")
    assert flt.replacement == "#"


TEXT = st.text(
    alphabet=st.one_of(
        st.characters(),
        st.sampled_from(sorted(ZERO_WIDTH_AND_BIDI | {"\x00", "\x1b", "\x85", "\r", "\n", "\t"})),
        st.sampled_from(list("secrthun2 api_key=1234-[]")),
    ),
    max_size=80,
)
FILTERS = st.sampled_from(
    [OutputFilter([]), SECRETS, OutputFilter(["secret", "(?i)SECRET"]), OutputFilter([r"\d+"])]
)


@settings(max_examples=200, deadline=None)
@given(FILTERS, TEXT)
def test_output_never_holds_control_or_invisible_characters(flt: OutputFilter, text: str) -> None:
    """Whatever the input, the output holds no control character but newline and tab."""
    cleaned = flt.clean(text)
    assert not any(is_forbidden(char) for char in cleaned)


@settings(max_examples=200, deadline=None)
@given(FILTERS, TEXT)
def test_clean_is_idempotent(flt: OutputFilter, text: str) -> None:
    """Cleaning an already clean text changes nothing."""
    once = flt.clean(text)
    assert flt.clean(once) == once
