"""``tidegate readiness``: every offline check of a release, one line each, then one verdict.

The checks, in the order they print:

===============  ==========================================================================
config           the config loads with the real loader (secret files may be absent: they are
                 mounted at run time), and its profile's start-up rules hold
environments     :func:`tidegate.ops.envs.check_envs` over ``--envs``
container image  the ``--dockerfile``: non-root ``USER``, a ``HEALTHCHECK``, pinned base images,
                 no secret in ``ENV`` or ``ARG`` (:data:`RULES`, ``DKR...``)
drain            ``server.drain_seconds`` against compose's ``stop_grace_period`` and
                 Kubernetes' ``terminationGracePeriodSeconds`` (:mod:`tidegate.ops.timeouts`)
smoke test       the gateway built from the config, every provider replaced by a fake, answers
                 one streamed and one plain request (each with ``X-Request-ID``) and serves
                 ``/metrics``, all in process
timeout chain    each layer gives up before the one above (:mod:`tidegate.ops.timeouts`)
load at peak     the configured admission at ``--peak-rps`` through the lab: less than 1% shed
                 and the p95 under ``server.request_timeout_s``
eval verdicts    each provider a route falls back to has a verdict that is not ``block``,
                 and one (``go``/``review``) unless the config approves it itself
eval suite       ``--suite`` run against ``--target``: not ``block``
game day         the shipped release scenario (or ``--gameday``) replayed: the gate rolls the
                 bad canary back before full exposure
rollback plan    :func:`tidegate.ops.rollback.check_rollback` over ``--rollback``
===============  ==========================================================================

A check whose input was not given prints ``skipped (no --X given)`` and does not fail the result,
unless ``--strict``. The command prints ``RESULT: READY`` and exits 0, or ``RESULT: NOT READY``
and exits 1; a usage error exits 2.

Compose runs the config it mounts: when a compose gateway service mounts a config file at the
path its ``--config`` names (``/etc/tidegate/tidegate.yaml`` when the image's command is used),
the compose drain and timeout checks use that file (:func:`compose_gateway_config`).
"""

from __future__ import annotations

import asyncio
import math
import re
import shlex
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final
from urllib.parse import urlsplit

import orjson
import typer
import yaml
from pydantic import ValidationError
from structlog.testing import capture_logs

from tidegate.errors import ConfigError, StoreError
from tidegate.gateway.app import Gateway
from tidegate.gateway.auth import hash_key
from tidegate.gateway.build import admission_options_from
from tidegate.gateway.config import (
    AuthConfig,
    Config,
    LoggingConfig,
    StateConfig,
    load_config,
    profile_problems,
    resolve,
)
from tidegate.gateway.http import Message, Receive, Scope, Send
from tidegate.gateway.runtime import build_runtime
from tidegate.gateway.upstreams import upstream_configs
from tidegate.lab.engine import Fleet, Traffic, simulate
from tidegate.lab.gameday import load_scenario, run_release
from tidegate.lab.workload import Deterministic, Poisson, parse_distribution
from tidegate.ops.dockerfile import assignments, parse_dockerfile, stages_of, substitute
from tidegate.ops.envs import check_envs, looks_like_secret
from tidegate.ops.eval import (
    EvalVerdict,
    default_verdict_store,
    evaluate,
    latest_verdicts,
    load_suite,
)
from tidegate.ops.findings import (
    Finding,
    Rule,
    Severity,
    format_finding,
    has_errors,
    rule_table,
)
from tidegate.ops.rollback import StepAction, check_rollback, load_plan
from tidegate.ops.timeouts import (
    Deployment,
    check_timeouts,
    gateway_chains,
    load_timing_config,
    read_compose,
    read_kubernetes,
)
from tidegate.policy.flags import ANSWER_MODE
from tidegate.providers.base import Provider
from tidegate.providers.fake import FakeProvider

__all__ = [
    "DEFAULT_IMAGE_CONFIG",
    "MAX_SHED_SHARE",
    "RULES",
    "AsgiAnswer",
    "CheckResult",
    "Deployed",
    "ReadinessInputs",
    "Status",
    "asgi_request",
    "check_config",
    "check_container_image",
    "check_drain",
    "check_environments",
    "check_eval_suite",
    "check_eval_verdicts",
    "check_gameday",
    "check_load",
    "check_rollback_plan",
    "check_smoke",
    "check_timeout_chain",
    "compose_gateway_config",
    "dockerfile_findings",
    "format_result",
    "image_problem",
    "is_ready",
    "read_deployments",
    "readiness_command",
    "run_readiness",
]

#: Where the image's own command reads its config (``tidegate serve --config ...``).
DEFAULT_IMAGE_CONFIG: Final = "/etc/tidegate/tidegate.yaml"
#: The load check fails at or above this share of requests refused or dropped.
MAX_SHED_SHARE: Final = 0.01

E, W = Severity.ERROR, Severity.WARNING

RULES: Final[Mapping[str, Rule]] = rule_table(
    Rule("DKR001", E, "the Dockerfile reads and has a FROM"),
    Rule("DKR002", E, "the final stage runs as a non-root USER"),
    Rule("DKR003", E, "the final stage has a HEALTHCHECK"),
    Rule("DKR004", E, "every base image is pinned: an exact version tag or a digest"),
    Rule("DKR005", E, "no ENV or ARG holds a secret, by its name or its value"),
    Rule("DKR006", W, "a base image tag names the full version, not only major.minor"),
    Rule("RDY001", W, "every flag a rollback step sets is defined in the config"),
)


