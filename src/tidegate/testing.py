"""Test doubles that users of tidegate need for their own tests.

- :class:`ManualClock`: a clock that moves only when told to (``advance``, ``set``).
- :func:`seeded_rng`: the only kind of randomness a policy may take.
- :class:`FakeProvider`: an in-process provider that acts out a plain function or a script.
- :class:`FakeUpstream`: the scriptable OpenAI-compatible server, started on a loopback port.
"""

from __future__ import annotations

import importlib
import random

from tidegate.clock import ClockWentBackwards, ManualClock
from tidegate.providers.fake import FakeProvider
from tidegate.providers.fake_upstream import FakeUpstream

__all__ = [
    "ClockWentBackwards",
    "FakeProvider",
    "FakeUpstream",
    "ManualClock",
    "compiled",
    "seeded_rng",
]


def compiled(module: str) -> bool:
    """Whether the named tidegate module runs compiled (a mypyc build) rather than as Python."""
    loaded = importlib.import_module(module)
    return not str(getattr(loaded, "__file__", "")).endswith(".py")


def seeded_rng(seed: int = 0) -> random.Random:
    """A private, seeded ``random.Random``."""
    return random.Random(seed)
