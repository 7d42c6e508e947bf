"""Output checks applied to every text a user is about to see, model answers and excerpts alike.

:class:`OutputFilter` does two things, in this order:

1. strips characters that hide or reorder text: C0 and C1 control characters (except ``\\n`` and
   ``\\t``) and DEL, zero-width characters, bidirectional embedding/override/isolate marks, and
   the invisible Unicode tag characters that can smuggle instructions past a reader;
2. replaces every match of the configured deny patterns with a fixed replacement.

Stripping comes first so that a control character cannot split a denied word into two harmless
halves. ``clean`` is idempotent: running it on its own output changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

__all__ = ["DEFAULT_REPLACEMENT", "INVISIBLE_CHARACTERS", "OutputFilter", "strip_invisible"]

DEFAULT_REPLACEMENT: Final = "[redacted]"


def _invisible() -> frozenset[str]:
    codes: set[int] = set()
    codes.update(range(0x20))  # C0
    codes.difference_update((0x09, 0x0A))  # tab and newline carry layout, not hidden meaning
    codes.add(0x7F)  # DEL
    codes.update(range(0x80, 0xA0))  # C1
    codes.update((0x180E, 0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF))  # zero-width
    codes.update((0x061C, 0x200E, 0x200F))  # bidi marks
    codes.update(range(0x202A, 0x202F))  # bidi embeddings and overrides
    codes.update(range(0x2066, 0x206A))  # bidi isolates
    codes.update(range(0xE0000, 0xE0080))  # tag characters
    return frozenset(chr(code) for code in codes)


#: Every character :func:`strip_invisible` removes.
INVISIBLE_CHARACTERS: Final[frozenset[str]] = _invisible()

_STRIP_TABLE: Final[dict[int, None]] = {ord(char): None for char in INVISIBLE_CHARACTERS}
#: The ASCII ones alone, as bytes: most answers are ASCII without any, and finding that out with
#: ``bytes.translate`` (a table lookup a byte, in C) is cheaper than translating the text
#: character by character, or than matching a regular expression's character class.
_ASCII_INVISIBLE: Final[bytes] = bytes(
    sorted(ord(char) for char in INVISIBLE_CHARACTERS if char.isascii())
)

#: ``clean`` repeats the deny patterns until nothing changes; a replacement can complete a new
#: match with its neighbours, so one pass is not always a fixed point. This bounds pathological
#: pattern sets.
_MAX_PASSES: Final = 8


def strip_invisible(text: str) -> str:
    """``text`` without the characters in :data:`INVISIBLE_CHARACTERS`."""
    if text.isascii():
        raw = text.encode("ascii")
        if len(raw.translate(None, _ASCII_INVISIBLE)) == len(raw):
            return text
    return text.translate(_STRIP_TABLE)


class OutputFilter:
    """Strip invisible characters and redact deny-pattern matches; patterns are compiled once.

    Patterns are Python regular expressions, matched anywhere in the text (use ``(?i)`` for
    case-insensitive matching). A pattern that does not compile, or that would match inside the
    replacement itself (which would make redaction never settle), raises ``ValueError`` naming it.
    """

    __slots__ = ("_compiled", "_patterns", "_replacement")

    def __init__(
        self, deny_patterns: Sequence[str] = (), replacement: str = DEFAULT_REPLACEMENT
    ) -> None:
        if isinstance(deny_patterns, str):
            raise TypeError("deny_patterns must be a sequence of patterns, not one string")
        if strip_invisible(replacement) != replacement:
            raise ValueError(f"replacement {replacement!r} contains invisible characters")
        compiled: list[re.Pattern[str]] = []
        for pattern in deny_patterns:
            if not pattern:
                raise ValueError("deny pattern '' is empty: it would match everywhere")
            try:
                regex = re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"deny pattern {pattern!r} is not a valid regular expression: {error}"
                ) from error
            if _matches_something(regex, replacement):
                raise ValueError(
                    f"deny pattern {pattern!r} matches the replacement {replacement!r}"
                )
            compiled.append(regex)
        self._patterns = tuple(deny_patterns)
        self._compiled = tuple(compiled)
        self._replacement = replacement

    @property
    def patterns(self) -> tuple[str, ...]:
        return self._patterns

    @property
    def replacement(self) -> str:
        return self._replacement

    def clean(self, text: str) -> str:
        """``text`` with invisible characters removed and deny-pattern matches replaced."""
        text = strip_invisible(text)
        if not self._compiled:
            return text
        for _ in range(_MAX_PASSES):
            before = text
            for regex in self._compiled:
                text = regex.sub(self._replace, text)
            if text == before:
                break
        return text

    def _replace(self, match: re.Match[str]) -> str:
        # An empty match (``a*``, ``\b``) redacts nothing; replacing it would insert the
        # replacement between every character.
        return self._replacement if match.group() else ""

    def __repr__(self) -> str:
        return f"OutputFilter({list(self._patterns)!r}, replacement={self._replacement!r})"


def _matches_something(regex: re.Pattern[str], text: str) -> bool:
    return any(match.group() for match in regex.finditer(text))
