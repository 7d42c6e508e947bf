"""Test doubles that users of tidegate need for their own tests.

``ManualClock`` moves only when told to; ``seeded_rng`` gives the same random stream every run.
"""

from __future__ import annotations

import random

from tidegate.clock import ClockWentBackwards, ManualClock

__all__ = ["ClockWentBackwards", "ManualClock", "seeded_rng"]


def seeded_rng(seed: int = 0) -> random.Random:
    """A private, seeded ``random.Random``: the only kind of randomness a policy may take."""
    return random.Random(seed)
