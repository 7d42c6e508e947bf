"""Independent replications on a process pool, their summaries, and the checks that can fail.

Replication ``i`` of a command run with ``--seed S`` runs on :func:`replication_seed` ``(S, i)``,
a seed hashed from both, so replications are independent of each other and of the worker that
runs them: results come back in replication order and are summarised in that order, so the same
seed and count give the same bytes on one worker or many.

A replication returns plain data (numbers, strings, lists and dicts); :func:`aggregate` turns a
list of them into the same shape with every number replaced by an
:class:`~tidegate.lab.stats.Interval` over the replications.

For steady-state runs:

* :func:`mser5_warmup` chooses the warm-up by MSER-5 on a pilot run started empty;
* :func:`littles_check` compares the time-average ``L`` (integrated over the window) with
  ``lambda_eff x W`` from the departures alone (two independent paths) and reports their
  difference with its interval;
* :func:`stationarity` tests the number in the system for a trend across batches of the window:
  a queue whose arrivals exceed its capacity, or a window that still holds the start-up
  transient, grows across it.
"""

from __future__ import annotations

import math
import multiprocessing
import random
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Final

from tidegate.lab.engine import Fleet, Traffic, simulate
from tidegate.lab.report import Report
from tidegate.lab.stats import Interval, batch_means, interval, mser5, t_quantile, trend

__all__ = [
    "BATCHES",
    "LITTLE_TOLERANCE",
    "PILOT_SLICES",
    "LittleCheck",
    "Stationarity",
    "aggregate",
    "chosen",
    "littles_check",
    "mser5_warmup",
    "plain",
    "replicate",
    "replication_seed",
    "run_replications",
    "stationarity",
    "steady_metrics",
]

#: Slices of a pilot run for MSER-5 (batched by five: 100 points).
PILOT_SLICES: Final = 500
#: Batches of the measured window for the trend test.
BATCHES: Final = 20
#: Little's law holds when the interval of (L - lambda_eff W) / L reaches within this of zero.
LITTLE_TOLERANCE: Final = 0.02
#: A trend counts when its one-sided t statistic passes this quantile and the fitted rise over
#: the window is more than this share of the mean.
TREND_QUANTILE: Final = 0.999
TREND_RISE: Final = 0.05

_TASK: list[Any] = []


def chosen(names: Iterable[str], known: Sequence[str], what: str) -> tuple[str, ...]:
    """``names`` as a tuple, each one of ``known`` (a ``ValueError`` names the first that is
    not: an unknown ``what``)."""
    picked = tuple(names)
    for name in picked:
        if name not in known:
            raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(known)}")
    return picked


def replication_seed(seed: int, index: int) -> int:
    """The seed of replication ``index`` of a run seeded ``seed``."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index!r}")
    return random.Random(f"tidegate-lab/replication/{seed}/{index}").getrandbits(48)


def _call(seed: int) -> Any:
    function, spec = _TASK[-1]
    return function(spec, seed)


def run_replications(
    function: Callable[[Any, int], Any],
    spec: Any,
    *,
    seed: int,
    replications: int,
    workers: int = 1,
    progress: Callable[[], None] | None = None,
) -> list[Any]:
    """``function(spec, replication_seed(seed, i))`` for each replication, in order.

    With ``workers > 1`` the replications run on a pool of forked processes (``spec`` is
    inherited, not pickled; only seeds and results cross); ``progress`` is called as each ends.
    """
    if isinstance(replications, bool) or replications < 1:
        raise ValueError(f"replications must be an int >= 1, got {replications!r}")
    if isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    seeds = [replication_seed(seed, i) for i in range(replications)]
    tick = progress if progress is not None else (lambda: None)
    pool_size = min(workers, replications)
    if pool_size <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        results = []
        for one in seeds:
            results.append(function(spec, one))
            tick()
        return results
    _TASK.append((function, spec))
    try:
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=pool_size, mp_context=context) as pool:
            futures = {pool.submit(_call, one): i for i, one in enumerate(seeds)}
            ordered: list[Any] = [None] * replications
            for future in as_completed(futures):
                ordered[futures[future]] = future.result()
                tick()
        return ordered
    finally:
        _TASK.pop()


def replicate(
    function: Callable[[Any, int], Any],
    spec: Any,
    *,
    seed: int,
    replications: int,
    workers: int = 1,
    progress: Callable[[], None] | None = None,
) -> tuple[Any, list[Any]]:
    """:func:`run_replications`, then :func:`aggregate`: the summary (every number an
    :class:`Interval`) and the replications' own results, in replication order."""
    values = run_replications(
        function, spec, seed=seed, replications=replications, workers=workers, progress=progress
    )
    return aggregate(values), values


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def aggregate(values: Sequence[Any]) -> Any:
    """The replications' results in their common shape, each number an :class:`Interval`.

    Dicts are aggregated key by key, lists of one length item by item; ``None`` counts as an
    unmeasured number where the others are numbers. Anything else is kept when every replication
    agrees, and listed per replication when they do not.
    """
    first = values[0]
    if all(isinstance(v, dict) for v in values) and all(v.keys() == first.keys() for v in values):
        return {key: aggregate([v[key] for v in values]) for key in first}
    if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
        return [aggregate([v[i] for v in values]) for i in range(len(first))]
    if all(_number(v) or v is None for v in values) and any(_number(v) for v in values):
        return interval([math.nan if v is None else float(v) for v in values])
    if all(v == first for v in values):
        return first
    return list(values)


