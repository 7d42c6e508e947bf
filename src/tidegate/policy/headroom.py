"""Provider-reported headroom: what an upstream says is left of its rate limits, and a route
order that goes around a provider before its 429 arrives.

OpenAI (and Azure OpenAI, and most OpenAI-compatible servers) answer with
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, the reset as a duration (``1s``,
``6m0s``, ``20ms``); Anthropic with ``anthropic-ratelimit-{requests,tokens,input-tokens,
output-tokens}-{limit,remaining,reset}``, the reset as an RFC 3339 time. :func:`read_headers`
turns either into a :class:`Headroom`; a :class:`HeadroomBook` keeps the latest one per
provider. A provider is *low* when some allowance it reported has no more than
``low_fraction`` of its limit left (or nothing left, when no limit was said), until the reset
it reported, or for ``horizon_s`` after the report when it said none.
:func:`prefer_ample` then moves the low providers of a route plan behind the others,
keeping route order within each group: a low primary is still called when no other candidate
is left, and nothing is skipped, so the plan's candidates are the same set either way.

Pure: the book reads time only from the :class:`~tidegate.clock.Clock` it is given (``now()``
for deadlines, ``wall()`` to read an absolute reset), and only when an answer reports headroom.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tidegate.clock import Clock
from tidegate.policy.routing import RoutePlan

__all__ = [
    "RESOURCES",
    "Allowance",
    "Headroom",
    "HeadroomBook",
    "parse_duration",
    "prefer_ample",
    "read_headers",
]

#: What an allowance can count, in the order they are reported.
RESOURCES = ("requests", "tokens", "input_tokens", "output_tokens")
#: The header that says each dialect reports headroom at all (looked up first, and alone, on
#: every answer: an upstream that reports nothing costs one lookup).
_OPENAI_MARK = "x-ratelimit-remaining-requests"
_OPENAI_TOKENS_MARK = "x-ratelimit-remaining-tokens"
_ANTHROPIC_MARK = "anthropic-ratelimit-requests-remaining"
_ANTHROPIC_TOKENS_MARK = "anthropic-ratelimit-tokens-remaining"
#: Each dialect's header that is there whenever an answer reports headroom.
_MARKS = {"openai": _OPENAI_MARK, "anthropic": _ANTHROPIC_MARK}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


@dataclass(frozen=True, slots=True)
class Allowance:
    """One limit as reported: how much is left, of how much, and when it refills (clock time)."""

    resource: str
    remaining: int
    limit: int | None = None
    reset_at: float | None = None

    def fraction_left(self) -> float | None:
        """``remaining / limit``, or None without a (positive) limit."""
        if self.limit is None or self.limit <= 0:
            return None
        return self.remaining / self.limit


@dataclass(frozen=True, slots=True)
class Headroom:
    """What one answer said is left (at clock time ``observed_at``)."""

    observed_at: float
    allowances: tuple[Allowance, ...]

    def low(self, now: float, *, low_fraction: float, horizon_s: float) -> Allowance | None:
        """The first allowance that is low at ``now``, or None."""
        for allowance in self.allowances:
            until = allowance.reset_at
            if until is None:
                until = self.observed_at + horizon_s
            if now >= until:
                continue  # refilled since, as far as anyone said
            left = allowance.fraction_left()
            if allowance.remaining <= 0 or (left is not None and left <= low_fraction):
                return allowance
        return None

    def as_dict(self, now: float) -> dict[str, Any]:
        """For ``/readyz``: by resource, what is left, of what, and seconds to its reset."""
        return {
            a.resource: {
                "remaining": a.remaining,
                "limit": a.limit,
                "reset_in_s": None if a.reset_at is None else round(max(0.0, a.reset_at - now), 3),
            }
            for a in self.allowances
        }


def parse_duration(text: str) -> float | None:
    """Seconds in an OpenAI reset duration (``1s``, ``6m0s``, ``1h2m3.5s``, ``20ms``); a bare
    number is seconds. None for anything else."""
    text = text.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    total, at = 0.0, 0
    for match in _DURATION.finditer(text):
        if match.start() != at:
            return None
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        at = match.end()
    return total if at == len(text) and at > 0 else None


def _count(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    return int(value) if value.isdigit() else None


def _reset_time(value: str | None, now: float, now_wall: float) -> float | None:
    """Clock time of an RFC 3339 reset (Anthropic), or of a duration (some compatible servers)."""
    if value is None:
        return None
    seconds = parse_duration(value)
    if seconds is not None:
        return now + seconds
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return now + max(0.0, when.timestamp() - now_wall)


def read_headers(headers: Mapping[str, str], now: float, now_wall: float) -> Headroom | None:
    """The headroom an answer's headers report (OpenAI's or Anthropic's), or None."""
    allowances: list[Allowance] = []
    if _OPENAI_MARK in headers or _OPENAI_TOKENS_MARK in headers:
        for resource in ("requests", "tokens"):
            remaining = _count(headers.get(f"x-ratelimit-remaining-{resource}"))
            if remaining is None:
                continue
            reset = headers.get(f"x-ratelimit-reset-{resource}")
            seconds = None if reset is None else parse_duration(reset)
            allowances.append(
                Allowance(
                    resource,
                    remaining,
                    _count(headers.get(f"x-ratelimit-limit-{resource}")),
                    None if seconds is None else now + seconds,
                )
            )
    elif _ANTHROPIC_MARK in headers or _ANTHROPIC_TOKENS_MARK in headers:
        for resource in RESOURCES:
            stem = "anthropic-ratelimit-" + resource.replace("_", "-")
            remaining = _count(headers.get(f"{stem}-remaining"))
            if remaining is None:
                continue
            allowances.append(
                Allowance(
                    resource,
                    remaining,
                    _count(headers.get(f"{stem}-limit")),
                    _reset_time(headers.get(f"{stem}-reset"), now, now_wall),
                )
            )
    return Headroom(now, tuple(allowances)) if allowances else None


