"""Which providers automatic failover may use: approval by evidence, or by an operator.

A fallback is used automatically only when its latest eval-gate verdict (``tidegate eval``,
:mod:`tidegate.state.verdicts`) is ``go`` or ``review``, or when the config approves it
explicitly (``approved_fallback: true``: an override, logged at start-up, and in the
``production`` profile only with ``approved_fallback_reason``). ``approved_fallback: false``
takes a provider out whatever its verdict, and a ``block`` verdict beats an override. A route's
primary is not a fallback: it is always tried (docs/policies/routing.md#fallback-approval).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Protocol

import structlog

__all__ = [
    "EVIDENCE",
    "Approvable",
    "check_override",
    "log_fallback_overrides",
    "may_fall_back",
    "override_problems",
]

log = structlog.get_logger("tidegate")

#: The verdicts that approve a fallback without an override.
EVIDENCE: Final = frozenset({"go", "review"})


class Approvable(Protocol):
    """What a provider's config says about its approval (``ProviderConfig``)."""

    @property
    def approved_fallback(self) -> bool | None: ...

    @property
    def approved_fallback_reason(self) -> str | None: ...


def may_fall_back(provider: Approvable, verdict: str | None) -> bool:
    """Whether automatic failover may use ``provider``, given its latest eval ``verdict``
    (``None``: it has none): ``block`` or ``false`` never, an override yes, else the evidence."""
    if verdict == "block" or provider.approved_fallback is False:
        return False
    return provider.approved_fallback is True or verdict in EVIDENCE


def check_override(provider: Approvable) -> None:
    """A reason explains an explicit ``approved_fallback``: alone it approves nothing."""
    if provider.approved_fallback_reason is not None and provider.approved_fallback is None:
        raise ValueError("approved_fallback_reason explains an explicit approved_fallback: set it")


def override_problems(providers: Mapping[str, Approvable]) -> list[str]:
    """What the ``production`` profile refuses: an override that gives no reason."""
    return [
        f"production needs a reason for an explicit fallback approval: set "
        f"providers.{name}.approved_fallback_reason (or drop providers.{name}.approved_fallback "
        "and let its eval verdict decide)"
        for name, provider in providers.items()
        if provider.approved_fallback is True and provider.approved_fallback_reason is None
    ]


def log_fallback_overrides(providers: Mapping[str, Approvable]) -> None:
    """One warning at start-up per provider the config approves as an automatic fallback, with
    the reason given: an approval without evidence (a ``block`` verdict still takes it out)."""
    for name, provider in providers.items():
        if provider.approved_fallback is True:
            log.warning(
                "fallback_override",
                provider=name,
                reason=provider.approved_fallback_reason or "none given",
            )