# --------------------------------------------------------------------------- results


class Status(StrEnum):
    """How one check came out."""

    OK = "ok"
    FAIL = "FAIL"
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One line of the report: the check, how it came out, why, and the findings under it."""

    name: str
    status: Status
    summary: str
    details: tuple[str, ...] = ()

    def passed(self, *, strict: bool = False) -> bool:
        """Whether this check lets the release go (a skip does, unless ``strict``)."""
        return self.status is Status.OK or (self.status is Status.SKIPPED and not strict)


def _ok(name: str, summary: str, details: Iterable[str] = ()) -> CheckResult:
    return CheckResult(name, Status.OK, summary, tuple(details))


def _failed(name: str, summary: str, details: Iterable[str] = ()) -> CheckResult:
    return CheckResult(name, Status.FAIL, summary, tuple(details))


def _skipped(name: str, option: str) -> CheckResult:
    return CheckResult(name, Status.SKIPPED, f"no {option} given")


def _from_findings(name: str, findings: Sequence[Finding], clean: str) -> CheckResult:
    lines = [format_finding(f) for f in findings]
    if has_errors(findings):
        errors = sum(1 for f in findings if f.severity is Severity.ERROR)
        return _failed(name, f"{errors} error(s)", lines)
    warned = f" ({len(findings)} warning(s))" if findings else ""
    return _ok(name, clean + warned, lines)


def _no_config(name: str) -> CheckResult:
    return _failed(name, "needs a config that loads (see the config line)")


NAME_WIDTH: Final = 16


def format_result(result: CheckResult) -> list[str]:
    """The check's line (``name  ok: summary``), then its findings indented."""
    if result.status is Status.SKIPPED:
        head = f"skipped ({result.summary})"
    else:
        head = f"{result.status.value}: {result.summary}"
    return [f"{result.name:<{NAME_WIDTH}}{head}", *(f"    {d}" for d in result.details)]


def is_ready(results: Iterable[CheckResult], *, strict: bool = False) -> bool:
    """Whether every check passed (with ``strict``, a skipped check fails)."""
    return all(r.passed(strict=strict) for r in results)


# --------------------------------------------------------------------------- config


def _absent_secret_files(config: Config, config_path: Path) -> list[str]:
    files: list[tuple[str, Path | None]] = [
        ("auth.keys_file", config.auth.keys_file),
        ("auth.admin_keys_file", config.auth.admin_keys_file),
    ]
    files += [(f"providers.{n}.api_key_file", p.api_key_file) for n, p in config.providers.items()]
    return [
        key for key, path in files if path is not None and not resolve(config_path, path).is_file()
    ]


def check_config(path: Path) -> tuple[Config | None, CheckResult]:
    """The config as the other checks see it, and whether it may start.

    The real loader is tried first (without ``TIDEGATE_*`` overrides: the file is what is
    checked). A config it refuses only because its secret files are not on this machine passes,
    naming them; any other refusal fails. A config that validates but breaks its profile's rules
    is still returned, so the other checks can run.
    """
    name = "config"
    try:
        config = load_config(path, env={})
    except ConfigError as exc:
        refusal = exc.message
    else:
        return config, _ok(name, f"{path} loads (profile {config.profile.value})")
    try:
        config = Config.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    except (OSError, yaml.YAMLError, ValidationError):
        return None, _failed(name, refusal)
    problems = profile_problems(config)
    if problems:
        return config, _failed(name, f"profile {config.profile.value} refuses to start", problems)
    absent = _absent_secret_files(config, path)
    if not absent:
        return config, _failed(name, refusal)
    return config, _ok(
        name,
        f"{path} loads (profile {config.profile.value}); secret files to mount at run time: "
        + ", ".join(absent),
    )


# --------------------------------------------------------------------------- environments


def check_environments(envs: Path | None) -> CheckResult:
    """The environment rules (``ENV...``) over every environment folder in ``envs``."""
    name = "environments"
    if envs is None:
        return _skipped(name, "--envs")
    findings = check_envs(envs)
    folders = sorted(p.name for p in envs.iterdir() if p.is_dir()) if envs.is_dir() else []
    return _from_findings(name, findings, f"{', '.join(folders)} pass every rule")


# --------------------------------------------------------------------------- the Dockerfile


def image_problem(image: str) -> tuple[Severity, str] | None:
    """Why a base image reference is not pinned (an error) or only loosely (a warning)."""
    if "$" in image:
        return E, f"{image} names a build argument with no default: no one image is pinned"
    if "@" in image:
        digest = image.split("@", 1)[1]
        if re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            return None
        return E, f"{image}: {digest!r} is not a sha256 digest"
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return E, f"{image} has no tag, which means latest: name an exact version or a digest"
    tag = last.split(":", 1)[1]
    version = re.match(r"v?(\d+(?:\.\d+)*)", tag)
    if version is None:
        return E, f"{image}: the tag {tag!r} names no version, and it moves"
    parts = version.group(1).split(".")
    if len(parts) == 1 and len(parts[0]) < 8:  # eight digits and more: a date or a build number
        return E, f"{image} names only a major version, which moves with every release"
    if len(parts) == 2:
        return W, f"{image} names major.minor only, which moves with patch releases"
    return None


