"""The Helm chart (deploy/helm/tidegate), rendered as `helm template` renders it, then checked
against the Kubernetes API schemas and tidegate's own timeout and drain checks.

helm is not installable on CI, so tests/deploy/helm_render (helm's engine: Go's text/template with
the sprig functions, helm's own functions and its values schema check) is built here from Debian's
Go packages. Without them the tests skip, except under CI
(``TIDEGATE_TEST_REQUIRE_HELM_RENDER=1``, set by .ci/run, or ``CI=true``), where they fail.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

import tidegate
from tests.deploy.conftest import (
    DEPLOY,
    DOCKERFILE,
    PRODUCTION_CONFIG,
    ROOT,
    SECRET_NAME,
    by_kind,
    load_with_secrets,
)
from tidegate.ops.findings import Severity
from tidegate.ops.readiness import Status, check_drain, check_timeout_chain, read_deployments
from tidegate.ops.timeouts import check_timeouts, read_kubernetes

CHART = DEPLOY / "helm" / "tidegate"
RENDERER = ROOT / "tests" / "deploy" / "helm_render"
#: Where Debian's golang-*-dev packages install their sources (a GOPATH).
DEBIAN_GOPATH = Path("/usr/share/gocode")
SPRIG = DEBIAN_GOPATH / "src" / "github.com" / "Masterminds" / "sprig"
KUBERNETES_VERSION = "1.30"
DEFAULTS: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
SCHEMA: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))

#: The override values files the chart is rendered with, besides its defaults.
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    # Both store URLs, passwords included, from existing Secrets: no password file to copy.
    "replicas-and-secret-urls": {
        "replicaCount": 3,
        "state": {
            "urlSecret": {"name": "tidegate-postgres", "key": "url"},
            "fastUrlSecret": {"name": "tidegate-redis", "key": "url"},
            "pgpass": {"existingSecret": ""},
        },
    },
    "admin-off": {"admin": {"enabled": False}},
    "autoscaled-with-ingress": {"autoscaling": {"enabled": True}, "ingress": {"enabled": True}},
}
#: The env the pods of a variant get from its Secrets, given to the real loader as they would be.
SECRET_ENV: dict[str, dict[str, str]] = {
    "replicas-and-secret-urls": {
        "TIDEGATE_STATE__URL": "postgresql://tidegate:pw@postgres:5432/tidegate",
        "TIDEGATE_STATE__FAST_URL": "redis://:pw@redis:6379/0",
    },
}


class Render(Protocol):
    def __call__(
        self, *overrides: dict[str, Any], name: str = ..., notes: bool = ...
    ) -> subprocess.CompletedProcess[str]: ...


def _merged(*overrides: dict[str, Any]) -> dict[str, Any]:
    """values.yaml with the overrides merged over it, as helm merges values files."""

    def merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
        for key, value in src.items():
            if value is None:
                dst.pop(key, None)
            elif isinstance(value, dict) and isinstance(dst.get(key), dict):
                merge(dst[key], value)
            else:
                dst[key] = value

    values = copy.deepcopy(DEFAULTS)
    for override in overrides:
        merge(values, override)
    return values


@pytest.fixture(scope="session")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/deploy/helm_render, built once in GOPATH mode against Debian's sprig and yaml.v3."""
    required = os.environ.get("TIDEGATE_TEST_REQUIRE_HELM_RENDER") == "1"
    required = required or os.environ.get("CI", "").lower() == "true"
    missing = []
    if shutil.which("go") is None:
        missing.append("golang-go")
    if not SPRIG.is_dir():
        missing.append("golang-github-masterminds-sprig-dev")
    if not (DEBIAN_GOPATH / "src" / "gopkg.in" / "yaml.v3").is_dir():
        missing.append("golang-gopkg-yaml.v3-dev")
    if missing:
        reason = f"the chart renderer needs apt-get install {' '.join(missing)}"
        if required:
            pytest.fail(f"TIDEGATE_TEST_REQUIRE_HELM_RENDER=1 or CI=true, but {reason}")
        pytest.skip(reason)
    binary = tmp_path_factory.mktemp("helm-render") / "helm_render"
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": str(DEBIAN_GOPATH), "GOFLAGS": ""}
    if not any(env.get(name) for name in ("GOCACHE", "XDG_CACHE_HOME", "HOME")):
        env["GOCACHE"] = str(binary.parent / "go-cache")  # Go has no default cache without them
    built = subprocess.run(
        ["go", "build", "-o", str(binary), "."],
        cwd=RENDERER,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    return binary


@pytest.fixture(scope="session")
def render(renderer: Path, tmp_path_factory: pytest.TempPathFactory) -> Render:
    """Run the renderer on the chart with override values files (dicts), as `helm template`."""
    folder = tmp_path_factory.mktemp("helm-values")

    def run(
        *overrides: dict[str, Any], name: str = "tidegate", notes: bool = False
    ) -> subprocess.CompletedProcess[str]:
        args = [str(renderer), "--name", name, "--namespace", "gateway"]
        args += ["--notes"] if notes else []
        for override in overrides:
            path = folder / f"values-{len(list(folder.iterdir()))}.yaml"
            path.write_text(yaml.safe_dump(override), encoding="utf-8")
            args += ["-f", str(path)]
        args.append(str(CHART))
        return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)

    return run


