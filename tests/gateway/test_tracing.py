"""Tracing: one span per request carrying its request id and the GenAI attributes, one child
span per provider attempt, the caller's trace continued and sent upstream, and the spans
exported over OTLP/HTTP."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import fake
from tidegate.gateway.config import ProviderConfig
from tidegate.gateway.tracing import attempt_event, breaker_event, gen_ai_provider, max_tokens_of
from tidegate.policy.attempts import RetryRefused
from tidegate.policy.breaker import BreakerState, CallRejected, CircuitClosed, ProbeReleased

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "up-model-2024",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
}


def config(**extra: Any) -> dict[str, Any]:
    return {
        "providers": {
            "p": fake(model="m-1", faults=[{"on_attempts": [1], "kind": "http", "status": 500}]),
        },
        "models": {"chat": {"providers": ["p"]}},
        "retry": {"base_s": 0.001, "cap_s": 0.001},
        **extra,
    }


def recorder() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    assert span.attributes is not None
    return dict(span.attributes)


@dataclass
class Upstream:
    """An OpenAI-compatible upstream on loopback that records each request's headers."""

    base_url: str = ""
    headers: list[dict[str, str]] = field(default_factory=list)


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[Upstream]:
    seen = Upstream()

    async def complete(request: web.Request) -> web.Response:
        seen.headers.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response(ANSWER)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    seen.base_url = f"http://{host}:{port}/v1"
    yield seen
    await runner.cleanup()


def real_upstream(upstream: Upstream, **tracing: Any) -> dict[str, Any]:
    provider = {
        "type": "openai",
        "model": "up-model",
        "base_url": upstream.base_url,
        "approved_fallback": True,
    }
    return {
        "providers": {"up": provider},
        "models": {"chat": {"providers": ["up"]}},
        "tracing": {"enabled": True, **tracing},
    }


@pytest.mark.asyncio
async def test_a_request_span_and_one_span_per_attempt(gateway_client: AppFactory) -> None:
    """From X-Request-ID to the trace: the request span names the route, who served, what was
    tried; each attempt is a client span under it; the retry is an event of the request span."""
    provider, exporter = recorder()
    async with gateway_client(config(tracing={"enabled": True}), tracer_provider=provider) as (
        client,
        _,
    ):
        response = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"X-Request-ID": "trace-me"}
        )
        assert response.status_code == 200
    (request,) = named(exporter, "tidegate.request")
    attempts = named(exporter, "tidegate.attempt")
    top = attrs(request)
    assert request.kind is SpanKind.SERVER
    assert top["tidegate.request_id"] == "trace-me"
    assert top["tidegate.tried"] == "p=server, p=ok"
    assert top["http.response.status_code"] == 200
    assert top["gen_ai.operation.name"] == "chat"
    assert top["gen_ai.request.model"] == "chat"
    assert top["gen_ai.request.max_tokens"] == 50
    assert top["gen_ai.response.model"] == "m-1"
    assert top["gen_ai.provider.name"] == "fake"
    assert top["gen_ai.usage.input_tokens"] > 0
    assert top["gen_ai.usage.output_tokens"] > 0
    assert "error.type" not in top
    assert len(attempts) == 2
    assert all(
        a.parent is not None and a.parent.span_id == request.context.span_id for a in attempts
    )
    first, second = sorted(attempts, key=lambda a: attrs(a)["tidegate.attempt"])
    assert first.kind is SpanKind.CLIENT
    assert attrs(first)["error.type"] == "server"
    assert first.status.status_code is StatusCode.ERROR
    assert attrs(second)["gen_ai.request.model"] == "m-1"
    assert attrs(second)["gen_ai.operation.name"] == "chat"
    assert attrs(second)["gen_ai.usage.output_tokens"] > 0
    assert "error.type" not in attrs(second)
    retry = [e for e in request.events if e.name == "tidegate.retry"]
    assert len(retry) == 1
    assert retry[0].attributes is not None
    assert retry[0].attributes["tidegate.provider"] == "p"
    assert retry[0].attributes["error.type"] == "server"


@pytest.mark.asyncio
async def test_failover_and_the_breaker_are_events_of_the_request(
    gateway_client: AppFactory,
) -> None:
    """A provider that fails opens its breaker (one failure here) and hands over: both are
    events; the next request's plan leaves the open breaker's provider out, another event."""
    provider, exporter = recorder()
    failing = fake(model="m-1", faults=[{"kind": "http", "status": 500}])
    setup = {
        "providers": {"p": failing, "q": fake(model="m-2")},
        "models": {"chat": {"providers": ["p", "q"]}},
        "retry": {"attempts": 1},
        "breaker": {"consecutive_failures": 1},
        "tracing": {"enabled": True},
    }
    async with gateway_client(setup, tracer_provider=provider) as (client, _):
        for _ in range(2):
            response = await client.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 200
    first, second = named(exporter, "tidegate.request")
    events = [e.name for e in first.events]
    assert "tidegate.breaker.opened" in events
    assert "tidegate.failover" in events
    failover = next(e for e in first.events if e.name == "tidegate.failover")
    assert failover.attributes is not None
    assert failover.attributes["tidegate.failover.to"] == "q"
    assert attrs(first)["tidegate.served_by"] == "q"
    assert attrs(first)["gen_ai.response.model"] == "m-2"
    (skipped,) = second.events  # the route's plan left the open breaker's provider out
    assert skipped.name == "tidegate.skipped"
    assert skipped.attributes is not None
    assert dict(skipped.attributes) == {
        "tidegate.provider": "p",
        "tidegate.skip.reason": "breaker_open",
    }