_SECRET_WORDS: Final = frozenset(
    {
        "KEY",
        "APIKEY",
        "SECRET",
        "TOKEN",
        "PASSWORD",
        "PASSWD",
        "CREDENTIAL",
        "CREDENTIALS",
        "PRIVATE",
    }
)
_PATH_WORDS: Final = frozenset({"FILE", "PATH", "DIR"})


def _secret_name(name: str) -> bool:
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name.upper()) if w]
    if not words or words[-1] in _PATH_WORDS:
        return False
    return any(w in _SECRET_WORDS for w in words)


def _secret_value(value: str) -> str | None:
    kind = looks_like_secret(value)
    if kind is not None:
        return kind
    if "://" in value and "$" not in value:
        try:
            if urlsplit(value).password:
                return "a URL with a password"
        except ValueError:
            return None
    return None


def dockerfile_findings(text: str, shown: str = "Dockerfile") -> list[Finding]:
    """Every ``DKR...`` finding of a Dockerfile's text."""
    instructions = parse_dockerfile(text)
    stages = stages_of(instructions)
    if not stages:
        return [RULES["DKR001"].finding("no FROM: not a Dockerfile", shown)]
    findings: list[Finding] = []
    for stage in stages:
        if stage.parent is not None or stage.image.lower() == "scratch":
            continue
        problem = image_problem(stage.image)
        if problem is not None:
            severity, message = problem
            rule = RULES["DKR004"] if severity is E else RULES["DKR006"]
            findings.append(rule.finding(message, f"{shown}:{stage.line}"))
    final = stages[-1]
    user = final.last("USER")
    if user is None:
        findings.append(
            RULES["DKR002"].finding(
                "the final stage sets no USER, so the gateway runs as root", f"{shown}"
            )
        )
    else:
        who = substitute(user.args, final.values()).split(":", 1)[0].strip()
        if "$" in who:
            findings.append(
                RULES["DKR002"].finding(
                    f"USER {user.args} names a variable with no default: the user is unknown",
                    f"{shown}:{user.line}",
                )
            )
        elif who in ("root", "0"):
            findings.append(
                RULES["DKR002"].finding(
                    f"USER {user.args}: the gateway runs as root", f"{shown}:{user.line}"
                )
            )
    check = final.last("HEALTHCHECK")
    if check is None:
        findings.append(
            RULES["DKR003"].finding(
                "the final stage has no HEALTHCHECK: docker and compose cannot tell a hung "
                "gateway from a working one",
                shown,
            )
        )
    elif check.args.split(" ", 1)[0].upper() == "NONE":
        findings.append(
            RULES["DKR003"].finding(
                "HEALTHCHECK NONE turns the health check off", f"{shown}:{check.line}"
            )
        )
    for ins in instructions:
        if ins.keyword not in ("ENV", "ARG"):
            continue
        for name, value in assignments(ins.keyword, ins.args):
            where = f"{shown}:{ins.line}"
            if _secret_name(name):
                findings.append(
                    RULES["DKR005"].finding(
                        f"{ins.keyword} {name} looks like a secret: it stays in the image (and "
                        "its history); mount secrets as files at run time",
                        where,
                    )
                )
            elif value and (kind := _secret_value(value)) is not None:
                findings.append(
                    RULES["DKR005"].finding(
                        f"{ins.keyword} {name} holds {kind}: it stays in the image; mount "
                        "secrets as files at run time",
                        where,
                    )
                )
    return findings


def check_container_image(dockerfile: Path | None) -> CheckResult:
    """The ``DKR...`` rules over ``--dockerfile``."""
    name = "container image"
    if dockerfile is None:
        return _skipped(name, "--dockerfile")
    try:
        text = dockerfile.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        finding = RULES["DKR001"].finding(f"cannot read the Dockerfile ({exc})", str(dockerfile))
        return _from_findings(name, [finding], "")
    findings = dockerfile_findings(text, str(dockerfile))
    if has_errors(findings):
        return _from_findings(name, findings, "")
    stages = stages_of(parse_dockerfile(text))
    final = stages[-1]
    user = final.last("USER")
    bases = sorted({s.image for s in stages if s.parent is None and s.image.lower() != "scratch"})
    clean = (
        f"non-root USER {user.args if user else '?'}, HEALTHCHECK, pinned "
        f"{', '.join(bases) or 'scratch'}, no secret in ENV or ARG"
    )
    return _from_findings(name, findings, clean)


# --------------------------------------------------------------------------- deployments


def _words(value: Any) -> list[str]:
    if isinstance(value, list):
        return [str(v) for v in value]
    if value is None:
        return []
    try:
        return shlex.split(str(value))
    except ValueError:
        return str(value).split()


def _config_argument(words: Sequence[str]) -> str | None:
    """The config a command passes to ``tidegate serve`` (``--config X``, ``-c X``,
    ``--config=X``), also inside a shell string (``sh -c "... tidegate serve --config X"``)."""
    tokens: list[str] = []
    for word in words:
        tokens += _words(word) if " " in word else [word]
    if "serve" not in tokens:
        return None
    after = tokens[tokens.index("serve") + 1 :]
    for index, token in enumerate(after):
        if token.startswith("--config="):
            return token.split("=", 1)[1]
        if token in ("--config", "-c") and index + 1 < len(after):
            return after[index + 1]
    return None