def _documents(result: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("---\n# Source: tidegate/templates/")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def rendered(render: Render) -> dict[str, list[dict[str, Any]]]:
    """The documents of every variant."""
    return {name: _documents(render(values)) for name, values in VARIANTS.items()}


def _one(documents: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d
        for d in documents
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _pod(documents: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = _one(documents, "Deployment")["spec"]["template"]["spec"]
    return spec


def _gateway(documents: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = [c for c in _pod(documents)["containers"] if c["name"] == "tidegate"]
    return dict(container)


def _config(documents: list[dict[str, Any]]) -> dict[str, Any]:
    text = _one(documents, "ConfigMap")["data"]["tidegate.yaml"]
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def _containers(documents: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    pod = _pod(documents)
    yield from pod["containers"]
    yield from pod.get("initContainers", [])


def _secret_items(documents: list[dict[str, Any]]) -> dict[str, str]:
    """File name under the secrets mount -> the existing Secret it comes from."""
    (volume,) = [v for v in _pod(documents)["volumes"] if v["name"] == "secrets"]
    items = {}
    for source in volume["projected"]["sources"]:
        for item in source["secret"]["items"]:
            assert item["key"] == item["path"]
            items[item["path"]] = source["secret"]["name"]
    return items


variants = pytest.mark.parametrize("variant", list(VARIANTS))
_ALWAYS = ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"]
#: The kinds each variant renders: the admin Service but with admin off, the HPA and Ingress on.
KINDS = {
    "defaults": sorted([*_ALWAYS, "Service"]),
    "replicas-and-secret-urls": sorted([*_ALWAYS, "Service"]),
    "admin-off": sorted(_ALWAYS),
    "autoscaled-with-ingress": sorted([*_ALWAYS, "Service", "HorizontalPodAutoscaler", "Ingress"]),
}


def test_the_chart_is_versioned_with_the_project() -> None:
    """Chart.yaml: apiVersion v2, the chart's own version, and appVersion the project's version."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "tidegate"
    assert chart["version"] == "0.1.0"
    assert chart["appVersion"] == tidegate.__version__


def test_the_values_schema_is_draft_7_and_agrees_with_the_defaults() -> None:
    """values.schema.json is a valid draft-07 schema, and values.yaml and every variant meet it
    (checked by the reference implementation, beside the renderer's own check)."""
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    for overrides in VARIANTS.values():
        jsonschema.Draft7Validator(SCHEMA).validate(_merged(overrides))


@variants
def test_every_document_is_valid_for_kubernetes(
    rendered: dict[str, list[dict[str, Any]]], variant: str
) -> None:
    """Each rendered object validates, strictly (no unknown field), against Kubernetes 1.30's
    schemas; the variant renders exactly the objects it should, and no Secret."""
    documents = rendered[variant]
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    kinds = sorted(d["kind"] for d in documents)
    assert kinds == KINDS[variant]
    assert "Secret" not in kinds


def test_the_replica_count_is_the_value_unless_the_autoscaler_owns_it(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """replicas: 2 by default, 3 when set; with autoscaling, none, and the HPA targets the
    Deployment with the values' bounds."""
    assert _one(rendered["defaults"], "Deployment")["spec"]["replicas"] == 2
    assert _one(rendered["replicas-and-secret-urls"], "Deployment")["spec"]["replicas"] == 3
    autoscaled = rendered["autoscaled-with-ingress"]
    assert "replicas" not in _one(autoscaled, "Deployment")["spec"]
    hpa = _one(autoscaled, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "tidegate",
    }
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (3, 12)
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    pdb = _one(autoscaled, "PodDisruptionBudget")["spec"]
    assert 1 <= pdb["maxUnavailable"] < hpa["minReplicas"]


@variants
def test_the_admin_port_is_on_its_own_cluster_ip_service_only(
    rendered: dict[str, list[dict[str, Any]]], variant: str
) -> None:
    """The public Service has the http port alone; the admin Service is ClusterIP on the
    container port admin (server.admin_port); every Ingress path goes to the public port."""
    documents = rendered[variant]
    public = _one(documents, "Service", "tidegate")["spec"]
    assert public["ports"] == [{"name": "http", "port": 80, "targetPort": "http"}]
    ports = {p["name"]: p["containerPort"] for p in _gateway(documents)["ports"]}
    config = _config(documents)
    annotations = _one(documents, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    if variant == "admin-off":
        assert ports == {"http": 8080}
        assert not [d for d in documents if d["metadata"]["name"] == "tidegate-admin"]
        assert "admin_port" not in config["server"]
        assert "admin_keys_file" not in config["auth"], "an admin API would be on the public port"
        assert annotations["prometheus.io/port"] == "8080"
    else:
        assert ports == {"http": 8080, "admin": 9090}
        admin = _one(documents, "Service", "tidegate-admin")["spec"]
        assert admin["type"] == "ClusterIP"
        assert admin["ports"] == [{"name": "admin", "port": 9090, "targetPort": "admin"}]
        assert admin["selector"] == public["selector"]
        assert (config["server"]["admin_port"], config["server"]["admin_host"]) == (9090, "0.0.0.0")
        assert annotations["prometheus.io/port"] == "9090"
    for ingress in [d for d in documents if d["kind"] == "Ingress"]:
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"] == {"name": "tidegate", "port": {"name": "http"}}


@variants
def test_the_probes_hit_healthz_and_readyz_on_the_public_port(
    rendered: dict[str, list[dict[str, Any]]], variant: str
) -> None:
    """Liveness and startup GET /healthz, readiness GET /readyz, on the port the config serves."""
    documents = rendered[variant]
    gateway = _gateway(documents)
    probes = DEFAULTS["probes"]
    assert gateway["livenessProbe"] == {
        "httpGet": {"path": "/healthz", "port": "http"},
        **probes["liveness"],
    }
    assert gateway["readinessProbe"] == {
        "httpGet": {"path": "/readyz", "port": "http"},
        **probes["readiness"],
    }
    assert gateway["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    (http,) = [p for p in gateway["ports"] if p["name"] == "http"]
    server = _config(documents)["server"]
    assert http["containerPort"] == server["port"] == 8080
    assert server["host"] == "0.0.0.0"


@variants
def test_secrets_come_only_from_the_existing_secrets_named(
    rendered: dict[str, list[dict[str, Any]]], variant: str, tmp_path: Path
) -> None:
    """No env holds a value that looks secret; store URLs come by secretKeyRef; each secret file
    the config names is an item of the projected volume, from the Secret the values name."""
    documents = rendered[variant]
    gateway = _gateway(documents)
    env = {e["name"]: e for e in gateway.get("env", [])}
    for container in _containers(documents):
        assert "envFrom" not in container
        for entry in container.get("env", []):
            assert "value" not in entry, entry["name"]
            assert not SECRET_NAME.search(entry["name"]), entry["name"]
    if variant == "replicas-and-secret-urls":
        assert env == {
            "TIDEGATE_STATE__URL": {
                "name": "TIDEGATE_STATE__URL",
                "valueFrom": {"secretKeyRef": {"name": "tidegate-postgres", "key": "url"}},
            },
            "TIDEGATE_STATE__FAST_URL": {
                "name": "TIDEGATE_STATE__FAST_URL",
                "valueFrom": {"secretKeyRef": {"name": "tidegate-redis", "key": "url"}},
            },
        }
        assert "initContainers" not in _pod(documents)
    else:
        assert env == {}
    config = _config(documents)
    items = _secret_items(documents)
    paths = [config["auth"]["keys_file"], config["auth"].get("admin_keys_file")]
    paths += [p.get("api_key_file") for p in config["providers"].values()]
    named = [p for p in paths if p]
    assert len(named) == (3 if variant == "admin-off" else 4)
    for path in named:
        folder, _, name = path.rpartition("/")
        assert folder == "/run/secrets/tidegate", path
        assert items.pop(name) == "tidegate-secrets", name
    assert items == (
        {} if variant == "replicas-and-secret-urls" else {"pgpass": "tidegate-secrets"}
    )
    # The config the pods run loads with the real loader, given what the pods are given.
    path = tmp_path / "tidegate.yaml"
    path.write_text(_one(documents, "ConfigMap")["data"]["tidegate.yaml"], encoding="utf-8")
    loaded = load_with_secrets(path, tmp_path, **SECRET_ENV.get(variant, {}))
    assert loaded.server.port == 8080
    if variant == "replicas-and-secret-urls":
        assert "url" not in config["state"]
        assert loaded.state.fast_url == "redis://:pw@redis:6379/0"


def test_the_default_config_is_the_production_config(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """With the defaults the chart's ConfigMap carries deploy/tidegate.production.yaml, key for
    key, as deploy/kubernetes/ does."""
    production = yaml.safe_load(PRODUCTION_CONFIG.read_text(encoding="utf-8"))
    assert _config(rendered["defaults"]) == production


def test_the_defaults_deploy_what_the_plain_manifests_deploy(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """Probes, preStop, grace period, rollout, security, resources, ports, mounts, the init
    container, the autoscaler's law and the Ingress annotations are deploy/kubernetes/'s."""
    plain = by_kind("Deployment")["spec"]
    (plain_gateway,) = plain["template"]["spec"]["containers"]
    chart = _one(rendered["autoscaled-with-ingress"], "Deployment")["spec"]
    gateway = _gateway(rendered["autoscaled-with-ingress"])
    for key in ("livenessProbe", "readinessProbe", "lifecycle", "resources", "securityContext"):
        assert gateway[key] == plain_gateway[key], key
    assert gateway["startupProbe"] == {"timeoutSeconds": 1, **plain_gateway["startupProbe"]}
    assert gateway["ports"] == plain_gateway["ports"]
    assert gateway["volumeMounts"] == plain_gateway["volumeMounts"]
    assert gateway["image"] == plain_gateway["image"]
    for key in ("terminationGracePeriodSeconds", "securityContext", "automountServiceAccountToken"):
        assert chart["template"]["spec"][key] == plain["template"]["spec"][key], key
    assert chart["strategy"] == plain["strategy"]
    assert chart["revisionHistoryLimit"] == plain["revisionHistoryLimit"]
    (init,) = chart["template"]["spec"]["initContainers"]
    (plain_init,) = plain["template"]["spec"]["initContainers"]
    assert init["command"] == plain_init["command"]
    assert init["volumeMounts"] == plain_init["volumeMounts"]
    documents = rendered["autoscaled-with-ingress"]
    hpa = _one(documents, "HorizontalPodAutoscaler")["spec"]
    plain_hpa = by_kind("HorizontalPodAutoscaler")["spec"]
    for key in ("minReplicas", "maxReplicas", "metrics", "behavior"):
        assert hpa[key] == plain_hpa[key], key
    pdb = _one(documents, "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == by_kind("PodDisruptionBudget")["spec"]["maxUnavailable"]
    ingress = _one(documents, "Ingress")
    plain_ingress = by_kind("Ingress")
    assert ingress["metadata"]["annotations"] == plain_ingress["metadata"]["annotations"]
    assert ingress["spec"]["tls"] == plain_ingress["spec"]["tls"]
    assert ingress["spec"]["ingressClassName"] == plain_ingress["spec"]["ingressClassName"]


def test_the_probe_timings_are_the_values(render: Render) -> None:
    """A values file changes one probe timing; the others keep their defaults."""
    gateway = _gateway(_documents(render({"probes": {"readiness": {"periodSeconds": 7}}})))
    assert gateway["readinessProbe"] == {
        "httpGet": {"path": "/readyz", "port": "http"},
        "periodSeconds": 7,
        "timeoutSeconds": 2,
        "failureThreshold": 2,
    }
    assert gateway["livenessProbe"]["periodSeconds"] == 10


def test_the_config_is_mounted_where_the_image_reads_it(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The image's CMD reads --config PATH: the ConfigMap's key, mounted there, with no
    command or args in the pod to change it."""
    (cmd,) = re.findall(r"^CMD (\[.*\])$", DOCKERFILE.read_text(encoding="utf-8"), re.M)
    words = json.loads(cmd)
    path = Path(words[words.index("--config") + 1])
    documents = rendered["defaults"]
    gateway = _gateway(documents)
    assert "command" not in gateway
    assert "args" not in gateway
    (mount,) = [m for m in gateway["volumeMounts"] if m["name"] == "config"]
    assert mount["mountPath"] == str(path.parent)
    (volume,) = [v for v in _pod(documents)["volumes"] if v["name"] == "config"]
    configmap = _one(documents, "ConfigMap")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert list(configmap["data"]) == [path.name]


@variants
def test_the_rendered_manifests_pass_the_timeout_and_drain_checks(
    rendered: dict[str, list[dict[str, Any]]], variant: str, tmp_path: Path
) -> None:
    """`tidegate check timeouts` and the readiness checks read the rendered manifests: one
    gateway whose grace period (80 s) outlasts the preStop pause (10 s) plus the drain (60 s),
    the callers' 90 s outside the Ingress's 75 s; no finding at all."""
    documents = rendered[variant]
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "tidegate.yaml").write_text(yaml.safe_dump_all(documents), encoding="utf-8")
    config = tmp_path / "tidegate.yaml"
    config.write_text(_one(documents, "ConfigMap")["data"]["tidegate.yaml"], encoding="utf-8")
    deployment, findings = read_kubernetes(folder)
    assert findings == []
    assert deployment is not None
    ((grace, pre_stop),) = [(g.grace_s, g.pre_stop_s) for g in deployment.graces]
    assert (grace, pre_stop) == (80.0, 10.0)
    assert [c.layer.timeout_s for c in deployment.clients] == [90.0]
    balancers = [b.layer.timeout_s for b in deployment.balancers]
    assert balancers == ([75.0] if variant == "autoscaled-with-ingress" else [])
    assert _config(documents)["server"]["drain_seconds"] == 60
    assert check_timeouts(config, kubernetes=folder) == []
    # And as `tidegate readiness --config ... --kubernetes ...` sees them.
    deployed = read_deployments(config, None, folder)
    drain = check_drain(deployed)
    assert (drain.status, drain.summary) == (
        Status.OK,
        "kubernetes terminationGracePeriodSeconds 80s > preStop 10s + drain 60s",
    )
    assert check_timeout_chain(config, deployed).status is Status.OK


def test_the_checks_see_a_load_balancer_that_gives_up_first(render: Render, tmp_path: Path) -> None:
    """An Ingress read timeout under the request deadline is a TMO002 error in the chart's output."""
    timeout = "nginx.ingress.kubernetes.io/proxy-read-timeout"
    documents = _documents(render({"ingress": {"enabled": True, "annotations": {timeout: "30"}}}))
    (tmp_path / "k8s").mkdir()
    (tmp_path / "k8s" / "all.yaml").write_text(yaml.safe_dump_all(documents), encoding="utf-8")
    config = tmp_path / "tidegate.yaml"
    config.write_text(_one(documents, "ConfigMap")["data"]["tidegate.yaml"], encoding="utf-8")
    findings = check_timeouts(config, kubernetes=tmp_path / "k8s")
    errors = [f for f in findings if f.severity is Severity.ERROR]
    assert errors
    assert {f.rule_id for f in errors} == {"TMO002"}


def test_the_grace_period_follows_the_drain(render: Render) -> None:
    """terminationGracePeriodSeconds is derived from preStopSeconds + drainSeconds (+10 s), and
    drainSeconds is the config's server.drain_seconds."""
    documents = _documents(render({"drainSeconds": 120, "preStopSeconds": 5}))
    assert _pod(documents)["terminationGracePeriodSeconds"] == 135
    assert _gateway(documents)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert _config(documents)["server"]["drain_seconds"] == 120
    explicit = _documents(render({"terminationGracePeriodSeconds": 71}))
    assert _pod(explicit)["terminationGracePeriodSeconds"] == 71


def test_a_changed_config_rolls_the_pods(
    render: Render, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """The pod template carries the config's checksum, so `helm upgrade` with a new config
    restarts the pods; a values file's config merges into the defaults key by key."""

    def checksum(documents: list[dict[str, Any]]) -> str:
        annotations = _one(documents, "Deployment")["spec"]["template"]["metadata"]["annotations"]
        return str(annotations["checksum/config"])

    changed = _documents(render({"config": {"logging": {"level": "debug"}}}))
    assert _config(changed)["logging"] == {"level": "debug", "json_lines": True}
    # Values files merge in order, and null removes a key.
    removed = render(
        {"config": {"logging": {"level": "debug"}}}, {"config": {"logging": {"json_lines": None}}}
    )
    assert _config(_documents(removed))["logging"] == {"level": "debug"}
    assert checksum(changed) != checksum(rendered["defaults"])
    assert re.fullmatch(r"[0-9a-f]{64}", checksum(changed))
    assert checksum(_documents(render({}))) == checksum(rendered["defaults"])


def test_a_release_name_names_every_object_consistently(render: Render) -> None:
    """Released as `edge`, every object is edge-tidegate*, and each reference follows."""
    documents = _documents(render(VARIANTS["autoscaled-with-ingress"], name="edge"))
    names = {(d["kind"], d["metadata"]["name"]) for d in documents}
    assert names == {
        ("ConfigMap", "edge-tidegate-config"),
        ("Deployment", "edge-tidegate"),
        ("HorizontalPodAutoscaler", "edge-tidegate"),
        ("Ingress", "edge-tidegate"),
        ("PodDisruptionBudget", "edge-tidegate"),
        ("Service", "edge-tidegate"),
        ("Service", "edge-tidegate-admin"),
        ("ServiceAccount", "edge-tidegate"),
    }
    pod = _pod(documents)
    labels = _one(documents, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pod["serviceAccountName"] == "edge-tidegate"
    (config,) = [v for v in pod["volumes"] if v["name"] == "config"]
    assert config["configMap"]["name"] == "edge-tidegate-config"
    for document in documents:
        spec = document.get("spec", {})
        selector = spec.get("selector", {})
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), document["kind"]
        if document["kind"] in ("Service", "PodDisruptionBudget"):
            assert selector["app.kubernetes.io/instance"] == "edge"
    backend = _one(documents, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend["service"]["name"] == "edge-tidegate"
    hpa = _one(documents, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "edge-tidegate"


def test_the_notes_say_how_to_reach_both_listeners(render: Render) -> None:
    """NOTES.txt renders, names the Secrets to create and the admin port-forward (or its absence)."""
    notes = render(notes=True)
    assert notes.returncode == 0, notes.stderr
    assert "tidegate-secrets (key keys.yaml)" in notes.stdout
    assert "port-forward service/tidegate-admin 9090:9090" in notes.stdout
    off = render({"admin": {"enabled": False}}, notes=True)
    assert off.returncode == 0, off.stderr
    assert "tidegate-admin" not in off.stdout
    assert "admin.enabled: false" in off.stdout


#: Values files the chart refuses, and the message that says why.
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "replicas-not-a-number": (
        {"replicaCount": "three"},
        "replicaCount: invalid type: expected integer, given string",
    ),
    "plain-text-secret": (
        {"secrets": {"apiKeys": {"value": "sk-live-0123"}}},
        'secrets.apiKeys: additional property "value" is not allowed',
    ),
    "latest-tag": ({"image": {"tag": "latest"}}, "image.tag: must not match"),
    "grace-shorter-than-drain": (
        {"terminationGracePeriodSeconds": 60},
        "terminationGracePeriodSeconds (60) must be longer than preStopSeconds + drainSeconds (70)",
    ),
    "no-api-keys-secret": (
        {"secrets": {"apiKeys": {"existingSecret": ""}}},
        "secrets.apiKeys.existingSecret: name the existing Secret that holds the API keys file",
    ),
    "chart-managed-key": (
        {"config": {"server": {"port": 9000}}},
        "config.server.port is set by the chart: set service.containerPort instead",
    ),
    "key-for-no-provider": (
        {"secrets": {"providerKeys": {"mistral": {"existingSecret": "s", "key": "k"}}}},
        "secrets.providerKeys.mistral: config.providers has no provider mistral",
    ),
    "no-state-url": (
        {"state": {"url": ""}},
        "state: set state.url or state.urlSecret",
    ),
}

#: The cases values.schema.json refuses (the reference implementation agrees); the templates
#: refuse the others.
BY_SCHEMA = {"replicas-not-a-number", "plain-text-secret", "latest-tag"}


@pytest.mark.parametrize("case", list(REFUSED))
def test_invalid_values_fail_the_render_with_a_clear_message(render: Render, case: str) -> None:
    """The render fails, prints nothing, and the error names the value at fault."""
    values, message = REFUSED[case]
    result = render(values)
    assert result.returncode == 1
    assert result.stdout == ""
    assert message in result.stderr
    schema_errors = list(jsonschema.Draft7Validator(SCHEMA).iter_errors(_merged(values)))
    assert bool(schema_errors) == (case in BY_SCHEMA), schema_errors
