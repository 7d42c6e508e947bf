"""Instructions per request of tidegate and of the pass-through, counted by valgrind's callgrind.

Run with ``.venv/bin/python benchmarks/instructions.py`` (valgrind and, preferably, nginx
installed). The same servers as ``benchmarks/gateway.py`` (nginx upstream, the minimal
pass-through, ``tidegate serve`` with the default pipeline and SQLite state) run one at a time
under callgrind; a fixed number of requests (32 at a time, from an aiohttp client outside
valgrind) warms each up, the counters are dumped, the measured requests follow, and the second
dump divided by their number is the cost of one request. Instruction counts do not depend on
what else the machine is doing, so this ratio is the steady companion of ``gateway.py``'s req/s
and CPU time on a shared machine; it leaves out the kernel's share (the socket system calls,
which both targets make alike). ``TIDEGATE_*`` variables reach the tidegate under test as
config overrides, for what-if counts (``TIDEGATE_STATE__LEASES__MAX_CHUNK=1``: leases off).

Under callgrind a request runs about fifty times slower, so the two things tidegate decides by
elapsed time are stretched by the same factor for this run: the lease window
(``state.leases.hold_s``, configuration) and the 50 ms after which a request gets a disconnect
watcher (``tidegate.gateway.watch.WATCH_AFTER_S``, set by a small launcher). Without that, the run
would measure a slow-motion gateway whose leases are fifty times smaller and whose every request
has a watcher, which a real one at this load does not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

import gateway as gw  # the servers and helpers of benchmarks/gateway.py (run from this folder)

#: How much slower a request runs under callgrind (time-based settings are stretched by it).
SLOWDOWN = 50
LAUNCHER = """
import sys
import tidegate.gateway.watch as watch
watch.WATCH_AFTER_S *= {slowdown}
from tidegate.cli import main
sys.argv[0] = "tidegate"
sys.exit(main())
"""


async def _send(url: str, count: int, body: bytes, headers: dict[str, str]) -> int:
    """``count`` requests, 32 at a time; returns how many did not answer 200."""
    left = count
    failed = 0
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            nonlocal left, failed
            while left > 0:
                left -= 1
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    failed += response.status != 200

        await asyncio.gather(*(worker() for _ in range(32)))
    return failed


def _dumped_total(workdir: Path, pid: int, before: set[Path]) -> int:
    """Trigger a callgrind dump of ``pid`` and return the instructions it counted since the last."""
    subprocess.run(["callgrind_control", "--dump", str(pid)], check=True, capture_output=True)
    for _ in range(200):
        # Only this process's numbered dumps: an earlier target's files are in the folder too.
        fresh = set(workdir.glob(f"callgrind.out.{pid}.*")) - before
        for path in fresh:
            text = path.read_text(encoding="utf-8", errors="replace")
            found = re.search(r"^(?:summary|totals): (\d+)", text, re.MULTILINE)
            if found:
                before.add(path)
                return int(found.group(1))
        gw.CLOCK.sleep(0.1)
    raise gw.BenchError("callgrind wrote no dump within 20 s")


def count(
    name: str,
    argv: list[str],
    url: str,
    *,
    workdir: Path,
    body: bytes,
    headers: dict[str, str],
    warmup: int,
    requests: int,
    procs: gw.Processes,
) -> float:
    """Start ``argv`` under callgrind, warm it up, and count the instructions of ``requests``."""
    command = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={workdir}/callgrind.out.%p",
        *argv,
    ]
    proc = procs.start(name, command, log=workdir / f"{name}.log", cwd=workdir)
    try:  # the target goes when its count is done, or fails (the upstream stays for the next)
        give_up = gw.CLOCK.now() + 300.0
        while True:
            procs.check_alive()
            try:
                status, _, _ = gw.http(url, body=body.decode(), headers=headers)
                if status == 200:
                    break
            except OSError:
                pass
            if gw.CLOCK.now() > give_up:
                raise gw.BenchError(f"{name} did not answer under callgrind within 300 s")
            gw.CLOCK.sleep(0.5)
        failed = asyncio.run(_send(url, warmup, body, headers))
        seen: set[Path] = set()
        _dumped_total(workdir, proc.pid, seen)
        failed += asyncio.run(_send(url, requests, body, headers))
        total = _dumped_total(workdir, proc.pid, seen)
    finally:
        procs.stop_all()
    if failed:
        raise gw.BenchError(f"{failed} requests to {name} failed")
    return total / requests


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=1000, help="requests before counting")
    parser.add_argument("--requests", type=int, default=2000, help="requests counted")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and its logs")
    args = parser.parse_args(argv)
    console = Console(highlight=False)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        # Not a failed run: this machine cannot count instructions (make bench goes on).
        console.print("skipped: valgrind is not installed (Debian package valgrind)")
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="tidegate-instructions-"))
    processes = gw.Processes()
    body = gw.REQUEST_BODY.encode()
    try:
        upstream_port, port = gw.free_port(), gw.free_port()
        upstream = gw.start_upstream(processes, workdir, upstream_port, "auto")
        upstream_url = f"http://{gw.HOST}:{upstream_port}{gw.ROUTE}"
        url = f"http://{gw.HOST}:{port}{gw.ROUTE}"
        results: dict[str, float] = {}
        json_headers = {"Content-Type": "application/json"}
        results["pass-through"] = count(
            "pass-through",
            gw.passthrough_argv(port, upstream_url),
            url,
            workdir=workdir,
            body=body,
            headers=json_headers,
            warmup=args.warmup,
            requests=args.requests,
            procs=gw.Processes(),
        )
        config = gw.tidegate_config(workdir, upstream_port, slowdown=SLOWDOWN)
        launcher = workdir / "launch_tidegate.py"
        launcher.write_text(LAUNCHER.format(slowdown=SLOWDOWN), encoding="utf-8")
        key = gw.write_keys(workdir)
        argv_ = [
            sys.executable,
            str(launcher),
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
        ]
        results["tidegate"] = count(
            "tidegate",
            argv_,
            url,
            workdir=workdir,
            body=body,
            headers={**json_headers, "Authorization": f"Bearer {key}"},
            warmup=args.warmup,
            requests=args.requests,
            procs=gw.Processes(),
        )
    except gw.BenchError as error:
        console.print(f"[bold red]benchmark failed:[/] {error}")
        return 1
    finally:
        gw.clean_up(processes, workdir, keep=args.keep, console=console)
    table = Table(title="instructions per request (callgrind), same upstream, same run")
    table.add_column("target")
    table.add_column("instructions / request", justify="right")
    for name, value in results.items():
        table.add_row(name, f"{value:,.0f}")
    ratio = results["tidegate"] / results["pass-through"]
    table.add_row("tidegate vs pass-through", f"{ratio:.2f}x")
    console.print(
        f"upstream: {upstream}; {args.warmup} warm-up and {args.requests} counted "
        "requests per target, 32 at a time"
    )
    overrides = sorted(k for k in os.environ if k.startswith("TIDEGATE_"))
    if overrides:  # they reach the tidegate under test as config overrides
        console.print(f"[bold yellow]environment overrides in effect:[/] {' '.join(overrides)}")
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
