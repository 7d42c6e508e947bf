"""The canary controller on a live gateway in front of the fake upstream."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.gateway.harness import KEY, running_gateway
from tests.gateway.upstream import RunningUpstream, openai_provider, running_upstream

pytestmark = pytest.mark.slow

ADMIN = "tg-canary-admin"
USERS = [f"user-{i}" for i in range(300)]


def script(candidate_fault: float) -> dict[str, Any]:
    faults = (
        [{"probability": candidate_fault, "kind": "http", "status": 500}] if candidate_fault else []
    )
    return {
        "seed": 3,
        "models": {
            "base-model": {"text": "baseline answer"},
            "cand-model": {"text": "candidate answer", "faults": faults},
        },
    }


@contextmanager
def live(tmp_path: Path, **canary: Any) -> Iterator[tuple[httpx.Client, RunningUpstream]]:
    digest = hashlib.sha256(ADMIN.encode()).hexdigest()
    (tmp_path / "admin.yaml").write_text(
        yaml.safe_dump({"keys": [{"id": "ops", "sha256": digest}]})
    )
    with running_upstream(script(0.0)) as up:
        config = {
            "auth": {"keys_file": "keys.yaml", "admin_keys_file": "admin.yaml"},
            "providers": {
                "base": openai_provider(up, "base-model"),
                "cand": openai_provider(up, "cand-model"),
            },
            "models": {
                "chat": {
                    "providers": ["base"],
                    "canary": {
                        "salt": "chat-v2",
                        "candidate": {"providers": ["cand"], "prompt_version": "v2"},
                        "schedule": [0.1, 0.5, 1.0],
                        "evaluate_every_s": 3600,  # the test asks for each evaluation itself
                        "min_requests": 15,
                        "min_baseline_requests": 15,
                        "error_margin": 0.05,
                        # Latency on a shared test machine is noise: these tests judge errors.
                        "latency_ratio": 100.0,
                        **canary,
                    },
                }
            },
            "retry": {"attempts": 1},
            "cache": {"enabled": False},
            "rate_limits": {},
        }
        with (
            running_gateway(tmp_path, config) as (base, _),
            httpx.Client(
                base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=10
            ) as client,
        ):
            yield client, up


def admin(client: httpx.Client, path: str, **body: Any) -> Any:
    response = client.post(
        path,
        json={"who": "release-manager", "why": "test", **body},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert response.status_code == 200, response.text
    return response.json()


def traffic(client: httpx.Client, users: list[str]) -> dict[str, str]:
    """Send one request per user; return each user's version."""
    versions = {}
    for user in users:
        response = client.post(
            "/v1/chat/completions",
            json={"model": "chat", "user": user, "messages": [{"role": "user", "content": "hi"}]},
        )
        versions[user] = response.headers["x-tidegate-version"]
    return versions


def test_healthy_candidate_reaches_full_traffic_and_cohorts_are_sticky(tmp_path: Path) -> None:
    """Every step proceeds; a user in the candidate cohort at 10% stays in it at 50% and 100%."""
    with live(tmp_path) as (client, _):
        assert admin(client, "/admin/rollouts/chat/start")["share"] == 0.1
        first = traffic(client, USERS)
        early = {u for u, v in first.items() if v == "candidate"}
        assert 10 <= len(early) <= 60
        step = admin(client, "/admin/rollouts/chat/evaluate")
        assert (step["verdict"], step["share"]) == ("proceed", 0.5)
        second = traffic(client, USERS)
        assert all(second[u] == "candidate" for u in early)
        step = admin(client, "/admin/rollouts/chat/evaluate")
        assert (step["verdict"], step["state"], step["share"]) == ("proceed", "done", 1.0), step
        third = traffic(client, USERS[:40])
        assert set(third.values()) == {"candidate"}


def test_candidate_failing_with_its_share_is_rolled_back_by_flag(tmp_path: Path) -> None:
    """Healthy at 10%, failing at 50%: the gate rolls it back before 100%, reasons in the audit."""
    with live(tmp_path) as (client, up):
        admin(client, "/admin/rollouts/chat/start")
        traffic(client, USERS)
        assert admin(client, "/admin/rollouts/chat/evaluate")["share"] == 0.5
        up.replace_script(script(0.5))  # the defect grows with traffic
        traffic(client, USERS)
        step = admin(client, "/admin/rollouts/chat/evaluate")
        assert (step["verdict"], step["state"], step["share"]) == ("rollback", "rolled_back", 0.0)
        assert set(traffic(client, USERS[:40]).values()) == {"baseline"}
        audit = client.get(
            "/admin/audit?flag=rollout.chat.share", headers={"Authorization": f"Bearer {ADMIN}"}
        ).json()
        last = audit[0]
        assert (last["new"], last["who"]) == (0.0, "rollout-controller")
        assert "error" in last["why"]


def test_too_few_requests_holds(tmp_path: Path) -> None:
    """With only a handful of requests in the window the gate holds; it never proceeds."""
    with live(tmp_path) as (client, _):
        admin(client, "/admin/rollouts/chat/start")
        traffic(client, USERS[:5])
        step = admin(client, "/admin/rollouts/chat/evaluate")
        assert (step["verdict"], step["share"]) == ("hold", 0.1)
        status = client.get(
            "/admin/rollouts/chat", headers={"Authorization": f"Bearer {ADMIN}"}
        ).json()
        assert (status["state"], status["share"]) == ("running", 0.1)
