"""Unique identifiers made without a system call: a random prefix per process, then a counter.

Request and reservation ids must be unique, not secret: a new random value for each one cost a
``getrandom`` system call on every request. Here the process draws 8 random bytes once and
numbers its ids after them, so two processes (or two runs of one) never share a prefix except
with the odds of a 64-bit collision. Tokens that must not be guessed (API keys, idempotency
claim tokens) still come from :mod:`secrets`.
"""

from __future__ import annotations

import itertools
import os
import secrets
from typing import Final

__all__ = ["IdSource", "new_id"]


class IdSource:
    """``prefix`` (16 hex digits, random) followed by a counter in hex, at least ``width`` wide."""

    def __init__(self, prefix: str | None = None, *, width: int = 8) -> None:
        self._width = width
        self.restart(prefix)

    def restart(self, prefix: str | None = None) -> None:
        """A new prefix (random unless given) and the counter back at 1."""
        self.prefix = prefix if prefix is not None else secrets.token_hex(8)
        self._count = itertools.count(1)
        # A %-template made once: cheaper per id than an f-string with a nested format spec.
        self._template = self.prefix.replace("%", "%%") + f"%0{self._width}x"

    def __call__(self) -> str:
        return self._template % next(self._count)


#: The process-wide source: 24 hex characters, like the random ids it replaces.
new_id: Final = IdSource()
# A forked worker process draws its own prefix instead of repeating its parent's ids.
os.register_at_fork(after_in_child=new_id.restart)
