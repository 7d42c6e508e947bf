"""``tidegate lab``: the lab's scenarios on the command line.

Every sub-command prints a table, takes ``--json`` to print plain data instead, and ``--plot
FILE.png`` where a picture helps. Sweeps show a progress bar on standard error. Every run is in
virtual time with a seed, so the same command prints the same output.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from tidegate.lab import capacity as capacity_module
from tidegate.lab import gameday as gameday_module
from tidegate.lab import load as load_module
from tidegate.lab import recovery as recovery_module
from tidegate.lab import replay as replay_module
from tidegate.lab import scaling as scaling_module
from tidegate.lab import storm as storm_module
from tidegate.lab import surge as surge_module
from tidegate.lab.engine import DISPATCH_RULES, Fleet
from tidegate.lab.replicate import plain, replication_seed
from tidegate.lab.stats import Interval
from tidegate.lab.workload import Deterministic, Exponential, load_trace, parse_distribution
from tidegate.policy.admission import AdmissionOptions

__all__ = ["lab_app"]

T = TypeVar("T")

lab_app = typer.Typer(
    name="lab",
    help="Run tidegate's policies against simulated traffic in virtual time.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
PlotOption = Annotated[
    Path | None, typer.Option("--plot", help="Write a PNG plot to this file.", dir_okay=False)
]
SeedOption = Annotated[int, typer.Option(help="Seed: the same seed prints the same output.")]

ReplicationsOption = Annotated[
    int, typer.Option(min=1, help="Independent replications; figures are their mean and 95% CI.")
]
JobsOption = Annotated[
    int | None,
    typer.Option(
        min=1, help="Processes running replications (default: every core).", show_default=False
    ),
]
DispatchOption = Annotated[
    str,
    typer.Option(help="How requests reach workers: round_robin or shortest_queue."),
]


def _positive(value: float | None) -> float | None:
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise typer.BadParameter(f"must be a finite number > 0, got {value!r}")
    return value


def _positive_list(values: list[float] | None) -> list[float] | None:
    for value in values or []:
        _positive(value)
    return values


def _dispatch(text: str) -> Any:
    if text not in DISPATCH_RULES:
        raise _fail(f"--dispatch: use one of {', '.join(DISPATCH_RULES)}, got {text!r}")
    return text


def _jobs(jobs: int | None) -> int:
    return jobs if jobs is not None else (os.cpu_count() or 1)


def _iv(value: Any, digits: int = 0, scale: float = 1.0) -> str:
    """A figure over the replications: ``mean ± half-width`` (``-`` when unmeasured)."""
    if isinstance(value, Interval):
        return value.format(digits, scale)
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return _fmt(float(value) * scale, digits)
    return str(value)


def _agreed(value: Any) -> str:
    """A label over the replications: itself when they agree, else each label's count."""
    if not isinstance(value, list):
        return str(value)
    counts: dict[str, int] = {}
    for one in value:
        counts[str(one)] = counts.get(str(one), 0) + 1
    return ", ".join(f"{label} {n}/{len(value)}" for label, n in sorted(counts.items()))


def _console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 140  # piped or captured: do not squeeze tables into 80 columns
    return console


def _emit_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False, allow_nan=False))


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"


def _numeric(cell: str) -> bool:
    return cell == "" or cell == "-" or cell[:1].isdigit() or cell[:2].lstrip("+-.")[:1].isdigit()


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    # The title is a caption above the table, not wrapped to the table's width.
    table = Table(title=title, title_justify="left", title_style="bold", min_width=len(title))
    for index, column in enumerate(columns):
        numbers = index > 0 and all(_numeric(row[index]) for row in rows)
        table.add_column(column, justify="right" if numbers else "left")
    for row in rows:
        table.add_row(*row)
    return table


@contextmanager
def _progress(total: int, label: str, enabled: bool) -> Iterator[Callable[[], None]]:
    """A progress bar on standard error; yields the function that advances it."""
    if not enabled or total <= 1:
        yield lambda: None
        return
    progress = Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        task = progress.add_task(label, total=total)
        yield lambda: progress.advance(task)


def _replicated(
    run: Callable[..., T],
    *args: Any,
    seed: int,
    replications: int,
    jobs: int | None,
    bar: bool,
    **options: Any,
) -> T:
    """``run(*args, **options)`` over ``replications`` seeded from ``seed`` on ``jobs``
    processes (one a core when None), with a progress bar when ``bar``."""
    with _progress(replications, "replications", bar) as tick:
        return run(
            *args, seed=seed, replications=replications, jobs=_jobs(jobs), progress=tick, **options
        )


def _fail(message: str) -> typer.Exit:
    typer.echo(f"tidegate lab: {message}", err=True)
    return typer.Exit(2)


def _distribution(text: str, option: str) -> Any:
    try:
        return parse_distribution(text)
    except ValueError as exc:
        raise _fail(f"{option}: {exc}") from None


def _wrote(path: Path | None) -> None:
    if path is not None:
        typer.echo(f"plot written to {path}", err=True)


# --------------------------------------------------------------------------- capacity


