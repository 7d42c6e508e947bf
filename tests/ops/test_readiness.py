"""``tidegate readiness``: each check passing and failing, and the verdict over the shipped files."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner, Result

import tidegate.ops.readiness as readiness_module
from tests.ops.conftest import FIXTURES
from tidegate.gateway.config import Config, load_config
from tidegate.ops.eval import EvalVerdict, record_verdict
from tidegate.ops.findings import Severity
from tidegate.ops.readiness import (
    RULES,
    CheckResult,
    ReadinessInputs,
    Status,
    check_config,
    check_drain,
    check_environments,
    check_eval_suite,
    check_eval_verdicts,
    check_gameday,
    check_load,
    check_rollback_plan,
    check_smoke,
    check_timeout_chain,
    compose_gateway_config,
    dockerfile_findings,
    format_result,
    image_problem,
    is_ready,
    read_deployments,
    readiness_command,
    run_readiness,
)

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ROOT / "deploy" / "tidegate.production.yaml"
COMPOSE = ROOT / "docker-compose.yml"
KUBERNETES = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "Dockerfile"
ROLLBACK = ROOT / "deploy" / "rollback.yaml"
EVAL = FIXTURES / "eval"

runner = CliRunner()


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """A group, so that readiness is invoked by name as the lead mounts it."""

    app.command("readiness")(readiness_command)
    return app


def readiness(*args: str) -> Result:
    return runner.invoke(_app(), ["readiness", *args])


def shipped(dockerfile: Path = DOCKERFILE) -> list[str]:
    return [
        "--config", str(PRODUCTION), "--compose", str(COMPOSE), "--kubernetes", str(KUBERNETES),
        "--dockerfile", str(dockerfile), "--rollback", str(ROLLBACK),
    ]  # fmt: skip


def statuses(output: str) -> dict[str, str]:
    """Each check's name -> ok, FAIL or skipped, from the report's lines."""
    found = {}
    for line in output.splitlines():
        if line.startswith((" ", "RESULT")):
            continue
        name, rest = line[:16].strip(), line[16:]
        found[name] = rest.split(":")[0].split(" ")[0]
    return found


def production() -> Config:
    config, _ = check_config(PRODUCTION)
    assert config is not None
    return config


def write_config(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def small_config(**extra: Any) -> dict[str, Any]:
    return {
        "profile": "dev",
        "state": {"url": "memory://"},
        "providers": {"main": {"type": "fake", "model": "fake-1", "fake": {"text": "hi"}}},
        "models": {"chat": {"providers": ["main"]}},
        **extra,
    }


# --------------------------------------------------------------------------- the command


@pytest.mark.slow
def test_the_shipped_deployment_is_ready() -> None:
    """The repository's config, compose file, manifests, Dockerfile and rollback plan: exit 0."""
    result = readiness(*shipped(), "--peak-rps", "40")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "RESULT: READY"
    assert statuses(result.output) == {
        "config": "ok",
        "environments": "skipped",
        "container image": "ok",
        "drain": "ok",
        "smoke test": "ok",
        "timeout chain": "ok",
        "load at peak": "ok",
        "eval verdicts": "ok",
        "eval suite": "skipped",
        "game day": "ok",
        "rollback plan": "ok",
    }
    assert "environments    skipped (no --envs given)" in result.output.splitlines()


@pytest.mark.slow
def test_a_dockerfile_that_runs_as_root_is_not_ready(tmp_path: Path) -> None:
    """One broken file (the Dockerfile's USER) fails its named check: exit 1, NOT READY."""
    broken = tmp_path / "Dockerfile"
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "USER 10001:10001" in text
    broken.write_text(text.replace("USER 10001:10001", "USER root"), encoding="utf-8")
    result = readiness(*shipped(broken))
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[-1] == "RESULT: NOT READY"
    assert [n for n, s in statuses(result.output).items() if s == "FAIL"] == ["container image"]
    assert any(line.startswith("container image FAIL: 1 error(s)") for line in lines)
    assert any("DKR002" in line and "USER root: the gateway runs as root" in line for line in lines)


