"""The timeout chain over the real files: each layer gives up before the one that called it.

The layers, from the outside in, and where each is read:

============================  =================================================================
client                        compose: the label ``tidegate.client_timeout_s`` on any service;
                              Kubernetes: the annotation ``tidegate.client_timeout_s`` on any
                              object. Seconds. Optional (a warning when a deployment has none).
load balancer                 compose: ``proxy_read_timeout`` in the nginx configs mounted into a
                              service whose image is nginx (nginx's default, 60s, when a config
                              proxies without setting it); Kubernetes: the Ingress annotation
                              ``nginx.ingress.kubernetes.io/proxy-read-timeout`` and the Service
                              annotation ``service.beta.kubernetes.io/aws-load-balancer-
                              connection-idle-timeout``.
gateway request               ``server.request_timeout_s``
stream limit of provider P    ``providers.P.stream.max_duration_s``
retrying calls of route R     ``retry.attempts`` x ``models.R.per_try_timeout_s`` + the worst
                              total backoff (:func:`tidegate.policy.retry.provider_layer`)
============================  =================================================================

:func:`tidegate.policy.deadline.chain_problems` decides whether they nest. Shutdown is checked
too: ``server.drain_seconds`` must be shorter than compose's ``stop_grace_period`` (Docker's
default is 10s) and, with the ``preStop`` sleep added, than Kubernetes'
``terminationGracePeriodSeconds`` (default 30s), or the orchestrator kills requests mid-drain.

The gateway services are found by the label (compose) or annotation/label (Kubernetes)
``tidegate.gateway: "true"``, or by an image, command or args that mention ``tidegate``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import ValidationError

from tidegate.errors import ConfigError
from tidegate.gateway.config import Config, load_config
from tidegate.gateway.timing import layer_problems, timeout_chains
from tidegate.ops.findings import Finding, Rule, Severity, rule_table
from tidegate.policy.deadline import Layer

__all__ = [
    "AWS_IDLE_TIMEOUT",
    "CLIENT_TIMEOUT_KEY",
    "COMPOSE_DEFAULT_GRACE_S",
    "GATEWAY_KEY",
    "INGRESS_READ_TIMEOUT",
    "KUBERNETES_DEFAULT_GRACE_S",
    "NGINX_DEFAULT_READ_TIMEOUT_S",
    "RULES",
    "Deployment",
    "Grace",
    "Timed",
    "check_chain",
    "check_timeouts",
    "gateway_chains",
    "load_timing_config",
    "parse_duration",
    "parse_nginx_time",
    "read_compose",
    "read_kubernetes",
]

CLIENT_TIMEOUT_KEY: Final = "tidegate.client_timeout_s"
GATEWAY_KEY: Final = "tidegate.gateway"
INGRESS_READ_TIMEOUT: Final = "nginx.ingress.kubernetes.io/proxy-read-timeout"
AWS_IDLE_TIMEOUT: Final = "service.beta.kubernetes.io/aws-load-balancer-connection-idle-timeout"
NGINX_DEFAULT_READ_TIMEOUT_S: Final = 60.0
COMPOSE_DEFAULT_GRACE_S: Final = 10.0
KUBERNETES_DEFAULT_GRACE_S: Final = 30.0

E, W = Severity.ERROR, Severity.WARNING

RULES: Final[Mapping[str, Rule]] = rule_table(
    Rule("TMO001", E, "the gateway config loads"),
    Rule("TMO002", E, "each layer of the chain gives up before the layer above it"),
    Rule("TMO003", E, "compose's stop_grace_period is longer than server.drain_seconds"),
    Rule(
        "TMO004",
        E,
        "Kubernetes' terminationGracePeriodSeconds is longer than the preStop sleep plus "
        "server.drain_seconds",
    ),
    Rule("TMO005", E, "the compose file reads and has a gateway service"),
    Rule("TMO006", E, "the Kubernetes manifests read and have a gateway workload"),
    Rule("TMO007", E, "every timeout in the deployment files can be read"),
    Rule("TMO008", W, "a deployment declares its client timeout"),
    Rule("TMO009", W, "deployment files do not override the gateway's timeouts by environment"),
)


@dataclass(frozen=True, slots=True)
class Timed:
    """A layer of the chain, where it is set, and how its time adds up (may be empty)."""

    layer: Layer
    where: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Grace:
    """How long an orchestrator waits for one gateway workload before killing it."""

    workload: str
    grace_s: float
    default: bool
    pre_stop_s: float
    where: str


@dataclass(frozen=True, slots=True)
class Deployment:
    """What one set of deployment files puts around the gateway."""

    kind: str
    clients: tuple[Timed, ...]
    balancers: tuple[Timed, ...]
    graces: tuple[Grace, ...]


# --------------------------------------------------------------------------- durations

_GO_UNITS: Final = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_GO_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_NGINX_UNITS: Final = {
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 604800.0,
    "M": 2592000.0,
    "y": 31536000.0,
}
_NGINX_PART = re.compile(r"\s*(\d+)(ms|s|m|h|d|w|M|y)?")
_INTERPOLATION = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}")


def _interpolate(text: str) -> str:
    """Compose's ``${VAR:-default}`` taken at its default (the files, not a shell, are checked)."""
    return _INTERPOLATION.sub(lambda m: m.group(1) or "", text)


