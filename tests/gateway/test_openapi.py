"""The served OpenAPI document against a live gateway: schemathesis generates requests from it,
valid and invalid, and every answer must be one the document describes, and never a 5xx.

Two runs share one gateway on a loopback port (a fake provider, the harness's keys file):
schemathesis's Python API (random requests of both kinds, every check), and its command line
(the same checks, plus its coverage phase: each documented bound just inside and just outside,
missing fields, and methods the document does not list). Both aim requests at the gateway's
route (``openapi_hooks.aim``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from schemathesis.schemas import BaseSchema

from tests.gateway import openapi_hooks  # registers the hook that aims every request
from tests.gateway.harness import KEY, fake, running_gateway
from tidegate.gateway.openapi import OPENAPI

pytestmark = pytest.mark.slow

CONFIG: dict[str, Any] = {
    "providers": {"p": fake("answer", model="m-1")},
    "models": {openapi_hooks.ALIAS: {"providers": ["p"]}},
    "logging": {"level": "error"},
}
#: Examples per operation and generation mode.
EXAMPLES = 50
#: Whole seconds each run may take (a bound far above what either takes).
TIME_LIMIT_S = 60
#: What a request the document accepts may still get: what no schema can know refuses it (an
#: unknown model 404, a key not allowed it 403, another body sent with its Idempotency-Key 422,
#: its twin still running 409, a rate limit 429). Unlike schemathesis's default, not a 5xx.
ACCEPTED = ["2xx", "401", "403", "404", "409", "422", "429"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def live_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway on a loopback port with a fake provider and the harness's keys file."""
    with running_gateway(tmp_path_factory.mktemp("openapi"), CONFIG) as (base, _):
        yield base


def served_schema(base: str) -> BaseSchema:
    """The document the gateway serves, as schemathesis tests it: with a valid key (so that
    the check of the security scheme sends requests without it, and with a wrong one)."""
    config = schemathesis.Config.from_dict(
        {
            "base-url": base,
            "request-timeout": 10,
            "auth": {"openapi": {"bearer": {"bearer": KEY}}},
            "checks": {"positive_data_acceptance": {"expected-statuses": ACCEPTED}},
        }
    )
    return schemathesis.openapi.from_url(f"{base}/openapi.json", config=config)


def test_the_served_document_is_the_one_in_the_source(live_gateway: str) -> None:
    """GET /openapi.json answers with tidegate.gateway.openapi.OPENAPI, without a key."""
    response = httpx.get(f"{live_gateway}/openapi.json")
    assert response.status_code == 200
    assert response.json() == OPENAPI


def test_generated_requests_get_the_answers_the_document_describes(live_gateway: str) -> None:
    """Random requests, valid and invalid, of every operation: each answer has a documented
    status, content type, body and headers; a valid request is served (or refused only as
    ACCEPTED allows), an invalid one is refused with a 4xx, and none is a 5xx."""
    schema = served_schema(live_gateway)
    failures: list[str] = []
    sent = 0
    started = time.monotonic()  # noqa: TID251  # reported, and bounds the run; decides nothing
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]  # an invalid document fails here
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                derandomize=True,  # the same requests on every run: a gate, not a search
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(operation.as_strategy(generation_mode=mode))
            def run(case: Case[Any]) -> None:
                nonlocal sent
                sent += 1
                case.call_and_validate()  # aimed by openapi_hooks.before_call

            try:
                run()
            except Unsatisfiable:  # no parameters or body: nothing can be made invalid
                assert mode is GenerationMode.NEGATIVE, operation.label
            except (Exception, BaseExceptionGroup) as error:  # schemathesis's FailureGroup
                failures.append(f"{operation.label} ({mode.value}): {error}")
    elapsed = time.monotonic() - started  # noqa: TID251
    print(f"schemathesis (Python API): {sent} requests in {elapsed:.1f} s")
    assert not failures, "\n\n".join(failures)
    assert elapsed < TIME_LIMIT_S


def test_the_command_line_run_with_its_coverage_phase_passes(
    live_gateway: str, tmp_path: Path
) -> None:
    """`st run` with every check and its examples, coverage and fuzzing phases finds nothing:
    the document's bounds are the server's, and an undocumented method is 405 with Allow."""
    accepted = ", ".join(f'"{status}"' for status in ACCEPTED)
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        f"""
request-timeout = 10

[auth.openapi.bearer]
bearer = "{KEY}"

[generation]
max-examples = {EXAMPLES}
deterministic = true
database = "none"

[checks.positive_data_acceptance]
expected-statuses = [{accepted}]
""",
        encoding="utf-8",
    )
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": openapi_hooks.__name__,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    st = Path(sys.executable).with_name("st")
    command = [str(st), "--no-color", "--config-file", str(config), "run"]
    command += [f"{live_gateway}/openapi.json", "--checks", "all", "--workers", "1"]
    command += ["--phases", "examples,coverage,fuzzing"]
    done = subprocess.run(
        command,
        cwd=tmp_path,  # no schemathesis.toml or report of this run lands in the checkout
        env=env,
        capture_output=True,
        text=True,
        timeout=TIME_LIMIT_S,  # not st's max-time: fuzzing would repeat until it was spent
        check=False,
    )
    summary = [line for line in done.stdout.splitlines() if "generated" in line]
    print(f"schemathesis (command line): {summary}")
    assert done.returncode == 0, done.stdout[-20_000:] + done.stderr[-5_000:]
