"""Tracing setup for one process, and the few span helpers the runtime calls.

``setup(settings, service_name)`` builds a private ``TracerProvider`` (not OTel's global one, so a
test can set up, shut down and set up again in one process) with a parent-based trace-id ratio
sampler and one exporter (OTLP gRPC/HTTP, console, JSON lines, or one passed in, such as an
in-memory exporter in tests). With ``exporter="none"`` nothing is built: ``is_enabled()`` is False
and every helper returns at once (no span objects, no context switches), so tracing off costs a
flag test per hook.

Context crosses processes as a W3C ``traceparent`` string (``00-<trace id>-<span id>-<flags>``),
in the micro-batch plan and in the NATS message headers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from wavepp.telemetry.settings import TelemetrySettings
from wavepp.telemetry.spans import JsonLinesSpanExporter

log = logging.getLogger(__name__)

TRACEPARENT_HEADER = "traceparent"

_PROPAGATOR = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None


def _make_exporter(settings: TelemetrySettings, service_name: str) -> SpanExporter:
    if settings.exporter == "console":
        return ConsoleSpanExporter()
    if settings.exporter == "jsonl":
        return JsonLinesSpanExporter(settings.jsonl_path.replace("{process}", service_name))
    if settings.exporter == "otlp-grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=settings.endpoint or None)
    if settings.exporter == "otlp-http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as OTLPHttpSpanExporter,
        )

        return OTLPHttpSpanExporter(endpoint=settings.endpoint or None)
    raise ValueError(f"telemetry.exporter={settings.exporter!r}: no exporter for it")


def setup(
    settings: TelemetrySettings,
    service_name: str,
    *,
    span_exporter: SpanExporter | None = None,
) -> bool:
    """Configure tracing for this process (replacing any earlier setup).

    Args:
        settings: exporter, endpoint, sampling ratio, JSON-lines path.
        service_name: the OTel ``service.name`` (e.g. ``wavepp-scheduler``, ``wavepp-stage-2``).
        span_exporter: use this exporter instead of the one ``settings`` names (tests pass an
            ``InMemorySpanExporter``); tracing is then on even if ``settings.exporter`` is none,
            and each span is exported when it ends (SimpleSpanProcessor; else in batches).

    Returns:
        Whether tracing is on.
    """
    shutdown()
    if span_exporter is None and not settings.is_tracing:
        return False
    global _provider, _tracer
    exporter = span_exporter or _make_exporter(settings, service_name)
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}),
        sampler=ParentBased(TraceIdRatioBased(settings.sampling_ratio)),
    )
    processor = (
        SimpleSpanProcessor(exporter)
        if span_exporter is not None
        else BatchSpanProcessor(exporter, max_queue_size=65536, schedule_delay_millis=1000)
    )
    provider.add_span_processor(processor)
    _provider = provider
    _tracer = provider.get_tracer("wavepp")
    return True


def shutdown() -> None:
    """Flush and stop this process's tracing (a no-op when it is off)."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        try:
            provider.shutdown()
        except Exception as exc:  # an unreachable collector must not fail the caller
            log.warning("tracing shutdown: %s", exc)


def force_flush() -> None:
    if _provider is not None:
        _provider.force_flush()


def is_enabled() -> bool:
    return _tracer is not None


def current_context() -> Context | None:
    """The current context (for spans recorded later under it); None when tracing is off."""
    return otel_context.get_current() if _tracer is not None else None


def _ns(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e9)


def start_span(
    name: str,
    *,
    parent: Context | None = None,
    start_s: float | None = None,
    attributes: Mapping[str, Any] | None = None,
    links: list[Link] | None = None,
) -> Span | None:
    """Start a span (None when tracing is off). ``parent`` None: the current context.

    ``start_s``: ``time.time()`` seconds of the start, for spans recorded after the fact.
    """
    if _tracer is None:
        return None
    return _tracer.start_span(
        name, context=parent, start_time=_ns(start_s), attributes=attributes, links=links
    )


def end_span(span: Span | None, end_s: float | None = None, **attributes: Any) -> None:
    """Set ``attributes`` and end ``span`` at ``end_s`` (``time.time()`` seconds; None: now)."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    span.end(end_time=_ns(end_s))


def record_span(
    name: str,
    start_s: float,
    end_s: float,
    *,
    parent: Context | None,
    attributes: Mapping[str, Any] | None = None,
    links: list[Link] | None = None,
) -> None:
    """Record a finished span with known start and end (``time.time()`` seconds)."""
    span = start_span(name, parent=parent, start_s=start_s, attributes=attributes, links=links)
    end_span(span, end_s)


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Span | None]:
    """A child of the current span for the ``with`` block; yields None when tracing is off."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, attributes=attributes or None) as current:
        yield current


@contextlib.contextmanager
def use_span(parent: Span | None) -> Iterator[None]:
    """Make ``parent`` the current span inside the block (spans started there become children)."""
    if parent is None or _tracer is None:
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(parent))
    try:
        yield
    finally:
        otel_context.detach(token)


def context_of(span: Span | None) -> Context | None:
    return None if span is None else trace.set_span_in_context(span)


def traceparent_of(span: Span | None) -> str:
    """The W3C traceparent of ``span`` ("" when there is none or it is not sampled)."""
    if span is None or not span.get_span_context().trace_flags.sampled:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT_HEADER, "")


def current_traceparent() -> str:
    """The W3C traceparent of the current span ("" when tracing is off, or no sampled span is
    current): what a process puts in an outgoing message to continue the trace there."""
    if _tracer is None:
        return ""
    current = trace.get_current_span()
    return traceparent_of(current) if current.get_span_context().is_valid else ""


def context_from_traceparent(traceparent: str) -> Context | None:
    """The remote parent context of a W3C traceparent (None if empty or malformed)."""
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({TRACEPARENT_HEADER: traceparent})
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx
