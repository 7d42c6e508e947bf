"""The gateway in front of an upstream whose errors echo credentials and whose 2xx lie.

The upstream is the real fake upstream on a loopback socket, driven by scripted ``http`` and
``raw`` faults; the provider's key comes from its ``api_key_file``, as in production. Every log
line the gateway writes is recorded (each module's logger and the request line), so that a test
can assert that the key is nowhere: not in the body, not in a header, not in a log line.
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.gateway.conftest import AppFactory
from tests.providers.helpers import gateway_config
from tidegate.gateway import app as app_module
from tidegate.gateway.app import Gateway
from tidegate.providers.fake_upstream import FakeUpstream

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

SECRET = "tidegate-upstream-secret-7f3a"  # not shaped like any known key: only config knows it
OTHER_KEY = "sk-proj-Zx81Qw0PlmN4bV7cX2sA9dF3gH6jK1"  # key-shaped, configured nowhere
PRIMARY, BACKUP = "primary-model", "backup-model"
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "How do I rotate keys?"}]}
ECHO = f"Incorrect API key provided: {SECRET}. Another one: {OTHER_KEY}"


class LogLines:
    """Stands in for every logger of the gateway and records each line it is asked to write."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def request(self, fields: dict[str, Any]) -> None:
        self.lines.append(orjson.dumps({"event": "request", **fields}, default=str).decode())

    def bind(self, **_: Any) -> LogLines:
        return self

    def __getattr__(self, level: str) -> Any:
        def write(event: str = "", *args: Any, **fields: Any) -> None:
            line = orjson.dumps(
                {"level": level, "event": event, "args": args, **fields}, default=str
            ).decode()
            if level == "exception":
                line += traceback.format_exc()
            self.lines.append(line)

        return write


@pytest.fixture
def log_lines(monkeypatch: pytest.MonkeyPatch) -> LogLines:
    """Every ``log`` of a tidegate module, and the request-line writer, recorded in one list."""
    recorder = LogLines()
    for name, module in list(sys.modules.items()):
        if name.startswith("tidegate.") and hasattr(module, "log"):
            monkeypatch.setattr(module, "log", recorder)
    monkeypatch.setattr(app_module, "configure_logging", lambda config: recorder.request)
    return recorder


def _config(
    up: FakeUpstream, tmp_path: Path, *, backup: bool = False, **extra: Any
) -> dict[str, Any]:
    (tmp_path / "primary-key.txt").write_text(SECRET + "\n", encoding="utf-8")
    providers: dict[str, Any] = {
        "primary": {
            "type": "openai",
            "base_url": up.base_url,
            "model": PRIMARY,
            "api_key_file": "primary-key.txt",
        }
    }
    if backup:
        providers["backup"] = {
            "type": "openai",
            "base_url": up.base_url,
            "model": BACKUP,
            "approved_fallback": True,  # the test's fallback has no eval verdict
        }
    return gateway_config(providers, **extra)


@asynccontextmanager
async def _gateway(
    gateway_client: AppFactory,
    tmp_path: Path,
    faults: list[dict[str, Any]],
    **options: Any,
) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway, FakeUpstream]]:
    script = {
        "models": {
            PRIMARY: {"text": "from the primary", "faults": faults},
            BACKUP: {"text": "from the backup"},
        }
    }
    async with (
        FakeUpstream(script) as up,
        gateway_client(_config(up, tmp_path, **options)) as (client, app),
    ):
        yield client, app, up


def _assert_nowhere(response: httpx.Response, log_lines: LogLines, *secrets: str) -> None:
    seen = [response.text, *(f"{k}: {v}" for k, v in response.headers.items()), *log_lines.lines]
    assert log_lines.lines, "the gateway logged nothing: the recorder is not in place"
    for secret in secrets:
        assert not [text for text in seen if secret in text], f"{secret!r} leaked"


async def _attempts(client: httpx.AsyncClient, provider: str, result: str) -> float:
    text = (await client.get("/metrics")).text
    pattern = rf'tidegate_provider_attempts_total{{provider="{provider}",result="{result}"}} (\S+)'
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


def _echo(status: int, code: str) -> dict[str, Any]:
    body = {"error": {"message": ECHO, "type": "invalid_request_error", "code": code}}
    return {"kind": "http", "status": status, "body": body}


@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [
        (_echo(401, "invalid_api_key"), 502, "provider_auth"),
        (_echo(400, "invalid_value"), 400, "provider_bad_request"),
        (_echo(429, "rate_limit_exceeded"), 429, "provider_rate_limited"),
        (_echo(500, "server_error"), 502, "provider_server"),
        (
            {
                "kind": "raw",
                "status": 401,
                "body": f"Unauthorized: Bearer {SECRET} ({OTHER_KEY})",
                "content_type": "text/plain",
                "headers": {"x-request-id": SECRET, "www-authenticate": f"Bearer {SECRET}"},
            },
            502,
            "provider_auth",
        ),
    ],
)
async def test_an_upstream_error_echoing_the_key_never_shows_it(
    fault: dict[str, Any],
    status: int,
    code: str,
    gateway_client: AppFactory,
    tmp_path: Path,
    log_lines: LogLines,
) -> None:
    """An upstream error that echoes the configured key (and another key) reaches the caller
    with its status and code but without either key, in the body, the headers or the log."""
    async with _gateway(gateway_client, tmp_path, [fault]) as (client, _, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
    _assert_nowhere(response, log_lines, SECRET, OTHER_KEY)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"].startswith(f"HTTP {fault['status']}")


async def test_the_degraded_cause_in_the_log_does_not_carry_the_key(
    gateway_client: AppFactory, tmp_path: Path, log_lines: LogLines
) -> None:
    """When degraded mode answers instead, the logged cause (the provider's error) has no key."""
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "keys.md").write_text("# Keys\n\nRotate keys with `keyctl rotate`.\n", "utf-8")
    degraded = {"degraded": {"corpus_dir": str(corpus)}}
    async with _gateway(gateway_client, tmp_path, [_echo(500, "server_error")], **degraded) as (
        client,
        _,
        _,
    ):
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.headers["x-tidegate-degraded"] == "true"
    assert any("degraded_answer" in line for line in log_lines.lines)
    _assert_nowhere(response, log_lines, SECRET, OTHER_KEY)


