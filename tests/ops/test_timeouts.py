"""The timeout chain over real files: each rule fails on a broken copy of the passing fixture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ops.conftest import FIXTURES, Copier, edit_yaml
from tidegate.ops.findings import Finding, Severity
from tidegate.ops.timeouts import (
    RULES,
    Timed,
    check_chain,
    check_timeouts,
    gateway_chains,
    load_timing_config,
    parse_duration,
    parse_nginx_time,
    read_compose,
    read_kubernetes,
)
from tidegate.policy.deadline import Layer

GOOD = FIXTURES / "timeouts" / "good"
BAD = FIXTURES / "timeouts" / "bad"


def _check(root: Path) -> list[Finding]:
    return check_timeouts(
        root / "tidegate.yaml",
        compose=root / "docker-compose.yml",
        kubernetes=root / "kubernetes",
    )


def _compose(root: Path, change: Callable[[dict[str, Any]], object]) -> None:
    edit_yaml(root / "docker-compose.yml", change)


def _deployment(root: Path, change: Callable[[dict[str, Any]], object]) -> None:
    path = root / "kubernetes" / "deployment.yaml"
    docs = list(yaml.safe_load_all(path.read_text()))
    change(docs[0])
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = doc["spec"]["template"]["spec"]
    return pod


def _bad_config(root: Path) -> None:
    edit_yaml(root / "tidegate.yaml", lambda d: d["server"].update(request_timout_s=60))


def _short_request(root: Path) -> None:
    edit_yaml(root / "tidegate.yaml", lambda d: d["server"].update(request_timeout_s=40))


def _short_compose_grace(root: Path) -> None:
    _compose(root, lambda d: d["services"]["gateway"].update(stop_grace_period="15s"))


def _short_kubernetes_grace(root: Path) -> None:
    _deployment(root, lambda d: _pod(d).update(terminationGracePeriodSeconds=25))


def _no_gateway_service(root: Path) -> None:
    _compose(root, lambda d: d["services"].pop("gateway"))


def _no_gateway_workload(root: Path) -> None:
    (root / "kubernetes" / "deployment.yaml").unlink()


def _unreadable_grace(root: Path) -> None:
    _compose(root, lambda d: d["services"]["gateway"].update(stop_grace_period="forever"))


def _no_client_timeout(root: Path) -> None:
    _compose(root, lambda d: d["services"]["nginx"].pop("labels"))


def _override_by_environment(root: Path) -> None:
    env = {"TIDEGATE_SERVER__DRAIN_SECONDS": "45", "TIDEGATE_LOGGING__LEVEL": "debug"}
    _compose(root, lambda d: d["services"]["gateway"].update(environment=env))


#: One way to break each rule, starting from the passing fixture.
BREAKS: dict[str, Callable[[Path], None]] = {
    "TMO001": _bad_config,
    "TMO002": _short_request,
    "TMO003": _short_compose_grace,
    "TMO004": _short_kubernetes_grace,
    "TMO005": _no_gateway_service,
    "TMO006": _no_gateway_workload,
    "TMO007": _unreadable_grace,
    "TMO008": _no_client_timeout,
    "TMO009": _override_by_environment,
}


def test_every_rule_has_a_way_to_break_it() -> None:
    """The table of breaks covers exactly the rules the module declares."""
    assert set(BREAKS) == set(RULES)


def test_the_passing_fixture_nests_and_drains_in_time() -> None:
    """client 120 > nginx 90 > request 60 > stream 50 > 46.5, and both grace periods suffice."""
    assert _check(GOOD) == []


@pytest.mark.parametrize("rule_id", sorted(BREAKS))
def test_each_rule_fires_on_its_broken_fixture(copy_fixture: Copier, rule_id: str) -> None:
    """Breaking the passing fixture one way gives a finding under that rule, at its severity."""
    root = copy_fixture("timeouts/good")
    assert _check(root) == []
    BREAKS[rule_id](root)
    findings = _check(root)
    hits = [f for f in findings if f.rule_id == rule_id]
    assert hits, findings
    assert {f.severity for f in hits} == {RULES[rule_id].severity}


def test_only_timing_overrides_are_warned_about(copy_fixture: Copier) -> None:
    """TIDEGATE_SERVER__DRAIN_SECONDS is a timing override; TIDEGATE_LOGGING__LEVEL is not."""
    root = copy_fixture("timeouts/good")
    _override_by_environment(root)
    (finding,) = _check(root)
    assert finding.message.startswith("TIDEGATE_SERVER__DRAIN_SECONDS overrides a timeout")


def test_the_shipped_defaults_do_not_nest() -> None:
    """With the default stream limit and per-try timeout, both inner layers outlive the request."""
    messages = [f.message for f in _check(BAD) if f.rule_id == "TMO002"]
    assert messages == [
        "gateway request (60s) lasts as long as load balancer (60s): the load balancer may give "
        "up first and the gateway request is orphaned",
        "stream limit of provider primary (300s) outlives gateway request (60s): the gateway "
        "request gives up first and the stream limit of provider primary is orphaned",
        "retrying calls of route chat-default (91.5s) outlives gateway request (60s): the gateway "
        "request gives up first and the retrying calls of route chat-default is orphaned "
        "(3 tries x 30s + 1.5s worst backoff)",
    ]


def test_unset_grace_periods_take_the_orchestrators_defaults() -> None:
    """No stop_grace_period is Docker's 10s; no terminationGracePeriodSeconds is Kubernetes' 30s."""
    by_rule = {f.rule_id: f for f in _check(BAD)}
    assert "stop_grace_period is 10s (the default)" in by_rule["TMO003"].message
    assert "terminationGracePeriodSeconds is 30s (the default)" in by_rule["TMO004"].message
    assert "preStop sleep (5s)" in by_rule["TMO004"].message


def test_a_grace_period_equal_to_the_drain_is_too_short(copy_fixture: Copier) -> None:
    """A grace period exactly as long as the drain kills at the same instant: it must be longer."""
    root = copy_fixture("timeouts/good")
    _compose(root, lambda d: d["services"]["gateway"].update(stop_grace_period="20s"))
    assert [f.rule_id for f in _check(root)] == ["TMO003"]
    _compose(root, lambda d: d["services"]["gateway"].update(stop_grace_period="20500ms"))
    assert _check(root) == []


def test_the_prestop_sleep_counts_against_the_kubernetes_grace(copy_fixture: Copier) -> None:
    """40s of grace covers 5s preStop + 20s drain, but not a 25s preStop sleep."""
    root = copy_fixture("timeouts/good")

    def long_sleep(doc: dict[str, Any]) -> None:
        container = _pod(doc)["containers"][0]
        container["lifecycle"]["preStop"] = {"exec": {"command": ["/bin/sh", "-c", "sleep 25"]}}

    _deployment(root, long_sleep)
    (finding,) = _check(root)
    assert finding.rule_id == "TMO004"
    assert "preStop sleep (25s)" in finding.message


def test_nginx_without_a_read_timeout_uses_its_default(tmp_path: Path) -> None:
    """A proxying nginx config without proxy_read_timeout is read as nginx's 60s default."""
    (tmp_path / "nginx.conf").write_text("server { location / { proxy_pass http://g; } }\n")
    compose = {
        "services": {
            "gateway": {"image": "tidegate:1", "stop_grace_period": "1m"},
            "lb": {"image": "nginx:1.27", "volumes": ["./nginx.conf:/etc/nginx/nginx.conf"]},
        }
    }
    (tmp_path / "compose.yml").write_text(yaml.safe_dump(compose))
    deployment, findings = read_compose(tmp_path / "compose.yml")
    assert findings == []
    assert deployment is not None
    assert [t.layer for t in deployment.balancers] == [Layer("load balancer", 60.0)]
    assert deployment.graces[0].grace_s == 60.0