def test_strict_turns_a_skipped_check_into_a_failure(tmp_path: Path) -> None:
    """Without --strict a missing input is a skip; with it the same report is NOT READY."""
    config = str(write_config(tmp_path, small_config()))
    relaxed = readiness("--config", config)
    assert relaxed.exit_code == 0, relaxed.output
    assert "rollback plan   skipped (no --rollback given)" in relaxed.output.splitlines()
    strict = readiness("--config", config, "--strict")
    assert strict.exit_code == 1
    assert "rollback plan   FAIL: skipped with --strict (no --rollback given)" in strict.output
    assert strict.output.splitlines()[-1] == "RESULT: NOT READY"


def test_suite_and_target_go_together() -> None:
    """--suite without --target (or the reverse) is a usage error, exit 2."""
    result = readiness("--config", str(PRODUCTION), "--suite", str(EVAL / "golden.jsonl"))
    assert result.exit_code == 2
    assert "--suite and --target go together" in result.output


def test_a_result_passes_unless_it_failed_or_strict_meets_a_skip() -> None:
    """ok passes; FAIL fails; a skip passes only without strict. Details print indented."""
    ok = CheckResult("a", Status.OK, "fine", ("WARNING x",))
    skipped = CheckResult("b", Status.SKIPPED, "no --b given")
    failed = CheckResult("c", Status.FAIL, "broken")
    assert is_ready([ok, skipped])
    assert not is_ready([ok, skipped], strict=True)
    assert not is_ready([ok, failed])
    assert format_result(ok) == [f"{'a':<16}ok: fine", "    WARNING x"]
    assert format_result(skipped) == [f"{'b':<16}skipped (no --b given)"]


# --------------------------------------------------------------------------- config


def test_a_config_whose_secret_files_are_mounted_later_loads_and_names_them() -> None:
    """Production's secret files are not here: the check passes and lists what to mount."""
    config, result = check_config(PRODUCTION)
    assert config is not None
    assert result.status is Status.OK
    assert "auth.keys_file" in result.summary
    assert "providers.openai-primary.api_key_file" in result.summary


def test_a_config_its_profile_refuses_fails(tmp_path: Path) -> None:
    """Production without authentication is refused by its profile: FAIL with the reason."""
    data = yaml.safe_load(PRODUCTION.read_text(encoding="utf-8"))
    del data["auth"]
    config, result = check_config(write_config(tmp_path, data))
    assert config is not None
    assert result.status is Status.FAIL
    assert "production needs authentication: set auth.keys_file" in result.details


def test_a_config_that_does_not_validate_fails_and_stops_the_checks_that_need_it(
    tmp_path: Path,
) -> None:
    """An unknown key fails the config line; the smoke and load checks then fail too."""
    path = write_config(tmp_path, small_config(surprise=1))
    config, result = check_config(path)
    assert config is None
    assert result.status is Status.FAIL
    assert "unknown key 'surprise'" in result.summary
    assert check_smoke(None, path).status is Status.FAIL
    assert check_load(None, 10.0).status is Status.FAIL


# --------------------------------------------------------------------------- environments


def test_environment_rules_pass_and_fail_with_the_fixtures() -> None:
    """The passing fixture folder is ok; the failing one fails with ENV findings."""
    assert check_environments(None).status is Status.SKIPPED
    good = check_environments(FIXTURES / "envs" / "good")
    assert good.status is Status.OK, good.details
    assert good.summary == "dev, production, staging pass every rule"
    bad = check_environments(FIXTURES / "envs" / "bad")
    assert bad.status is Status.FAIL
    assert any("ENV008" in line for line in bad.details)


# --------------------------------------------------------------------------- the Dockerfile

GOOD = """\
# syntax=docker/dockerfile:1.7
FROM python:3.11.13-slim AS builder
RUN pip install \\
    tidegate
FROM python:3.11.13-slim
ENV PATH=/opt/venv/bin:$PATH PGPASSFILE=/run/tidegate/pgpass
ENV POSTGRES_PASSWORD_FILE /run/secrets/pg
ARG GIT_SHA=unknown
USER 10001:10001
HEALTHCHECK --interval=10s CMD ["python", "-c", "print(1)"]
CMD ["tidegate", "serve"]
"""


def rule_ids(text: str) -> list[str]:
    return [f.rule_id for f in dockerfile_findings(text)]


def test_a_good_dockerfile_has_no_finding() -> None:
    """Pinned images, a non-root user, a health check and no secret: nothing to report."""
    assert dockerfile_findings(GOOD) == []