def _event_stream(*events: dict[str, Any]) -> dict[str, Any]:
    body = "".join(f"data: {orjson.dumps(event).decode()}\n\n" for event in events)
    return {"kind": "raw", "body": body, "content_type": "text/event-stream"}


_CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": PRIMARY}
_ERROR_EVENT = {"error": {"message": f"key {SECRET} revoked ({OTHER_KEY})", "type": "server_error"}}


@pytest.mark.parametrize(
    "events",
    [
        (_ERROR_EVENT,),
        ({**_CHUNK, "choices": [{"index": 0, "delta": {"content": "Rotate"}}]}, _ERROR_EVENT),
    ],
    ids=["before_any_chunk", "after_a_chunk"],
)
async def test_a_stream_error_event_echoing_the_key_never_shows_it(
    events: tuple[dict[str, Any], ...],
    gateway_client: AppFactory,
    tmp_path: Path,
    log_lines: LogLines,
) -> None:
    """An error event inside the provider's stream that echoes the key ends the caller's answer
    (as an error, or as an incomplete stream) without the key anywhere."""
    async with _gateway(gateway_client, tmp_path, [_event_stream(*events)]) as (client, _, _):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert "revoked" in response.text
    _assert_nowhere(response, log_lines, SECRET, OTHER_KEY)


NOT_ANSWERS = {
    "no_choices": {"id": "c", "object": "chat.completion"},
    "empty_choices": {"id": "c", "object": "chat.completion", "choices": []},
    "choices_not_objects": {"id": "c", "choices": ["from the primary"]},
    "message_not_an_object": {"id": "c", "choices": [{"index": 0, "message": "hi"}]},
    "error_object": {"error": {"message": "upstream exploded", "type": "server_error"}},
}


@pytest.mark.parametrize("body", NOT_ANSWERS.values(), ids=NOT_ANSWERS.keys())
async def test_a_200_that_is_not_an_answer_fails_over_to_the_backup(
    body: dict[str, Any], gateway_client: AppFactory, tmp_path: Path
) -> None:
    """A primary's 200 that is not an answer counts as a malformed attempt and the caller gets
    the backup's answer."""
    fault = {"kind": "raw", "body": body}
    async with _gateway(gateway_client, tmp_path, [fault], backup=True) as (client, _, up):
        response = await client.post("/v1/chat/completions", json=CHAT)
        malformed = await _attempts(client, "primary", "malformed")
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "from the backup"
    assert response.headers["x-tidegate-served-by"] == "backup"
    assert malformed == 1.0
    assert [a["outcome"] for a in up.attempts] == ["raw_200", "ok"]


@pytest.mark.parametrize("body", NOT_ANSWERS.values(), ids=NOT_ANSWERS.keys())
async def test_a_200_that_is_not_an_answer_without_a_backup_is_a_502(
    body: dict[str, Any], gateway_client: AppFactory, tmp_path: Path
) -> None:
    """With no backup, a 200 that is not an answer reaches the caller as 502 provider_malformed,
    retryable, never as a success."""
    fault = {"kind": "raw", "body": body}
    async with _gateway(gateway_client, tmp_path, [fault]) as (client, _, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    error = response.json()["error"]
    assert (error["code"], error["retryable"]) == ("provider_malformed", True)
    assert error["message"].startswith("HTTP 200 but not an answer")


async def test_a_200_that_is_not_an_answer_is_retried_on_the_same_provider(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """A malformed 200 is retried like a 5xx: the second attempt's answer is served."""
    fault = {"on_attempts": [1], "kind": "raw", "body": {"choices": []}}
    retry = {"retry": {"attempts": 2, "base_s": 0.01, "cap_s": 0.01}}
    async with _gateway(gateway_client, tmp_path, [fault], **retry) as (client, _, up):
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.json()["choices"][0]["message"]["content"] == "from the primary"
    assert [a["outcome"] for a in up.attempts] == ["raw_200", "ok"]


async def test_a_body_cut_short_is_a_connection_error_and_retried(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """A 200 whose body stops before its Content-Length is a connection error, retried on the
    same provider, never handed on."""
    fault = {"on_attempts": [1], "kind": "cut_after", "tokens": 1}
    retry = {"retry": {"attempts": 2, "base_s": 0.01, "cap_s": 0.01}}
    async with _gateway(gateway_client, tmp_path, [fault], **retry) as (client, _, up):
        response = await client.post("/v1/chat/completions", json=CHAT)
        cut = await _attempts(client, "primary", "connection")
    assert response.json()["choices"][0]["message"]["content"] == "from the primary"
    assert cut == 1.0
    assert [a["outcome"] for a in up.attempts] == ["cut", "ok"]


async def test_embeddings_that_are_not_an_answer_are_a_502(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """An embeddings 200 whose data is not a list of objects is 502 provider_malformed."""
    fault = {"kind": "raw", "body": {"object": "list", "data": [[0.1, 0.2]]}}
    async with _gateway(gateway_client, tmp_path, [fault]) as (client, _, _):
        response = await client.post("/v1/embeddings", json={"model": "chat", "input": "x"})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "provider_malformed"
