"""The Dockerfile, .dockerignore and requirements.lock, read as text (no Docker engine here)."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.conftest import DOCKERFILE, ROOT, SECRET_NAME

#: An image reference pinned to an exact version (``name:1.2.3...``) or to a digest.
PINNED = re.compile(r"^[\w./-]+(:\d+\.\d+\.\d+[\w.-]*)?(@sha256:[0-9a-f]{64})?$")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int


def parse(text: str) -> list[Instruction]:
    """Dockerfile instructions with continuation lines joined, comments dropped, by stage."""
    instructions: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        keyword, _, args = whole.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, " ".join(args.split()), stage))
    return instructions


def env_names(instructions: list[Instruction]) -> list[str]:
    """The variable names every ``ENV`` sets (``ENV A=1 B=2`` and the old ``ENV A 1``)."""
    names = []
    for ins in instructions:
        if ins.keyword != "ENV":
            continue
        if "=" in ins.args.split(" ", 1)[0]:
            names += [pair.split("=", 1)[0] for pair in ins.args.split(" ") if "=" in pair]
        else:
            names.append(ins.args.split(" ", 1)[0])
    return names


def secret_env_names(text: str) -> list[str]:
    return [name for name in env_names(parse(text)) if SECRET_NAME.search(name)]


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse(DOCKERFILE.read_text(encoding="utf-8"))


def final(instructions: list[Instruction]) -> list[Instruction]:
    last = max(ins.stage for ins in instructions)
    return [ins for ins in instructions if ins.stage == last]


def test_the_build_is_multi_stage(dockerfile: list[Instruction]) -> None:
    """A builder stage installs; the final stage copies the virtualenv from it."""
    froms = [ins for ins in dockerfile if ins.keyword == "FROM"]
    assert len(froms) >= 2
    assert froms[0].args.endswith(" AS builder")
    copies = [ins.args for ins in final(dockerfile) if ins.keyword == "COPY"]
    assert any(c.startswith("--from=builder /opt/venv") for c in copies)


def test_every_base_image_is_pinned_and_the_final_one_is_python_3_11_slim(
    dockerfile: list[Instruction],
) -> None:
    """Every FROM names an exact version or a digest; the runtime is Python 3.11 slim."""
    images = [ins.args.split(" ")[0] for ins in dockerfile if ins.keyword == "FROM"]
    for image in images:
        assert PINNED.match(image), image
        assert "@sha256:" in image or re.search(r":\d", image), image
    assert re.match(r"^python:3\.11\.\d+-slim", images[-1]), images[-1]


def test_the_dependency_layer_is_cached_on_the_lock_file(dockerfile: list[Instruction]) -> None:
    """The lock is copied and installed before the source, so code changes reuse that layer."""
    builder = [ins for ins in dockerfile if ins.stage == 0]
    order = [(ins.keyword, ins.args) for ins in builder]
    lock_copy = next(
        i for i, (k, a) in enumerate(order) if k == "COPY" and "requirements.lock" in a
    )
    lock_install = next(i for i, (k, a) in enumerate(order) if "-r requirements.lock" in a)
    source_copy = next(i for i, (k, a) in enumerate(order) if k == "COPY" and a.startswith("src "))
    assert lock_copy < lock_install < source_copy
    assert "pyproject.toml" in order[lock_copy][1]


def test_the_final_stage_runs_as_a_non_root_user(dockerfile: list[Instruction]) -> None:
    """USER in the final stage is a numeric, non-zero uid (runAsNonRoot can verify it)."""
    users = [ins.args for ins in final(dockerfile) if ins.keyword == "USER"]
    assert users, "no USER in the final stage"
    uid = users[-1].split(":")[0]
    assert uid.isdigit()
    assert int(uid) != 0


def test_the_healthcheck_probes_healthz_with_python(dockerfile: list[Instruction]) -> None:
    """HEALTHCHECK calls /healthz through Python's urllib: the slim image has no curl."""
    checks = [ins.args for ins in final(dockerfile) if ins.keyword == "HEALTHCHECK"]
    assert len(checks) == 1
    command = json.loads(checks[0].split("CMD ", 1)[1])
    assert command[0] == "python"
    assert "/healthz" in command[-1]
    assert "urllib.request" in command[-1]


