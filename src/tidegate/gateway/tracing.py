"""Optional tracing: a span per request and one per provider attempt, exported with OpenTelemetry.

Off by default. With ``tracing.enabled: true`` (and the ``otel`` extra installed) the gateway
keeps its own tracer provider and exports over OTLP/HTTP to ``tracing.endpoint`` (or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT``), or to the console. Each request span carries the request id, so
"the answer was wrong" goes from the ``X-Request-ID`` in a user's report to the trace: the route,
who served, what was tried, and one child span per provider attempt with its outcome.

The request span continues the caller's trace (W3C ``traceparent`` and ``tracestate``), and the
current span's context goes upstream on every provider request: a hook on the shared aiohttp
session (:meth:`Tracing.trace_configs`), present only when tracing is on. Spans carry the
OpenTelemetry GenAI attributes (``gen_ai.*``); retries, refused retries, failovers and breaker
changes are events on the span that is current when they happen (the request's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Final, TypeVar

from tidegate.errors import ConfigError, ProviderError
from tidegate.gateway.config import ProviderConfig, TracingConfig
from tidegate.policy.attempts import AttemptEvent, RetryPlanned, RetryRefused
from tidegate.policy.breaker import (
    BreakerEvent,
    CallRejected,
    CircuitClosed,
    CircuitHalfOpened,
    CircuitOpened,
)

if TYPE_CHECKING:
    import aiohttp

T = TypeVar("T")
E = TypeVar("E")
Described = tuple[str, dict[str, Any]] | None

__all__ = [
    "OPERATIONS",
    "Tracing",
    "attempt_event",
    "breaker_event",
    "gen_ai_provider",
    "max_tokens_of",
]

#: ``gen_ai.operation.name`` by the path of the model endpoint that does it.
OPERATIONS: Final = {
    "/v1/chat/completions": "chat",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
    "/v1/embeddings": "embeddings",
}
#: ``gen_ai.provider.name`` by provider type (the conventions' well-known values).
_PROVIDER_NAMES: Final = {
    "openai": "openai",
    "anthropic": "anthropic",
    "azure_openai": "azure.ai.openai",
    "bedrock": "aws.bedrock",
    "gemini": "gcp.gemini",
}
#: OpenAI-compatible presets the conventions name as providers of their own.
_PRESET_NAMES: Final = {"deepseek": "deepseek", "groq": "groq", "mistral": "mistral_ai"}


def gen_ai_provider(config: ProviderConfig) -> str:
    """The ``gen_ai.provider.name`` of a provider (its type when the conventions name none)."""
    if config.preset in _PRESET_NAMES:
        return _PRESET_NAMES[config.preset]
    if config.gemini is not None and config.gemini.vertex is not None:
        return "gcp.vertex_ai"
    return _PROVIDER_NAMES.get(config.type, config.type)


def max_tokens_of(body: Mapping[str, Any]) -> int | None:
    """The completion's token limit the request asked for, if any."""
    given = body.get("max_completion_tokens", body.get("max_tokens"))
    return given if type(given) is int else None


def attempt_event(event: AttemptEvent) -> Described:
    """An attempts-policy event as a span event: its name and attributes."""
    if isinstance(event, RetryPlanned):
        return "tidegate.retry", {
            "tidegate.provider": event.provider,
            "tidegate.attempt": event.attempt,
            "tidegate.delay_s": event.delay,
            "tidegate.retry_after": event.from_retry_after,
            "error.type": event.kind.value,
        }
    if isinstance(event, RetryRefused):
        return "tidegate.retry_refused", {"tidegate.provider": event.provider}
    return "tidegate.failover", {
        "tidegate.provider": event.from_provider,
        "tidegate.failover.to": event.to_provider,
        "error.type": event.kind.value,
    }


def breaker_event(event: BreakerEvent) -> Described:
    """A breaker's state change or refusal as a span event (its probes are left out)."""
    if isinstance(event, CallRejected):
        return "tidegate.breaker.rejected", {
            "tidegate.provider": event.name,
            "tidegate.breaker.state": event.state.value,
            "tidegate.breaker.retry_after_s": event.retry_after,
        }
    if isinstance(event, CircuitOpened):
        return "tidegate.breaker.opened", {
            "tidegate.provider": event.name,
            "tidegate.breaker.reason": event.reason.value,
        }
    if isinstance(event, CircuitHalfOpened | CircuitClosed):
        moved = "half_opened" if isinstance(event, CircuitHalfOpened) else "closed"
        return f"tidegate.breaker.{moved}", {"tidegate.provider": event.name}
    return None


