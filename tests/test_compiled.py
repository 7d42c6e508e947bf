"""Which build the tests run: the plain Python, or the compiled build of the lab's hot modules.

``make accel-test`` runs the lab, policy and clock tests against the compiled build with
``TIDEGATE_EXPECT_COMPILED=1``; every other run must be the plain Python, so an extension module
left in ``src/`` (which would shadow the code being edited) fails here.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import KEY, fake, write_config
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config
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


@pytest.mark.asyncio
async def test_the_gateway_answers_in_the_build_under_test(tmp_path: Path) -> None:
    """A chat completion through the whole app on its own runtime, on the real clock, with the
    rate limit, budget and admission steps on: the compiled build's policies run there on the
    gateway's SystemClock (they once raised NotImplementedError on it)."""
    limit = {"rate_per_s": 100, "burst": 1_000}
    config = {
        "providers": {"p": fake("compiled or not")},
        "models": {"chat": {"providers": ["p"]}},
        "rate_limits": {"per_user": limit, "per_tenant": limit},
        "budgets": {"calls": 1_000},
        "cache": {"enabled": False},  # every request is a call
        "state": {"url": f"sqlite:///{tmp_path / 'state.db'}"},
    }
    path = write_config(tmp_path, config)
    app = Gateway(load_config(path, env={}), path)
    await app.startup()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://gw",
            headers={"Authorization": f"Bearer {KEY}"},
        ) as client:
            for _ in range(3):
                answer = await client.post(
                    "/v1/chat/completions",
                    json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
                )
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"] == "compiled or not"
                assert answer.headers["x-tidegate-served-by"] == "p"
    finally:
        await app.shutdown()
