"""The request path, step by step, against in-process fake providers (no sockets)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import LOW_KEY, fake
from tidegate.gateway import http
from tidegate.gateway.pipeline import answer
from tidegate.providers.fake import FakeProvider

pytestmark = pytest.mark.asyncio

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}


def one_route(**provider: Any) -> dict[str, Any]:
    return {
        "providers": {"p": fake("answer", model="m-1", **provider)},
        "models": {"chat": {"providers": ["p"]}},
    }


def attempts(app: Any, name: str = "p") -> int:
    provider = app.runtime.providers[name]
    assert isinstance(provider, FakeProvider)
    return len(provider.attempts)


async def test_idempotency_key_replays_the_stored_answer(gateway_client: AppFactory) -> None:
    """The same key and body return the first answer again without another upstream call."""
    async with gateway_client(one_route()) as (client, app):
        first = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "k1"}
        )
        second = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "k1"}
        )
        assert first.status_code == second.status_code == 200
        assert second.content == first.content
        assert second.headers["idempotent-replayed"] == "true"
        assert attempts(app) == 1


async def test_an_idempotent_answer_is_stored_before_it_is_sent(
    gateway_client: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica that dies right after sending leaves a key that replays, not one in progress."""
    order: list[str] = []
    original_send = http.send_raw  # how the pipeline sends an answer

    async def spy_send(send: Any, status: int, *args: Any, **kwargs: Any) -> None:
        order.append(f"send {status}")
        await original_send(send, status, *args, **kwargs)

    monkeypatch.setattr(answer, "send_raw", spy_send)
    async with gateway_client(one_route()) as (client, app):
        store = app.runtime.stores.idempotency
        original_complete = store.complete

        async def spy_complete(*args: Any, **kwargs: Any) -> None:
            order.append("complete")
            await original_complete(*args, **kwargs)

        monkeypatch.setattr(store, "complete", spy_complete)
        response = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "k-order"}
        )
        assert response.status_code == 200
    assert order == ["complete", "send 200"]


async def test_idempotency_key_with_another_body_is_422(gateway_client: AppFactory) -> None:
    """Reusing a key for a different request is refused, and the upstream is not called."""
    async with gateway_client(one_route()) as (client, app):
        await client.post("/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "k1"})
        other = {**CHAT, "messages": [{"role": "user", "content": "something else"}]}
        response = await client.post(
            "/v1/chat/completions", json=other, headers={"Idempotency-Key": "k1"}
        )
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "idempotency_key_reused"
        assert attempts(app) == 1


async def test_failed_attempt_abandons_the_key(gateway_client: AppFactory) -> None:
    """A request that failed leaves its key free, so a retry with the same key runs."""
    config = one_route(faults=[{"on_attempts": [1], "kind": "http", "status": 400}])
    async with gateway_client(config) as (client, app):
        failed = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "k"}
        )
        retried = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "k"}
        )
        assert failed.status_code == 400
        assert retried.status_code == 200
        assert attempts(app) == 2


async def test_concurrent_duplicate_waits_for_the_first(gateway_client: AppFactory) -> None:
    """A duplicate arriving while the first runs waits for it and gets the same answer."""
    async with gateway_client(one_route(latency=0.2)) as (client, app):
        headers = {"Idempotency-Key": "same"}
        first, second = await asyncio.gather(
            client.post("/v1/chat/completions", json=CHAT, headers=headers),
            client.post("/v1/chat/completions", json=CHAT, headers=headers),
        )
        assert first.status_code == second.status_code == 200
        assert first.json()["id"] == second.json()["id"]
        assert attempts(app) == 1