def test_every_dockerfile_rule_has_a_stable_id_and_a_summary() -> None:
    """The rules table lists each DKR and RDY rule once with its severity."""
    assert sorted(RULES) == [
        "DKR001", "DKR002", "DKR003", "DKR004", "DKR005", "DKR006", "RDY001",
    ]  # fmt: skip
    assert RULES["DKR006"].severity is Severity.WARNING
    assert RULES["DKR002"].severity is Severity.ERROR


def test_a_file_without_from_is_not_a_dockerfile() -> None:
    """DKR001: no FROM at all."""
    assert rule_ids("RUN echo hi\n") == ["DKR001"]


@pytest.mark.parametrize(
    "user", ["USER root", "USER 0", "USER 0:0", "USER root:root", "ARG UID=0\nUSER ${UID}"]
)
def test_a_root_user_fails(user: str) -> None:
    """DKR002: root by name, by uid, or through a build argument's default."""
    assert rule_ids(GOOD.replace("USER 10001:10001", user)) == ["DKR002"]


def test_no_user_or_an_unknown_one_fails() -> None:
    """DKR002: no USER means root; a variable with no default cannot be checked."""
    assert rule_ids(GOOD.replace("USER 10001:10001\n", "")) == ["DKR002"]
    assert rule_ids(GOOD.replace("USER 10001:10001", "USER $APP_UID")) == ["DKR002"]


def test_a_user_in_a_stage_the_final_one_builds_on_counts() -> None:
    """A final stage FROM an earlier stage inherits its USER and HEALTHCHECK."""
    text = (
        'FROM python:3.11.13-slim AS base\nUSER app\nHEALTHCHECK CMD true\nFROM base\nCMD ["run"]\n'
    )
    assert dockerfile_findings(text) == []


def test_a_user_only_in_an_earlier_stage_does_not_count() -> None:
    """A USER in the builder stage does not carry into a final stage built from an image."""
    text = GOOD.replace("USER 10001:10001\n", "").replace(
        "AS builder\n", "AS builder\nUSER 10001\n"
    )
    assert rule_ids(text) == ["DKR002"]


def test_a_missing_or_disabled_healthcheck_fails() -> None:
    """DKR003: no HEALTHCHECK, or HEALTHCHECK NONE."""
    without = "\n".join(line for line in GOOD.splitlines() if "HEALTHCHECK" not in line)
    assert rule_ids(without) == ["DKR003"]
    assert rule_ids(GOOD.replace("HEALTHCHECK --interval=10s CMD", "HEALTHCHECK NONE #")) == [
        "DKR003"
    ]


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("python", "no tag, which means latest"),
        ("python:latest", "names no version"),
        ("python:slim", "names no version"),
        ("python:3-slim", "only a major version"),
        ("python@sha1:abc", "not a sha256 digest"),
        ("${BASE}", "no default"),
    ],
)
def test_an_unpinned_base_image_fails(image: str, expected: str) -> None:
    """DKR004: no tag, a moving tag, a major version only, a bad digest, an unknown argument."""
    problem = image_problem(image)
    assert problem is not None
    assert problem[0] is Severity.ERROR
    assert expected in problem[1]
    assert "DKR004" in rule_ids(GOOD.replace("FROM python:3.11.13-slim\n", f"FROM {image}\n"))


@pytest.mark.parametrize(
    "image",
    [
        "python:3.11.13-slim-bookworm",
        "registry.example.com:5000/team/python:3.11.13",
        "python@sha256:" + "a" * 64,
        "python:3.11.13@sha256:" + "b" * 64,
        "ubuntu:20240125",
    ],
)
def test_a_pinned_base_image_passes(image: str) -> None:
    """An exact version tag (a registry port is not a tag), a digest, or a dated tag."""
    assert image_problem(image) is None


def test_a_major_minor_tag_is_a_warning() -> None:
    """DKR006: python:3.11 moves with patch releases; it warns but does not fail."""
    findings = dockerfile_findings(GOOD.replace("FROM python:3.11.13-slim\n", "FROM python:3.11\n"))
    assert [(f.rule_id, f.severity) for f in findings] == [("DKR006", Severity.WARNING)]