def test_compose_configs_and_interpolation_are_followed(tmp_path: Path) -> None:
    """nginx configs given as compose `configs`, and ${VAR:-default} values, are read."""
    (tmp_path / "lb.conf").write_text("location / { proxy_pass http://g; proxy_read_timeout 2m; }")
    compose = {
        "configs": {"lb": {"file": "./lb.conf"}},
        "services": {
            "api": {
                "build": ".",
                "labels": {"tidegate.gateway": "true"},
                "stop_grace_period": "${GRACE:-45s}",
            },
            "edge": {"image": "docker.io/library/nginx:stable", "configs": ["lb"]},
        },
    }
    (tmp_path / "compose.yml").write_text(yaml.safe_dump(compose))
    deployment, findings = read_compose(tmp_path / "compose.yml")
    assert findings == []
    assert deployment is not None
    assert [t.layer.timeout_s for t in deployment.balancers] == [120.0]
    assert [(g.workload, g.grace_s) for g in deployment.graces] == [("api", 45.0)]


def test_a_gateway_label_set_false_excludes_a_service(tmp_path: Path) -> None:
    """tidegate.gateway: "false" overrides an image that happens to mention tidegate."""
    compose = {
        "services": {"docs": {"image": "tidegate-docs:1", "labels": ["tidegate.gateway=false"]}}
    }
    (tmp_path / "compose.yml").write_text(yaml.safe_dump(compose))
    _, findings = read_compose(tmp_path / "compose.yml")
    assert [f.rule_id for f in findings] == ["TMO005"]