def test_the_git_sha_is_baked_in_and_the_image_serves_the_production_config(
    dockerfile: list[Instruction],
) -> None:
    """ARG GIT_SHA becomes TIDEGATE_GIT_SHA; CMD serves /etc/tidegate/tidegate.yaml on SIGTERM."""
    stage = final(dockerfile)
    assert any(i.keyword == "ARG" and i.args.startswith("GIT_SHA") for i in stage)
    assert any(i.keyword == "ENV" and "TIDEGATE_GIT_SHA=${GIT_SHA}" in i.args for i in stage)
    assert [i.args for i in stage if i.keyword == "STOPSIGNAL"] == ["SIGTERM"]
    cmd = [json.loads(i.args) for i in stage if i.keyword == "CMD"]
    assert cmd == [["tidegate", "serve", "--config", "/etc/tidegate/tidegate.yaml"]]
    copies = [i.args for i in stage if i.keyword == "COPY"]
    assert "deploy/tidegate.production.yaml /etc/tidegate/tidegate.yaml" in copies


def test_no_env_instruction_sets_a_secret(dockerfile: list[Instruction]) -> None:
    """No ENV name looks like a secret; secrets are files mounted at run time."""
    assert env_names(dockerfile), "the parser found no ENV at all"
    assert secret_env_names(DOCKERFILE.read_text(encoding="utf-8")) == []


def test_the_secret_env_check_catches_a_secret() -> None:
    """The ENV check above would fail on a Dockerfile that bakes a key in, in either form."""
    bad = "FROM python:3.11.13-slim\nENV OPENAI_API_KEY=sk-123 A=1\nENV DB_PASSWORD hunter2\n"
    assert secret_env_names(bad) == ["OPENAI_API_KEY", "DB_PASSWORD"]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore (last matching pattern wins, ``!`` re-includes) drops ``path``."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(p, body) for p in prefixes) or (
            body.startswith("**/") and any(fnmatch.fnmatchcase(x, body[3:]) for x in parts)
        ):
            ignored = not negate
    return ignored


def test_dockerignore_sends_what_the_build_copies_and_nothing_secret(
    dockerfile: list[Instruction],
) -> None:
    """Every COPY source reaches the builder; git history, venvs, local state and tests do not."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [
        word
        for ins in dockerfile
        if ins.keyword == "COPY" and not ins.args.startswith("--from")
        for word in ins.args.split(" ")[:-1]
    ]
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not _ignored(source, patterns), f"{source} is excluded from the build context"
    assert _ignored("src/tidegate/__pycache__/cli.cpython-311.pyc", patterns)
    for private in (".git/config", ".venv/bin/python", ".tidegate/state.db", "tests/__init__.py"):
        assert _ignored(private, patterns), private
    assert _ignored("deploy/compose/secrets/pgpass", patterns)


def test_requirements_lock_pins_every_runtime_dependency() -> None:
    """Each line pins one exact version, and every dependency of the project (with the extras the
    image ships: redis, postgres, bedrock, gemini, otel) is in the lock."""
    lines = [
        line.strip()
        for line in (ROOT / "requirements.lock").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    locked = {}
    for line in lines:
        requirement = Requirement(line)
        (spec,) = requirement.specifier
        assert spec.operator == "==", line
        locked[canonicalize_name(requirement.name)] = spec.version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = list(project["dependencies"])
    for extra in ("redis", "postgres", "bedrock", "gemini", "otel"):
        wanted += project["optional-dependencies"][extra]
    for raw in wanted:
        requirement = Requirement(raw)
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{requirement.name} is not in requirements.lock"
        assert requirement.specifier.contains(locked[name]), f"{name}=={locked[name]} vs {raw}"
    # What the extras pull in: uvicorn[standard] and psycopg[binary,pool].
    for pulled in ("uvloop", "httptools", "psycopg-binary", "psycopg-pool"):
        assert pulled in locked, f"{pulled} is not in requirements.lock"
    assert "tidegate" not in locked
