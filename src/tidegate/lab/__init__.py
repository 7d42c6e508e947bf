"""The virtual-time lab: a discrete-event engine that drives the policy objects, and the queueing
theory used to check it.

:mod:`~tidegate.lab.engine` runs :class:`Traffic` against a :class:`Fleet` of real admission
controllers and returns a :class:`Report` (per-class fates, latency, Little's law). The scenario
modules (:mod:`~tidegate.lab.capacity`, :mod:`~tidegate.lab.load`, :mod:`~tidegate.lab.storm`,
:mod:`~tidegate.lab.surge`, :mod:`~tidegate.lab.gameday`, :mod:`~tidegate.lab.scaling`,
:mod:`~tidegate.lab.replay`, :mod:`~tidegate.lab.recovery`, :mod:`~tidegate.lab.placement`)
drive the other policies and the real stores; :mod:`~tidegate.lab.cli` puts them on the command
line as ``tidegate lab``, and :mod:`~tidegate.lab.theory` holds the closed forms.
"""

from tidegate.lab.capacity import monthly_cost, plan_workers
from tidegate.lab.engine import EventQueue, Fleet, Simulation, Traffic, ceiling, simulate
from tidegate.lab.gameday import load_scenario, run_gameday, run_release
from tidegate.lab.load import backpressure, load_sweep
from tidegate.lab.replay import load_replay_config, replay_log
from tidegate.lab.report import ClassReport, Latency, Report
from tidegate.lab.scaling import run_autoscale
from tidegate.lab.storm import run_storm, run_storms
from tidegate.lab.surge import SurgeOptions, ladder, run_surge
from tidegate.lab.theory import (
    erlang_a,
    erlang_b,
    erlang_c,
    mmc,
    mmck,
    mmck_blocking,
    pollaczek_khinchine,
)
from tidegate.lab.workload import (
    ClosedLoop,
    Constant,
    Deterministic,
    Empirical,
    Exponential,
    LogNormal,
    Piecewise,
    Poisson,
    Trace,
    TraceRecord,
    load_trace,
)

__all__ = [
    "ClassReport",
    "ClosedLoop",
    "Constant",
    "Deterministic",
    "Empirical",
    "EventQueue",
    "Exponential",
    "Fleet",
    "Latency",
    "LogNormal",
    "Piecewise",
    "Poisson",
    "Report",
    "Simulation",
    "SurgeOptions",
    "Trace",
    "TraceRecord",
    "Traffic",
    "backpressure",
    "ceiling",
    "erlang_a",
    "erlang_b",
    "erlang_c",
    "ladder",
    "load_replay_config",
    "load_scenario",
    "load_sweep",
    "load_trace",
    "mmc",
    "mmck",
    "mmck_blocking",
    "monthly_cost",
    "plan_workers",
    "pollaczek_khinchine",
    "replay_log",
    "run_autoscale",
    "run_gameday",
    "run_release",
    "run_storm",
    "run_storms",
    "run_surge",
    "simulate",
]