def parse_duration(value: object) -> float:
    """Seconds in a compose duration (``"1m30s"``, ``"40s"``, ``"500ms"``) or a plain number."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        return float(value)
    text = _interpolate(str(value)).strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    if not text or _GO_PART.sub("", text):
        raise ValueError(f"not a duration: {value!r}")
    return sum(float(n) * _GO_UNITS[unit] for n, unit in _GO_PART.findall(text))


def parse_nginx_time(text: str) -> float:
    """Seconds in an nginx time (``60``, ``90s``, ``1m30s``, ``500ms``); no unit means seconds."""
    stripped = text.strip()
    if not stripped or _NGINX_PART.sub("", stripped).strip():
        raise ValueError(f"not an nginx time: {text!r}")
    return sum(float(n) * _NGINX_UNITS[unit or "s"] for n, unit in _NGINX_PART.findall(stripped))


# --------------------------------------------------------------------------- the gateway


def load_timing_config(path: Path) -> tuple[Config | None, list[Finding]]:
    """The config for its timings: the real loader, else the same model without its file checks.

    Secret files and the profile's rules do not change a timeout (``check envs`` checks them), so
    a config whose secrets are mounted only in the container is still checked here.
    """
    try:
        return load_config(path, env={}), []
    except ConfigError as exc:
        refusal = exc.message
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        return Config.model_validate(data), []
    except (OSError, yaml.YAMLError, ValidationError):
        return None, [RULES["TMO001"].finding(refusal, str(path))]


def gateway_chains(config: Config, where: str) -> list[list[Timed]]:
    """The gateway's own layers, one chain per route and provider: request, stream, calls
    (:func:`tidegate.gateway.timing.timeout_chains`, which start-up warns about too)."""
    return [
        [Timed(link.layer, f"{where} [{link.key}]", link.detail) for link in chain]
        for chain in timeout_chains(config)
    ]


def check_chain(chain: Sequence[Timed]) -> list[Finding]:
    """A TMO002 finding for every layer that would outlive a layer above it."""
    findings: list[Finding] = []
    for index, problem in layer_problems([t.layer for t in chain]):
        timed = chain[index]
        detail = f" ({timed.detail})" if timed.detail else ""
        findings.append(RULES["TMO002"].finding(problem + detail, timed.where))
    return findings


# --------------------------------------------------------------------------- shared helpers


def _labels(value: Any) -> dict[str, str]:
    """Compose labels or environment, as a mapping or a list of ``KEY=VALUE``."""
    if isinstance(value, Mapping):
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    if isinstance(value, list):
        pairs = (str(item).partition("=") for item in value)
        return {k: v for k, _, v in pairs}
    return {}


def _words(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return "" if value is None else str(value)


def _truthy(value: str | None) -> bool | None:
    if value is None:
        return None
    return value.strip().lower() in {"true", "1", "yes", "on"}


def _is_gateway(marks: Mapping[str, str], *texts: str) -> bool:
    explicit = _truthy(marks.get(GATEWAY_KEY))
    if explicit is not None:
        return explicit
    return any("tidegate" in text.lower() for text in texts)


_TIMING_KEYS: Final = (
    ("server", "request_timeout_s"),
    ("server", "drain_seconds"),
    ("models", "*", "per_try_timeout_s"),
    ("retry", "*"),
    ("providers", "*", "stream", "*"),
)


def _timing_override(name: str) -> bool:
    if not name.startswith("TIDEGATE_"):
        return False
    path = name[len("TIDEGATE_") :].lower().split("__")
    return any(
        len(path) == len(pattern)
        and all(p in ("*", part) for p, part in zip(pattern, path, strict=True))
        for pattern in _TIMING_KEYS
    )


def _override_findings(env: Mapping[str, str], where: str) -> list[Finding]:
    return [
        RULES["TMO009"].finding(
            f"{name} overrides a timeout by environment, which this check does not see: "
            "set it in the config file",
            where,
        )
        for name in sorted(env)
        if _timing_override(name)
    ]


def _client(marks: Mapping[str, str], where: str) -> tuple[list[Timed], list[Finding]]:
    raw = marks.get(CLIENT_TIMEOUT_KEY)
    if raw is None:
        return [], []
    try:
        seconds = parse_duration(raw)
    except ValueError:
        return [], [RULES["TMO007"].finding(f"{CLIENT_TIMEOUT_KEY} is {raw!r}, not seconds", where)]
    return [Timed(Layer("client", seconds), f"{where} [{CLIENT_TIMEOUT_KEY}]")], []


# --------------------------------------------------------------------------- compose


def _nginx_layers(path: Path, shown: str) -> tuple[list[Timed], list[Finding]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        return [], [RULES["TMO005"].finding(f"cannot read {path.name} ({exc.strerror})", shown)]
    text = re.sub(r"#[^\n]*", "", text)
    values = re.findall(r"\bproxy_read_timeout\s+([^;]+);", text)
    if not values:
        if re.search(r"\bproxy_pass\b", text) is None:
            return [], []
        layer = Layer("load balancer", NGINX_DEFAULT_READ_TIMEOUT_S)
        return [Timed(layer, f"{shown} [proxy_read_timeout unset: nginx default]")], []
    layers: list[Timed] = []
    findings: list[Finding] = []
    for raw in dict.fromkeys(v.strip() for v in values):
        try:
            seconds = parse_nginx_time(raw)
        except ValueError:
            findings.append(
                RULES["TMO007"].finding(f"proxy_read_timeout is {raw!r}, not an nginx time", shown)
            )
            continue
        layers.append(Timed(Layer("load balancer", seconds), f"{shown} [proxy_read_timeout]"))
    return layers, findings


def _nginx_files(service: Mapping[str, Any], configs: Mapping[str, Any], base: Path) -> list[Path]:
    """Host files mounted into an nginx service: bind volumes and compose ``configs``."""
    sources: list[str] = []
    for volume in service.get("volumes") or ():
        if isinstance(volume, str):
            host = _interpolate(volume).split(":", 1)[0]
        elif isinstance(volume, Mapping) and volume.get("type", "bind") == "bind":
            host = _interpolate(str(volume.get("source", "")))
        else:
            continue
        if host.startswith((".", "/", "~")):
            sources.append(host)
    for ref in service.get("configs") or ():
        name = ref.get("source") if isinstance(ref, Mapping) else ref
        entry = configs.get(str(name)) if isinstance(configs, Mapping) else None
        if isinstance(entry, Mapping) and entry.get("file"):
            sources.append(_interpolate(str(entry["file"])))
    files: list[Path] = []
    for source in sources:
        path = Path(source).expanduser()
        path = path if path.is_absolute() else base / path
        if path.is_dir():
            files += sorted(path.rglob("*.conf"))
        elif path.suffix == ".conf" or not path.exists():
            files.append(path)
    return files


def read_compose(path: Path) -> tuple[Deployment | None, list[Finding]]:
    """The client, load balancer and grace periods a compose file puts around the gateway."""
    shown = str(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        return None, [
            RULES["TMO005"].finding(f"cannot read the compose file ({exc.strerror})", shown)
        ]
    except yaml.YAMLError as exc:
        return None, [RULES["TMO005"].finding(f"not valid YAML: {exc}", shown)]
    services = data.get("services") if isinstance(data, Mapping) else None
    if not isinstance(services, Mapping) or not services:
        return None, [RULES["TMO005"].finding("the compose file has no services", shown)]
    configs = data.get("configs") or {}
    clients: list[Timed] = []
    balancers: list[Timed] = []
    graces: list[Grace] = []
    findings: list[Finding] = []
    for name, service in services.items():
        if not isinstance(service, Mapping):
            continue
        where = f"{shown} [services.{name}]"
        labels = _labels(service.get("labels"))
        found, problems = _client(labels, where)
        clients += found
        findings += problems
        image = str(service.get("image", ""))
        command = _words(service.get("command")) + " " + _words(service.get("entrypoint"))
        if re.match(r"(.*/)?nginx([:@]|$)", image):
            for conf in _nginx_files(service, configs, path.parent):
                layers, problems = _nginx_layers(conf, str(conf))
                balancers += layers
                findings += problems
            continue
        if not _is_gateway(labels, image, command):
            continue
        findings += _override_findings(_labels(service.get("environment")), where)
        raw = service.get("stop_grace_period")
        try:
            grace = COMPOSE_DEFAULT_GRACE_S if raw is None else parse_duration(raw)
        except ValueError:
            findings.append(
                RULES["TMO007"].finding(f"stop_grace_period is {raw!r}, not a duration", where)
            )
            continue
        graces.append(
            Grace(
                str(name), grace, raw is None, 0.0, f"{shown} [services.{name}.stop_grace_period]"
            )
        )
    if not graces and not any(f.rule_id == "TMO007" for f in findings):
        findings.append(
            RULES["TMO005"].finding(
                f'no gateway service found: label one {GATEWAY_KEY}: "true", or use an image '
                "or command naming tidegate",
                shown,
            )
        )
    deployment = Deployment("compose", tuple(clients), tuple(balancers), tuple(graces))
    return deployment, findings


# --------------------------------------------------------------------------- Kubernetes


def _documents(folder: Path) -> Iterator[tuple[Path, Any]]:
    files = sorted(p for p in folder.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    for file in files:
        for doc in yaml.safe_load_all(file.read_text(encoding="utf-8")):
            if isinstance(doc, Mapping) and doc.get("kind") == "List":
                for item in doc.get("items") or ():
                    yield file, item
            else:
                yield file, doc


def _pre_stop_seconds(container: Mapping[str, Any]) -> float:
    pre_stop = (container.get("lifecycle") or {}).get("preStop") or {}
    sleep = pre_stop.get("sleep")
    if isinstance(sleep, Mapping) and isinstance(sleep.get("seconds"), int | float):
        return float(sleep["seconds"])
    command = _words((pre_stop.get("exec") or {}).get("command"))
    match = re.search(r"\bsleep\s+(\d+(?:\.\d+)?)", command)
    return float(match.group(1)) if match else 0.0


def _annotated_layer(
    annotations: Mapping[str, str], key: str, where: str
) -> tuple[list[Timed], list[Finding]]:
    raw = annotations.get(key)
    if raw is None:
        return [], []
    try:
        seconds = parse_duration(raw)
    except ValueError:
        return [], [RULES["TMO007"].finding(f"{key} is {raw!r}, not seconds", where)]
    return [Timed(Layer("load balancer", seconds), f"{where} [{key}]")], []


def _workload_grace(
    doc: Mapping[str, Any], workload: str, where: str
) -> tuple[list[Grace], list[Finding]]:
    template = (doc.get("spec") or {}).get("template") or {}
    pod = template.get("spec") or {}
    meta = template.get("metadata") or {}
    marks = {**_labels(meta.get("labels")), **_labels(meta.get("annotations"))}
    marks.update(_labels((doc.get("metadata") or {}).get("annotations")))
    findings: list[Finding] = []
    gateways = [
        c
        for c in pod.get("containers") or ()
        if isinstance(c, Mapping)
        and _is_gateway(
            marks, str(c.get("image", "")), _words(c.get("command")) + " " + _words(c.get("args"))
        )
    ]
    if not gateways:
        return [], []
    raw = pod.get("terminationGracePeriodSeconds")
    if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int | float)):
        finding = RULES["TMO007"].finding(
            f"terminationGracePeriodSeconds is {raw!r}, not a number of seconds", where
        )
        return [], [finding]
    grace = KUBERNETES_DEFAULT_GRACE_S if raw is None else float(raw)
    graces: list[Grace] = []
    for container in gateways:
        env = {
            str(e.get("name")): str(e.get("value", ""))
            for e in container.get("env") or ()
            if isinstance(e, Mapping)
        }
        findings += _override_findings(env, where)
        graces.append(
            Grace(
                workload,
                grace,
                raw is None,
                _pre_stop_seconds(container),
                f"{where.removesuffix(']')}: terminationGracePeriodSeconds]",
            )
        )
    return graces, findings


def read_kubernetes(folder: Path) -> tuple[Deployment | None, list[Finding]]:
    """The client, load balancer and grace periods in a folder of Kubernetes manifests."""
    shown = str(folder)
    if not folder.is_dir():
        return None, [RULES["TMO006"].finding("the Kubernetes folder does not exist", shown)]
    clients: list[Timed] = []
    balancers: list[Timed] = []
    graces: list[Grace] = []
    findings: list[Finding] = []
    try:
        documents = list(_documents(folder))
    except (OSError, yaml.YAMLError) as exc:
        return None, [RULES["TMO006"].finding(f"cannot read the manifests: {exc}", shown)]
    for file, doc in documents:
        if not isinstance(doc, Mapping):
            continue
        kind = str(doc.get("kind", ""))
        name = str((doc.get("metadata") or {}).get("name", "?"))
        where = f"{file} [{kind} {name}]"
        annotations = _labels((doc.get("metadata") or {}).get("annotations"))
        found, problems = _client(annotations, where)
        clients += found
        findings += problems
        if kind == "Ingress":
            layers, problems = _annotated_layer(annotations, INGRESS_READ_TIMEOUT, where)
        elif kind == "Service":
            layers, problems = _annotated_layer(annotations, AWS_IDLE_TIMEOUT, where)
        elif kind in ("Deployment", "StatefulSet", "DaemonSet"):
            more, problems = _workload_grace(doc, f"{kind} {name}", where)
            graces += more
            layers = []
        else:
            continue
        balancers += layers
        findings += problems
    if not graces and not any(f.rule_id == "TMO007" for f in findings):
        findings.append(
            RULES["TMO006"].finding(
                "no gateway workload found: a Deployment, StatefulSet or DaemonSet whose "
                f"container image, command or args name tidegate (or annotate it {GATEWAY_KEY})",
                shown,
            )
        )
    deployment = Deployment("kubernetes", tuple(clients), tuple(balancers), tuple(graces))
    return deployment, findings


# --------------------------------------------------------------------------- the check


def _grace_findings(deployment: Deployment, drain: float) -> list[Finding]:
    findings: list[Finding] = []
    for grace in deployment.graces:
        default = " (the default)" if grace.default else ""
        if deployment.kind == "compose":
            if grace.grace_s <= drain:
                findings.append(
                    RULES["TMO003"].finding(
                        f"service {grace.workload}: stop_grace_period is {grace.grace_s:g}s"
                        f"{default}, not longer than server.drain_seconds ({drain:g}s): Docker kills the gateway before in-flight requests "
                        "finish draining",
                        grace.where,
                    )
                )
        elif grace.grace_s <= grace.pre_stop_s + drain:
            findings.append(
                RULES["TMO004"].finding(
                    f"{grace.workload}: terminationGracePeriodSeconds is {grace.grace_s:g}s"
                    f"{default}, not longer than the preStop sleep ({grace.pre_stop_s:g}s) plus "
                    f"server.drain_seconds ({drain:g}s): Kubernetes kills the "
                    "pod before in-flight requests finish draining",
                    grace.where,
                )
            )
    return findings


def _chains(deployment: Deployment | None, inner: list[list[Timed]]) -> Iterable[list[Timed]]:
    if deployment is None:
        yield from inner
        return
    clients: Sequence[Timed | None] = deployment.clients or (None,)
    balancers: Sequence[Timed | None] = deployment.balancers or (None,)
    for client in clients:
        for balancer in balancers:
            outer = [t for t in (client, balancer) if t is not None]
            for chain in inner:
                yield outer + chain


def check_timeouts(
    config_path: Path,
    *,
    compose: Path | None = None,
    kubernetes: Path | None = None,
) -> list[Finding]:
    """Every timeout-chain and drain problem of the config and the given deployment files."""
    config, findings = load_timing_config(config_path)
    deployments: list[Deployment] = []
    for path, reader in ((compose, read_compose), (kubernetes, read_kubernetes)):
        if path is None:
            continue
        deployment, problems = reader(path)
        findings += problems
        if deployment is not None:
            deployments.append(deployment)
            if not deployment.clients:
                findings.append(
                    RULES["TMO008"].finding(
                        f"no client timeout declared ({CLIENT_TIMEOUT_KEY}): the chain is "
                        "checked from the load balancer in",
                        str(path),
                    )
                )
    if config is None:
        return findings
    try:
        inner = gateway_chains(config, str(config_path))
    except ValueError as exc:
        return [*findings, RULES["TMO001"].finding(f"retry: {exc}", str(config_path))]
    chains: list[list[Timed]] = []
    targets: list[Deployment | None] = [*deployments] or [None]
    for target in targets:
        chains += _chains(target, inner)
    for chain in chains:
        for finding in check_chain(chain):
            if finding not in findings:
                findings.append(finding)
    for deployment in deployments:
        findings += _grace_findings(deployment, config.server.drain_seconds)
    return findings
