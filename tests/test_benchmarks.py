"""The benchmark scripts that run in seconds run here, small, so they cannot rot unnoticed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