def _is_gateway_service(service: Mapping[str, Any]) -> bool:
    labels = service.get("labels")
    marks: dict[str, str] = {}
    if isinstance(labels, Mapping):
        marks = {str(k): str(v) for k, v in labels.items()}
    elif isinstance(labels, list):
        marks = dict(str(item).partition("=")[::2] for item in labels)
    explicit = marks.get("tidegate.gateway")
    if explicit is not None:
        return explicit.strip().lower() in ("true", "1", "yes", "on")
    texts = [str(service.get("image", "")), *_words(service.get("command"))]
    texts += _words(service.get("entrypoint"))
    return any("tidegate" in t.lower() for t in texts)


def compose_gateway_config(compose: Path) -> Path | None:
    """The host file a compose gateway service mounts as its config, if there is one.

    The container path is the one its command passes to ``--config`` (the image's own command
    reads :data:`DEFAULT_IMAGE_CONFIG`); the host file must exist. ``None`` when no gateway
    service mounts its config from a file.
    """
    try:
        data = yaml.safe_load(compose.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    services = data.get("services") if isinstance(data, Mapping) else None
    if not isinstance(services, Mapping):
        return None
    for service in services.values():
        if not isinstance(service, Mapping) or not _is_gateway_service(service):
            continue
        words = _words(service.get("entrypoint")) + _words(service.get("command"))
        inside = _config_argument(words) or DEFAULT_IMAGE_CONFIG
        for volume in service.get("volumes") or ():
            if isinstance(volume, str):
                parts = volume.split(":")
                host, target = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
            elif isinstance(volume, Mapping):
                host, target = str(volume.get("source", "")), str(volume.get("target", ""))
            else:
                continue
            if target != inside or not host.startswith((".", "/", "~")):
                continue
            path = Path(host).expanduser()
            path = path if path.is_absolute() else compose.parent / path
            if path.is_file():
                return path
    return None


@dataclass(frozen=True, slots=True)
class Deployed:
    """One set of deployment files, the config it runs, and what the timeout check found."""

    kind: str
    path: Path
    config_path: Path
    deployment: Deployment | None
    drain_s: float | None
    findings: tuple[Finding, ...]


def read_deployments(
    config_path: Path, compose: Path | None, kubernetes: Path | None
) -> list[Deployed]:
    """The deployment files given, each with the config it runs and its timeout findings."""
    deployed: list[Deployed] = []
    if compose is not None:
        runs = compose_gateway_config(compose) or config_path
        timing, _ = load_timing_config(runs)
        deployed.append(
            Deployed(
                "compose",
                compose,
                runs,
                read_compose(compose)[0],
                None if timing is None else timing.server.drain_seconds,
                tuple(check_timeouts(runs, compose=compose)),
            )
        )
    if kubernetes is not None:
        timing, _ = load_timing_config(config_path)
        deployed.append(
            Deployed(
                "kubernetes",
                kubernetes,
                config_path,
                read_kubernetes(kubernetes)[0],
                None if timing is None else timing.server.drain_seconds,
                tuple(check_timeouts(config_path, kubernetes=kubernetes)),
            )
        )
    return deployed


_DRAIN_RULES: Final = frozenset({"TMO003", "TMO004", "TMO005", "TMO006"})


def _drain_finding(finding: Finding) -> bool:
    if finding.rule_id in _DRAIN_RULES:
        return True
    grace = ("stop_grace_period", "terminationGracePeriodSeconds")
    return finding.rule_id == "TMO007" and any(word in finding.message for word in grace)


def _grace_text(item: Deployed) -> str:
    if item.deployment is None or not item.deployment.graces or item.drain_s is None:
        return f"{item.kind}: unreadable"
    grace = min(item.deployment.graces, key=lambda g: g.grace_s - g.pre_stop_s)
    if item.kind == "compose":
        return (
            f"compose (runs {item.config_path}): stop_grace_period {grace.grace_s:g}s > "
            f"drain {item.drain_s:g}s"
        )
    return (
        f"kubernetes terminationGracePeriodSeconds {grace.grace_s:g}s > preStop "
        f"{grace.pre_stop_s:g}s + drain {item.drain_s:g}s"
    )


def check_drain(deployed: Sequence[Deployed]) -> CheckResult:
    """Each orchestrator waits longer than the gateway's drain before it kills the gateway."""
    name = "drain"
    if not deployed:
        return _skipped(name, "--compose or --kubernetes")
    findings = [f for item in deployed for f in item.findings if _drain_finding(f)]
    return _from_findings(name, findings, "; ".join(_grace_text(item) for item in deployed))


def _chain_text(config: Config, where: str, deployment: Deployment | None) -> str:
    layers: list[tuple[str, float]] = []
    if deployment is not None:
        if deployment.clients:
            layers.append(("client", min(c.layer.timeout_s for c in deployment.clients)))
        if deployment.balancers:
            layers.append(("load balancer", max(b.layer.timeout_s for b in deployment.balancers)))
    chains = gateway_chains(config, where)
    if chains:
        layers.append(("request", chains[0][0].layer.timeout_s))
        layers.append(("stream", max(c[1].layer.timeout_s for c in chains)))
        layers.append(("calls", max(c[2].layer.timeout_s for c in chains)))
    return " > ".join(f"{label} {seconds:g}s" for label, seconds in layers)


def check_timeout_chain(config_path: Path, deployed: Sequence[Deployed]) -> CheckResult:
    """Each layer gives up before the one above, for the config and every deployment given."""
    name = "timeout chain"
    findings = [f for item in deployed for f in item.findings if not _drain_finding(f)]
    targets: list[Deployed | None] = [*deployed]
    if all(item.config_path != config_path for item in deployed):
        # No deployment runs --config itself (compose may mount its own): check it alone too.
        findings = check_timeouts(config_path) + findings
        targets.insert(0, None)
    unique = list(dict.fromkeys(findings))
    if has_errors(unique):
        return _from_findings(name, unique, "")
    texts: list[str] = []
    for item in targets:
        path = config_path if item is None else item.config_path
        config, _ = load_timing_config(path)
        if config is None:
            continue
        text = _chain_text(config, str(path), None if item is None else item.deployment)
        texts.append(text if item is None else f"{item.kind}: {text}")
    return _from_findings(name, unique, "; ".join(dict.fromkeys(texts)))


# --------------------------------------------------------------------------- smoke test

SMOKE_KEY: Final = "tg-readiness-smoke-key"
SMOKE_TEXT: Final = "ready when you are"


@dataclass(frozen=True, slots=True)
class AsgiAnswer:
    status: int
    headers: dict[str, str]
    body: bytes


async def asgi_request(
    app: Callable[[Scope, Receive, Send], Awaitable[None]],
    method: str,
    path: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
) -> AsgiAnswer:
    """One request to an ASGI app in process; the client disconnects once the answer is whole."""
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    if body:
        raw += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 50000),
        "server": ("readiness.local", 80),
    }
    delivered = False
    complete = asyncio.Event()
    status = 0
    answer_headers: dict[str, str] = {}
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
            for key, value in message.get("headers", ()):
                answer_headers[bytes(key).decode("latin-1").lower()] = bytes(value).decode(
                    "latin-1"
                )
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body"):
                complete.set()

    on_receive: Receive = receive
    on_send: Send = send
    await app(scope, on_receive, on_send)
    return AsgiAnswer(status, answer_headers, b"".join(chunks))