class Tracing:
    """Spans when enabled, nothing (and no cost beyond a branch) when not."""

    def __init__(
        self, tracer: Any = None, provider: Any = None, *, propagate_upstream: bool = True
    ) -> None:
        self._tracer = tracer
        self._provider = provider
        #: Whether spans are made (a tracer was configured).
        self.enabled = tracer is not None
        self._propagate = propagate_upstream
        self._propagator: Any = None
        self._api: Any = None
        if tracer is not None:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            self._propagator = TraceContextTextMapPropagator()
            self._api = trace

    @classmethod
    def from_config(cls, config: TracingConfig, *, provider: Any = None) -> Tracing:
        """The tracer ``config`` asks for; ``provider`` (an SDK TracerProvider) is for tests."""
        if not config.enabled:
            return cls()
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import (
                BatchSpanProcessor,
                ConsoleSpanExporter,
                SpanExporter,
            )
            from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
        except ImportError:
            raise ConfigError(
                "tracing.enabled needs the otel extra: pip install 'tidegate[otel]'"
            ) from None
        if provider is None:
            provider = TracerProvider(
                resource=Resource.create({"service.name": config.service_name}),
                sampler=TraceIdRatioBased(config.sample_ratio),
            )
            exporter: SpanExporter
            if config.exporter == "console":
                exporter = ConsoleSpanExporter()
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                exporter = (
                    OTLPSpanExporter(endpoint=config.endpoint)
                    if config.endpoint
                    else OTLPSpanExporter()
                )
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(
            provider.get_tracer("tidegate"), provider, propagate_upstream=config.propagate_upstream
        )

    def span(self, name: str, **attributes: Any) -> AbstractContextManager[Any]:
        """A span as the current one (a child of the current span, if any), or nothing."""
        if self._tracer is None:
            return nullcontext()
        return self._started(name, attributes)

    def request(
        self, headers: Mapping[str, str], attributes: dict[str, Any]
    ) -> AbstractContextManager[Any]:
        """The ``tidegate.request`` span (tracing on), continuing the trace of the caller's
        ``traceparent``/``tracestate`` headers when it sent them."""
        parent = self._propagator.extract(headers)
        kind = self._api.SpanKind.SERVER
        return self._started("tidegate.request", attributes, kind=kind, context=parent)

    def finish(
        self, span: Any, attributes: dict[str, Any], events: list[Described], *, failed: bool
    ) -> None:
        """Add what the request did to its span; ``failed``: a server error."""
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        for event in events:
            if event is not None:
                span.add_event(*event)
        if failed:
            span.set_status(self._api.Status(self._api.StatusCode.ERROR))

    async def attempt(self, call: Awaitable[T], attributes: dict[str, Any]) -> T:
        """Await one provider attempt inside its ``tidegate.attempt`` span (tracing on): the
        span is its timing, with the answer's model and usage or the failure's ``error.type``."""
        kind = self._api.SpanKind.CLIENT
        with self._started("tidegate.attempt", attributes, kind=kind) as span:
            try:
                result = await call
            except ProviderError as error:
                span.set_attribute("error.type", error.kind.value)
                raise
            except Exception as error:
                span.set_attribute("error.type", type(error).__qualname__)
                raise
            span.set_attributes(_answered(result))
            return result

    def recording(
        self, on_event: Callable[[E], None], describe: Callable[[E], Described]
    ) -> Callable[[E], None]:
        """``on_event``, and (tracing on) each event ``describe`` names as an event of the
        current span too. Off, ``on_event`` itself: nothing is added."""
        if self._tracer is None:
            return on_event
        current = self._api.get_current_span

        def both(event: E) -> None:
            on_event(event)
            described = describe(event)
            if described is not None:
                current().add_event(*described)

        return both

    def trace_configs(self) -> list[aiohttp.TraceConfig]:
        """The hooks of the upstream session (none when off): each request sends the current
        span's context as ``traceparent``/``tracestate``."""
        if self._tracer is None or not self._propagate:
            return []
        import aiohttp

        inject = self._propagator.inject

        async def on_request_start(
            session: aiohttp.ClientSession,
            context: Any,
            params: aiohttp.TraceRequestStartParams,
        ) -> None:
            inject(params.headers)

        config = aiohttp.TraceConfig()
        config.on_request_start.append(on_request_start)
        return [config]

    @contextmanager
    def _started(self, name: str, attributes: dict[str, Any], **options: Any) -> Iterator[Any]:
        clean = {k: v for k, v in attributes.items() if v is not None}
        with self._tracer.start_as_current_span(name, attributes=clean, **options) as span:
            yield span

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()

    async def aclose(self) -> None:
        """Flush and stop the exporter, off the event loop (its export is blocking I/O)."""
        if self._provider is not None:
            await asyncio.to_thread(self._provider.shutdown)


def _answered(result: Any) -> dict[str, Any]:
    """The ``gen_ai.response.*`` and ``gen_ai.usage.*`` of an attempt's result: an answer, or
    a stream's ``(items, first chunks)`` (its usage comes at its end, on the request span)."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], list):
        answer = next((c for c in result[1] if isinstance(c, dict) and c.get("model")), {})
    else:
        answer = result if isinstance(result, dict) else {}
    usage = answer.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    found = {
        "gen_ai.response.model": answer.get("model"),
        "gen_ai.response.id": answer.get("id"),
        "gen_ai.usage.input_tokens": usage.get("prompt_tokens"),
        "gen_ai.usage.output_tokens": usage.get("completion_tokens"),
    }
    return {k: v for k, v in found.items() if isinstance(v, str | int) and not isinstance(v, bool)}
