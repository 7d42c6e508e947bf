"""Tracing: one span per request carrying its request id, one child span per provider attempt."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake

pytestmark = pytest.mark.asyncio


def config(**extra: Any) -> dict[str, Any]:
    return {
        "providers": {
            "p": fake(model="m-1", faults=[{"on_attempts": [1], "kind": "http", "status": 500}]),
        },
        "models": {"chat": {"providers": ["p"]}},
        "retry": {"base_s": 0.001, "cap_s": 0.001},
        **extra,
    }


async def test_a_request_span_and_one_span_per_attempt(gateway_client: AppFactory) -> None:
    """From X-Request-ID to the trace: the request span names the route, who served, what was tried."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with gateway_client(config(tracing={"enabled": True}), tracer_provider=provider) as (
        client,
        _,
    ):
        response = await client.post(
            "/v1/chat/completions",
            json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Request-ID": "trace-me"},
        )
        assert response.status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    attempts = [s for s in exporter.get_finished_spans() if s.name == "tidegate.attempt"]
    request = spans["tidegate.request"]
    assert request.attributes is not None
    assert request.attributes["tidegate.request_id"] == "trace-me"
    assert request.attributes["tidegate.tried"] == "p=server, p=ok"
    assert request.attributes["http.response.status_code"] == 200
    assert len(attempts) == 2
    assert all(
        a.parent is not None and a.parent.span_id == request.context.span_id for a in attempts
    )


async def test_tracing_is_off_by_default(gateway_client: AppFactory) -> None:
    """Without tracing.enabled nothing is traced."""
    async with gateway_client(config()) as (_, app):
        assert not app.runtime.tracing.enabled
