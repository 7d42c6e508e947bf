"""Pictures of lab runs, drawn with matplotlib's Agg backend (no display needed).

Each function takes a scenario's results and a path, writes one PNG and returns the path.
matplotlib is imported only here, and only when a plot is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidegate.lab.capacity import CapacityRow
    from tidegate.lab.gameday import ReleaseResult
    from tidegate.lab.load import LoadPoint, LoadSummary
    from tidegate.lab.report import Report
    from tidegate.lab.scaling import AutoscaleResult
    from tidegate.lab.stats import Interval
    from tidegate.lab.storm import StormResult
    from tidegate.lab.surge import SurgeResult

__all__ = [
    "plot_autoscale",
    "plot_backpressure",
    "plot_capacity",
    "plot_gameday",
    "plot_load",
    "plot_load_summary",
    "plot_storm",
    "plot_surge",
]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # A fixed creation date keeps the file identical from run to run.
    fig.savefig(target, dpi=110, metadata={"Software": None, "Creation Time": None})
    _pyplot().close(fig)
    return target


def _theory_line(ax: Any, points: Sequence[LoadPoint | LoadSummary], label: str) -> bool:
    """The theory's shed share against the offered rate, where it has one; whether it had."""
    if all(p.theory is None for p in points):
        return False
    ax.plot(
        [p.rate for p in points if p.theory],
        [100 * p.theory.shed_share for p in points if p.theory],
        "k--",
        label=label,
    )
    return True


def _saturation_axes(axes: Any) -> None:
    """The saturation curve's titles and axis labels; the legend of throughput and L."""
    axes[0].set(xlabel="offered rate (req/s)", ylabel="shed (%)", title="Shedding")
    axes[1].set(xlabel="offered rate (req/s)", ylabel="p95 latency (s)", title="p95 latency")
    axes[2].set(xlabel="offered rate (req/s)", title="Throughput and Little's law")
    axes[2].legend()


def plot_load(points: Sequence[LoadPoint], path: str | Path) -> Path:
    """Shed share, p95 and throughput against the offered rate; L beside lambda x W."""
    plt = _pyplot()
    rates = [p.rate for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].plot(rates, [100 * p.shed_share for p in points], "o-", label="simulated")
    if _theory_line(axes[0], points, "M/M/c/K"):
        axes[0].legend()
    axes[1].plot(rates, [p.report.total.latency.p95 for p in points], "o-", color="tab:red")
    axes[2].plot(rates, [p.report.throughput for p in points], "o-", label="throughput")
    axes[2].plot(rates, rates, ":", color="grey", label="offered")
    axes[2].plot(rates, [p.report.in_system_mean for p in points], "s", label="L (in system)")
    axes[2].plot(rates, [p.report.littles_product for p in points], "x", label="lambda x W")
    _saturation_axes(axes)
    fig.suptitle("Saturation curve")
    return _save(fig, path)


def plot_backpressure(reports: Mapping[str, Report], path: str | Path) -> Path:
    """Shed, expired, late and on-time requests per admission shape, stacked."""
    plt = _pyplot()
    names = list(reports)
    parts = {
        "on time": [reports[n].total.on_time for n in names],
        "late": [reports[n].total.late for n in names],
        "expired": [reports[n].total.expired for n in names],
        "shed": [reports[n].total.shed_total for n in names],
    }
    colours = {"on time": "tab:green", "late": "tab:orange", "expired": "tab:red", "shed": "grey"}
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0] * len(names)
    for label, values in parts.items():
        ax.bar(names, values, bottom=bottom, label=label, color=colours[label])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(ylabel="requests", title="The same overload, three admission shapes")
    ax.legend()
    return _save(fig, path)


def plot_storm(results: Sequence[StormResult], capacity: int, path: str | Path) -> Path:
    """Calls per second reaching the provider, per strategy, against its capacity."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    for result in results:
        ax.plot(range(len(result.calls_per_second)), result.calls_per_second, label=result.strategy)
    ax.axhline(capacity, color="black", linestyle="--", label="capacity")
    ax.set(xlabel="second", ylabel="calls per second", title="Calls reaching the provider")
    ax.legend()
    return _save(fig, path)


def plot_surge(results: Sequence[SurgeResult], path: str | Path) -> Path:
    """Backlog over the window (log scale) and goodput per rung."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for result in results:
        times = [t for t, _ in result.backlog_trace]
        counts = [max(c, 0.5) for _, c in result.backlog_trace]
        axes[0].plot(times, counts, label=result.rung)
    axes[0].set_yscale("log")
    axes[0].set(xlabel="seconds into the surge", ylabel="requests in the system", title="Backlog")
    axes[0].legend(fontsize=8)
    names = [r.rung.replace("_", "\n") for r in results]
    axes[1].bar(names, [r.served for r in results], color="lightgrey", label="served")
    axes[1].bar(names, [r.goodput for r in results], color="tab:green", label="goodput")
    axes[1].bar(names, [r.critical_goodput for r in results], color="tab:blue", label="critical")
    axes[1].tick_params(axis="x", labelsize=7)
    axes[1].set(ylabel="requests", title="Served vs answered in time")
    axes[1].legend()
    first = results[0] if results else None
    if first is not None:
        fig.suptitle(
            f"Overload ladder at {first.multiplier:g}x, critical share {first.critical_share:g}"
        )
    return _save(fig, path)