def _smoke_config(config: Config, config_path: Path, keys_file: Path) -> Config:
    """The config with in-memory state, one test caller, quiet logs and no admin API; a
    degraded-mode corpus that is not on this machine is left out."""
    auth = AuthConfig(keys_file=keys_file)
    state = StateConfig(url="memory://", timeout_s=config.state.timeout_s)
    logging = LoggingConfig(level="error", json_lines=config.logging.json_lines)
    updates: dict[str, Any] = {"auth": auth, "state": state, "logging": logging}
    corpus = config.degraded.corpus_dir
    if corpus is not None and not resolve(config_path, corpus).is_dir():
        updates["degraded"] = config.degraded.model_copy(update={"corpus_dir": None})
    return config.model_copy(update=updates)


def _problem(label: str, answer: AsgiAnswer) -> str | None:
    if answer.status != 200:
        return f"{label}: HTTP {answer.status} {answer.body[:200].decode('utf-8', 'replace')}"
    if not answer.headers.get("x-request-id"):
        return f"{label}: no X-Request-ID header"
    return None


async def _smoke(config: Config, config_path: Path, folder: Path) -> list[str]:
    classes = config.admission.classes
    priority = "standard" if "standard" in classes else classes[0]
    keys = folder / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {
                        "id": "readiness",
                        "sha256": hash_key(SMOKE_KEY),
                        "tenant": "readiness",
                        "user": "readiness",
                        "priority": priority,
                        "data_class": "public",  # the class every provider may see
                    }
                ]
            }
        ),
        encoding="utf-8",
    )
    smoke = _smoke_config(config, config_path, keys)
    providers: dict[str, Provider] = {
        name: FakeProvider.from_script({"text": SMOKE_TEXT}, name=name) for name in config.providers
    }
    runtime = await build_runtime(smoke, config_path, providers=providers)
    app = Gateway(smoke, config_path, runtime=runtime)
    problems: list[str] = []
    try:
        model = next(iter(config.models))
        auth = {"authorization": f"Bearer {SMOKE_KEY}"}
        request = {"model": model, "messages": [{"role": "user", "content": "are you ready?"}]}
        plain = await asgi_request(app, "POST", "/v1/chat/completions", orjson.dumps(request), auth)
        problem = _problem("plain request", plain)
        if problem is None and SMOKE_TEXT not in plain.body.decode("utf-8", "replace"):
            problem = "plain request: the answer is not the fake provider's text"
        if problem is not None:
            problems.append(problem)
        # Another question, so that the response cache cannot answer for the provider.
        question = {"role": "user", "content": "are you ready to stream?"}
        streamed = await asgi_request(
            app,
            "POST",
            "/v1/chat/completions",
            orjson.dumps({**request, "messages": [question], "stream": True}),
            auth,
        )
        problem = _problem("streamed request", streamed)
        text = streamed.body.decode("utf-8", "replace")
        if problem is None and not streamed.headers.get("content-type", "").startswith(
            "text/event-stream"
        ):
            problem = "streamed request: not an event stream"
        if problem is None and "data: [DONE]" not in text:
            problem = "streamed request: the stream did not end with data: [DONE]"
        if problem is not None:
            problems.append(problem)
        # On the admin listener when the config puts it there (server.admin_metrics).
        where = app.admin if app.admin is not None and smoke.server.admin_metrics else app
        metrics = await asgi_request(where, "GET", "/metrics")
        if metrics.status != 200 or b"# TYPE" not in metrics.body:
            problems.append(f"/metrics: HTTP {metrics.status}, no Prometheus text")
    finally:
        await app.shutdown()
    return problems