def plain(value: Any) -> Any:
    """An aggregate as JSON data: each :class:`Interval` becomes its dict."""
    if isinstance(value, Interval):
        return value.as_dict()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


# --------------------------------------------------------------------------- steady state


def mser5_warmup(traffic: Traffic, fleet: Fleet, *, horizon: float, seed: int) -> float:
    """The warm-up MSER-5 chooses on a pilot run of ``horizon`` seconds started empty."""
    pilot = simulate(
        traffic,
        fleet,
        horizon=horizon,
        seed=replication_seed(seed, 0) ^ 0x5EED,
        series=PILOT_SLICES,
    )
    return mser5(pilot.in_system_series) * horizon / PILOT_SLICES


def steady_metrics(report: Report) -> dict[str, Any]:
    """One replication of a steady-state run as plain data: the figures the commands print,
    Little's law from both sides, and the window's number in the system in batches."""
    total = report.total
    window = report.window_series()
    return {
        "offered": total.offered,
        "shed_share": total.shed_total / total.offered if total.offered else 0.0,
        "expired_share": total.expired / total.offered if total.offered else 0.0,
        "p_wait": total.waited / total.admitted if total.admitted else math.nan,
        "mean_wait": total.mean_wait,
        "p95": total.latency.p95,
        "mean_latency": total.latency.mean,
        "throughput": report.throughput,
        "goodput": report.goodput,
        "utilisation": report.utilisation,
        "L": report.in_system_mean,
        "lambda_W": report.littles_product,
        "departure_rate": report.departure_rate,
        "sojourn_mean": report.sojourn_mean,
        "littles_difference": report.littles_difference,
        "batches": batch_means(window, BATCHES) if len(window) >= BATCHES else [],
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class LittleCheck:
    """L against lambda_eff x W over the replications, and whether they agree."""

    L: Interval
    lambda_w: Interval
    difference: Interval
    relative: Interval
    holds: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "L": self.L.as_dict(),
            "lambda_eff_W": self.lambda_w.as_dict(),
            "difference": self.difference.as_dict(),
            "relative_difference": self.relative.as_dict(),
            "tolerance": LITTLE_TOLERANCE,
            "holds": self.holds,
        }


def littles_check(metrics: Sequence[dict[str, Any]]) -> LittleCheck:
    """Little's law over replications of :func:`steady_metrics`.

    It holds when the interval of the relative difference ``(L - lambda_eff W) / L`` comes
    within :data:`LITTLE_TOLERANCE` of zero (with one replication, its value must).
    """
    ls = [float(m["L"]) for m in metrics]
    products = [float(m["departure_rate"]) * _nan(m["sojourn_mean"]) for m in metrics]
    differences = [a - b for a, b in zip(ls, products, strict=True)]
    relative = [
        d / a if a > 0 else (0.0 if d == 0 else math.nan)
        for d, a in zip(differences, ls, strict=True)
    ]
    rel = interval(relative)
    if math.isnan(rel.mean):
        holds = False
    elif math.isnan(rel.half_width):
        holds = abs(rel.mean) <= LITTLE_TOLERANCE
    else:
        holds = rel.low <= LITTLE_TOLERANCE and rel.high >= -LITTLE_TOLERANCE
    return LittleCheck(
        L=interval(ls),
        lambda_w=interval(products),
        difference=interval(differences),
        relative=rel,
        holds=holds,
    )


def _nan(value: Any) -> float:
    return math.nan if value is None else float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stationarity:
    """The trend of the number in the system across the window's batches, averaged over the
    replications: the slope per batch, its t statistic, the fitted rise over the window as a
    share of the mean, and the verdict."""

    slope: float
    t: float
    rise: float
    stationary: bool

    @property
    def warning(self) -> str | None:
        if self.stationary:
            return None
        return (
            "not stationary: arrivals exceed capacity (or the warm-up is too short): "
            f"the number in the system rises {self.rise:.0%} of its mean across the window"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "slope_per_batch": _finite(self.slope),
            "t": _finite(self.t),
            "rise": _finite(self.rise),
            "stationary": self.stationary,
            "warning": self.warning,
        }


def _finite(value: float) -> float | None:
    return None if math.isnan(value) or math.isinf(value) else value


def stationarity(metrics: Sequence[dict[str, Any]]) -> Stationarity:
    """Whether the replications' window trends upward: a one-sided t test on the slope of the
    batch means averaged over replications, at :data:`TREND_QUANTILE`, with a fitted rise over
    the window of at least :data:`TREND_RISE` of the mean."""
    series = [m["batches"] for m in metrics if m["batches"]]
    if not series:
        return Stationarity(slope=math.nan, t=math.nan, rise=math.nan, stationary=True)
    count = len(series[0])
    averaged = [math.fsum(s[i] for s in series) / len(series) for i in range(count)]
    fitted = trend(averaged)
    mean = math.fsum(averaged) / count
    rise = fitted.slope * (count - 1) / mean if mean > 0 else 0.0
    significant = fitted.t > t_quantile(TREND_QUANTILE, count - 2)
    return Stationarity(
        slope=fitted.slope,
        t=fitted.t,
        rise=rise,
        stationary=not (significant and rise > TREND_RISE),
    )