def test_base_images_from_build_arguments_and_stages() -> None:
    """FROM ${BASE} takes the global ARG's default; FROM an earlier stage is not an image."""
    text = "ARG BASE=python:3.11.13-slim\nFROM ${BASE} AS b\nFROM b\nUSER 1\nHEALTHCHECK CMD x\n"
    assert dockerfile_findings(text) == []
    latest = text.replace("3.11.13-slim", "latest")
    assert rule_ids(latest) == ["DKR004"]


@pytest.mark.parametrize(
    "line",
    [
        "ENV OPENAI_API_KEY=abc",
        "ENV DB_PASSWORD hunter2",
        "ARG GITHUB_TOKEN",
        "ENV UPSTREAM=sk-" + "a1B2" * 8,
        "ENV DATABASE_URL=postgresql://app:s3cret@db/app",
    ],
)
def test_a_secret_in_env_or_arg_fails(line: str) -> None:
    """DKR005: a secret-looking name (either ENV form, or ARG), or a value that is a secret."""
    text = GOOD.replace("ARG GIT_SHA=unknown", line)
    assert rule_ids(text) == ["DKR005"]


def test_an_instruction_inside_a_heredoc_or_after_a_comment_is_not_checked() -> None:
    """A USER root in a heredoc body is not an instruction, and a continued RUN stays one."""
    text = (
        "FROM python:3.11.13-slim\n"
        "RUN <<EOF\n"
        "USER root\n"
        "EOF\n"
        "RUN a \\\n"
        "  # a comment inside\n"
        "  && b\n"
        "USER 1000\n"
        "HEALTHCHECK CMD true\n"
    )
    assert dockerfile_findings(text) == []


# --------------------------------------------------------------------------- drain and timeouts


def test_compose_is_checked_with_the_config_it_mounts() -> None:
    """The compose gateways run deploy/compose/tidegate.yaml, whose drain fits compose's grace."""
    assert compose_gateway_config(COMPOSE) == ROOT / "deploy" / "compose" / "tidegate.yaml"
    result = check_drain(read_deployments(PRODUCTION, COMPOSE, KUBERNETES))
    assert result.status is Status.OK, result.details
    assert "compose (runs " in result.summary
    assert "stop_grace_period 40s > drain 30s" in result.summary
    assert "terminationGracePeriodSeconds 80s > preStop 10s + drain 60s" in result.summary


def _compose(tmp_path: Path, grace: str, mount: bool) -> Path:
    service: dict[str, Any] = {
        "image": "tidegate:local",
        "command": ["tidegate", "serve", "--config", "/srv/gw.yaml"],
        "stop_grace_period": grace,
        "labels": {"tidegate.client_timeout_s": "90"},
    }
    if mount:
        service["volumes"] = ["./gw.yaml:/srv/gw.yaml:ro"]
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump({"services": {"gw": service}}), encoding="utf-8")
    return path


def test_a_grace_period_shorter_than_the_drain_fails(tmp_path: Path) -> None:
    """stop_grace_period 10s against a 20s drain: the drain check fails with TMO003."""
    config = write_config(tmp_path, small_config(server={"drain_seconds": 20}))
    shutil.copy(config, tmp_path / "gw.yaml")
    compose = _compose(tmp_path, "10s", mount=True)
    assert compose_gateway_config(compose) == tmp_path / "gw.yaml"
    result = check_drain(read_deployments(config, compose, None))
    assert result.status is Status.FAIL
    assert any("TMO003" in line for line in result.details)
    assert check_drain(
        read_deployments(config, _compose(tmp_path, "30s", mount=False), None)
    ).status is (Status.OK)


def test_without_deployment_files_the_drain_check_is_skipped() -> None:
    """No --compose and no --kubernetes: nothing to compare the drain with."""
    assert check_drain([]).status is Status.SKIPPED


def test_a_timeout_that_outlives_its_caller_fails_the_chain(tmp_path: Path) -> None:
    """A stream limit longer than the request timeout: TMO002 in the chain check."""
    data = small_config(server={"request_timeout_s": 10})
    data["providers"]["main"]["stream"] = {"max_duration_s": 30}
    config = write_config(tmp_path, data)
    result = check_timeout_chain(config, [])
    assert result.status is Status.FAIL
    assert any("TMO002" in line for line in result.details)
    shipped_chain = check_timeout_chain(
        PRODUCTION, read_deployments(PRODUCTION, COMPOSE, KUBERNETES)
    )
    assert shipped_chain.status is Status.OK, shipped_chain.details
    assert "kubernetes: client 90s > load balancer 75s > request 60s" in shipped_chain.summary