@pytest.mark.asyncio
async def test_a_stream_attempt_and_embeddings_are_spans_too(gateway_client: AppFactory) -> None:
    provider, exporter = recorder()
    setup = {
        "providers": {"p": fake(model="m-1")},
        "models": {"chat": {"providers": ["p"]}},
        "tracing": {"enabled": True},
    }
    async with gateway_client(setup, tracer_provider=provider) as (client, _):
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.status_code == 200
        embedded = await client.post("/v1/embeddings", json={"model": "chat", "input": "hi"})
        assert embedded.status_code == 200
    stream_request, embed_request = named(exporter, "tidegate.request")
    stream_attempt, embed_attempt = named(exporter, "tidegate.attempt")
    assert attrs(stream_attempt)["gen_ai.response.model"] == "m-1"
    assert attrs(stream_request)["gen_ai.usage.output_tokens"] > 0  # known at the stream's end
    assert attrs(embed_attempt)["gen_ai.operation.name"] == "embeddings"
    assert attrs(embed_request)["gen_ai.operation.name"] == "embeddings"
    assert embed_attempt.parent is not None
    assert embed_attempt.parent.span_id == embed_request.context.span_id


@pytest.mark.asyncio
async def test_the_callers_trace_is_continued_and_sent_upstream(
    gateway_client: AppFactory, upstream: Upstream
) -> None:
    """traceparent/tracestate from the caller: the request span is in the caller's trace, and
    the upstream request carries the attempt span's context (the shared session's hook)."""
    provider, exporter = recorder()
    async with gateway_client(real_upstream(upstream), tracer_provider=provider) as (client, _):
        response = await client.post(
            "/v1/chat/completions",
            json=CHAT,
            headers={"traceparent": TRACEPARENT, "tracestate": "vendor=abc"},
        )
        assert response.status_code == 200, response.text
    (request,) = named(exporter, "tidegate.request")
    (attempt,) = named(exporter, "tidegate.attempt")
    assert f"{request.context.trace_id:032x}" == CALLER_TRACE
    assert request.parent is not None
    assert f"{request.parent.span_id:016x}" == CALLER_SPAN
    assert attempt.parent is not None
    assert attempt.parent.span_id == request.context.span_id
    (sent,) = upstream.headers
    version, trace_id, parent_id, flags = sent["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", CALLER_TRACE, "01")
    assert parent_id == f"{attempt.context.span_id:016x}"
    assert sent["tracestate"] == "vendor=abc"
    values = attrs(attempt)
    assert values["gen_ai.provider.name"] == "openai"
    assert values["gen_ai.request.model"] == "up-model"
    assert values["gen_ai.response.model"] == "up-model-2024"
    assert values["gen_ai.usage.input_tokens"] == 7
    assert values["gen_ai.usage.output_tokens"] == 3
    assert attrs(request)["gen_ai.usage.input_tokens"] == 7


@pytest.mark.asyncio
async def test_a_request_without_traceparent_starts_a_trace_sent_upstream(
    gateway_client: AppFactory, upstream: Upstream
) -> None:
    provider, exporter = recorder()
    async with gateway_client(real_upstream(upstream), tracer_provider=provider) as (client, _):
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    (request,) = named(exporter, "tidegate.request")
    assert request.parent is None
    assert upstream.headers[0]["traceparent"].split("-")[1] == f"{request.context.trace_id:032x}"