class HeadroomBook:
    """The latest headroom each provider reported, and the route order it suggests."""

    def __init__(
        self,
        clock: Clock,
        *,
        low_fraction: float = 0.05,
        horizon_s: float = 60.0,
        prefer_others: bool = False,
    ) -> None:
        if not (math.isfinite(low_fraction) and 0 <= low_fraction < 1):
            raise ValueError(f"low_fraction must be in [0, 1), got {low_fraction!r}")
        if not (math.isfinite(horizon_s) and horizon_s > 0):
            raise ValueError(f"horizon_s must be positive, got {horizon_s!r}")
        self.clock = clock
        self.low_fraction = low_fraction
        self.horizon_s = horizon_s
        #: Whether routes go around low providers (:func:`prefer_ample`), or only record.
        self.prefer_others = prefer_others
        self._latest: dict[str, Headroom] = {}

    def observe(self, provider: str, headers: Mapping[str, str]) -> Headroom | None:
        """Record what an answer of ``provider`` reported (an answer that reports nothing
        leaves the last report as it was); returns the new report, if any."""
        if (
            _OPENAI_MARK not in headers
            and _ANTHROPIC_MARK not in headers
            and _OPENAI_TOKENS_MARK not in headers
            and _ANTHROPIC_TOKENS_MARK not in headers
        ):
            return None
        return self._record(provider, headers)

    def _record(self, provider: str, headers: Mapping[str, str]) -> Headroom | None:
        found = read_headers(headers, self.clock.now(), self.clock.wall())
        if found is not None:
            self._latest[provider] = found
        return found

    def watcher(self, provider: str, dialect: str) -> Callable[[Mapping[str, str]], None]:
        """What a provider speaking ``dialect`` (``openai`` or ``anthropic``) tells of every
        answer's headers: one lookup of that dialect's requests header decides whether the
        answer reports anything (both APIs send it whenever they report headroom; an upstream
        that reports nothing costs that one lookup an answer)."""
        mark = _MARKS[dialect]
        record = self._record

        def seen(headers: Mapping[str, str]) -> None:
            if mark in headers:  # the one check: observe()'s four are not made again
                record(provider, headers)

        return seen

    def latest(self, provider: str) -> Headroom | None:
        return self._latest.get(provider)

    def reported(self) -> Mapping[str, Headroom]:
        """Every provider's latest report."""
        return self._latest

    def low(self, provider: str) -> Allowance | None:
        """The allowance that makes ``provider`` low now, or None."""
        found = self._latest.get(provider)
        if found is None:
            return None
        return found.low(self.clock.now(), low_fraction=self.low_fraction, horizon_s=self.horizon_s)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """For ``/readyz``: each provider's latest report, and whether it is low now."""
        now = self.clock.now()
        return {
            name: {"low": self.low(name) is not None, **found.as_dict(now)}
            for name, found in sorted(self._latest.items())
        }


def prefer_ample(plan: RoutePlan, low: Collection[str]) -> RoutePlan:
    """``plan`` with its ``low`` candidates moved behind the others (route order kept within
    each group); the same plan when none is low, all are, or the low ones are already last."""
    candidates = plan.candidates
    if len(candidates) < 2 or not low:
        return plan
    ample = tuple(c for c in candidates if c.name not in low)
    if not ample or all(c.name in low for c in candidates[len(ample) :]):
        return plan
    return RoutePlan(ample + tuple(c for c in candidates if c.name in low), plan.skipped)
