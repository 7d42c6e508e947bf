"""The statistics of the lab's replications: means with Student-t intervals, batch means, the
MSER-5 warm-up rule and a trend test for stationarity.

Everything here is pure ``math`` on plain sequences of floats, so it gives the same bits
wherever it runs.

* :func:`t_quantile`: the Student-t quantile for an integer number of degrees of freedom, from
  the closed-form distribution function of integer degrees of freedom (Abramowitz and Stegun
  26.7.3 and 26.7.4) inverted by bisection, so no table limits the degrees of freedom.
* :func:`interval`: the mean of independent replications and its t-based confidence interval.
* :func:`batch_means`: a series cut into equal batches, each replaced by its mean.
* :func:`mser5`: the MSER-5 truncation point (White, 1997): the series is batched by five and the
  warm-up is the number of leading batches whose deletion minimises the squared standard error
  of the remaining mean; only the first half is searched.
* :func:`trend`: the least-squares slope of a series against its index and the slope's
  t statistic; a queue whose arrivals exceed its capacity grows and shows a strong positive
  slope, a stationary one does not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Interval",
    "Trend",
    "batch_means",
    "interval",
    "mser5",
    "t_cdf",
    "t_quantile",
    "trend",
]


def _check_df(df: int) -> None:
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an int >= 1, got {df!r}")


def _central(t: float, df: int) -> float:
    """P(|T| <= t) for t >= 0: the sums of Abramowitz and Stegun 26.7.3 (odd) and 26.7.4 (even)."""
    theta = math.atan(t / math.sqrt(df))
    sin, cos = math.sin(theta), math.cos(theta)
    cos2 = cos * cos
    if df % 2 == 1:
        if df == 1:
            return 2.0 * theta / math.pi
        term, total = cos, cos
        for k in range(3, df - 1, 2):  # cos^k with coefficients 2/3, 2*4/(3*5), ...
            term *= cos2 * (k - 1) / k
            total += term
        return 2.0 / math.pi * (theta + sin * total)
    term, total = 1.0, 1.0
    for k in range(2, df - 1, 2):  # cos^k with coefficients 1/2, 1*3/(2*4), ...
        term *= cos2 * (k - 1) / k
        total += term
    return sin * total


def t_cdf(t: float, df: int) -> float:
    """The Student-t distribution function with ``df`` degrees of freedom."""
    _check_df(df)
    if math.isnan(t):
        raise ValueError("t must be a number, got nan")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    half = 0.5 * _central(abs(t), df)
    return 0.5 + half if t >= 0 else 0.5 - half


def t_quantile(p: float, df: int) -> float:
    """The ``p``-quantile (0 < p < 1) of Student's t with ``df`` degrees of freedom."""
    _check_df(df)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    if p == 0.5:
        return 0.0
    target = abs(2.0 * p - 1.0)
    low, high = 0.0, 1.0
    while _central(high, df) < target:
        high *= 2.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if _central(middle, df) < target:
            low = middle
        else:
            high = middle
    value = 0.5 * (low + high)
    return value if p > 0.5 else -value


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """A mean over ``n`` replications with its ``confidence`` t interval ``mean +- half_width``.

    With one replication (or none that is finite) there is no interval: ``half_width`` is nan.
    """

    mean: float
    half_width: float
    stderr: float
    n: int
    confidence: float = 0.95

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def as_dict(self) -> dict[str, Any]:
        """Plain data: JSON has no nan, so an undefined figure is null."""

        def num(value: float) -> float | None:
            return None if math.isnan(value) or math.isinf(value) else value

        return {
            "mean": num(self.mean),
            "low": num(self.low),
            "high": num(self.high),
            "half_width": num(self.half_width),
            "n": self.n,
        }

    def format(self, digits: int = 2, scale: float = 1.0) -> str:
        """``mean +- half_width`` (``-`` when undefined), each times ``scale``."""
        if math.isnan(self.mean):
            return "-"
        if math.isnan(self.half_width):
            return f"{self.mean * scale:.{digits}f}"
        return f"{self.mean * scale:.{digits}f} ± {self.half_width * scale:.{digits}f}"


def interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean of ``values`` (independent replications) and its t interval.

    nan values (a figure a replication could not measure) are left out and ``n`` says how many
    counted.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    finite = [float(v) for v in values if not math.isnan(v)]
    n = len(finite)
    if n == 0:
        return Interval(mean=math.nan, half_width=math.nan, stderr=math.nan, n=0)
    mean = math.fsum(finite) / n
    if n == 1:
        return Interval(mean=mean, half_width=math.nan, stderr=math.nan, n=1)
    variance = math.fsum((v - mean) ** 2 for v in finite) / (n - 1)
    stderr = math.sqrt(variance / n)
    quantile = t_quantile(0.5 + confidence / 2.0, n - 1)
    return Interval(
        mean=mean, half_width=quantile * stderr, stderr=stderr, n=n, confidence=confidence
    )


def batch_means(series: Sequence[float], batches: int) -> list[float]:
    """``series`` cut into ``batches`` equal consecutive batches (a remainder at the start is
    dropped, the end being the part nearest steady state), each replaced by its mean."""
    if isinstance(batches, bool) or batches < 1:
        raise ValueError(f"batches must be an int >= 1, got {batches!r}")
    size = len(series) // batches
    if size < 1:
        raise ValueError(f"cannot cut {len(series)} values into {batches} batches")
    start = len(series) - size * batches
    return [
        math.fsum(series[start + i * size : start + (i + 1) * size]) / size for i in range(batches)
    ]


def mser5(series: Sequence[float]) -> int:
    """The MSER-5 truncation point of ``series``, in values of ``series`` (a multiple of five).

    The series is batched by five; for every ``d`` in the first half of the batches, the
    statistic is the variance of the batches after ``d`` over their count; the smallest wins
    (the earliest on a tie). A series of fewer than ten values is not truncated.
    """
    count = len(series) // 5
    if count < 2:
        return 0
    batched = [math.fsum(series[5 * i : 5 * i + 5]) / 5.0 for i in range(count)]
    best_d, best = 0, math.inf
    # Suffix sums from the end, so each d costs O(1).
    suffix_sum = [0.0] * (count + 1)
    suffix_sq = [0.0] * (count + 1)
    for i in range(count - 1, -1, -1):
        suffix_sum[i] = suffix_sum[i + 1] + batched[i]
        suffix_sq[i] = suffix_sq[i + 1] + batched[i] * batched[i]
    for d in range(count // 2 + 1):
        m = count - d
        mean = suffix_sum[d] / m
        statistic = max(suffix_sq[d] / m - mean * mean, 0.0) / m
        if statistic < best * (1.0 - 1e-12):
            best_d, best = d, statistic
    return 5 * best_d


@dataclass(frozen=True, slots=True, kw_only=True)
class Trend:
    """The least-squares slope of a series per step of its index, its standard error and
    t statistic (``slope / stderr``, infinite for a perfect line)."""

    slope: float
    stderr: float
    t: float


def trend(series: Sequence[float]) -> Trend:
    """The slope of ``series`` against 0, 1, 2, ...; needs at least three values."""
    n = len(series)
    if n < 3:
        raise ValueError(f"a trend needs at least three values, got {n}")
    x_mean = (n - 1) / 2.0
    y_mean = math.fsum(series) / n
    sxx = math.fsum((i - x_mean) ** 2 for i in range(n))
    sxy = math.fsum((i - x_mean) * (y - y_mean) for i, y in enumerate(series))
    slope = sxy / sxx
    residual = math.fsum((y - y_mean - slope * (i - x_mean)) ** 2 for i, y in enumerate(series))
    stderr = math.sqrt(residual / (n - 2) / sxx)
    if stderr == 0.0:
        t = 0.0 if slope == 0.0 else math.copysign(math.inf, slope)
    else:
        t = slope / stderr
    return Trend(slope=slope, stderr=stderr, t=t)