def check_smoke(
    config: Config | None, config_path: Path, *, timeout_s: float = 30.0
) -> CheckResult:
    """Build the gateway from the config with fake providers and send it real requests.

    State is in memory and the callers' keys are replaced by one test key, so nothing outside
    the process is touched; routes, admission, limits, budgets and flags are the config's.
    """
    name = "smoke test"
    if config is None:
        return _no_config(name)

    async def run() -> list[str]:
        with tempfile.TemporaryDirectory(prefix="tidegate-readiness-") as folder:
            async with asyncio.timeout(timeout_s):
                return await _smoke(config, config_path, Path(folder))

    try:
        # The gateway logs through structlog; here its lines are captured, not printed.
        with capture_logs():
            problems = asyncio.run(run())
    except TimeoutError:
        return _failed(name, f"the in-process gateway did not answer within {timeout_s:g}s")
    except (ConfigError, StoreError) as exc:
        return _failed(name, f"the gateway does not start: {exc.message}")
    except Exception as exc:  # any crash of the app is the finding itself
        return _failed(name, f"the gateway crashed: {type(exc).__name__}: {exc}")
    if problems:
        return _failed(name, f"{len(problems)} problem(s)", problems)
    model = next(iter(config.models))
    return _ok(
        name,
        f"model {model} on fake providers: a plain and a streamed answer, each with "
        "X-Request-ID; /metrics serves",
    )


# --------------------------------------------------------------------------- load at peak

#: Peak traffic is spread over this many tenants, so per-tenant bulkheads do not bind alone.
LOAD_TENANTS: Final = 16


def check_load(
    config: Config | None,
    peak_rps: float | None,
    *,
    replicas: int = 1,
    service_time: str = "exp:0.8",
    cpu_s: float = 0.015,
    horizon_s: float = 600.0,
    seed: int = 0,
) -> CheckResult:
    """The config's admission at the planned peak, in the lab's virtual time.

    ``replicas`` workers, each with the configured slots and queues and one core, serve Poisson
    arrivals at ``peak_rps`` whose model calls take ``service_time`` (lab notation: ``exp:0.8``,
    ``lognormal:0.8,2``, ``det:1``) plus ``cpu_s`` of CPU; each caller waits
    ``server.request_timeout_s``. Passes when less than :data:`MAX_SHED_SHARE` is refused or
    dropped and the p95 of the answers is under the request timeout.
    """
    name = "load at peak"
    if peak_rps is None:
        return _skipped(name, "--peak-rps")
    if config is None:
        return _no_config(name)
    try:
        fleet = Fleet(
            admission=admission_options_from(config),
            io=parse_distribution(service_time),
            cpu=Deterministic(value=cpu_s) if cpu_s > 0 else None,
            workers=replicas,
        )
        traffic = Traffic(
            arrivals=Poisson(rate=peak_rps),
            deadline=config.server.request_timeout_s,
            tenants=LOAD_TENANTS,
        )
        report = simulate(traffic, fleet, horizon=horizon_s, warmup=horizon_s / 10, seed=seed)
    except ValueError as exc:
        return _failed(name, str(exc))
    total = report.total
    refused = total.shed_total + total.expired
    share = refused / total.offered if total.offered else 0.0
    p95 = total.latency.p95
    limit = config.server.request_timeout_s
    text = (
        f"{peak_rps:g} req/s on {replicas} replica(s) x {config.admission.slots} slots "
        f"(ceiling {fleet.ceiling:.1f} req/s): shed {share:.2%}, p95 {p95:.2f}s"
    )
    problems = []
    if share >= MAX_SHED_SHARE:
        problems.append(f"shed {share:.2%} is not under {MAX_SHED_SHARE:.0%}")
    if math.isnan(p95) or p95 >= limit:
        problems.append(f"p95 {p95:.2f}s is not under server.request_timeout_s ({limit:g}s)")
    if problems:
        return _failed(name, text, problems)
    return _ok(name, f"{text} < {limit:g}s")


# --------------------------------------------------------------------------- eval gate


def _fallbacks(config: Config) -> dict[str, list[str]]:
    """Providers that some route falls back to (any place after the first), with the routes."""
    found: dict[str, list[str]] = {}
    for alias, route in config.models.items():
        for provider in route.providers[1:]:
            found.setdefault(provider, []).append(alias)
    return found