def test_the_config_is_checked_alone_when_no_deployment_runs_it() -> None:
    """Compose runs its own config, so production's chain is checked on its own as well."""
    result = check_timeout_chain(PRODUCTION, read_deployments(PRODUCTION, COMPOSE, None))
    assert result.status is Status.OK, result.details
    assert result.summary.startswith("request 60s > stream 55s > calls 46.5s; compose: ")
    assert "compose: client 90s > load balancer 75s > request 30s" in result.summary


# --------------------------------------------------------------------------- smoke test


def test_the_smoke_test_passes_on_the_production_config() -> None:
    """Production's routes and policies on fake providers answer plain and streamed requests."""
    result = check_smoke(production(), PRODUCTION)
    assert result.status is Status.OK, result.details
    assert result.summary.startswith("model chat-default on fake providers")


def test_the_smoke_test_fails_when_the_second_request_is_refused(tmp_path: Path) -> None:
    """A per-user bucket of one request lets the plain answer through and refuses the stream."""
    data = small_config(rate_limits={"per_user": {"rate_per_s": 0.001, "burst": 1}})
    path = write_config(tmp_path, data)
    config, _ = check_config(path)
    result = check_smoke(config, path)
    assert result.status is Status.FAIL
    assert len(result.details) == 1
    assert result.details[0].startswith("streamed request: HTTP 429")


def test_the_smoke_test_fails_when_the_gateway_cannot_start(tmp_path: Path) -> None:
    """A config the runtime refuses (a bad redaction pattern) is reported, not raised."""
    path = write_config(tmp_path, small_config(output={"deny_patterns": ["("]}))
    config, _ = check_config(path)
    result = check_smoke(config, path)
    assert result.status is Status.FAIL
    assert result.summary.startswith("the gateway does not start: output.deny_patterns")


# --------------------------------------------------------------------------- load at peak


def test_the_planned_peak_fits_the_configured_admission() -> None:
    """40 req/s on production's 64 slots: nothing shed, p95 well under the 60 s timeout."""
    result = check_load(production(), 40.0, horizon_s=120.0)
    assert result.status is Status.OK, result.details
    assert "shed 0.00%" in result.summary


def test_a_peak_above_the_ceiling_sheds_and_fails(tmp_path: Path) -> None:
    """Two slots cannot carry 20 req/s of 0.8 s calls: more than 1% is shed."""
    path = write_config(tmp_path, small_config(admission={"slots": 2, "queue_cap": 4}))
    config, _ = check_config(path)
    result = check_load(config, 20.0, horizon_s=120.0)
    assert result.status is Status.FAIL
    assert any(line.startswith("shed ") and "is not under 1%" in line for line in result.details)
    assert check_load(config, None).status is Status.SKIPPED


def test_a_bad_service_time_is_reported() -> None:
    """The lab's distribution syntax is checked; a typo fails the check with the reason."""
    result = check_load(production(), 10.0, service_time="gamma:1")
    assert result.status is Status.FAIL
    assert "cannot read a distribution" in result.summary


# --------------------------------------------------------------------------- eval gate


def test_a_blocked_fallback_fails_and_a_blocked_primary_does_not(tmp_path: Path) -> None:
    """anthropic-fallback falls back for chat-default: block fails; in-house leads every route."""
    store = tmp_path / "verdicts.json"
    record_verdict(store, "in-house", EvalVerdict.BLOCK, {})
    record_verdict(store, "anthropic-fallback", EvalVerdict.GO, {})
    passing = check_eval_verdicts(production(), PRODUCTION, str(store))
    assert passing.status is Status.OK
    assert "anthropic-fallback go" in passing.summary
    assert "openai-primary approved in config, no verdict yet" in passing.summary
    record_verdict(store, "anthropic-fallback", EvalVerdict.BLOCK, {})
    failing = check_eval_verdicts(production(), PRODUCTION, str(store))
    assert failing.status is Status.FAIL
    assert failing.details == (
        "anthropic-fallback is a fallback on chat-default and its latest verdict is block",
    )


