"""SIGHUP to a real `tidegate serve` process: the keys file is read again, nothing dies."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.gateway.harness import KEY, ServedProcess, fake, serving_process
from tidegate.gateway.auth import hash_key

pytestmark = pytest.mark.slow

NEW_KEY = "tg-test-new-key"
CONFIG: dict[str, Any] = {
    "logging": {"level": "info"},
    "providers": {"main": fake("hello"), "slow": fake("slowly", latency=0.6)},
    "models": {"chat": {"providers": ["main"]}, "slow": {"providers": ["slow"]}},
}


def _ask(served: ServedProcess, key: str, model: str = "chat") -> httpx.Response:
    return httpx.post(
        f"{served.base}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )


def _write_keys(folder: Path, *keys: str) -> None:
    entries = [
        {"id": f"k{i}", "sha256": hash_key(key), "tenant": "t1", "user": f"u{i}"}
        for i, key in enumerate(keys)
    ]
    (folder / "keys.yaml").write_text(yaml.safe_dump({"keys": entries}), encoding="utf-8")


def _events(output: str, event: str) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for line in output.splitlines()
        if line.startswith("{") and json.loads(line).get("event") == event
    ]


def test_sighup_reloads_the_keys_file_without_dropping_a_request(tmp_path: Path) -> None:
    """After SIGHUP the new keys file is in force, the request in flight still gets its 200,
    and the process keeps serving with a keys_reloaded line naming the count."""
    with serving_process(tmp_path, CONFIG) as served:
        assert _ask(served, NEW_KEY).status_code == 401
        in_flight: dict[str, httpx.Response] = {}
        caller = threading.Thread(target=lambda: in_flight.update(r=_ask(served, KEY, "slow")))
        caller.start()
        threading.Event().wait(0.2)  # the slow request is waiting on its provider
        _write_keys(tmp_path, NEW_KEY)
        served.process.send_signal(signal.SIGHUP)
        output = served.wait_for('"keys_reloaded"')
        caller.join(timeout=10)
        assert in_flight["r"].status_code == 200
        assert _ask(served, NEW_KEY).status_code == 200
        assert _ask(served, KEY).status_code == 401
        assert served.process.poll() is None
    assert _events(output, "keys_reloaded")[0]["keys"] == 1


def test_a_broken_keys_file_on_sighup_keeps_the_old_keys(tmp_path: Path) -> None:
    """A keys file that does not load on SIGHUP is logged as keys_reload_failed; the keys
    already loaded go on answering."""
    with serving_process(tmp_path, CONFIG) as served:
        (tmp_path / "keys.yaml").write_text("keys: [not, a, key]\n", encoding="utf-8")
        served.process.send_signal(signal.SIGHUP)
        output = served.wait_for('"keys_reload_failed"')
        assert _ask(served, KEY).status_code == 200
        assert served.process.poll() is None
    assert _events(output, "keys_reload_failed")[0]["keys_kept"] == 2


def test_sighup_to_the_supervisor_of_several_workers_replaces_them_in_turn(
    tmp_path: Path,
) -> None:
    """With two workers, SIGHUP makes uvicorn's supervisor start two new workers (each logs
    serving) and stop the old ones; requests are answered throughout."""
    with serving_process(tmp_path, {**CONFIG, "server": {"workers": 2}}) as served:
        served.wait_for('"serving"')
        pause = threading.Event()
        for _ in range(250):  # both workers up before the signal
            if len(_events(served.output(), "serving")) == 2:
                break
            pause.wait(0.02)
        assert len(_events(served.output(), "serving")) == 2
        served.process.send_signal(signal.SIGHUP)
        for _ in range(750):
            assert _ask(served, KEY).status_code == 200
            if len(_events(served.output(), "stopping")) == 2:
                break
            pause.wait(0.02)
        output = served.output()
        assert served.process.poll() is None
    assert len(_events(output, "serving")) == 4
    started = {e["pid"] for e in _events(output, "serving")}
    stopped = {e["pid"] for e in _events(output, "stopping")}
    assert len(stopped) == 2
    assert stopped < started
