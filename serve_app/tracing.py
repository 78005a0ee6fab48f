"""OpenTelemetry tracing of the serving path, from the HTTP edge to the engine.

Each process of the app (ingress, engine replicas) sets up its own tracer from the app's TracingConfig
and the standard OTEL_* environment variables (explicit config wins). With the exporter `none` (the
default) nothing is installed and every helper here returns at once: tracing costs nothing.

The W3C context travels: extracted from the HTTP request's traceparent/tracestate (a new trace when
absent), injected into PreparedRequest.trace_context, restored in the replica. Spans:
  ingress   "<METHOD> <route>" (SERVER) > "tokenize", "route" (our prefix router's decision)
  replica   "llm_request" (SERVER; vLLM's name), with events queued/scheduled/first_token/preempted/
            finished and gen_ai.* attributes; "engine_step" spans in detailed mode.
Prompt and completion text are recorded only with record_content."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER: Tracer | None = None  # this process's, once set up
_CONFIG: ResolvedTracing | None = None
_PROVIDER: TracerProvider | None = None  # the SDK provider behind _TRACER (imported only when tracing is on)


class TracingConfig(BaseModel):
    """App args `tracing:`; a field left unset falls back to its OTEL_* environment variable."""

    model_config = ConfigDict(extra="forbid")

    exporter: Literal["none", "otlp", "console"] | None = Field(
        None, description="OTEL_TRACES_EXPORTER; `none` (default) installs nothing.")
    protocol: Literal["grpc", "http/protobuf"] | None = Field(
        None, description="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL; default grpc.")
    endpoint: str | None = Field(
        None, description="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT.")
    sampling_ratio: float | None = Field(
        None, ge=0.0, le=1.0, description="OTEL_TRACES_SAMPLER_ARG; parent-based ratio sampling, default 1.")
    service_name: str | None = Field(None, description="OTEL_SERVICE_NAME; default pagedserve.")
    resource_attributes: dict[str, str] = Field(
        default_factory=dict, description="Added to OTEL_RESOURCE_ATTRIBUTES and our own (model, replica).")
    export_interval_ms: int | None = Field(
        None, ge=1, description="OTEL_BSP_SCHEDULE_DELAY: how often finished spans are exported; default 5000.")
    detailed: bool = Field(False, description="Also one span per engine step (costly).")
    record_content: bool = Field(False, description="Record prompt and completion text on spans.")


class ResolvedTracing(BaseModel):
    export_interval_ms: int
    exporter: str
    protocol: str
    endpoint: str | None
    sampling_ratio: float
    service_name: str
    resource_attributes: dict[str, str]
    detailed: bool
    record_content: bool


def resolve(config: TracingConfig) -> ResolvedTracing:
    env = os.environ
    attrs = dict(kv.split("=", 1) for kv in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",") if "=" in kv)
    return ResolvedTracing(
        export_interval_ms=config.export_interval_ms or int(env.get("OTEL_BSP_SCHEDULE_DELAY", "5000")),
        exporter=config.exporter or env.get("OTEL_TRACES_EXPORTER", "none"),
        protocol=config.protocol or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        endpoint=config.endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        sampling_ratio=config.sampling_ratio if config.sampling_ratio is not None
        else float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0")),
        service_name=config.service_name or env.get("OTEL_SERVICE_NAME", "pagedserve"),
        resource_attributes={**attrs, **config.resource_attributes},
        detailed=config.detailed,
        record_content=config.record_content,
    )


def setup_tracing(config: TracingConfig, attributes: Mapping[str, str], exporter=None) -> Tracer | None:
    """Install this process's tracer (once) and return it; None when tracing is off. `exporter`
    overrides the configured one (tests pass an in-memory exporter)."""
    global _TRACER, _CONFIG, _PROVIDER
    if _TRACER is not None:  # one per process (several deployments can share one, e.g. in local testing)
        return _TRACER
    resolved = resolve(config)
    if exporter is None and resolved.exporter == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({"service.name": resolved.service_name, **resolved.resource_attributes, **attributes})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(resolved.sampling_ratio)))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(_exporter(resolved),
                                                       schedule_delay_millis=resolved.export_interval_ms))
    _TRACER, _CONFIG, _PROVIDER = provider.get_tracer("pagedserve"), resolved, provider
    return _TRACER


def flush(timeout_ms: int = 5000) -> None:
    """Export the finished spans still queued. A stopping replica calls this: Ray ends the process
    without running atexit, so the batch exporter would lose the spans of its last interval."""
    if _PROVIDER is not None:
        _PROVIDER.force_flush(timeout_ms)


def _exporter(resolved: ResolvedTracing):
    if resolved.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if resolved.exporter != "otlp":
        raise ValueError(f"tracing.exporter: unknown exporter {resolved.exporter!r} (none, otlp, console)")
    kwargs = {"endpoint": resolved.endpoint} if resolved.endpoint else {}
    if resolved.protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        kwargs["insecure"] = True
    return OTLPSpanExporter(**kwargs)


def tracer() -> Tracer | None:
    return _TRACER


def config() -> ResolvedTracing | None:
    return _CONFIG


def inject(ctx=None) -> dict[str, str]:
    """The current (or given) context as a W3C carrier; empty when tracing is off."""
    if _TRACER is None:
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Mapping[str, str] | None):
    return _PROPAGATOR.extract(carrier or {})


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading of this machine as epoch nanoseconds (span timestamps)."""
    return time.time_ns() - time.monotonic_ns() + int(monotonic_s * 1e9)


def fail(span, error: BaseException) -> None:
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


class TracingMiddleware:
    """The ingress request span (SERVER): starts it as a child of the caller's traceparent (a new trace
    when absent), makes it current for the route's code, and ends it when the response, streamed or
    not, has been sent."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        tracer_ = _TRACER
        if tracer_ is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        method, path = scope.get("method", "GET"), scope.get("path", "")
        span = tracer_.start_span(
            f"{method} {path}", context=extract(headers), kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path,
                        "user_agent.original": headers.get("user-agent", "")},
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        status = 500

        async def send_and_watch(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except BaseException as e:
            fail(span, e)
            raise
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
            otel_context.detach(token)


class _NoSpan:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        return None


def handle_span(name: str, trace_context: Mapping[str, str] | None):
    """The ingress span of a DeploymentHandle call (SERVER), child of the caller's W3C carrier."""
    if _TRACER is None:
        return _NoSpan()
    return _TRACER.start_as_current_span(name, context=extract(trace_context), kind=SpanKind.SERVER,
                                         attributes={"pagedserve.api": name})


def span(name: str, **attributes):
    """A child span of the current one, as a context manager; nothing at all when tracing is off."""
    if _TRACER is None:
        return _NoSpan()
    return _TRACER.start_as_current_span(name, attributes=attributes)