def plot_gameday(results: Sequence[ReleaseResult], path: str | Path) -> Path:
    """Requests exposed to the candidate and failed, per strategy with the gate off and on."""
    plt = _pyplot()
    labels = [f"{r.strategy}\ngate {'on' if r.gated else 'off'}" for r in results]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(labels, [r.exposed for r in results], color="tab:orange", label="exposed")
    ax.bar(labels, [r.failed for r in results], color="tab:red", label="failed")
    for index, result in enumerate(results):
        if result.rolled_back_at is not None:
            ax.annotate(
                f"back at {result.rolled_back_at / 60:.0f} min",
                (index, result.exposed),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set(ylabel="requests on the candidate", title="Release game day")
    ax.legend()
    return _save(fig, path)


def plot_autoscale(results: Sequence[AutoscaleResult], path: str | Path) -> Path:
    """Serving and ordered replicas over time, per law, with the measured arrival rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 3.2 * len(results)), sharex=True)
    if len(results) == 1:
        axes = [axes]
    for ax, result in zip(axes, results, strict=True):
        times = [s.at for s in result.trace]
        ax.step(times, [s.serving for s in result.trace], where="post", label="serving")
        ax.step(
            times,
            [s.serving + s.pending for s in result.trace],
            where="post",
            linestyle="--",
            label="serving + pending",
        )
        ax.set(ylabel="replicas", title=f"{result.law} law")
        twin = ax.twinx()
        twin.plot(times, [s.arrival_rate for s in result.trace], color="grey", alpha=0.4)
        twin.set_ylabel("arrivals per second")
        ax.legend(loc="upper left")
    axes[-1].set_xlabel("seconds")
    return _save(fig, path)


def plot_capacity(rows: Sequence[CapacityRow], path: str | Path) -> Path:
    """The slot limit and the core limit of each fleet shape; the lower one is the ceiling."""
    plt = _pyplot()
    labels = [f"{r.workers}w x {r.slots} slots" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r.slot_limit for r in rows], width=0.4, label="slot limit")
    ax.bar(
        [i + 0.2 for i in x],
        [0.0 if math.isinf(r.core_limit) else r.core_limit for r in rows],
        width=0.4,
        label="core limit",
    )
    ax.set_xticks(list(x), labels)
    ax.set(ylabel="requests per second", title="Ceiling: the smaller of the two limits")
    ax.legend()
    return _save(fig, path)


def plot_load_summary(points: Sequence[LoadSummary], path: str | Path) -> Path:
    """The replicated saturation curve: shed share, p95 and throughput against the offered
    rate with 95% error bars, and L beside lambda_eff x W with theirs."""
    plt = _pyplot()
    rates = [p.rate for p in points]

    def bars(axes: Any, key: str, scale: float = 1.0, **style: Any) -> None:
        means = [scale * _mean(p.figures[key]) for p in points]
        errors = [scale * _half(p.figures[key]) for p in points]
        axes.errorbar(rates, means, yerr=errors, capsize=3, **style)

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    bars(axes[0], "shed_share", 100.0, fmt="o-", label="simulated (95% CI)")
    _theory_line(axes[0], points, "theory")
    axes[0].legend()
    bars(axes[1], "p95", fmt="o-", color="tab:red")
    bars(axes[2], "throughput", fmt="o-", label="throughput")
    axes[2].plot(rates, rates, ":", color="grey", label="offered")
    for side, fmt, label in (("L", "s", "L (in system)"), ("lambda_w", "x", "lambda_eff x W")):
        sides = [getattr(p.little, side) for p in points]
        axes[2].errorbar(
            rates,
            [s.mean for s in sides],
            yerr=[_half(s) for s in sides],
            fmt=fmt,
            capsize=3,
            label=label,
        )
    _saturation_axes(axes)
    fig.suptitle(f"Saturation curve ({points[0].little.L.n} replications, 95% CI)")
    return _save(fig, path)


def _mean(value: Interval) -> float:
    return value.mean


def _half(value: Interval) -> float:
    return 0.0 if math.isnan(value.half_width) else value.half_width
