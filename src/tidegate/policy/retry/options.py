"""How many tries and how long to wait between them: the frozen options, the backoff arithmetic
and the timeout layer a retrying call adds to the chain."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import StrEnum

from tidegate.policy.deadline import Layer

__all__ = ["Jitter", "RetryOptions", "backoff_ceiling", "provider_layer"]


def check_finite(field: str, value: float, *, minimum: float) -> None:
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{field} must be a finite number >= {minimum!r}, got {value!r}")


class Jitter(StrEnum):
    """How a backoff is randomised.

    ``full`` waits anywhere between zero and the exponential ceiling; ``equal`` waits half the
    ceiling plus a random amount up to the other half; ``decorrelated`` grows from the previous
    wait (between ``base`` and three times the previous wait); ``none`` waits the ceiling itself,
    which makes clients that failed together retry together.
    """

    FULL = "full"
    EQUAL = "equal"
    DECORRELATED = "decorrelated"
    NONE = "none"


def backoff_ceiling(retry_number: int, *, base: float, factor: float, cap: float) -> float:
    """``min(cap, base * factor ** retry_number)``, without overflowing for large numbers."""
    if retry_number < 0:
        raise ValueError(f"retry_number must be >= 0, got {retry_number!r}")
    try:
        raw = base * factor**retry_number
    except OverflowError:
        return cap
    return min(cap, raw)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryOptions:
    """How many tries, and how long to wait between them.

    Retries are numbered from 0: retry 0 is the wait before the second attempt.
    """

    #: Total tries, the first one included; 1 means never retry.
    attempts: int = 3
    #: Seconds: the ceiling of the first retry's wait, and the least decorrelated wait.
    base: float = 0.5
    #: How much the ceiling grows per retry.
    factor: float = 2.0
    #: Seconds: no wait is ever longer.
    cap: float = 8.0
    #: How the wait is randomised below its ceiling.
    jitter: Jitter = Jitter.FULL
    #: Seconds: the shortest attempt worth starting; an attempt never starts with less time left.
    min_attempt: float = 0.01

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise ValueError(f"attempts must be an int, got {self.attempts!r}")
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts!r}")
        check_finite("base", self.base, minimum=0.0)
        check_finite("factor", self.factor, minimum=1.0)
        check_finite("cap", self.cap, minimum=self.base)
        check_finite("min_attempt", self.min_attempt, minimum=0.0)
        # Accept the plain string too ("equal"), so options read from config need no conversion.
        try:
            jitter = Jitter(self.jitter)
        except ValueError:
            choices = ", ".join(j.value for j in Jitter)
            raise ValueError(f"jitter must be one of {choices}, got {self.jitter!r}") from None
        object.__setattr__(self, "jitter", jitter)

    def ceiling(self, retry_number: int) -> float:
        """The exponential ceiling for retry ``retry_number``: ``min(cap, base * factor**n)``."""
        return backoff_ceiling(retry_number, base=self.base, factor=self.factor, cap=self.cap)

    def delay(self, retry_number: int, rng: random.Random, previous: float | None = None) -> float:
        """The jittered wait before retry ``retry_number`` (0 for the first retry).

        ``previous`` is the wait before the previous retry; only ``decorrelated`` uses it, and
        takes ``base`` when it is ``None``.
        """
        ceiling = self.ceiling(retry_number)
        if self.jitter is Jitter.NONE:
            return ceiling
        if self.jitter is Jitter.FULL:
            return min(ceiling, rng.uniform(0.0, ceiling))
        if self.jitter is Jitter.EQUAL:
            half = ceiling / 2.0
            return min(ceiling, half + rng.uniform(0.0, half))
        last = self.base if previous is None else previous
        if math.isnan(last) or last < 0:
            raise ValueError(f"previous must be a wait in seconds >= 0, got {previous!r}")
        high = max(self.base, 3.0 * last)
        return min(self.cap, high, rng.uniform(self.base, high))

    def max_delay(self, retry_number: int) -> float:
        """The longest wait :meth:`delay` can return for retry ``retry_number``.

        For ``decorrelated`` it assumes each ``previous`` was this policy's own earlier delay.
        """
        if self.jitter is not Jitter.DECORRELATED:
            return self.ceiling(retry_number)
        if retry_number < 0:
            raise ValueError(f"retry_number must be >= 0, got {retry_number!r}")
        # Follow the same float steps as delay() so the bound holds to the last bit.
        high = self.base
        for _ in range(retry_number + 1):
            grown = min(self.cap, max(self.base, 3.0 * high))
            if grown == high:
                break  # at the cap (or stuck at a zero base): it cannot grow any more
            high = grown
        return high

    def worst_total_backoff(self, attempts: int | None = None) -> float:
        """The longest total wait across all retries of ``attempts`` tries (default: ours)."""
        tries = self.attempts if attempts is None else attempts
        if tries < 1:
            raise ValueError(f"attempts must be >= 1, got {tries!r}")
        return math.fsum(self.max_delay(n) for n in range(tries - 1))


def provider_layer(name: str, attempts: int, per_try_s: float, policy: RetryOptions) -> Layer:
    """The timeout layer of a retrying provider call, for :func:`chain_problems`.

    It may last ``attempts`` times the per-try timeout plus the worst-case total backoff. A
    provider's ``retry_after`` can stretch a wait beyond the backoff; the deadline bounds that.
    """
    check_finite("per_try_s", per_try_s, minimum=0.0)
    return Layer(name, attempts * per_try_s + policy.worst_total_backoff(attempts))