async def test_concurrent_duplicate_gets_409_after_the_bounded_wait(
    gateway_client: AppFactory,
) -> None:
    """When the first outlives idempotency.wait_s the duplicate gets 409 with Retry-After."""
    config = {**one_route(latency=0.5), "idempotency": {"wait_s": 0.1}}
    async with gateway_client(config) as (client, _):
        headers = {"Idempotency-Key": "slow"}
        first, second = await asyncio.gather(
            client.post("/v1/chat/completions", json=CHAT, headers=headers),
            client.post("/v1/chat/completions", json=CHAT, headers=headers),
        )
        statuses = sorted([first.status_code, second.status_code])
        assert statuses == [200, 409]
        conflict = first if first.status_code == 409 else second
        assert conflict.headers["retry-after"] == "1"


async def test_cache_serves_the_second_identical_request(gateway_client: AppFactory) -> None:
    """The exact response cache answers a repeat without calling the provider."""
    async with gateway_client(one_route()) as (client, app):
        first = await client.post("/v1/chat/completions", json=CHAT)
        second = await client.post("/v1/chat/completions", json=CHAT)
        assert (first.headers["x-tidegate-cache"], second.headers["x-tidegate-cache"]) == (
            "miss",
            "hit",
        )
        assert second.json() == first.json()
        assert attempts(app) == 1


async def test_cache_is_per_tenant(gateway_client: AppFactory) -> None:
    """Another tenant's identical request is not served from the first tenant's cache."""
    config = {**one_route(), "admission": {"classes": ["critical", "standard", "batch"]}}
    async with gateway_client(config) as (client, app):
        await client.post("/v1/chat/completions", json=CHAT)
        other = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {LOW_KEY}"}
        )
        assert other.headers["x-tidegate-cache"] == "miss"
        assert attempts(app) == 2


async def test_fallback_answers_are_not_cached(gateway_client: AppFactory) -> None:
    """An answer served by a fallback is not stored, so the primary is asked again next time."""
    config = {
        "providers": {
            "p": fake(model="m-1", faults=[{"on_attempts": [1], "kind": "http", "status": 404}]),
            "b": fake("backup", model="m-2"),
        },
        "models": {"chat": {"providers": ["p", "b"]}},
    }
    async with gateway_client(config) as (client, _app):
        first = await client.post("/v1/chat/completions", json=CHAT)
        second = await client.post("/v1/chat/completions", json=CHAT)
        assert first.headers["x-tidegate-served-by"] == "b"
        assert second.headers["x-tidegate-served-by"] == "p"
        assert second.headers["x-tidegate-cache"] == "miss"


async def test_single_flight_shares_one_upstream_call(gateway_client: AppFactory) -> None:
    """Ten identical requests in flight together cause one upstream call."""
    async with gateway_client(one_route(latency=0.2)) as (client, app):
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=CHAT) for _ in range(10))
        )
        assert {a.status_code for a in answers} == {200}
        assert len({a.json()["id"] for a in answers}) == 1
        assert attempts(app) == 1
        assert sorted(a.headers["x-tidegate-cache"] for a in answers).count("shared") == 9


async def test_admission_refuses_at_once_when_full(gateway_client: AppFactory) -> None:
    """With one slot and no waiting room a concurrent request gets 503 queue_full with Retry-After."""
    config = {
        **one_route(latency=0.3),
        "cache": {"enabled": False},
        "admission": {"slots": 1, "queue_cap": 1, "mode": "queue_cap"},
    }
    async with gateway_client(config) as (client, _):
        bodies = [{**CHAT, "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=b) for b in bodies)
        )
        statuses = sorted(a.status_code for a in answers)
        assert statuses == [200, 200, 503]
        refused = next(a for a in answers if a.status_code == 503)
        assert refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1


async def test_caller_deadline_header_shortens_the_budget(gateway_client: AppFactory) -> None:
    """X-Tidegate-Deadline-Ms caps the whole request: a slow provider times out as a 504."""
    config = {
        **one_route(latency=5.0),
        "cache": {"enabled": False},
        "admission": {"mode": "queue_cap"},
    }
    async with gateway_client(config) as (client, _):
        response = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"X-Tidegate-Deadline-Ms": "150"}
        )
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "provider_timeout"