@lab_app.command()
def capacity(
    shape: Annotated[
        list[str] | None,
        typer.Option(help="A fleet shape WORKERSxSLOTS; repeat for several.", show_default=False),
    ] = None,
    cpu: Annotated[float, typer.Option(help="Seconds of CPU per request.")] = 0.015,
    io: Annotated[float, typer.Option(help="Seconds waiting for the model per request.")] = 0.8,
    cores: Annotated[int, typer.Option(help="Cores per worker.")] = 1,
    check: Annotated[bool, typer.Option(help="Also simulate each shape saturated.")] = False,
    replications: ReplicationsOption = 10,
    jobs: JobsOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
    plot: PlotOption = None,
) -> None:
    """The ceiling of each fleet shape: the smaller of slots / (cpu + io) and cores / cpu.
    With --check, the throughput simulated saturated, a mean over replications with its 95%
    interval."""
    shapes = []
    for text in shape or ["1x8", "1x64", "4x64"]:
        workers, _, slots = text.lower().partition("x")
        try:
            shapes.append((int(workers), int(slots)))
        except ValueError:
            raise _fail(f"--shape {text!r}: use WORKERSxSLOTS, for example 4x64") from None
    try:
        rows = capacity_module.capacity_table(shapes, cpu=cpu, io=io, cores=cores)
        simulated: list[Interval] = []
        if check:
            simulated = _replicated(
                capacity_module.check_shapes,
                shapes,
                cpu=cpu,
                io=io,
                cores=cores,
                seed=seed,
                replications=replications,
                jobs=jobs,
                bar=not json_output,
            )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if plot is not None:
        from tidegate.lab.plot import plot_capacity

        plot_capacity(rows, plot)
    if json_output:
        shaped = []
        for index, r in enumerate(rows):
            data = r.as_dict()
            data["simulated"] = simulated[index].as_dict() if check else None
            shaped.append(data)
        _emit_json(
            {
                "cpu": cpu,
                "io": io,
                "cores": cores,
                "replications": replications if check else None,
                "seed": seed,
                "shapes": shaped,
            }
        )
        return
    columns = ["fleet", "slot limit", "core limit", "ceiling req/s", "binds"]
    if check:
        columns.append("simulated")
    table_rows = []
    for index, r in enumerate(rows):
        row = [
            f"{r.workers} worker{'s' if r.workers > 1 else ''} x {r.slots} slots",
            _fmt(r.slot_limit, 1),
            _fmt(r.core_limit, 1),
            _fmt(r.ceiling, 1),
            r.binding,
        ]
        if check:
            row.append(simulated[index].format(1))
        table_rows.append(row)
    title = f"Ceiling at cpu {cpu:g} s, io {io:g} s, {cores} core(s) per worker"
    if check:
        title += f"; simulated: {replications} replications, 95% CI"
    _console().print(_table(title, columns, table_rows))
    _wrote(plot)


# --------------------------------------------------------------------------- load


def _fleet(
    *, workers: int, slots: int, waiting: int, cpu: float, io: str, dispatch: str = "round_robin"
) -> Fleet:
    return Fleet(
        admission=AdmissionOptions(
            classes=("standard",),
            slots=slots,
            queue_cap=None if waiting < 0 else waiting,
            mode="queue_cap",
            dequeue="fifo",
            drop_expired_at_dequeue=False,
        ),
        cpu=Deterministic(value=cpu) if cpu > 0 else None,
        io=_distribution(io, "--io"),
        workers=workers,
        dispatch=_dispatch(dispatch),
    )


@lab_app.command()
def load(
    rate: Annotated[
        list[float] | None,
        typer.Option(help="Offered rate (req/s); repeat for a sweep.", callback=_positive_list),
    ] = None,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes.")] = 1,
    slots: Annotated[int, typer.Option(min=1, help="In-flight slots per worker.")] = 8,
    waiting: Annotated[
        int, typer.Option(min=-1, help="Waiting places per worker; -1 is unbounded.")
    ] = 8,
    cpu: Annotated[float, typer.Option(min=0.0, help="Seconds of CPU per request.")] = 0.015,
    io: Annotated[
        str, typer.Option(help="Model-call time: exp:MEAN, det:S, lognormal:MEAN,SCV.")
    ] = "exp:0.8",
    dispatch: DispatchOption = "round_robin",
    horizon: Annotated[
        float, typer.Option(help="Seconds simulated per replication.", callback=_positive)
    ] = 600.0,
    warmup: Annotated[
        float | None,
        typer.Option(min=0.0, help="Seconds discarded at the start (default: MSER-5 chooses)."),
    ] = None,
    theory: Annotated[
        bool,
        typer.Option(help="Show the model matching --dispatch beside (needs --cpu 0, exp io)."),
    ] = False,
    replications: ReplicationsOption = 10,
    jobs: JobsOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
    plot: PlotOption = None,
) -> None:
    """A sweep of offered rates: shed %, p95, throughput, utilisation, and Little's law (L
    against lambda_eff x W from the departures), each a mean with its 95% interval."""
    rates = rate or [4.0, 8.0, 10.0, 14.0]
    if warmup is not None and warmup >= horizon:
        raise _fail(f"--warmup must be below --horizon ({horizon:g}), got {warmup:g}")
    try:
        fleet = _fleet(
            workers=workers, slots=slots, waiting=waiting, cpu=cpu, io=io, dispatch=dispatch
        )
        points = []
        with _progress(len(rates) * replications, "replications", not json_output) as tick:
            for one in rates:
                points.append(
                    load_module.load_summary(
                        one,
                        fleet,
                        horizon=horizon,
                        warmup=warmup,
                        seed=seed,
                        replications=replications,
                        jobs=_jobs(jobs),
                        with_theory=theory,
                        progress=tick,
                    )
                )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if plot is not None:
        from tidegate.lab.plot import plot_load_summary

        plot_load_summary(points, plot)
    if json_output:
        _emit_json(
            {
                "fleet": {
                    "workers": workers,
                    "slots": slots,
                    "waiting": waiting,
                    "cpu": cpu,
                    "io": io,
                    "dispatch": dispatch,
                },
                "ceiling": fleet.ceiling,
                "replications": replications,
                "seed": seed,
                "points": [p.as_dict() for p in points],
            }
        )
        return
    model = _model_name(dispatch) if workers > 1 else "M/M/c/K"
    columns = ["rate", "warm-up s", "shed %", "p95 s", "done/s", "slots used", "L", "lambda_eff*W"]
    if theory:
        columns += ["shed % (theory)", "L (theory)"]
    rows = []
    warnings = []
    for p in points:
        f = p.figures
        row = [
            _fmt(p.rate, 1),
            _fmt(p.warmup, 0),
            f["shed_share"].format(1, 100),
            f["p95"].format(2),
            f["throughput"].format(2),
            f["utilisation"].format(2),
            p.little.L.format(2),
            p.little.lambda_w.format(2) + ("" if p.little.holds else " (!)"),
        ]
        if theory:
            row += (
                [_fmt(100 * p.theory.shed_share, 1), _fmt(p.theory.in_system)]
                if p.theory is not None
                else ["n/a", "n/a"]
            )
        rows.append(row)
        if p.steady.warning is not None:
            warnings.append(f"rate {p.rate:g}: {p.steady.warning}")
        if not p.little.holds:
            warnings.append(
                f"rate {p.rate:g}: Little's law fails: L - lambda_eff W = "
                f"{p.little.difference.format(2)} ({p.little.relative.format(1, 100)}% of L)"
            )
    title = (
        f"{workers} worker(s) x {slots} slots, {waiting if waiting >= 0 else 'unbounded'} waiting, "
        f"cpu {cpu:g} s, io {io}, {dispatch}: ceiling {fleet.ceiling:.1f} req/s; "
        f"{replications} replications, 95% CI" + (f"; theory {model}" if theory else "")
    )
    _console().print(_table(title, columns, rows))
    for warning in warnings:
        typer.echo(f"warning: {warning}", err=True)
    _wrote(plot)


