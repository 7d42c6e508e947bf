"""What one simulated run saw: counts per class, latency percentiles, and Little's law.

Counts follow each request that arrived inside the measured window to its fate, so every class
balances exactly: ``offered == completed + shed + expired + in_system``. ``shed`` were refused at
the door, ``expired`` left the queue unserved because their deadline passed (dropped at dequeue,
or the caller gave up), ``completed`` were served (``on_time`` by their deadline, else ``late``),
and ``in_system`` were still waiting or in service when the run ended.

Little's law is checked on every run. ``in_system_mean`` (L) is the number of requests in the
system integrated over the window from the event stream. ``passage_rate`` (lambda) counts the
requests that spent any time in the system during the window (those present at its start plus
those admitted inside it) per second, and ``time_in_system_mean`` (W) is the mean time each of
them spent there within the window. The two sides are summed along independent paths (one
running integral, one record per request), so ``L == lambda * W`` to floating-point rounding is a
check of the engine's bookkeeping, not an identity. Over a window much longer than W,
``passage_rate`` approaches the admitted arrival rate and the throughput, and W the mean latency.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

try:  # numpy comes with the lab extra; without it, percentiles sort (same values, slower)
    import numpy as _np

    _HAVE_NUMPY = True
except ImportError:  # pragma: no cover - the test environment has numpy
    _HAVE_NUMPY = False

#: Below this many values a plain sort is as fast as handing them to numpy.
_PARTITION_FROM: Final = 2048
_QUANTILES: Final = (0.50, 0.95, 0.99)

__all__ = [
    "ClassReport",
    "Latency",
    "Report",
    "mean_and_stderr",
    "percentile",
]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of already sorted values by linear interpolation; nan if empty."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    n = len(sorted_values)
    if n == 0:
        return math.nan
    position = q * (n - 1)
    low = math.floor(position)
    high = min(low + 1, n - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """The sample mean and its standard error (sample standard deviation over sqrt(n))."""
    n = len(values)
    if n < 2:
        raise ValueError(f"need at least two values for a standard error, got {n}")
    mean = math.fsum(values) / n
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


@dataclass(frozen=True, slots=True, kw_only=True)
class Latency:
    """Time in system of completed requests, in seconds (nan when nothing completed)."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Latency:
        """Summarise ``values`` (any order).

        The percentiles need only a few order statistics, not a full sort: with numpy (the
        ``lab`` extra) and many values they come from one partition, which gives exactly the
        values a sort would, several times faster.
        """
        if len(values) < _PARTITION_FROM or not _HAVE_NUMPY:
            return cls.of_sorted(sorted(values))
        n = len(values)
        positions = [q * (n - 1) for q in _QUANTILES]
        lows = [math.floor(position) for position in positions]
        wanted = sorted({*lows, *(min(low + 1, n - 1) for low in lows), n - 1})
        array = _np.array(values, dtype=float)
        array.partition(wanted)
        stats = {index: float(array[index]) for index in wanted}
        p50, p95, p99 = (
            stats[low] + (stats[min(low + 1, n - 1)] - stats[low]) * (position - low)
            for low, position in zip(lows, positions, strict=True)
        )
        return cls(count=n, mean=math.fsum(values) / n, p50=p50, p95=p95, p99=p99, max=stats[n - 1])

    @classmethod
    def of_sorted(cls, ordered: Sequence[float]) -> Latency:
        """Summarise ``ordered``, which is already in ascending order (not checked)."""
        if not ordered:
            return cls(
                count=0, mean=math.nan, p50=math.nan, p95=math.nan, p99=math.nan, max=math.nan
            )
        return cls(
            count=len(ordered),
            mean=math.fsum(ordered) / len(ordered),
            p50=percentile(ordered, 0.50),
            p95=percentile(ordered, 0.95),
            p99=percentile(ordered, 0.99),
            max=ordered[-1],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassReport:
    """The fate of one class's requests that arrived inside the measured window."""

    klass: str
    offered: int
    admitted: int
    shed: Mapping[str, int]
    expired: int
    completed: int
    on_time: int
    late: int
    in_system: int
    #: Admitted requests that found no free slot and had to wait (started or not).
    waited: int
    #: Requests that started service, and their mean wait in the queue (zero for direct starts).
    started: int
    mean_wait: float
    latency: Latency
    #: Seconds from arrival to a "no": 0 for a refusal at the door, the wait for an expiry.
    rejection_time_mean: float
    rejection_time_max: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "shed", MappingProxyType(dict(sorted(self.shed.items()))))

    @property
    def shed_total(self) -> int:
        return sum(self.shed.values())

    @property
    def balanced(self) -> bool:
        """Flow balance: every offered request is completed, shed, expired or still inside."""
        return self.offered == self.completed + self.shed_total + self.expired + self.in_system

    def as_dict(self) -> dict[str, Any]:
        return {
            "klass": self.klass,
            "offered": self.offered,
            "admitted": self.admitted,
            "shed": dict(self.shed),
            "shed_total": self.shed_total,
            "expired": self.expired,
            "completed": self.completed,
            "on_time": self.on_time,
            "late": self.late,
            "in_system": self.in_system,
            "waited": self.waited,
            "started": self.started,
            "mean_wait": _num(self.mean_wait),
            "latency": {k: _num(v) for k, v in _latency_dict(self.latency).items()},
            "rejection_time_mean": _num(self.rejection_time_mean),
            "rejection_time_max": _num(self.rejection_time_max),
        }