def test_an_unreadable_verdict_store_fails(tmp_path: Path) -> None:
    """A verdicts file that is not what tidegate eval writes is a failure, not a pass."""
    store = tmp_path / "verdicts.json"
    store.write_text(json.dumps({"something": "else"}), encoding="utf-8")
    result = check_eval_verdicts(production(), PRODUCTION, str(store))
    assert result.status is Status.FAIL
    assert "cannot read the verdicts" in result.summary


def test_a_suite_run_gives_a_fresh_verdict_that_the_fallback_check_uses(tmp_path: Path) -> None:
    """wayward fails the golden suite (block): the suite line and the verdict line both fail."""
    path = EVAL / "tidegate.yaml"
    config, _ = check_config(path)
    verdict, steady = check_eval_suite(config, path, EVAL / "golden.jsonl", "steady")
    assert (verdict, steady.status) == (EvalVerdict.GO, Status.OK)
    verdict, wayward = check_eval_suite(config, path, EVAL / "golden.jsonl", "wayward")
    assert verdict is EvalVerdict.BLOCK
    assert wayward.status is Status.FAIL
    assert wayward.summary.startswith("wayward: ")
    store = str(tmp_path / "none.json")
    fresh = check_eval_verdicts(config, path, store, {"wayward": verdict})
    assert fresh.status is Status.FAIL
    assert check_eval_verdicts(config, path, store, {"wayward": EvalVerdict.GO}).status is Status.OK


def test_a_fallback_without_a_verdict_is_a_finding(tmp_path: Path) -> None:
    """wayward falls back for chat-default with no verdict and no approved_fallback: failover
    would skip it, so the check fails naming it; an override or a review verdict passes."""
    path = EVAL / "tidegate.yaml"
    config, _ = check_config(path)
    assert config is not None
    store = str(tmp_path / "none.json")
    result = check_eval_verdicts(config, path, store)
    assert result.status is Status.FAIL
    assert result.summary == f"fallback(s) 1 without a verdict (verdicts: {store})"
    assert result.details == (
        "wayward is a fallback on chat-default and has no eval verdict, so failover skips it: "
        "run tidegate eval wayward, or approve it with approved_fallback: true and a reason",
    )
    record_verdict(store, "wayward", EvalVerdict.REVIEW, {})
    reviewed = check_eval_verdicts(config, path, store)
    assert reviewed.status is Status.OK
    assert reviewed.summary == f"every fallback is approved (wayward review; verdicts: {store})"
    for approved, shown in (
        (True, "wayward approved in config, no verdict yet"),
        (False, "wayward off"),
    ):
        providers = dict(config.providers)
        providers["wayward"] = providers["wayward"].model_copy(
            update={"approved_fallback": approved}
        )
        changed = config.model_copy(update={"providers": providers})
        result = check_eval_verdicts(changed, path, str(tmp_path / "still-none.json"))
        assert result.status is Status.OK
        assert shown in result.summary


def test_a_suite_against_a_provider_whose_key_is_not_here_fails_plainly() -> None:
    """Production's openai-primary reads a key file mounted only in the pod: FAIL, no crash."""
    verdict, result = check_eval_suite(
        production(), PRODUCTION, EVAL / "golden.jsonl", "openai-primary"
    )
    assert verdict is None
    assert result.status is Status.FAIL
    assert result.summary.startswith("providers.openai-primary.api_key_file: cannot read")
    assert "openai-api-key" in result.summary


# --------------------------------------------------------------------------- game day


def test_the_gate_rolls_back_the_shipped_bad_candidate_before_full_exposure() -> None:
    """The shipped scenario: the gated canary is rolled back while its share is under 100%."""
    result = check_gameday()
    assert result.status is Status.OK
    assert result.summary.startswith("the shipped scenario: the gate rolled the canary back at ")


def test_a_candidate_the_gate_never_rolls_back_fails(tmp_path: Path) -> None:
    """A healthy candidate reaches 100%: the replay proves nothing about the gate, so it fails."""
    scenario = json.loads((ROOT / "src/tidegate/lab/data/gameday.json").read_text("utf-8"))
    scenario["candidate"] = dict(scenario["baseline"])
    path = tmp_path / "healthy.json"
    path.write_text(json.dumps(scenario), encoding="utf-8")
    result = check_gameday(path)
    assert result.status is Status.FAIL
    assert "did not roll the candidate back" in result.summary
    broken = tmp_path / "broken.json"
    broken.write_text("{", encoding="utf-8")
    assert "cannot read the scenario" in check_gameday(broken).summary


