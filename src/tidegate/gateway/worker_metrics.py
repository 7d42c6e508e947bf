"""Metrics that add up across worker processes (``tidegate serve --workers N``).

Each worker keeps its own metrics (the request path updates plain attributes, see
:mod:`tidegate.gateway.metrics`). With several workers, ``tidegate serve`` makes a private folder
and names it in ``TIDEGATE_METRICS_DIR``; every worker then writes what its registry collects
into ``<pid>.json`` there, every :data:`SHARE_EVERY_S` seconds from a task of its own (never
from a request) and once more when it stops. A scrape, answered by whichever worker the
connection reached, writes that worker's numbers as of now, reads every worker's file and
answers with their sum:

- counters and histograms (buckets, counts, sums) are added up, including those of workers that
  have stopped (a worker replaced on SIGHUP keeps its counts in the total, so counters never go
  down); a ``_created`` sample takes the earliest;
- gauges are what is true now: the workers that still run, added up (requests in flight, queue
  depths), except the breaker state, which is the worst of them (each worker has its own
  breakers).

So one scrape shows every request every worker has answered, at most :data:`SHARE_EVERY_S`
seconds late for the workers other than the one answering. The folder is removed when the
supervisor exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import structlog
from prometheus_client import generate_latest
from prometheus_client.core import Metric

from tidegate.gateway.runtime import Runtime

__all__ = ["METRICS_DIR_ENV", "SHARE_EVERY_S", "SharedMetrics", "merge", "start_sharing"]

log = structlog.get_logger("tidegate")

#: Names the folder the workers share their metrics in (set by ``tidegate serve``).
METRICS_DIR_ENV = "TIDEGATE_METRICS_DIR"
#: How often a worker writes its metrics for the others' scrapes.
SHARE_EVERY_S = 0.25
#: Gauges whose workers' values merge to the largest, or to the smallest (a provider's headroom:
#: the worker that heard of the least left); the others are added up.
MAX_GAUGES = frozenset({"tidegate_breaker_state"})
MIN_GAUGES = frozenset({"tidegate_provider_headroom_remaining"})

#: One worker's metrics as written: ``[name, type, help, [[sample, labels, value], ...]]``.
Family = list[Any]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedMetrics:
    """One worker's side: its file in the shared folder, and the merged exposition."""

    def __init__(self, folder: Path, rt: Runtime, pid: int | None = None) -> None:
        self.folder = folder
        self.rt = rt
        self.pid = os.getpid() if pid is None else pid
        self.path = folder / f"{self.pid}.json"
        self.task: asyncio.Task[None] | None = None

    def families(self, *, running: bool = True) -> list[Family]:
        """What the registry collects now (without the gauges once the worker has stopped)."""
        return [
            [f.name, f.type, f.documentation, [[s.name, s.labels, s.value] for s in f.samples]]
            for f in self.rt.metrics.registry.collect()
            if running or f.type != "gauge"
        ]

    def write(self, *, running: bool = True) -> None:
        data = {"pid": self.pid, "running": running, "families": self.families(running=running)}
        partial = self.path.with_suffix(".partial")
        partial.write_bytes(orjson.dumps(data))
        os.replace(partial, self.path)

    def snapshots(self) -> Iterator[tuple[bool, list[Family]]]:
        """Each worker's families, and whether that worker is running."""
        for path in sorted(self.folder.glob("*.json")):
            try:
                data = orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError):  # replaced as it was read: next scrape
                continue
            running = bool(data["running"]) and (data["pid"] == self.pid or _alive(data["pid"]))
            yield running, data["families"]

    def exposition(self) -> bytes:
        """Every worker's metrics, merged (this worker's as of now)."""
        self.write()
        return generate_latest(_Families(merge(self.snapshots())))

    async def run(self) -> None:
        """Write this worker's metrics every :data:`SHARE_EVERY_S` seconds until cancelled."""
        while True:
            await self.rt.sleep(SHARE_EVERY_S)
            try:
                self.rt.refresh_gauges()
                self.write()
            except OSError as exc:  # the folder went away (the supervisor is exiting)
                log.warning("metrics_share_failed", error=str(exc))

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        with contextlib.suppress(OSError):
            self.write(running=False)


class _Families:
    """What :func:`prometheus_client.generate_latest` reads: a ``collect()``."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge(snapshots: Iterable[tuple[bool, list[Family]]]) -> list[Metric]:
    """The families of several workers as one: counters and histograms added up, gauges of the
    running workers added up (or the largest, :data:`MAX_GAUGES`, or the smallest,
    :data:`MIN_GAUGES`), ``_created`` the earliest."""
    heads: dict[str, tuple[str, str]] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for running, families in snapshots:
        for name, kind, documentation, samples in families:
            if kind == "gauge" and not running:
                continue
            heads.setdefault(name, (kind, documentation))
            merged = values.setdefault(name, {})
            for sample, labels, value in samples:
                key = (sample, tuple(labels.items()))
                seen = merged.get(key)
                merged[key] = value if seen is None else _combine(name, kind, sample, seen, value)
    out = []
    for name, (kind, documentation) in heads.items():
        family = Metric(name, documentation, kind)
        for (sample, labels), value in values[name].items():
            family.add_sample(sample, dict(labels), value)
        out.append(family)
    return out


def _combine(name: str, kind: str, sample: str, seen: float, value: float) -> float:
    if sample.endswith("_created"):
        return min(seen, value)
    if kind == "gauge" and name in MAX_GAUGES:
        return max(seen, value)
    if kind == "gauge" and name in MIN_GAUGES:
        return min(seen, value)
    return seen + value


def start_sharing(rt: Runtime) -> SharedMetrics | None:
    """Share this worker's metrics when ``tidegate serve`` runs several (else None)."""
    folder = os.environ.get(METRICS_DIR_ENV)
    if not folder:
        return None
    shared = SharedMetrics(Path(folder), rt)
    rt.metrics.merged = shared.exposition
    shared.write()
    shared.task = asyncio.get_running_loop().create_task(shared.run())
    return shared