@lab_app.command()
def backpressure(
    rate: Annotated[
        float,
        typer.Option(help="Offered rate (req/s), above the ceiling.", callback=_positive),
    ] = 14.0,
    slots: Annotated[int, typer.Option(min=1, help="In-flight slots.")] = 8,
    waiting: Annotated[int, typer.Option(min=0, help="Places in the bounded waiting room.")] = 8,
    deadline: Annotated[
        float,
        typer.Option(help="Seconds each caller waits for its answer.", callback=_positive),
    ] = 3.0,
    cpu: Annotated[float, typer.Option(min=0.0, help="Seconds of CPU per request.")] = 0.015,
    io: Annotated[str, typer.Option(help="Model-call time distribution.")] = "exp:0.8",
    horizon: Annotated[
        float, typer.Option(help="Seconds simulated per replication.", callback=_positive)
    ] = 120.0,
    replications: ReplicationsOption = 10,
    jobs: JobsOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
    plot: PlotOption = None,
) -> None:
    """The same overload against no waiting room, a bounded one, and an unbounded queue; each
    figure a mean over replications with its 95% interval."""
    settings: dict[str, Any] = {
        "slots": slots,
        "waiting_room": waiting,
        "deadline": deadline,
        "io": _distribution(io, "--io"),
        "cpu": Deterministic(value=cpu) if cpu > 0 else None,
        "horizon": horizon,
    }
    try:
        summary = _replicated(
            load_module.backpressure_summary,
            rate,
            seed=seed,
            replications=replications,
            jobs=jobs,
            bar=not json_output,
            **settings,
        )
        reports = (
            load_module.backpressure(rate, seed=replication_seed(seed, 0), **settings)
            if plot is not None
            else None
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if reports is not None and plot is not None:
        from tidegate.lab.plot import plot_backpressure

        plot_backpressure(reports, plot)
    if json_output:
        _emit_json({"replications": replications, "seed": seed, "shapes": plain(summary)})
        return
    rows = [
        [
            name,
            _iv(f["shed"]),
            _iv(f["expired"]),
            _iv(f["late"]),
            _iv(f["on_time"]),
            _iv(f["in_system"]),
            _iv(f["p95"], 2),
        ]
        for name, f in summary.items()
    ]
    _console().print(
        _table(
            f"{rate:g} req/s for {horizon:g} s against {slots} slots, deadline {deadline:g} s; "
            f"{replications} replications, 95% CI",
            ["shape", "shed", "expired", "late", "on time", "still inside", "p95 s"],
            rows,
        )
    )
    _wrote(plot)


# --------------------------------------------------------------------------- storm


@lab_app.command()
def storm(
    rate: Annotated[float, typer.Option(help="New requests per second.")] = 12.0,
    capacity: Annotated[int, typer.Option(help="Calls per second the provider accepts.")] = 20,
    outage_start: Annotated[float, typer.Option(help="Second the outage begins.")] = 30.0,
    outage_length: Annotated[float, typer.Option(help="Seconds the outage lasts.")] = 30.0,
    duration: Annotated[float, typer.Option(help="Seconds of new requests.")] = 120.0,
    deadline: Annotated[float, typer.Option(help="Seconds each caller waits.")] = 10.0,
    attempts: Annotated[int, typer.Option(help="Tries per request, the first included.")] = 4,
    budget_ratio: Annotated[float, typer.Option(help="Retry budget: share of first tries.")] = 0.1,
    replications: ReplicationsOption = 10,
    jobs: JobsOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
    plot: PlotOption = None,
) -> None:
    """A provider outage under naive retries, backoff with jitter, a retry budget, a breaker;
    each figure a mean over replications with its 95% interval."""
    try:
        options = storm_module.StormOptions(
            rate=rate,
            capacity=capacity,
            outage_start=outage_start,
            outage_length=outage_length,
            duration=duration,
            deadline=deadline,
            attempts=attempts,
            budget_ratio=budget_ratio,
        )
        summary = _replicated(
            storm_module.storm_summary,
            options,
            seed=seed,
            replications=replications,
            jobs=jobs,
            bar=not json_output,
        )
        results = (
            storm_module.run_storms(options, seed=replication_seed(seed, 0))
            if plot is not None
            else None
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if results is not None and plot is not None:
        from tidegate.lab.plot import plot_storm

        plot_storm(results, capacity, plot)
    if json_output:
        _emit_json(
            {
                "replications": replications,
                "seed": seed,
                "strategies": [
                    {"strategy": name, **plain(figures)} for name, figures in summary.items()
                ],
            }
        )
        return
    labels = {
        "naive": "retry at once",
        "backoff": "backoff + full jitter",
        "budget": "+ 10% retry budget" if budget_ratio == 0.1 else f"+ {budget_ratio:.0%} budget",
        "breaker": "+ budget + breaker",
    }
    rows = [
        [
            labels[name],
            _iv(f["calls"]),
            _iv(f["peak"]),
            _iv(f["served"]),
            _iv(f["gave_up"]),
            _iv(f["seconds_over_capacity"], 1),
            _iv(f["short_circuited"]),
        ]
        for name, f in summary.items()
    ]
    _console().print(
        _table(
            f"{rate:g} new req/s, provider capacity {capacity}/s, outage {outage_start:g}-"
            f"{outage_start + outage_length:g} s; {replications} replications, 95% CI",
            [
                "strategy",
                "calls",
                "peak/s",
                "served",
                "gave up",
                "s over capacity",
                "short-circuited",
            ],
            rows,
        )
    )
    _wrote(plot)


# --------------------------------------------------------------------------- surge


@lab_app.command()
def surge(
    multiplier: Annotated[
        list[float] | None,
        typer.Option(help="Arrival rate over capacity; repeat to sweep.", callback=_positive_list),
    ] = None,
    critical_share: Annotated[
        list[float] | None, typer.Option(help="Share of critical requests; repeat to sweep.")
    ] = None,
    slots: Annotated[int, typer.Option(min=1, help="In-flight slots of the fleet.")] = 20,
    service: Annotated[str, typer.Option(help="Service time distribution.")] = "det:1",
    deadline: Annotated[
        float, typer.Option(help="Seconds an answer stays useful.", callback=_positive)
    ] = 30.0,
    duration: Annotated[
        float, typer.Option(help="Seconds until capacity arrives.", callback=_positive)
    ] = 900.0,
    queue_cap: Annotated[
        int | None,
        typer.Option(
            min=0, help="bounded_queue's cap on the whole queue (default: one deadline of service)."
        ),
    ] = None,
    threshold: Annotated[float, typer.Option(help="conditional_priority's load factor.")] = 2.0,
    dequeue_margin: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="deadline_at_dequeue: drop this early (0: the controller's literal check).",
        ),
    ] = 0.0,
    rung: Annotated[list[str] | None, typer.Option(help="Only these rungs; repeatable.")] = None,
    replications: ReplicationsOption = 10,
    jobs: JobsOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
    plot: PlotOption = None,
) -> None:
    """The overload ladder: served, goodput, critical share, shed, backlog, time to rejection;
    each a mean over replications with its 95% interval."""
    multipliers = multiplier or [10.0]
    shares = critical_share or [0.1]
    rungs = tuple(rung) if rung else surge_module.RUNGS
    try:
        options = surge_module.SurgeOptions(
            slots=slots,
            service=_distribution(service, "--service"),
            deadline=deadline,
            duration=duration,
            queue_cap=queue_cap,
            conditional_threshold=threshold,
            dequeue_margin=dequeue_margin,
            multiplier=multipliers[0],
            critical_share=shares[0],
        )
        points = _replicated(
            surge_module.surge_summary,
            options,
            multipliers=multipliers,
            critical_shares=shares,
            seed=seed,
            replications=replications,
            jobs=jobs,
            rungs=rungs,
            bar=not json_output,
        )
        first = (
            surge_module.run_surge(options, seed=replication_seed(seed, 0), rungs=rungs)
            if plot is not None
            else None
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if first is not None and plot is not None:
        from tidegate.lab.plot import plot_surge

        plot_surge(first, plot)
    if json_output:
        _emit_json(
            {
                "capacity": options.capacity,
                "deadline": deadline,
                "duration": duration,
                "bounded_cap": options.bounded_cap,
                "replications": replications,
                "seed": seed,
                "points": [
                    {
                        "multiplier": p["multiplier"],
                        "critical_share": p["critical_share"],
                        "rungs": [plain(r) for r in p["rungs"].values()],
                    }
                    for p in points
                ],
            }
        )
        return
    console = _console()
    for p in points:
        rows = [
            [
                name,
                _iv(r["served"]),
                _iv(r["goodput"]),
                _iv(r["critical_goodput_share"], 2),
                _iv(r["shed"]),
                _iv(r["expired"]),
                _iv(r["backlog"]),
                _iv(r["rejection_time_mean"], 1),
            ]
            for name, r in p["rungs"].items()
        ]
        console.print(
            _table(
                f"{p['multiplier']:g}x capacity ({options.capacity:g} req/s), critical share "
                f"{p['critical_share']:g}, deadline {deadline:g} s, {duration:g} s until capacity "
                f"arrives; {replications} replications, 95% CI",
                [
                    "rung",
                    "served",
                    "goodput",
                    "critical share",
                    "shed",
                    "expired",
                    "backlog",
                    "time to no s",
                ],
                rows,
            )
        )
    _wrote(plot)


# --------------------------------------------------------------------------- gameday


@lab_app.command()
def gameday(
    scenario: Annotated[
        Path | None,
        typer.Option(help="Release scenario (JSON); default: the built-in one.", dir_okay=False),
    ] = None,
    steps: Annotated[
        bool, typer.Option(help="Print the first replication's gated steps with their reasons.")
    ] = True,
    replications: ReplicationsOption = 10,
    jobs: JobsOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
    plot: PlotOption = None,
) -> None:
    """A release with a defect that grows with traffic, under rolling, canary and blue-green;
    each figure a mean over replications with its 95% interval."""
    try:
        loaded = gameday_module.load_scenario(scenario)
        summary, first = _replicated(
            gameday_module.gameday_summary,
            loaded,
            seed=seed,
            replications=replications,
            jobs=jobs,
            bar=not json_output,
        )
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from None
    if plot is not None:
        from tidegate.lab.plot import plot_gameday

        plot_gameday(gameday_module.run_gameday(loaded, seed=replication_seed(seed, 0)), plot)
    if json_output:
        _emit_json(
            {
                "replications": replications,
                "seed": seed,
                "releases": plain(summary),
                "first_replication": first,
            }
        )
        return
    rows = [
        [
            r["strategy"],
            "on" if r["gated"] else "off",
            _agreed(r["outcome"]),
            _iv(r["exposed"]),
            _iv(r["failed"]),
            _iv(r["rolled_back_at"], 1, 1 / 60),
        ]
        for r in summary
    ]
    console = _console()
    console.print(
        _table(
            f"Candidate error rate {loaded.candidate.error_rate:.0%} + "
            f"{loaded.candidate.defect_slope:g} x its share; baseline "
            f"{loaded.baseline.error_rate:.0%}; {loaded.rate:g} req/s; "
            f"{replications} replications, 95% CI",
            ["strategy", "gate", "outcome", "on candidate", "failed", "rolled back, min"],
            rows,
        )
    )
    if steps:
        for r in first:
            if not r["gated"]:
                continue
            step_rows = [
                [
                    f"{s['at'] / 60:.0f} min",
                    f"{s['share']:.0%}",
                    f"{s['canary_errors']}/{s['canary_requests']}",
                    f"{s['baseline_errors']}/{s['baseline_requests']}",
                    s["action"],
                    s["reasons"][0] if s["action"] != "proceed" else "all checks passed",
                ]
                for s in r["steps"]
            ]
            console.print(
                _table(
                    f"{r['strategy']}, gate on, first replication: step by step",
                    ["at", "share", "candidate errors", "baseline errors", "decision", "reason"],
                    step_rows,
                )
            )
    _wrote(plot)


# --------------------------------------------------------------------------- autoscale


@lab_app.command()
def autoscale(
    base_rate: Annotated[float, typer.Option(help="Arrivals per second before and after.")] = 20.0,
    surge_rate: Annotated[float, typer.Option(help="Arrivals per second during the surge.")] = 60.0,
    surge_start: Annotated[float, typer.Option(help="Second the surge begins.")] = 300.0,
    surge_end: Annotated[float, typer.Option(help="Second the surge ends.")] = 1800.0,
    duration: Annotated[float, typer.Option(help="Seconds simulated.")] = 2700.0,
    slots: Annotated[int, typer.Option(help="Slots per replica (service 1 s each).")] = 4,
    lead_time: Annotated[float, typer.Option(help="Seconds from order to serving.")] = 180.0,
    interval: Annotated[float, typer.Option(help="Seconds between decisions.")] = 15.0,
    deadline: Annotated[float, typer.Option(help="Seconds each request may take.")] = 20.0,
    replications: ReplicationsOption = 10,
    jobs: JobsOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
    plot: PlotOption = None,
) -> None:
    """Proportional vs damped law under a lead time and a surge; each figure a mean over
    replications with its 95% interval."""
    try:
        options = scaling_module.AutoscaleOptions(
            base_rate=base_rate,
            surge_rate=surge_rate,
            surge_start=surge_start,
            surge_end=surge_end,
            duration=duration,
            slots=slots,
            lead_time=lead_time,
            interval=interval,
            deadline=deadline,
        )
        summary = _replicated(
            scaling_module.autoscale_summary,
            options,
            seed=seed,
            replications=replications,
            jobs=jobs,
            bar=not json_output,
        )
        results = (
            [
                scaling_module.run_autoscale(law, options, seed=replication_seed(seed, 0))
                for law in scaling_module.LAWS
            ]
            if plot is not None
            else None
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if results is not None and plot is not None:
        from tidegate.lab.plot import plot_autoscale

        plot_autoscale(results, plot)
    if json_output:
        _emit_json({"replications": replications, "seed": seed, "laws": plain(summary)})
        return
    rows = [
        [
            r["law"],
            _iv(r["peak_replicas"], 1),
            _iv(r["direction_changes"], 1),
            _iv(r["cold_starts"]),
            _iv(r["goodput_share"], 1, 100),
            _iv(r["replica_seconds"], 1, 1 / 3600),
        ]
        for r in summary
    ]
    _console().print(
        _table(
            f"{base_rate:g} -> {surge_rate:g} req/s from {surge_start:g} s to {surge_end:g} s, "
            f"lead time {lead_time:g} s, start at {options.initial_replicas} replicas; "
            f"{replications} replications, 95% CI",
            [
                "law",
                "peak replicas",
                "direction changes",
                "cold starts",
                "goodput %",
                "replica-hours",
            ],
            rows,
        )
    )
    _wrote(plot)


# --------------------------------------------------------------------------- plan


@contextmanager
def _sizing_progress(enabled: bool, replications: int) -> Iterator[Any]:
    """A progress bar over each fleet size's replications, relabelled per size."""
    if not enabled:
        yield None
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        task = progress.add_task("replications", total=replications)

        def on_size(workers: int, rate: float) -> Callable[[], None]:
            progress.reset(
                task, total=replications, description=f"{workers} workers at {rate:g} req/s"
            )
            return lambda: progress.advance(task)

        yield on_size


@lab_app.command()
def plan(
    peak: Annotated[
        float, typer.Option(help="Peak requests per second.", callback=_positive)
    ] = 40.0,
    spike: Annotated[
        float, typer.Option(min=1.0, help="Spike as a multiple of the peak (1: no spike check).")
    ] = 1.5,
    cpu: Annotated[float, typer.Option(min=0.0, help="Seconds of CPU per request.")] = 0.015,
    io: Annotated[
        float,
        typer.Option(help="Mean seconds waiting for the model (exponential).", callback=_positive),
    ] = 0.8,
    slots: Annotated[int, typer.Option(min=1, help="In-flight slots per worker.")] = 8,
    waiting: Annotated[
        int, typer.Option(min=-1, help="Waiting places per worker; -1 is unbounded.")
    ] = 0,
    deadline: Annotated[
        float | None,
        typer.Option(
            help="Seconds a caller waits before giving up (default: forever).", callback=_positive
        ),
    ] = None,
    shed_target: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Largest share refused or expired.")
    ] = 0.01,
    cores: Annotated[int, typer.Option(min=1, help="Cores per worker.")] = 1,
    target: Annotated[float, typer.Option(help="Target utilisation of each worker.")] = 0.6,
    spare: Annotated[int, typer.Option(min=0, help="Spare workers beyond the target.")] = 1,
    dispatch: DispatchOption = "round_robin",
    horizon: Annotated[
        float, typer.Option(help="Seconds simulated per replication.", callback=_positive)
    ] = 300.0,
    requests_per_month: Annotated[
        float, typer.Option(min=0.0, help="Requests per month.")
    ] = 20_000_000,
    tokens_per_request: Annotated[float, typer.Option(min=0.0, help="Tokens per request.")] = 1200,
    worker_hour: Annotated[
        float, typer.Option(min=0.0, help="Price of one worker for an hour.")
    ] = 0.05,
    price_per_1k_tokens: Annotated[
        float, typer.Option(min=0.0, help="Price of 1,000 tokens.")
    ] = 0.002,
    check: Annotated[
        bool, typer.Option(help="Size the fleet by simulation at the peak and the spike.")
    ] = True,
    theory: Annotated[
        bool, typer.Option(help="Show the size the model matching --dispatch gives.")
    ] = False,
    replications: ReplicationsOption = 10,
    jobs: JobsOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
) -> None:
    """Workers for a peak: the mean-value law, and the smallest fleets that simulation finds
    meeting a shed target at the peak and at a spike, with 95% intervals."""
    try:
        planned = capacity_module.plan_workers(
            peak, cpu=cpu, io=io, slots=slots, cores=cores, target_utilisation=target, spare=spare
        )
        spec = capacity_module.PlanSpec(
            slots=slots,
            waiting=None if waiting < 0 else waiting,
            cpu=Deterministic(value=cpu) if cpu > 0 else None,
            io=Exponential(mean=io),
            cores=cores,
            deadline=deadline,
            dispatch=_dispatch(dispatch),
            horizon=horizon,
        )
        sizings: dict[str, capacity_module.Sizing] = {}
        if check:
            rates = {"peak": peak} if spike == 1.0 else {"peak": peak, "spike": peak * spike}
            with _sizing_progress(not json_output, replications) as on_size:
                for name, rate in rates.items():
                    sizings[name] = capacity_module.size_fleet(
                        spec,
                        rate,
                        target=shed_target if shed_target > 0 else 1e-9,
                        seed=seed,
                        replications=replications,
                        jobs=_jobs(jobs),
                        on_size=on_size,
                    )
        fleet_size = max([planned.workers, *(s.chosen.workers for s in sizings.values())])
        cost = capacity_module.monthly_cost(
            fleet_size,
            requests_per_month=requests_per_month,
            tokens_per_request=tokens_per_request,
            worker_hour_price=worker_hour,
            price_per_1k_tokens=price_per_1k_tokens,
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if json_output:
        _emit_json(
            {
                "replications": replications,
                "seed": seed,
                "dispatch": dispatch,
                "waiting": waiting,
                "deadline": deadline,
                "plan": planned.as_dict(),
                "sizes": {name: s.as_dict() for name, s in sizings.items()},
                "workers": fleet_size,
                "monthly_cost": {
                    **cost.as_dict(),
                    "per_request": cost.per_request(requests_per_month),
                },
            }
        )
        return
    rows = [
        [
            "mean-value law",
            f"{planned.workers} ({planned.spare} spare, {planned.utilisation_at_peak:.0%} used at peak)",
        ],
        ["ceiling per worker", f"{planned.per_worker_ceiling:.1f} req/s"],
    ]
    warnings = []
    for name, sizing in sizings.items():
        chosen = sizing.chosen
        rows.append(
            [
                f"smallest fleet, {name} {sizing.rate:g} req/s",
                f"{chosen.workers}: shed {chosen.failed.format(2, 100)}%, p95 {chosen.p95.format(2)} s",
            ]
        )
        if sizing.below is not None:
            rows.append(
                [
                    f"  one fewer ({sizing.below.workers})",
                    f"shed {sizing.below.failed.format(2, 100)}%",
                ]
            )
        if theory:
            rows.append(
                [
                    f"  theory ({_model_name(dispatch)})",
                    "n/a" if sizing.theory_workers is None else str(sizing.theory_workers),
                ]
            )
        for sized in (chosen, sizing.below):
            if sized is not None and sized.steady.warning is not None:
                warnings.append(
                    f"{sized.workers} workers at {sized.rate:g} req/s: {sized.steady.warning}"
                )
    rows += [
        ["workers to run", str(fleet_size)],
        ["compute per month", f"{cost.compute:,.2f}"],
        ["tokens per month", f"{cost.tokens:,.2f}"],
        ["total per month", f"{cost.total:,.2f}"],
        ["per request", f"{cost.per_request(requests_per_month):.6f}"],
    ]
    room = "unbounded" if waiting < 0 else str(waiting)
    console = _console()
    console.print(
        _table(
            f"Plan for {peak:g} req/s (spike x{spike:g}), {slots} slots and {room} waiting per "
            f"worker, {dispatch}, shed < {shed_target:.1%}; {replications} replications, 95% CI",
            ["", "value"],
            rows,
        )
    )
    for warning in warnings:
        typer.echo(f"warning: {warning}", err=True)


def _model_name(dispatch: str) -> str:
    return "E_k/M/c/K per worker" if dispatch == "round_robin" else "M/M/c/K pooled"


# --------------------------------------------------------------------------- replay


def _sample(name: str) -> Path:
    return Path(str(resources.files("tidegate.lab").joinpath(f"data/{name}")))


@lab_app.command("replay")
def replay_command(
    log: Annotated[
        Path | None,
        typer.Option(
            help="Request log: the gateway's raw log (lines that are not requests are skipped "
            "and counted), JSONL or CSV; default: a generated sample.",
            dir_okay=False,
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="Candidate tidegate.yaml, read as the gateway reads it; default: a built-in "
            "sample.",
            dir_okay=False,
        ),
    ] = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
) -> None:
    """Replay a request log through a candidate config's admission, retry and breaker."""
    config_path = config or _sample("candidate.yaml")
    log_name = log.name if log is not None else "the built-in sample log"
    try:
        trace = load_trace(log) if log is not None else replay_module.sample_log(seed=seed)
        candidate = replay_module.load_replay_config(config_path)
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from None
    result = replay_module.replay_log(trace, candidate, seed=seed)
    if json_output:
        _emit_json(result.as_dict())
        return
    console = _console()
    groups = [g for g in replay_module.OUTCOMES if g in result.recorded or g in result.replayed]
    rows = [
        [
            group,
            str(result.recorded.get(group, 0)),
            str(result.replayed.get(group, 0)),
            f"{result.replayed.get(group, 0) - result.recorded.get(group, 0):+d}",
        ]
        for group in groups
    ]
    rows.append(["p95 of ok, s", _fmt(result.recorded_p95), _fmt(result.replayed_p95), ""])
    console.print(
        _table(
            f"{result.requests} requests from {log_name} through {config_path.name} "
            f"({result.calls} provider calls, {result.retries} retries, "
            f"{result.skipped} lines skipped)",
            ["outcome", "recorded", "replayed", "change"],
            rows,
        )
    )
    if result.changed:
        changed = sorted(result.changed.items(), key=lambda kv: (-kv[1], kv[0]))
        console.print(
            _table(
                "What would have changed",
                ["recorded", "replayed", "requests"],
                [[a, b, str(n)] for (a, b), n in changed],
            )
        )


# --------------------------------------------------------------------------- recovery


@lab_app.command()
def recovery(
    window_s: Annotated[
        float, typer.Option(help="Seconds the slow start ramps the recovered provider's share.")
    ] = 30.0,
    warmup_s: Annotated[
        float, typer.Option(help="Seconds the recovered provider takes to warm up.")
    ] = 30.0,
    rate: Annotated[float, typer.Option(help="Arrivals per second (Poisson).")] = 30.0,
    replications: ReplicationsOption = 10,
    jobs: JobsOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
) -> None:
    """A provider recovers cold under load: all its traffic back at once, or a slow start;
    each figure a mean over replications with its 95% interval."""
    try:
        options = recovery_module.RecoveryOptions(rate=rate, window_s=window_s, warmup_s=warmup_s)
        summary = _replicated(
            recovery_module.recovery_summary,
            options,
            seed=seed,
            replications=replications,
            jobs=jobs,
            bar=not json_output,
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if json_output:
        _emit_json(
            {
                "replications": replications,
                "seed": seed,
                "rate": rate,
                "window_s": window_s,
                "warmup_s": warmup_s,
                "window": [options.recover_at, options.window_end],
                "arms": [plain(figures) for figures in summary.values()],
            }
        )
        return
    labels = {"no_ramp": "no ramp", "slow_start": f"slow start {window_s:g}s"}
    rows = []
    for name, arm in summary.items():
        total = arm["window"]["total"]
        rows.append(
            [
                labels[name],
                _iv(total["offered"]),
                _iv(arm["primary_share"], 1, 100),
                _iv(total["goodput"]),
                _iv(total["timed_out"]),
                _iv(total["shed"]),
                _iv(total["p99"], 2),
            ]
        )
    _console().print(
        _table(
            f"{rate:g} req/s; primary {options.primary_capacity:g}/s back at "
            f"{options.recover_at:g} s at {options.cold_capacity_fraction:.0%}, warm at "
            f"{options.recover_at + warmup_s:g} s; arrivals {options.recover_at:g}-"
            f"{options.window_end:g} s; {replications} replications, 95% CI",
            ["arm", "offered", "on primary %", "goodput", "timed out", "shed", "p99 s"],
            rows,
        )
    )


# --------------------------------------------------------------------------- placement


@lab_app.command()
def placement(
    workers: Annotated[
        int, typer.Option(min=1, help="Gateway processes behind the round-robin dispatcher.")
    ] = 4,
    replications: ReplicationsOption = 10,
    jobs: JobsOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
) -> None:
    """Where state lives: one memory:// store per worker against one shared store, for a
    per-user rate limit, idempotent follow-ups and a response cache; each figure a mean over
    replications with its 95% interval, beside what uniform placement predicts."""
    # Imported here so that this command stays one block at the end of the module.
    from tidegate.lab import placement as placement_module

    try:
        options = placement_module.PlacementOptions(workers=workers)
        summary = _replicated(
            placement_module.placement_summary,
            options,
            seed=seed,
            replications=replications,
            jobs=jobs,
            bar=not json_output,
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    theory = placement_module.placement_theory(options)
    if json_output:
        _emit_json(
            {
                "replications": replications,
                "seed": seed,
                "workers": workers,
                "limit_per_user": options.limit,
                "placements": {name: plain(figures) for name, figures in summary.items()},
                "theory": theory,
            }
        )
        return
    own, one = summary["per_process"], summary["shared"]
    mine, ours = theory["per_process"], theory["shared"]
    limit = options.limit
    figures = [
        ("per-user limit x", "limit_ratio", 2, 1.0),
        (f"admitted per user (limit {limit:g})", "admitted_per_user", 1, 1.0),
        ("follow-ups with history %", "history_share", 1, 100.0),
        ("executions per idempotent key", "executions_per_key", 2, 1.0),
    ]
    rows = []
    for label, name, digits, scale in figures:
        key = "limit_ratio" if name == "admitted_per_user" else name
        factor = scale * (limit if name == "admitted_per_user" else 1.0)
        expected = [_fmt(mine[key] * factor, digits), _fmt(ours[key] * factor, digits)]
        rows.append(
            [label, _iv(own[name], digits, scale), _iv(one[name], digits, scale), *expected]
        )
    bound = f"{mine['model_calls']:.0f} (≤ {mine['model_calls_bound']:.0f})"
    rows.append(
        [
            f"model calls ({options.prompts} prompts x {options.repeats})",
            _iv(own["model_calls"], 1),
            _iv(one["model_calls"], 1),
            bound,
            f"{ours['model_calls']:.0f}",
        ]
    )
    _console().print(
        _table(
            f"{workers} worker{'s' if workers != 1 else ''} behind round-robin; {options.users} users x "
            f"{options.requests_per_user} requests in {options.window_s:g} s, limit "
            f"{options.rate:g}/s burst {options.burst:g}; {replications} replications, 95% CI",
            ["figure", "per process", "shared", "theory, per process", "theory, shared"],
            rows,
        )
    )


# --------------------------------------------------------------------------- tune


def _outage(text: str) -> tuple[float, float]:
    """``START,LENGTH`` in seconds, or ``none``."""
    if text.strip().lower() in ("none", "off", "0"):
        return 0.0, 0.0
    start, _, length = text.partition(",")
    try:
        return float(start), float(length)
    except ValueError:
        raise _fail(f"--outage {text!r}: use START,LENGTH in seconds, or none") from None


def _knob(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _tune_rows(result: Any) -> list[list[str]]:
    """The knobs (start, best) and the figures (start, best), each with its interval."""
    before, after = result.start.setting.yaml_keys(), result.best.setting.yaml_keys()
    rows = [
        [key, _knob(value), _knob(after[key]) + (" *" if after[key] != value else "")]
        for key, value in before.items()
    ]
    figures = [
        ("goodput req/s", "goodput", 2, 1.0),
        ("shed %", "shed_share", 1, 100.0),
        ("expired %", "expired_share", 1, 100.0),
        ("failed %", "failed_share", 1, 100.0),
        ("p95 s", "p95", 2, 1.0),
        ("calls per request", "calls_per_request", 2, 1.0),
        ("cost per request", "cost_per_request", 6, 1.0),
    ]
    for label, name, digits, scale in figures:
        rows.append(
            [
                label,
                result.start.figures[name].format(digits, scale),
                result.best.figures[name].format(digits, scale),
            ]
        )
    rows.append(
        [
            "meets the constraints",
            "yes" if result.start.feasible else "no: " + "; ".join(result.start.violations),
            "yes" if result.best.feasible else "no: " + "; ".join(result.best.violations),
        ]
    )
    return rows


def _tuned(
    start: Any, workload: Any, options: Any, where: tuple[str | None, str | None, int]
) -> Any:
    """The search on the process pool, or on a Dask cluster (``where``: the --cluster,
    --scheduler and pool size)."""
    from tidegate.lab import tune as tune_module

    cluster, scheduler, jobs = where
    if cluster is None and scheduler is None:
        return tune_module.tune(start, workload, options, tune_module.PoolBackend(jobs))
    with tune_module.dask_backend(scheduler=scheduler, workers=jobs) as backend:
        return tune_module.tune(start, workload, options, backend)


def _print_tuned(result: Any, name: str, replications: int) -> None:
    objective = result.objective
    typer.echo(
        f"workload: {result.workload}; searched {result.evaluated} settings in "
        f"{result.passes} pass(es); start and best re-run on fresh seeds"
    )
    _console().print(
        _table(
            f"{name} tuned for {objective}: {replications} replications, 95% CI",
            ["", "start", "best"],
            _tune_rows(result),
        )
    )
    typer.echo(f"gain ({objective}, paired): {result.gain.format(6 if objective == 'cost' else 2)}")
    typer.echo(result.verdict)
    typer.echo(result.diff if result.diff else "no change to the config")


@lab_app.command("tune")
def tune_command(
    config: Annotated[
        Path,
        typer.Option(help="The live tidegate.yaml, read as the gateway reads it.", dir_okay=False),
    ],
    objective: Annotated[
        str, typer.Option(help="goodput (maximised) or cost (per request, minimised).")
    ] = "goodput",
    trace: Annotated[
        Path | None,
        typer.Option(
            help="Replay this request log (as `lab replay` reads it) instead of a profile.",
            dir_okay=False,
        ),
    ] = None,
    rate: Annotated[float, typer.Option(help="Profile: arrivals per second (Poisson).")] = 30.0,
    duration: Annotated[float, typer.Option(help="Profile: seconds of arrivals.")] = 120.0,
    io: Annotated[
        str, typer.Option(help="Profile: model-call time: exp:MEAN, det:S, lognormal:MEAN,SCV.")
    ] = "lognormal:0.8,1",
    deadline: Annotated[
        float, typer.Option(help="Profile: seconds a caller waits (capped by the config's).")
    ] = 10.0,
    capacity: Annotated[
        float, typer.Option(help="Profile: calls per second the provider accepts.")
    ] = 80.0,
    outage: Annotated[
        str, typer.Option(help="Profile: START,LENGTH seconds every call fails, or none.")
    ] = "40,20",
    tokens: Annotated[int, typer.Option(help="Profile: tokens each call bills.")] = 1200,
    price_per_1k: Annotated[
        float | None,
        typer.Option(
            help="Price of 1,000 tokens (default: the config's prices for its first route's "
            "primary model, else 0.002).",
            show_default=False,
        ),
    ] = None,
    worker_hour: Annotated[float, typer.Option(help="Price of one worker for an hour.")] = 0.05,
    max_shed: Annotated[
        float | None, typer.Option(help="Largest share refused at the door.", show_default=False)
    ] = None,
    max_p95: Annotated[
        float | None, typer.Option(help="Largest p95 of the answered, s.", show_default=False)
    ] = None,
    max_cost_per_request: Annotated[
        float | None, typer.Option(help="Largest cost per request.", show_default=False)
    ] = None,
    passes: Annotated[int, typer.Option(min=1, help="Coordinate-descent passes at most.")] = 3,
    cluster: Annotated[
        str | None,
        typer.Option(
            help="Run replications on a Dask cluster: local (needs tidegate[cluster]).",
            show_default=False,
        ),
    ] = None,
    scheduler: Annotated[
        str | None,
        typer.Option(
            help="Run replications on the Dask scheduler at this address.", show_default=False
        ),
    ] = None,
    replications: ReplicationsOption = 5,
    jobs: JobsOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
) -> None:
    """Search queue cap, deadline admission, retries and their budget, the breaker and the fleet
    size for the setting with the best goodput under constraints; print it with 95% intervals
    and the change as a diff of the config."""
    from tidegate.lab import tune as tune_module

    if cluster is not None and cluster != "local":
        raise _fail(
            f"--cluster: only 'local' starts a cluster; use --scheduler ADDRESS, got {cluster!r}"
        )
    if cluster is not None and scheduler is not None:
        raise _fail("--cluster and --scheduler: give one of them")
    outage_start, outage_length = _outage(outage)
    try:
        options = tune_module.TuneOptions(
            objective=objective,
            constraints=tune_module.Constraints(
                max_shed=max_shed, max_p95=max_p95, max_cost_per_request=max_cost_per_request
            ),
            replications=replications,
            seed=seed,
            passes=passes,
        )
        profile = tune_module.Profile(
            rate=rate,
            duration=duration,
            io=io,
            deadline=deadline,
            capacity=capacity,
            outage_start=outage_start,
            outage_length=outage_length,
            tokens=tokens,
        )
        workload = tune_module.Workload(
            profile=profile,
            trace=load_trace(trace) if trace is not None else None,
            name=trace.name if trace is not None else "",
        )
        start = tune_module.load_start(config, per_1k_tokens=price_per_1k, worker_hour=worker_hour)
        result = _tuned(start, workload, options, (cluster, scheduler, _jobs(jobs)))
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from None
    if json_output:
        _emit_json(result.as_dict())
        return
    _print_tuned(result, config.name, replications)
