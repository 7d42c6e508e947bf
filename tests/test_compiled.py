"""Which build the tests run: the plain Python, or the compiled build of the lab's hot modules.

``make accel-test`` runs the lab, policy and clock tests against the compiled build with
``TIDEGATE_EXPECT_COMPILED=1``; every other run must be the plain Python, so an extension module
left in ``src/`` (which would shadow the code being edited) fails here.
"""

from __future__ import annotations

import os

import pytest

from tidegate.testing import compiled

#: The modules the mypyc hook in pyproject.toml compiles.
COMPILED_MODULES = (
    "tidegate.clock",
    "tidegate.policy.admission.controller",
    "tidegate.policy.admission.estimates",
    "tidegate.policy.admission.events",
    "tidegate.policy.admission.options",
    "tidegate.policy.admission.shares",
    "tidegate.policy.admission.snapshot",
    "tidegate.policy.admission.tickets",
    "tidegate.lab.engine",
    "tidegate.lab.workload",
)


@pytest.mark.parametrize("module", COMPILED_MODULES)
def test_the_build_under_test_is_the_one_expected(module: str) -> None:
    """Compiled exactly when the compiled build is under test."""
    expected = os.environ.get("TIDEGATE_EXPECT_COMPILED") == "1"
    assert compiled(module) is expected, (module, expected)


def test_the_rest_of_the_package_stays_python() -> None:
    """The gateway's modules are never compiled: only the lab's hot path is."""
    assert not compiled("tidegate.gateway.config")
    assert not compiled("tidegate.lab.report")