def _latency_dict(latency: Latency) -> dict[str, float]:
    return {
        "count": latency.count,
        "mean": latency.mean,
        "p50": latency.p50,
        "p95": latency.p95,
        "p99": latency.p99,
        "max": latency.max,
    }


def _num(value: float) -> float | None:
    """JSON has no nan: an undefined statistic is null."""
    return None if math.isnan(value) else value


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """One run: the window, the per-class fates, rates, utilisation and Little's law."""

    seed: int
    #: The measured window is ``[warmup, horizon]``.
    warmup: float
    horizon: float
    classes: tuple[ClassReport, ...]
    #: Time in system of every completed request of the window, all classes pooled.
    latency: Latency
    #: Completions (any cohort) inside the window, per second; and those on time.
    throughput: float
    goodput: float
    #: Busy slot-seconds over available slot-seconds; busy core-seconds over core-seconds.
    utilisation: float
    cpu_utilisation: float
    #: Little's law: L (time-integrated), lambda (passages per second), W (mean time inside).
    in_system_mean: float
    passage_rate: float
    time_in_system_mean: float
    #: Little's law from the other side, independent of L: requests that left the system
    #: (served or not) inside the window per second, and their mean whole time in the system.
    departure_rate: float = math.nan
    sojourn_mean: float = math.nan
    #: The time-average number in the system in equal slices of ``[0, horizon]`` (when asked).
    in_system_series: tuple[float, ...] = ()
    #: Anything a scenario adds (replica trace, peak calls, ...); kept out of the comparisons.
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def window(self) -> float:
        return self.horizon - self.warmup

    @property
    def littles_product(self) -> float:
        """lambda * W, to compare with ``in_system_mean``."""
        return self.passage_rate * self.time_in_system_mean

    @property
    def littles_difference(self) -> float:
        """L minus lambda_eff x W, lambda_eff and W from the departures alone: near zero for
        a stationary system over a window much longer than W; far from it for a growing queue,
        or a window that still holds the start-up transient."""
        return self.in_system_mean - self.departure_rate * self.sojourn_mean

    @property
    def series_step(self) -> float:
        """The length of one slice of ``in_system_series``."""
        return self.horizon / len(self.in_system_series) if self.in_system_series else math.nan

    def window_series(self) -> tuple[float, ...]:
        """The slices of ``in_system_series`` that lie inside the measured window."""
        if not self.in_system_series:
            return ()
        first = math.ceil(round(self.warmup / self.series_step, 9))
        return self.in_system_series[first:]

    def littles_law_holds(self, rel_tol: float = 1e-9) -> bool:
        """Whether L equals lambda * W to floating-point tolerance."""
        return math.isclose(
            self.in_system_mean, self.littles_product, rel_tol=rel_tol, abs_tol=1e-12
        )

    def by_class(self, klass: str) -> ClassReport:
        for report in self.classes:
            if report.klass == klass:
                return report
        raise KeyError(klass)

    @property
    def total(self) -> ClassReport:
        """All classes together."""
        classes = self.classes
        shed: dict[str, int] = {}
        for report in classes:
            for reason, count in report.shed.items():
                shed[reason] = shed.get(reason, 0) + count
        started = sum(r.started for r in classes)
        rejected = [r for r in classes if r.shed_total + r.expired]
        rejections = sum(r.shed_total + r.expired for r in rejected)
        return ClassReport(
            klass="all",
            offered=sum(r.offered for r in classes),
            admitted=sum(r.admitted for r in classes),
            shed=shed,
            expired=sum(r.expired for r in classes),
            completed=sum(r.completed for r in classes),
            on_time=sum(r.on_time for r in classes),
            late=sum(r.late for r in classes),
            in_system=sum(r.in_system for r in classes),
            waited=sum(r.waited for r in classes),
            started=started,
            mean_wait=_weighted((r.mean_wait, r.started) for r in classes),
            latency=self.latency,
            rejection_time_mean=(
                math.fsum(r.rejection_time_mean * (r.shed_total + r.expired) for r in rejected)
                / rejections
                if rejections
                else math.nan
            ),
            rejection_time_max=max((r.rejection_time_max for r in rejected), default=math.nan),
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``: numbers, strings, lists and dicts only."""
        return {
            "seed": self.seed,
            "warmup": self.warmup,
            "horizon": self.horizon,
            "throughput": self.throughput,
            "goodput": self.goodput,
            "utilisation": _num(self.utilisation),
            "cpu_utilisation": _num(self.cpu_utilisation),
            "latency": {k: _num(v) for k, v in _latency_dict(self.latency).items()},
            "littles_law": {
                "L": self.in_system_mean,
                "lambda": self.passage_rate,
                "W": self.time_in_system_mean,
                "lambda_W": self.littles_product,
                "departure_rate": _num(self.departure_rate),
                "sojourn_mean": _num(self.sojourn_mean),
                "difference": _num(self.littles_difference),
            },
            "total": self.total.as_dict(),
            "classes": [r.as_dict() for r in self.classes],
            **({"extra": dict(self.extra)} if self.extra else {}),
        }


def _weighted(pairs: Any) -> float:
    total = weight = 0.0
    for value, count in pairs:
        if count:
            total += value * count
            weight += count
    return total / weight if weight else math.nan