def test_kubernetes_reads_the_sleep_action_and_load_balancer_annotations(tmp_path: Path) -> None:
    """The preStop sleep action, an AWS idle timeout on a Service and a List are all read."""
    manifest = {
        "kind": "List",
        "items": [
            {
                "kind": "StatefulSet",
                "metadata": {"name": "gw"},
                "spec": {
                    "template": {
                        "spec": {
                            "terminationGracePeriodSeconds": 60,
                            "containers": [
                                {
                                    "name": "gw",
                                    "image": "registry.example/tidegate@sha256:abc",
                                    "lifecycle": {"preStop": {"sleep": {"seconds": 7}}},
                                }
                            ],
                        }
                    }
                },
            },
            {
                "kind": "Service",
                "metadata": {
                    "name": "gw",
                    "annotations": {
                        "service.beta.kubernetes.io/aws-load-balancer-connection-idle-timeout": "75"
                    },
                },
            },
        ],
    }
    (tmp_path / "all.yaml").write_text(yaml.safe_dump(manifest))
    deployment, findings = read_kubernetes(tmp_path)
    assert findings == []
    assert deployment is not None
    assert [(g.grace_s, g.pre_stop_s) for g in deployment.graces] == [(60.0, 7.0)]
    assert [t.layer.timeout_s for t in deployment.balancers] == [75.0]


def test_a_missing_kubernetes_folder_is_a_finding(tmp_path: Path) -> None:
    """A --kubernetes folder that does not exist is TMO006, not an exception."""
    deployment, findings = read_kubernetes(tmp_path / "nowhere")
    assert deployment is None
    assert [f.rule_id for f in findings] == ["TMO006"]


def test_a_config_whose_secrets_live_in_the_container_is_still_checked(tmp_path: Path) -> None:
    """Missing secret files and production's rules do not stop the timings being read."""
    config = {
        "profile": "production",
        "server": {"request_timeout_s": 20},
        "auth": {"keys_file": "/run/secrets/keys.yaml"},
        "providers": {"p": {"type": "fake", "model": "p", "stream": {"max_duration_s": 300}}},
        "models": {"chat": {"providers": ["p"], "per_try_timeout_s": 5}},
    }
    (tmp_path / "tidegate.yaml").write_text(yaml.safe_dump(config))
    loaded, findings = load_timing_config(tmp_path / "tidegate.yaml")
    assert findings == []
    assert loaded is not None
    assert loaded.server.request_timeout_s == 20
    messages = [f.message for f in check_timeouts(tmp_path / "tidegate.yaml")]
    assert len(messages) == 1
    assert messages[0].startswith("stream limit of provider p (300s) outlives gateway request")