async def test_budget_blocks_past_the_quota_until_midnight(gateway_client: AppFactory) -> None:
    """A daily quota of two calls refuses the third with 429 budget_exceeded and Retry-After."""
    config = {
        **one_route(),
        "cache": {"enabled": False},
        "budgets": {"calls": 2, "degrade_at": 1.0},
    }
    async with gateway_client(config) as (client, app):
        for i in range(2):
            ok = await client.post("/v1/chat/completions", json={**CHAT, "user": str(i)})
            assert ok.status_code == 200
        blocked = await client.post("/v1/chat/completions", json=CHAT)
        assert blocked.status_code == 429
        assert blocked.json()["error"]["code"] == "budget_exceeded"
        assert 1 <= int(blocked.headers["retry-after"]) <= 86_400
        usage = await app.runtime.stores.quotas.usage("t1:u1")
        assert (usage.calls, usage.reserved_calls) == (2, 0)
        assert usage.tokens > 0


async def test_budget_degrades_before_blocking(gateway_client: AppFactory) -> None:
    """Near the quota the request is served with the configured lower max_tokens, and says so."""
    config = {
        **one_route(),
        "cache": {"enabled": False},
        "budgets": {"calls": 10, "degrade_at": 0.05, "degrade": {"max_tokens": 7}},
    }
    async with gateway_client(config) as (client, app):
        response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 500})
        assert response.status_code == 200
        assert response.headers["x-tidegate-budget"] == "degraded"
        provider = app.runtime.providers["p"]
        assert provider.attempts[0].body["max_tokens"] == 7


async def test_failed_request_refunds_its_reservation(gateway_client: AppFactory) -> None:
    """A request that fails spends nothing from the daily budget."""
    config = {**one_route(faults=[{"kind": "http", "status": 400}]), "budgets": {"calls": 5}}
    async with gateway_client(config) as (client, app):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 400
        usage = await app.runtime.stores.quotas.usage("t1:u1")
        assert (usage.calls, usage.reserved_calls, usage.tokens) == (0, 0, 0)


async def test_priority_header_lowers_but_never_raises(gateway_client: AppFactory) -> None:
    """A standard key may ask to be batch, and asking to be critical is ignored."""
    async with gateway_client(one_route()) as (_client, app):
        rt = app.runtime
        identity = rt.keys.identify("Bearer tg-test-key")
        assert rt.identity_class(identity, "batch") == "batch"
        assert rt.identity_class(identity, "critical") == "standard"
        assert rt.identity_class(identity, "nonsense") == "standard"


@pytest.mark.parametrize(
    ("content", "headers", "status", "code"),
    [
        (b"{not json", {"content-type": "application/json"}, 400, "invalid_request"),
        (b"[1, 2]", {"content-type": "application/json"}, 400, "invalid_request"),
        (b"x" * 2_000_000, {"content-type": "application/json"}, 413, "payload_too_large"),
        (
            b"model=chat",
            {"content-type": "application/x-www-form-urlencoded"},
            415,
            "unsupported_media_type",
        ),
        (
            b'{"model": "chat", "messages": []}',
            {"content-type": "application/json"},
            400,
            "invalid_request",
        ),
        (
            b'{"model": "chat", "messages": [{"role": "user", "content": "x"}]}',
            {"content-type": "application/json", "x-tidegate-deadline-ms": "soon"},
            400,
            "invalid_request",
        ),
        (
            b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}',
            {"content-type": "application/json"},
            404,
            "model_not_found",
        ),
        (
            b'{"model": "chat", "messages": [{"role": "user", "content": "x"}]}',
            {"content-type": "application/json", "authorization": "Basic abc"},
            401,
            "invalid_api_key",
        ),
    ],
)
async def test_bad_input_gets_its_documented_4xx(
    gateway_client: AppFactory, content: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    """Malformed, oversized, mistyped and unauthenticated requests are 4xx, never 500."""
    async with gateway_client(one_route()) as (client, _):
        response = await client.post("/v1/chat/completions", content=content, headers=headers)
        assert response.status_code == status
        body = response.json()
        assert body["error"]["code"] == code
        assert set(body["error"]) == {"type", "code", "message", "retryable"}
        assert response.headers["x-request-id"]


async def test_request_id_is_taken_from_the_caller(gateway_client: AppFactory) -> None:
    """X-Request-ID from the caller is returned unchanged."""
    async with gateway_client(one_route()) as (client, _):
        response = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"X-Request-ID": "abc-123"}
        )
        assert response.headers["x-request-id"] == "abc-123"