# --------------------------------------------------------------------------- rollback plan


def test_the_shipped_plan_passes_without_findings() -> None:
    """Every RBK rule holds, and production defines the prompt.version flag the plan sets."""
    result = check_rollback_plan(ROLLBACK, production())
    assert result.status is Status.OK, result.details
    assert result.summary.startswith("5 units")
    assert result.details == ()


def test_a_step_setting_an_undefined_flag_is_warned_about(tmp_path: Path) -> None:
    """Without prompt.version under flags, the plan's prompt step draws RDY001."""
    path = write_config(tmp_path, small_config())
    result = check_rollback_plan(ROLLBACK, load_config(path, env={}))
    assert result.status is Status.OK
    assert [line.split()[1] for line in result.details] == ["RDY001"]
    assert "'prompt.version'" in result.details[0]


def test_a_flag_the_config_defines_draws_no_warning(tmp_path: Path) -> None:
    """With prompt.version under flags, the shipped plan has no finding at all."""
    path = write_config(
        tmp_path,
        small_config(
            flags=[{"name": "prompt.version", "type": "str", "default": "v2", "description": "d"}]
        ),
    )
    config, _ = check_config(path)
    result = check_rollback_plan(ROLLBACK, config)
    assert result.details == ()


def test_a_prompt_rollback_by_deploy_fails(tmp_path: Path) -> None:
    """A plan whose prompt unit needs a deploy breaks RBK004: the check fails naming it."""
    plan = yaml.safe_load(ROLLBACK.read_text(encoding="utf-8"))
    for unit in plan["units"]:
        unit["verify"] = str(ROOT / unit["verify"])  # the copy sits outside the repository
    plan["units"][0]["step"] = {"action": "deploy", "run": "make deploy"}
    broken = tmp_path / "rollback.yaml"
    broken.write_text(yaml.safe_dump(plan), encoding="utf-8")
    result = check_rollback_plan(broken, production())
    assert result.status is Status.FAIL
    assert [line.split()[1] for line in result.details] == ["RBK004"]
    assert check_rollback_plan(None).status is Status.SKIPPED


# --------------------------------------------------------------------------- the documentation

DOC = ROOT / "docs" / "readiness.md"


def _examples() -> list[tuple[list[str], str]]:
    """Each readiness command of docs/readiness.md with the text block that follows it."""
    text = DOC.read_text(encoding="utf-8")
    found = []
    pattern = r"```bash\n(tidegate readiness .*?)\n```\n\n```text\n(.*?)```"
    for command, output in re.findall(pattern, text, flags=re.S):
        args = shlex.split(command.replace("\\\n", " "))[2:]
        found.append((args, output))
    return found


@pytest.mark.slow
def test_the_documented_reports_are_the_real_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both reports in docs/readiness.md are what the command prints, run where they say."""
    (shipped_args, shipped_text), (broken_args, broken_text) = _examples()
    monkeypatch.chdir(ROOT)
    result = readiness(*shipped_args)
    assert (result.exit_code, result.output) == (0, shipped_text)
    (tmp_path / "deploy").mkdir()
    shutil.copy(PRODUCTION, tmp_path / "deploy" / PRODUCTION.name)
    text = DOCKERFILE.read_text(encoding="utf-8")
    (tmp_path / "Dockerfile").write_text(text.replace("USER 10001:10001", "USER root"), "utf-8")
    monkeypatch.chdir(tmp_path)
    result = readiness(*broken_args)
    assert (result.exit_code, result.output) == (1, broken_text)


def test_a_check_that_crashes_fails_on_its_own_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected error in one check is that check's FAIL; the others still report."""

    def boom(*args: object, **kwargs: object) -> CheckResult:
        raise RuntimeError("boom")

    monkeypatch.setattr(readiness_module, "check_gameday", boom)
    results = run_readiness(ReadinessInputs(config=PRODUCTION))
    by_name = {r.name: r for r in results}
    assert by_name["game day"].status is Status.FAIL
    assert by_name["game day"].summary == "the check crashed: RuntimeError: boom"
    assert by_name["rollback plan"].status is Status.SKIPPED
    assert len(results) == 11
