"""Metrics that add up: workers' metrics merged into one scrape, bounded label values, and an
exposition that prometheus-client's own parser reads and that follows the naming rules."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import KEY, fake, serving_process
from tidegate.gateway.worker_metrics import SharedMetrics, merge

CONFIG: dict[str, Any] = {
    "providers": {"p": fake("hi", model="m-1")},
    "models": {"chat": {"providers": ["p"]}},
}
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def _family(name: str, kind: str, *samples: tuple[str, dict[str, str], float]) -> list[Any]:
    return [name, kind, "help", [list(s) for s in samples]]


def test_merge_adds_counters_and_live_gauges_and_takes_the_worst_breaker() -> None:
    first = [
        _family("t_requests", "counter", ("t_requests_total", {"route": "a"}, 3.0)),
        _family("t_in_flight", "gauge", ("t_in_flight", {}, 2.0)),
        _family("tidegate_breaker_state", "gauge", ("tidegate_breaker_state", {"p": "x"}, 0.0)),
        _family("t_c", "counter", ("t_c_total", {}, 1.0), ("t_c_created", {}, 50.0)),
    ]
    second = [
        _family("t_requests", "counter", ("t_requests_total", {"route": "a"}, 4.0)),
        _family("t_in_flight", "gauge", ("t_in_flight", {}, 1.0)),
        _family("tidegate_breaker_state", "gauge", ("tidegate_breaker_state", {"p": "x"}, 2.0)),
        _family("t_c", "counter", ("t_c_total", {}, 1.0), ("t_c_created", {}, 40.0)),
    ]
    stopped = [
        _family("t_requests", "counter", ("t_requests_total", {"route": "a"}, 5.0)),
        _family("t_in_flight", "gauge", ("t_in_flight", {}, 9.0)),
    ]
    merged = {m.name: m for m in merge([(True, first), (True, second), (False, stopped)])}
    assert merged["t_requests"].samples[0].value == 12.0  # a stopped worker's counts stay
    assert merged["t_in_flight"].samples[0].value == 3.0  # its gauges do not
    assert merged["tidegate_breaker_state"].samples[0].value == 2.0
    assert [s.value for s in merged["t_c"].samples] == [2.0, 40.0]


@pytest.mark.asyncio
async def test_two_workers_files_scrape_as_one(gateway_client: AppFactory, tmp_path: Path) -> None:
    """Two processes' runtimes sharing a folder: either one's exposition counts both."""
    folder = tmp_path / "shared"
    folder.mkdir()
    async with gateway_client(CONFIG) as (one, app_one), gateway_client(CONFIG) as (two, app_two):
        for _ in range(3):
            assert (await one.post("/v1/chat/completions", json=CHAT)).status_code == 200
        for _ in range(7):
            assert (await two.post("/v1/chat/completions", json=CHAT)).status_code == 200
        first = SharedMetrics(folder, app_one.runtime, pid=1)
        second = SharedMetrics(folder, app_two.runtime, pid=2)
        second.write()
        text = first.exposition().decode()
        assert _requests(text) == 10
        assert first.path.exists()


def _requests(text: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in families["tidegate_requests"].samples if s.name.endswith("_total"))


@pytest.mark.asyncio
async def test_the_exposition_parses_and_follows_the_naming_rules(
    gateway_client: AppFactory,
) -> None:
    """prometheus-client's parser reads every family; names and label names are valid, counters
    end in _total, every family is tidegate_* with help text, and the caller's model names never
    become label values (an unknown model is the route "-")."""
    async with gateway_client(CONFIG) as (client, _):
        await client.post("/v1/chat/completions", json=CHAT)
        for i in range(5):
            bogus = {**CHAT, "model": f"random-model-{i}"}
            assert (await client.post("/v1/chat/completions", json=bogus)).status_code == 404
        text = (await client.get("/metrics")).text
    families = list(text_string_to_metric_families(text))
    assert len(families) > 10
    for family in families:
        assert family.name.startswith("tidegate_"), family.name
        assert NAME.match(family.name), family.name
        assert family.documentation, family.name
        for sample in family.samples:
            assert NAME.match(sample.name), sample.name
            assert all(LABEL.match(label) for label in sample.labels), sample
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created")), sample.name
            assert "random-model" not in "".join(sample.labels.values()), sample
    requests = next(f for f in families if f.name == "tidegate_requests")
    assert {s.labels["route"] for s in requests.samples} <= {"chat", "-"}
    assert {s.labels["model"] for s in requests.samples} <= {"m-1", "-"}
    histogram = next(f for f in families if f.name == "tidegate_request_duration_seconds")
    assert histogram.type == "histogram"


@pytest.mark.slow
def test_ten_requests_to_two_workers_show_as_ten_in_one_scrape(tmp_path: Path) -> None:
    """``tidegate serve`` with two workers: whichever worker answers the scrape counts the
    requests both answered (each worker shares its numbers every quarter second)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    config = {**CONFIG, "server": {"workers": 2}, "logging": {"level": "info"}}
    with serving_process(tmp_path, config) as served:
        pause = threading.Event()
        for _ in range(500):  # both workers up
            if served.output().count('"serving"') == 2:
                break
            pause.wait(0.02)
        for _ in range(10):  # a new connection each: the kernel spreads them over both workers
            answer = httpx.post(f"{served.base}/v1/chat/completions", json=CHAT, headers=headers)
            assert answer.status_code == 200
        counts: list[float] = []
        for _ in range(50):  # until each worker has shared its last numbers (0.25 s)
            counts.append(_requests(httpx.get(f"{served.base}/metrics").text))
            if counts[-1] == 10:
                break
            pause.wait(0.1)
        assert counts[-1] == 10, counts
        assert max(counts) == 10, counts
