"""Lab engine speed: customers simulated per second on M/M/8 at lambda 6.5, against SimPy.

Both run the same model in the same process: Poisson arrivals at 6.5 per second, exponential
service of mean 1 second, 8 servers, an unbounded FIFO queue. The lab engine sends every customer
through the real :class:`~tidegate.policy.admission.AdmissionController` (``offer``, ``start``,
``finish``) and keeps its full report (per-class counts, latency percentiles, Little's law);
SimPy runs its textbook ``Resource`` model. Each side runs ``ROUNDS`` times and the best round
counts, which is the least disturbed by other work on the machine. Both mean waits are printed
beside Erlang C, so a fast wrong answer would show.

Run: ``python benchmarks/lab.py`` (part of ``make bench``).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import simpy

from tidegate.clock import SystemClock
from tidegate.lab import theory
from tidegate.lab.engine import Fleet, Traffic, simulate
from tidegate.lab.workload import Exponential, Poisson
from tidegate.policy.admission import AdmissionOptions
from tidegate.testing import compiled

LAMBDA = 6.5
MU = 1.0
SERVERS = 8
HORIZON = 30_000.0  # simulated seconds per round: about 195,000 customers
ROUNDS = 3
TARGET_RATIO = 10.0

CLOCK = SystemClock()

#: The planner run whose wall time is reported: 10 replications on every core.
PLAN_ARGS: tuple[str, ...] = ("lab", "plan", "--peak", "40", "--spike", "1.5", "--slots", "8")
PLAN_ARGS += ("--waiting", "0", "--replications", "10", "--json")


def plan_wall_time() -> float:
    """Seconds of wall time ``tidegate lab plan`` takes with 10 replications on every core, in
    this build (the same ``PYTHONPATH``)."""
    tidegate = Path(sys.executable).parent / "tidegate"
    started = CLOCK.now()
    subprocess.run(
        [str(tidegate), *PLAN_ARGS],
        check=True,
        stdout=subprocess.DEVNULL,
        env=os.environ.copy(),
        timeout=600,
    )
    return CLOCK.now() - started


def lab_round(seed: int) -> tuple[int, float]:
    """Customers simulated and their mean wait, through the lab engine."""
    options = AdmissionOptions(
        classes=("standard",),
        slots=SERVERS,
        queue_cap=None,
        mode="queue_cap",
        dequeue="fifo",
        drop_expired_at_dequeue=False,
        service_rate=SERVERS * MU,
    )
    report = simulate(
        Traffic(arrivals=Poisson(rate=LAMBDA)),
        Fleet(admission=options, io=Exponential(mean=1.0 / MU)),
        horizon=HORIZON,
        seed=seed,
    )
    return report.total.offered, report.total.mean_wait


def simpy_round(seed: int) -> tuple[int, float]:
    """Customers simulated and their mean wait, in SimPy."""
    env = simpy.Environment()
    servers = simpy.Resource(env, capacity=SERVERS)
    rng = random.Random(seed)
    arrived = [0]
    waits: list[float] = []

    def customer() -> Generator[Any, Any, None]:
        arrival = env.now
        with servers.request() as request:
            yield request
            waits.append(env.now - arrival)
            yield env.timeout(rng.expovariate(MU))

    def source() -> Generator[Any, Any, None]:
        while True:
            yield env.timeout(rng.expovariate(LAMBDA))
            arrived[0] += 1
            env.process(customer())

    env.process(source())
    env.run(until=HORIZON)
    return arrived[0], sum(waits) / len(waits)


def best_rate(run: Callable[[int], tuple[int, float]]) -> tuple[float, float]:
    """The best customers-per-second over the rounds, and the last round's mean wait."""
    best, wait = 0.0, 0.0
    for seed in range(ROUNDS):
        started = CLOCK.now()
        customers, wait = run(seed)
        best = max(best, customers / (CLOCK.now() - started))
    return best, wait


def main() -> int:
    expected = theory.mmc(LAMBDA, MU, SERVERS).mean_wait
    lab_rate, lab_wait = best_rate(lab_round)
    simpy_rate, simpy_wait = best_rate(simpy_round)
    ratio = lab_rate / simpy_rate
    print(f"M/M/{SERVERS}, lambda={LAMBDA}, mu={MU}: {HORIZON:,.0f} simulated s, best of {ROUNDS}")
    print(f"{'engine':<50} {'customers/s':>12} {'mean wait s':>12}")
    build = "compiled" if compiled("tidegate.lab.engine") else "Python"
    label = f"tidegate lab, {build} (real AdmissionController)"
    print(f"{label:<50} {lab_rate:>12,.0f} {lab_wait:>12.4f}")
    print(
        f"{'SimPy ' + simpy.__version__ + ' (Resource)':<50} {simpy_rate:>12,.0f} {simpy_wait:>12.4f}"
    )
    print(f"{'Erlang C':<50} {'':>12} {expected:>12.4f}")
    verdict = "met" if ratio >= TARGET_RATIO else "not met"
    print(f"ratio lab / SimPy: {ratio:.2f}x (target {TARGET_RATIO:g}x: {verdict})")
    wall = plan_wall_time()
    cores = os.cpu_count() or 1
    print(f"tidegate {' '.join(PLAN_ARGS)}: {wall:.1f} s wall on {cores} cores ({build})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