async def test_service_endpoints(gateway_client: AppFactory) -> None:
    """healthz, readyz (breakers in the body), metrics, version, openapi and wrong methods."""
    async with gateway_client(one_route()) as (client, _):
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        ready = (await client.get("/readyz")).json()
        assert ready["status"] == "ready"
        assert ready["breakers"] == {"p": "closed"}
        await client.post("/v1/chat/completions", json=CHAT)
        metrics = (await client.get("/metrics")).text
        assert (
            'tidegate_requests_total{model="m-1",outcome="ok",route="chat",served_by="p"} 1.0'
            in metrics
        )
        assert "tidegate_in_flight_requests 0.0" in metrics
        version = (await client.get("/version")).json()
        assert set(version) == {"version", "git_sha"}
        spec = (await client.get("/openapi.json")).json()
        assert "/v1/chat/completions" in spec["paths"]
        assert (await client.get("/v1/chat/completions")).status_code == 405
        assert (await client.get("/nope")).status_code == 404


async def test_readyz_is_not_ready_while_the_sqlite_file_is_write_locked(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """With SQLite state, readiness asks for the write lock as requests do: while another
    process holds it, /readyz is 503 (a request with a budget to reserve fails with
    store_unavailable), and ready again once it is released."""
    state = {"url": f"sqlite:///{tmp_path}/state.db", "timeout_s": 0.05}
    config = {**one_route(), "state": state, "budgets": {"calls": 1_000}}
    async with gateway_client(config) as (client, _):
        assert (await client.get("/readyz")).status_code == 200
        other = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            ready = await client.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["problems"] == ["state store unreachable"]
            refused = await client.post("/v1/chat/completions", json=CHAT)
            assert refused.json()["error"]["code"] == "store_unavailable"
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert (await client.get("/readyz")).status_code == 200


async def test_open_breaker_is_reported_but_does_not_unready(gateway_client: AppFactory) -> None:
    """readyz stays 200 with an open breaker, and says which one is open."""
    config = {
        **one_route(faults=[{"kind": "http", "status": 500}]),
        "cache": {"enabled": False},
        "retry": {"attempts": 1},
        "breaker": {"consecutive_failures": 2, "recovery_s": 60},
    }
    async with gateway_client(config) as (client, _):
        for _ in range(2):
            await client.post("/v1/chat/completions", json=CHAT)
        refused = await client.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "circuit_open"
        ready = await client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["breakers"] == {"p": "open"}
        metrics = (await client.get("/metrics")).text
        assert 'tidegate_breaker_transitions_total{provider="p",to="open"} 1.0' in metrics
        assert 'tidegate_breaker_state{provider="p"} 2.0' in metrics


async def test_data_class_keeps_requests_away_from_providers_not_cleared_for_it(
    gateway_client: AppFactory,
) -> None:
    """An internal caller is never sent to a public-only provider: skipped, or 403 if none is left."""
    public_only = {**fake("public", model="m-pub"), "data_classes": ["public"]}
    config = {
        "providers": {"pub": public_only, "int": fake("internal", model="m-int")},
        "models": {"chat": {"providers": ["pub", "int"]}, "solo": {"providers": ["pub"]}},
    }
    async with gateway_client(config) as (client, app):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.headers["x-tidegate-served-by"] == "int"
        assert response.headers["x-tidegate-tried"] == "int=ok, pub=skipped:data_class"
        refused = await client.post("/v1/chat/completions", json={**CHAT, "model": "solo"})
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "forbidden"
        assert app.runtime.providers["pub"].attempts == []