def check_eval_verdicts(
    config: Config | None,
    config_path: Path,
    store: str | None = None,
    fresh: Mapping[str, EvalVerdict] | None = None,
) -> CheckResult:
    """Every provider that a route falls back to may be used automatically by evidence: its
    latest eval verdict is not ``block``, and it has one (``go`` or ``review``) unless the config
    approves it explicitly (``approved_fallback: true``) or takes it out (``false``).

    ``store`` defaults to where ``tidegate eval`` records them for this config; ``fresh``
    verdicts (from ``--suite``) take the place of the stored ones.
    """
    name = "eval verdicts"
    if config is None:
        return _no_config(name)
    where = store or default_verdict_store(config, config_path)
    try:
        verdicts = {**latest_verdicts(where), **(fresh or {})}
    except (ConfigError, StoreError) as exc:
        return _failed(name, f"cannot read the verdicts in {where}: {exc.message}")
    except ValueError as exc:
        return _failed(name, f"cannot read the verdicts in {where}: {exc}")
    fallbacks = _fallbacks(config)
    if not fallbacks:
        return _ok(name, "no route falls back to another provider")
    upstreams = upstream_configs(config)
    blocked, unjudged, parts = [], [], []
    for provider, routes in sorted(fallbacks.items()):
        verdict, approved = verdicts.get(provider), upstreams[provider].approved_fallback
        on = f"{provider} is a fallback on {', '.join(routes)}"
        if verdict is EvalVerdict.BLOCK:
            blocked.append(f"{on} and its latest verdict is block")
        elif verdict is None and approved is None:
            unjudged.append(
                f"{on} and has no eval verdict, so failover skips it: run tidegate eval "
                f"{provider}, or approve it with approved_fallback: true and a reason"
            )
        parts.append(_fallback_state(provider, verdict, approved))
    if blocked or unjudged:
        counts = [f"{len(blocked)} blocked"] if blocked else []
        counts += [f"{len(unjudged)} without a verdict"] if unjudged else []
        summary = f"fallback(s) {' and '.join(counts)} (verdicts: {where})"
        return _failed(name, summary, blocked + unjudged)
    return _ok(name, f"every fallback is approved ({'; '.join(parts)}; verdicts: {where})")


def _fallback_state(provider: str, verdict: EvalVerdict | None, approved: bool | None) -> str:
    """One fallback as the summary shows it: its verdict, and the config's say if it has one."""
    if approved is False:
        return f"{provider} off (approved_fallback: false)"
    if verdict is None:
        return f"{provider} approved in config, no verdict yet" if approved else provider
    return f"{provider} {verdict.value}"


def check_eval_suite(
    config: Config | None,
    config_path: Path,
    suite: Path | None,
    target: str | None,
    *,
    timeout_s: float = 30.0,
) -> tuple[EvalVerdict | None, CheckResult]:
    """Run ``suite`` against provider ``target`` (as ``tidegate eval`` does, without recording)."""
    name = "eval suite"
    if suite is None or target is None:
        return None, _skipped(name, "--suite and --target")
    if config is None:
        return None, _no_config(name)
    try:
        cases = load_suite(suite)
        report = asyncio.run(evaluate(config, config_path, target, cases, timeout_s=timeout_s))
    except ConfigError as exc:  # also a secret file of the target that is not on this machine
        return None, _failed(name, exc.message)
    failures = [f"FAIL {r.case_id}: {'; '.join(r.reasons)}" for r in report.results if not r.passed]
    text = (
        f"{target}: {report.passed}/{report.total} passed ({report.pass_rate:.0%}) -> "
        f"{report.verdict.value}"
    )
    if report.verdict is EvalVerdict.BLOCK:
        return report.verdict, _failed(name, text, failures)
    return report.verdict, _ok(name, text, failures)


# --------------------------------------------------------------------------- game day


def check_gameday(scenario: Path | None = None, *, seed: int = 0) -> CheckResult:
    """Replay a release with a defect that grows with traffic: the gate must roll it back.

    The canary runs with the real rollout gate (``tidegate lab gameday``); it passes when the
    gate rolls the candidate back while its share is still under 100%. ``scenario`` defaults to
    the one shipped with tidegate; any other must also describe a candidate that should fail.
    """
    name = "game day"
    try:
        loaded = load_scenario(scenario)
    except (OSError, ValueError) as exc:
        return _failed(name, f"cannot read the scenario: {exc}")
    result = run_release(loaded, "canary", gated=True, seed=seed)
    shown = "the shipped scenario" if scenario is None else str(scenario)
    rollback = next((s for s in result.steps if s.action == "rollback"), None)
    full = [s for s in result.steps if s.share >= 1.0]
    if rollback is None or result.rolled_back_at is None:
        return _failed(
            name,
            f"{shown}: the gate did not roll the candidate back (outcome {result.outcome})",
            [f"{s.at / 60:.0f} min, share {s.share:.0%}: {s.action}" for s in result.steps],
        )
    if full and full[0].at <= rollback.at:
        return _failed(name, f"{shown}: the candidate reached 100% before the gate rolled it back")
    return _ok(
        name,
        f"{shown}: the gate rolled the canary back at {rollback.share:.0%} after "
        f"{result.rolled_back_at / 60:.0f} min ({rollback.reasons[0]})",
    )


# --------------------------------------------------------------------------- rollback plan


def check_rollback_plan(plan: Path | None, config: Config | None = None) -> CheckResult:
    """The rollback plan's rules (``RBK...``), and its flag steps against the config's flags."""
    name = "rollback plan"
    if plan is None:
        return _skipped(name, "--rollback")
    findings = check_rollback(plan)
    loaded, _ = load_plan(plan)
    if loaded is not None and config is not None:
        known = {ANSWER_MODE, *(f.name for f in config.flags)}
        for index, unit in enumerate(loaded.units):
            step = unit.step
            if step.action is StepAction.FLAG and step.flag is not None and step.flag not in known:
                findings.append(
                    RULES["RDY001"].finding(
                        f"{unit.name}: the config defines no flag {step.flag!r}: add it under "
                        "flags before this step can run",
                        f"{plan} [units.{index} {unit.name}]",
                    )
                )
    units = len(loaded.units) if loaded is not None else 0
    return _from_findings(
        name, findings, f"{units} units, every kind, exact versions, verify tests exist"
    )


