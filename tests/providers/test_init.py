"""The public API of tidegate.providers."""

from __future__ import annotations

import tidegate.providers as providers


def test_all_is_sorted_and_every_name_resolves() -> None:
    """``__all__`` is sorted and every name in it is importable from the package."""
    assert providers.__all__ == sorted(providers.__all__)
    for name in providers.__all__:
        assert getattr(providers, name) is not None