@pytest.mark.asyncio
async def test_nothing_goes_upstream_when_off_or_not_propagated(
    gateway_client: AppFactory, upstream: Upstream
) -> None:
    """Tracing off: the session has no hook at all; ``propagate_upstream: false``: spans but no
    headers sent."""
    off = real_upstream(upstream)
    del off["tracing"]
    async with gateway_client(off) as (client, app):
        assert not app.runtime.tracing.enabled
        assert app.runtime.tracing.trace_configs() == []
        await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
    provider, exporter = recorder()
    quiet = real_upstream(upstream, propagate_upstream=False)
    async with gateway_client(quiet, tracer_provider=provider) as (client, _):
        await client.post("/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT})
    assert len(upstream.headers) == 2
    assert all("traceparent" not in sent for sent in upstream.headers)
    assert len(named(exporter, "tidegate.attempt")) == 1


@pytest.mark.asyncio
async def test_a_refused_request_has_its_error_type(gateway_client: AppFactory) -> None:
    provider, exporter = recorder()
    async with gateway_client(config(tracing={"enabled": True}), tracer_provider=provider) as (
        client,
        _,
    ):
        response = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert response.status_code == 404
    (request,) = named(exporter, "tidegate.request")
    assert attrs(request)["error.type"] == attrs(request)["tidegate.outcome"]
    assert request.status.status_code is StatusCode.UNSET  # a 4xx is the caller's, not ours


@pytest.mark.asyncio
async def test_tracing_is_off_by_default(gateway_client: AppFactory) -> None:
    """Without tracing.enabled nothing is traced."""
    async with gateway_client(config()) as (_, app):
        assert not app.runtime.tracing.enabled


# --------------------------------------------------------------------------- OTLP/HTTP


def _value(value: common_pb2.AnyValue) -> Any:
    return getattr(value, value.WhichOneof("value") or "string_value")


@pytest_asyncio.fixture
async def collector() -> AsyncIterator[
    tuple[str, list[trace_service_pb2.ExportTraceServiceRequest]]
]:
    """An OTLP/HTTP receiver on loopback: POST /v1/traces, protobuf in, protobuf out."""
    received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        received.append(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
        answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=answer, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}/v1/traces", received
    await runner.cleanup()


@pytest.mark.asyncio
async def test_spans_reach_an_otlp_http_receiver(
    gateway_client: AppFactory,
    collector: tuple[str, list[trace_service_pb2.ExportTraceServiceRequest]],
) -> None:
    """The configured exporter (OTLP/HTTP, batched) sends the spans; shutting down flushes."""
    endpoint, received = collector
    tracing = {"enabled": True, "endpoint": endpoint, "service_name": "tidegate-otlp-test"}
    async with gateway_client(config(tracing=tracing)) as (client, _):
        response = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT}
        )
        assert response.status_code == 200
    spans = [
        (resource, span)
        for export in received
        for resource in export.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    names = sorted(span.name for _, span in spans)
    assert names == ["tidegate.attempt", "tidegate.attempt", "tidegate.request"]
    services = {
        _value(kv.value)
        for resource, _ in spans
        for kv in resource.resource.attributes
        if kv.key == "service.name"
    }
    assert services == {"tidegate-otlp-test"}
    request = next(span for _, span in spans if span.name == "tidegate.request")
    assert request.trace_id.hex() == CALLER_TRACE
    assert request.parent_span_id.hex() == CALLER_SPAN
    values = {kv.key: _value(kv.value) for kv in request.attributes}
    assert values["gen_ai.operation.name"] == "chat"
    assert values["gen_ai.response.model"] == "m-1"
    assert [e.name for e in request.events] == ["tidegate.retry"]


# --------------------------------------------------------------------------- the names


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"type": "openai", "base_url": "http://h/v1"}, "openai"),
        ({"type": "anthropic", "base_url": "http://h"}, "anthropic"),
        ({"type": "bedrock"}, "aws.bedrock"),
        ({"type": "gemini"}, "gcp.gemini"),
        ({"type": "openai", "preset": "ollama"}, "openai"),
        ({"type": "openai", "preset": "deepseek", "api_key_file": "k"}, "deepseek"),
        ({"type": "openai", "preset": "mistral", "api_key_file": "k"}, "mistral_ai"),
    ],
)
def test_gen_ai_provider_names_follow_the_conventions(
    section: dict[str, Any], expected: str
) -> None:
    config = ProviderConfig.model_validate({"model": "m", **section})
    assert gen_ai_provider(config) == expected


def test_breaker_and_attempt_events_are_named() -> None:
    rejected = CallRejected(name="p", at=1.0, state=BreakerState.OPEN, retry_after=2.5)
    assert breaker_event(rejected) == (
        "tidegate.breaker.rejected",
        {
            "tidegate.provider": "p",
            "tidegate.breaker.state": "open",
            "tidegate.breaker.retry_after_s": 2.5,
        },
    )
    assert breaker_event(CircuitClosed(name="p", at=1.0)) == (
        "tidegate.breaker.closed",
        {"tidegate.provider": "p"},
    )
    assert breaker_event(ProbeReleased(name="p", at=1.0)) is None
    assert attempt_event(RetryRefused("p")) == (
        "tidegate.retry_refused",
        {"tidegate.provider": "p"},
    )


def test_max_tokens_is_an_integer_or_nothing() -> None:
    assert max_tokens_of({"max_completion_tokens": 9, "max_tokens": 5}) == 9
    assert max_tokens_of({"max_tokens": 5}) == 5
    assert max_tokens_of({"max_tokens": True}) is None
    assert max_tokens_of({}) is None