# --------------------------------------------------------------------------- the report


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadinessInputs:
    """Everything ``tidegate readiness`` was given; ``None`` skips the check that needs it."""

    config: Path
    envs: Path | None = None
    compose: Path | None = None
    kubernetes: Path | None = None
    dockerfile: Path | None = None
    rollback: Path | None = None
    suite: Path | None = None
    target: str | None = None
    gameday: Path | None = None
    peak_rps: float | None = None
    replicas: int = 1
    service_time: str = "exp:0.8"
    verdicts: str | None = None
    seed: int = 0


def _safely(name: str, run: Callable[[], CheckResult]) -> CheckResult:
    """A check that crashes fails on its own line; the report goes on."""
    try:
        return run()
    except Exception as exc:  # the report must show every other check too
        return _failed(name, f"the check crashed: {type(exc).__name__}: {exc}")


def run_readiness(
    inputs: ReadinessInputs, *, emit: Callable[[CheckResult], None] | None = None
) -> list[CheckResult]:
    """Run every check in order; ``emit`` sees each result as soon as it is known."""
    results: list[CheckResult] = []

    def add(result: CheckResult) -> None:
        results.append(result)
        if emit is not None:
            emit(result)

    config, loaded = check_config(inputs.config)
    add(loaded)
    add(_safely("environments", lambda: check_environments(inputs.envs)))
    add(_safely("container image", lambda: check_container_image(inputs.dockerfile)))
    deployed = read_deployments(inputs.config, inputs.compose, inputs.kubernetes)
    add(_safely("drain", lambda: check_drain(deployed)))
    add(_safely("smoke test", lambda: check_smoke(config, inputs.config)))
    add(_safely("timeout chain", lambda: check_timeout_chain(inputs.config, deployed)))
    add(
        _safely(
            "load at peak",
            lambda: check_load(
                config,
                inputs.peak_rps,
                replicas=inputs.replicas,
                service_time=inputs.service_time,
                seed=inputs.seed,
            ),
        )
    )
    verdict: EvalVerdict | None = None
    try:
        verdict, suite = check_eval_suite(config, inputs.config, inputs.suite, inputs.target)
    except Exception as exc:  # as in _safely: the report goes on
        suite = _failed("eval suite", f"the check crashed: {type(exc).__name__}: {exc}")
    fresh = {inputs.target: verdict} if verdict is not None and inputs.target else None
    add(
        _safely(
            "eval verdicts",
            lambda: check_eval_verdicts(config, inputs.config, inputs.verdicts, fresh),
        )
    )
    add(suite)
    add(_safely("game day", lambda: check_gameday(inputs.gameday, seed=inputs.seed)))
    add(_safely("rollback plan", lambda: check_rollback_plan(inputs.rollback, config)))
    return results


def readiness_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="The gateway's YAML config.")],
    envs: Annotated[
        Path | None, typer.Option(help="A folder with one subfolder per environment.")
    ] = None,
    compose: Annotated[Path | None, typer.Option(help="The docker-compose file.")] = None,
    kubernetes: Annotated[
        Path | None, typer.Option(help="The folder of Kubernetes manifests.")
    ] = None,
    dockerfile: Annotated[Path | None, typer.Option(help="The gateway's Dockerfile.")] = None,
    rollback: Annotated[
        Path | None, typer.Option(help="The rollback plan (rollback.yaml).")
    ] = None,
    suite: Annotated[
        Path | None, typer.Option(help="A golden suite to run against --target.")
    ] = None,
    target: Annotated[str | None, typer.Option(help="The provider --suite runs against.")] = None,
    gameday: Annotated[
        Path | None, typer.Option(help="A release scenario (default: the shipped one).")
    ] = None,
    peak_rps: Annotated[
        float | None, typer.Option(min=0.001, help="The planned peak, requests per second.")
    ] = None,
    replicas: Annotated[int, typer.Option(min=1, help="Replicas that share the peak.")] = 1,
    service_time: Annotated[
        str, typer.Option(help="Model-call time at the peak: exp:MEAN, lognormal:MEAN,SCV, det:S.")
    ] = "exp:0.8",
    verdicts: Annotated[
        str | None,
        typer.Option(help="Where eval verdicts are kept (default: where tidegate eval puts them)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the simulations.")] = 0,
    strict: Annotated[bool, typer.Option(help="A skipped check fails the result.")] = False,
) -> None:
    """Run every offline check of a release: one line each, then RESULT: READY or NOT READY."""
    if (suite is None) != (target is None):
        typer.echo("tidegate readiness: --suite and --target go together", err=True)
        raise typer.Exit(2)
    inputs = ReadinessInputs(
        config=config,
        envs=envs,
        compose=compose,
        kubernetes=kubernetes,
        dockerfile=dockerfile,
        rollback=rollback,
        suite=suite,
        target=target,
        gameday=gameday,
        peak_rps=peak_rps,
        replicas=replicas,
        service_time=service_time,
        verdicts=verdicts,
        seed=seed,
    )

    def emit(result: CheckResult) -> None:
        shown = result
        if strict and result.status is Status.SKIPPED:
            shown = _failed(result.name, f"skipped with --strict ({result.summary})")
        for line in format_result(shown):
            typer.echo(line)

    results = run_readiness(inputs, emit=emit)
    if is_ready(results, strict=strict):
        typer.echo("RESULT: READY")
        return
    typer.echo("RESULT: NOT READY")
    raise typer.Exit(1)
