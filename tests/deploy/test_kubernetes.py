"""The Kubernetes manifests, parsed: probes, grace period, disruption budget, autoscaler, mounts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.deploy.conftest import (
    KUBERNETES,
    PRODUCTION_CONFIG,
    SECRET_NAME,
    by_kind,
    load_with_secrets,
    manifests,
)
from tidegate.gateway.config import Config
from tidegate.ops.cli import check_app


@pytest.fixture(scope="module")
def pod() -> dict[str, Any]:
    spec: dict[str, Any] = by_kind("Deployment")["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def gateway(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["containers"] if c["name"] == "tidegate"]
    return dict(container)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    """The config the pods run: the ConfigMap's tidegate.yaml, through the real loader."""
    path = tmp_path / "tidegate.yaml"
    path.write_text(by_kind("ConfigMap")["data"]["tidegate.yaml"], encoding="utf-8")
    return load_with_secrets(path, tmp_path)


def _mount_path(container: dict[str, Any], volume: str) -> str:
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume]
    return str(mount["mountPath"])


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (volume,) = [v for v in pod["volumes"] if v["name"] == name]
    return dict(volume)


def test_the_configmap_carries_the_production_config_verbatim() -> None:
    """configmap.yaml's tidegate.yaml is deploy/tidegate.production.yaml, byte for byte."""
    data = by_kind("ConfigMap")["data"]["tidegate.yaml"]
    assert data == PRODUCTION_CONFIG.read_text(encoding="utf-8")


def test_liveness_probes_healthz_and_readiness_probes_readyz(gateway: dict[str, Any]) -> None:
    """Liveness touches nothing (/healthz); readiness checks dependencies (/readyz)."""
    port = gateway["ports"][0]["name"]
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert gateway["ports"][0]["containerPort"] == 8080


def test_the_container_listens_where_the_config_says(
    gateway: dict[str, Any], config: Config
) -> None:
    """The probes' port is the config's server.port, bound on every interface."""
    assert gateway["ports"][0]["containerPort"] == config.server.port
    assert config.server.host == "0.0.0.0"


def test_the_grace_period_outlasts_the_pre_stop_pause_plus_the_drain(
    pod: dict[str, Any], gateway: dict[str, Any], config: Config
) -> None:
    """terminationGracePeriodSeconds > preStop sleep + server.drain_seconds (it counts both)."""
    command = gateway["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause = float(command[1])
    assert pause > 0, "without a pause the load balancer still routes to a draining pod"
    assert pod["terminationGracePeriodSeconds"] > pause + config.server.drain_seconds


def test_pods_run_as_non_root_with_a_locked_down_container(
    pod: dict[str, Any], gateway: dict[str, Any]
) -> None:
    """runAsNonRoot with a non-zero uid; no privilege escalation, read-only root, no capabilities."""
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]