def test_a_config_that_does_not_validate_is_tmo001(tmp_path: Path) -> None:
    """A config with an unknown key gives the loader's own message under TMO001."""
    (tmp_path / "tidegate.yaml").write_text("providers: {}\nmodels: {}\nserver: {prot: 1}\n")
    (finding,) = check_timeouts(tmp_path / "tidegate.yaml")
    assert finding.rule_id == "TMO001"
    assert "unknown key 'server.prot'" in finding.message


def test_a_retry_cap_below_its_base_is_tmo001(tmp_path: Path) -> None:
    """Retry settings the policy refuses are reported instead of crashing the check."""
    config = {
        "retry": {"base_s": 2, "cap_s": 1},
        "providers": {"p": {"type": "fake", "model": "p"}},
        "models": {"chat": {"providers": ["p"]}},
    }
    (tmp_path / "tidegate.yaml").write_text(yaml.safe_dump(config))
    (finding,) = check_timeouts(tmp_path / "tidegate.yaml")
    assert finding.rule_id == "TMO001"
    assert finding.message.startswith("retry: cap must be")


def test_gateway_chains_compute_the_retrying_layer_with_provider_layer() -> None:
    """3 tries x 15s + (0.5 + 1) backoff is 46.5s, one chain per provider of the route."""
    config, _ = load_timing_config(GOOD / "tidegate.yaml")
    assert config is not None
    chains = gateway_chains(config, "cfg")
    assert [[t.layer.timeout_s for t in chain] for chain in chains] == [[60.0, 50.0, 46.5]] * 2
    assert chains[0][2].detail == "3 tries x 15s + 1.5s worst backoff"


def test_check_chain_blames_the_layer_that_outlives_its_caller() -> None:
    """The finding's place is where the offending (inner) layer is set."""
    chain = [
        Timed(Layer("client", 30.0), "client.yml"),
        Timed(Layer("load balancer", 60.0), "nginx.conf"),
        Timed(Layer("gateway request", 20.0), "tidegate.yaml"),
    ]
    (finding,) = check_chain(chain)
    assert finding.where == "nginx.conf"
    assert finding.severity is Severity.ERROR
    assert finding.message.startswith("load balancer (60s) outlives client (30s)")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("40s", 40.0), ("1m30s", 90.0), ("500ms", 0.5), ("1h", 3600.0), ("2.5s", 2.5), (15, 15.0)],
)
def test_compose_durations(text: str | int, seconds: float) -> None:
    """Compose durations follow Go's units; a bare number is seconds."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["forever", "", "10 s", "1x", True])
def test_unreadable_compose_durations_raise(text: str | bool) -> None:
    """Anything that is not a duration is refused, so the check can report it."""
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("60", 60.0),
        ("90s", 90.0),
        ("1m30s", 90.0),
        ("1m 30s", 90.0),
        ("500ms", 0.5),
        ("1h", 3600.0),
    ],
)
def test_nginx_times(text: str, seconds: float) -> None:
    """nginx times take ms, s, m, h (and longer) units; no unit means seconds."""
    assert parse_nginx_time(text) == seconds


@pytest.mark.parametrize("text", ["", "sixty", "60x", "1.5s"])
def test_unreadable_nginx_times_raise(text: str) -> None:
    """An nginx time nginx itself would refuse is refused here too."""
    with pytest.raises(ValueError):
        parse_nginx_time(text)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(min_value=0, max_value=48),
    st.integers(min_value=0, max_value=59),
    st.integers(min_value=0, max_value=59),
)
def test_duration_parts_add_up(hours: int, minutes: int, seconds: int) -> None:
    """Compose and nginx agree on h/m/s durations, and the parts add up exactly."""
    total = float(hours * 3600 + minutes * 60 + seconds)
    assert parse_duration(f"{hours}h{minutes}m{seconds}s") == total
    assert parse_nginx_time(f"{hours}h{minutes}m{seconds}s") == total
