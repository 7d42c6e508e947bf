"""Pure, synchronous decisions. Time comes from an injected Clock, randomness from an injected rng.

This package imports only ``tidegate.clock``, ``tidegate.errors`` and the standard library.
"""

__all__: list[str] = []