def test_the_gateway_has_resource_requests_and_a_memory_limit(gateway: dict[str, Any]) -> None:
    """The scheduler knows what a pod needs, and a leak ends in a restart, not a full node."""
    resources = gateway["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert "memory" in resources["limits"]


def test_config_and_secrets_are_mounted_as_files_never_env(
    pod: dict[str, Any], gateway: dict[str, Any]
) -> None:
    """The ConfigMap is at /etc/tidegate, the Secret under /run/secrets; no env holds a secret."""
    assert _volume(pod, "config")["configMap"]["name"] == by_kind("ConfigMap")["metadata"]["name"]
    assert _mount_path(gateway, "config") == "/etc/tidegate"
    assert _volume(pod, "secrets")["secret"]["secretName"] == "tidegate-secrets"
    assert _mount_path(gateway, "secrets") == "/run/secrets/tidegate"
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        for env in container.get("env", []):
            assert not SECRET_NAME.search(env["name"]), env["name"]
        assert "envFrom" not in container


def test_every_secret_file_the_config_names_is_in_the_secret(gateway: dict[str, Any]) -> None:
    """Each *_file path in the config lies under the Secret's mount and is a key of the Secret."""
    raw = yaml.safe_load(PRODUCTION_CONFIG.read_text(encoding="utf-8"))
    paths = [raw["auth"]["keys_file"], raw["auth"]["admin_keys_file"]]
    paths += [p["api_key_file"] for p in raw["providers"].values() if "api_key_file" in p]
    mount = _mount_path(gateway, "secrets")
    declared = set(by_kind("Secret")["stringData"])
    for path in paths:
        folder, _, name = path.rpartition("/")
        assert folder == mount, path
        assert name in declared, f"{name} is not a key of the Secret"


def test_the_database_password_file_is_prepared_by_the_init_container(
    pod: dict[str, Any], gateway: dict[str, Any]
) -> None:
    """The init container copies pgpass from the Secret into the private volume the URL names."""
    url = yaml.safe_load(PRODUCTION_CONFIG.read_text(encoding="utf-8"))["state"]["url"]
    passfile = url.split("passfile=", 1)[1].split("&", 1)[0]
    (init,) = pod["initContainers"]
    assert init["image"] == gateway["image"]
    assert init["command"][-1] == passfile
    assert init["command"][-2] == f"{_mount_path(gateway, 'secrets')}/pgpass"
    assert "0600" in init["command"]
    assert passfile.startswith(_mount_path(gateway, "run") + "/")
    assert "pgpass" in by_kind("Secret")["stringData"]


def test_images_are_never_latest(pod: dict[str, Any]) -> None:
    """Every container names an exact tag."""
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        image = container["image"]
        assert ":" in image, image
        assert not image.endswith(":latest"), image


def test_the_service_selects_the_pods_and_their_named_port(
    pod: dict[str, Any], gateway: dict[str, Any]
) -> None:
    """The Service's selector matches the pod labels; its target is the container's port name."""
    service = by_kind("Service")
    labels = by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == gateway["ports"][0]["name"]


def test_the_disruption_budget_allows_one_pod_down_at_a_time() -> None:
    """The PDB selects the gateway's pods and always leaves the HPA's minimum less one running."""
    pdb = by_kind("PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    labels = by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    minimum = by_kind("HorizontalPodAutoscaler")["spec"]["minReplicas"]
    if "maxUnavailable" in pdb["spec"]:
        assert 1 <= pdb["spec"]["maxUnavailable"] < minimum
    else:
        assert 1 <= pdb["spec"]["minAvailable"] < minimum


def test_the_autoscaler_scales_down_only_after_a_stabilisation_window() -> None:
    """autoscaling/v2 on the Deployment; scale-down waits (>= 5 minutes), scale-up does not."""
    hpa = by_kind("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == by_kind("Deployment")["metadata"]["name"]
    behavior = hpa["spec"]["behavior"]
    down = behavior["scaleDown"]["stabilizationWindowSeconds"]
    assert down >= 300
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] < down
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in by_kind("Deployment")["spec"], "the HPA owns the replica count"


def test_the_load_balancer_waits_longer_than_a_request(config: Config) -> None:
    """The Ingress read timeout outlasts server.request_timeout_s, so the gateway answers first."""
    annotations = by_kind("Ingress")["metadata"]["annotations"]
    read = float(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"])
    assert read > config.server.request_timeout_s
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"


def test_the_admin_port_is_reachable_inside_the_cluster_only(
    gateway: dict[str, Any], config: Config
) -> None:
    """The admin listener (with an admin keys file) is a named container port the ClusterIP
    Service reaches; the Ingress routes to the public port alone; Prometheus scrapes the
    admin port, where /metrics is."""
    assert config.auth.admin_keys_file is not None
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports["admin"] == config.server.admin_port != config.server.port
    assert config.server.admin_host == "0.0.0.0"
    service = by_kind("Service")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "admin"}
    admin_port = next(p["port"] for p in service["spec"]["ports"] if p["targetPort"] == "admin")
    for rule in by_kind("Ingress")["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]["port"]
            assert backend.get("name") == "http"
            assert backend.get("number") != admin_port
    annotations = by_kind("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert config.server.admin_metrics
    assert annotations["prometheus.io/port"] == str(config.server.admin_port)


def test_kustomization_applies_every_manifest_but_the_secret_template() -> None:
    """`kubectl apply -k` creates everything except the Secret, which is made from files."""
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text("utf-8"))
    files = {path.name for path, _ in manifests()}
    assert set(kustomization["resources"]) == files - {"secret.yaml"}
    for name in kustomization["resources"]:
        assert (KUBERNETES / name).is_file(), name
    image = by_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert kustomization["images"][0]["name"] == image.split(":")[0]


def test_the_timeout_check_passes_on_the_shipped_manifests() -> None:
    """`tidegate check timeouts` finds nothing wrong with the production config and manifests."""
    result = CliRunner().invoke(
        check_app,
        ["timeouts", "--config", str(PRODUCTION_CONFIG), "--kubernetes", str(KUBERNETES)],
    )
    assert result.exit_code == 0, result.output
    assert "WARNING" not in result.output
