"""The benchmark scripts that run in seconds run here, small, so they cannot rot unnoticed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_opcodes_counts_tidegates_own_path_by_module() -> None:
    """benchmarks/opcodes.py serves its requests and reports a count for the pipeline's modules
    (and none for its own request driver)."""
    done = subprocess.run(
        [sys.executable, "opcodes.py", "--warmup", "40", "--requests", "40", "--top", "5"],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "bytecodes per request" in out
    for module in ("tidegate/gateway/pipeline/", "tidegate/policy/admission/controller.py"):
        assert module in out
    assert "opcodes.py" not in out.split("by module", 1)[1]


def test_opcodes_counts_a_refusal_at_the_door() -> None:
    """``opcodes.py --door``: every request is refused at the door (the script fails otherwise),
    and the count is the door's and the parser's, not the app's steps."""
    done = subprocess.run(
        [sys.executable, "opcodes.py", "--door", "--warmup", "20", "--requests", "20"],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "bytecodes per refusal" in out
    for module in ("tidegate/gateway/door.py", "tidegate/gateway/protocol.py"):
        assert module in out
    by_module = out.split("by module", 1)[1]
    for app_only in ("tidegate/gateway/pipeline/steps.py", "tidegate/gateway/app.py"):
        assert app_only not in by_module


def test_overload_verdicts_from_the_loads() -> None:
    """benchmarks/overload.py's pure helpers: CPU per refusal less the served requests' share
    (the estimate), or less the idle CPU with nothing served (the verdict's), and one MET/MISSED
    verdict per target and load."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import overload
    finally:
        sys.path.remove(str(BENCHMARKS))
    capacity = overload.LoadResult(10.0, 400, 0, 0.0, 0.0, cpu_s=0.4)
    ten = overload.LoadResult(10.0, 400, 3_600, 0.5, 2.0, cpu_s=0.4 + 3_600 * 30e-6)
    hundred = overload.LoadResult(10.0, 390, 39_610, 1.0, 6.0, cpu_s=0.39 + 39_610 * 60e-6)
    assert round(ten.cpu_us_per_refusal(0.001), 6) == 30.0
    assert ten.shed_share == 0.9
    assert hundred.served_rps == 39.0
    # Refusals alone: 10 s with 1 ms/s of idle CPU, against the minimal server's.
    alone_ten = overload.LoadResult(10.0, 0, 3_000, 0.2, 0.9, cpu_s=0.01 + 3_000 * 40e-6)
    alone_hundred = overload.LoadResult(10.0, 0, 30_000, 0.3, 1.5, cpu_s=0.01 + 30_000 * 55e-6)
    floor = overload.LoadResult(10.0, 0, 30_000, 0.1, 0.5, cpu_s=30_000 * 10e-6)
    costs = {
        "10x": overload.RefusalCost(alone_ten, 0.001, floor),
        "100x": overload.RefusalCost(alone_hundred, 0.001, floor),
    }
    assert round(costs["10x"].tidegate_us, 6) == 40.0
    assert round(costs["100x"].floor_us, 6) == 10.0
    verdicts = overload.summarise(
        capacity, {"10x": ten, "100x": hundred}, costs, rss_growth_mib=2.0
    )
    assert [met for met, _ in verdicts] == [False, True, True, False, True]
    assert "6.00 ms" in verdicts[0][1]
    assert "97.5%" in verdicts[1][1]
    assert "at 10x: 40.0 µs" in verdicts[2][1]
    assert "at 100x: 55.0 µs" in verdicts[3][1]
    assert "10.0 µs" in verdicts[3][1]  # the minimal server's, beside it


def test_relay_counts_events_and_judges_cpu_per_chunk() -> None:
    """benchmarks/relay.py's pure helpers: a chunked answer's ``data:`` events and whether it was
    a complete 200 stream, CPU per chunk, and the MET/MISSED verdict at the 1.3x target."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import relay
    finally:
        sys.path.remove(str(BENCHMARKS))
    body = b'data: {"a":1}\n\ndata: {"a":2}\n\ndata: [DONE]\n\n'
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + body
    assert relay._events(answer) == (2, True)
    assert relay._events(answer.replace(b"data: [DONE]", b"data: {}")) == (3, False)
    assert relay._events(b"HTTP/1.1 503 Service Unavailable\r\n\r\n{}") == (0, False)
    minimal = relay.Totals(streams=10, chunks=2_000, cpu_s=0.04)
    assert round(minimal.cpu_us_per_chunk, 6) == 20.0
    assert relay.Totals().cpu_us_per_chunk == 0.0
    met, line = relay.verdict(minimal, relay.Totals(10, 2_000, 0.052))
    assert met
    assert "1.30x" in line
    met, line = relay.verdict(minimal, relay.Totals(10, 2_000, 0.074))
    assert not met
    assert "1.85x" in line
    assert relay.verdict(relay.Totals(), minimal)[0] is False
    request = relay.request_bytes("sk-test")
    head, _, payload = request.partition(b"\r\n\r\n")
    assert b"Authorization: Bearer sk-test" in head
    assert f"Content-Length: {len(payload)}".encode() in head


def test_gateway_ledger_verdict_and_configs(tmp_path: Path) -> None:
    """benchmarks/gateway.py's spend-ledger check: the share of req/s the ledger costs, judged at
    5%, from the same run's tidegate with and without it; the two configs run side by side
    (their own SQLite files) and only the second turns the ledger off."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gateway
    finally:
        sys.path.remove(str(BENCHMARKS))

    def summary(rps: float, cpu: float) -> gateway.Summary:
        return gateway.Summary(rps, rps, rps, cpu, 0.5, 1.0, 0)

    text, target, met = gateway.ledger_verdict(summary(960.0, 310.0), summary(1_000.0, 300.0))
    assert met
    assert "4.0% of tidegate's req/s" in text
    assert "+10 CPU µs" in text
    assert target == "<= 5%"
    assert not gateway.ledger_verdict(summary(940.0, 320.0), summary(1_000.0, 300.0))[2]
    with_ledger = yaml.safe_load(gateway.tidegate_config(tmp_path, 9).read_text())
    without = yaml.safe_load(gateway.tidegate_config(tmp_path, 9, ledger=False).read_text())
    assert "ledger" not in with_ledger  # the default: on
    assert without["ledger"] == {"enabled": False}
    assert with_ledger["state"]["url"] != without["state"]["url"]
    assert {**without, "ledger": None, "state": None} == {
        **with_ledger,
        "ledger": None,
        "state": None,
    }
