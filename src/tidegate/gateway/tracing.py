"""Optional tracing: a span per request and one per provider attempt, exported with OpenTelemetry.

Off by default. With ``tracing.enabled: true`` (and the ``otel`` extra installed) the gateway
keeps its own tracer provider and exports over OTLP/HTTP to ``tracing.endpoint`` (or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT``), or to the console. Each request span carries the request id, so
"the answer was wrong" goes from the ``X-Request-ID`` in a user's report to the trace: the route,
who served, what was tried, and one child span per provider attempt with its outcome.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from tidegate.errors import ConfigError
from tidegate.gateway.config import TracingConfig

T = TypeVar("T")

__all__ = ["Tracing"]


class Tracing:
    """Spans when enabled, nothing (and no cost beyond a branch) when not."""

    def __init__(self, tracer: Any = None, provider: Any = None) -> None:
        self._tracer = tracer
        self._provider = provider
        #: Whether spans are made (a tracer was configured).
        self.enabled = tracer is not None

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
        return cls(provider.get_tracer("tidegate"), provider)

    def span(self, name: str, **attributes: Any) -> AbstractContextManager[Any]:
        """A span as the current one (a child of the current span, if any), or nothing."""
        if self._tracer is None:
            return nullcontext()
        return self._started(name, attributes)

    @contextmanager
    def _started(self, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
        clean = {k: v for k, v in attributes.items() if v is not None}
        with self._tracer.start_as_current_span(name, attributes=clean) as span:
            yield span

    async def traced(self, call: Awaitable[T], name: str, attributes: dict[str, Any]) -> T:
        """Await ``call`` inside a span (tracing on: the span is its timing)."""
        with self.span(name, **attributes):
            return await call

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
