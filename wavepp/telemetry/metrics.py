"""Runtime metrics: OpenTelemetry instruments, exposed for Prometheus scraping on ``/metrics``.

This module is the project's one metrics stack (``docs/architecture.md``, "Metrics"): every
instrument is an OpenTelemetry instrument on a ``MeterProvider`` read by the OpenTelemetry
Prometheus exporter, through ``PrometheusExport``; it is also the only wavepp module that
imports ``prometheus_client`` (for the exporter's registry, the text format and the HTTP server).
The gateway's instruments (``wavepp.gateway.metrics``) use the same ``PrometheusExport``.

Instrument names follow OTel conventions (dotted, unit in ``unit``); the Prometheus exporter
turns them into Prometheus names with the unit and ``_total`` suffixes. ``PROMETHEUS_NAMES``
lists the resulting series (the dashboards' test checks every panel query against what a scrape
actually returns):

| OTel instrument                | kind        | unit          | Prometheus series                          |
| ------------------------------ | ----------- | ------------- | ------------------------------------------ |
| wavepp.wave_fill.ratio         | obs. gauge  | 1             | wavepp_wave_fill_ratio{pipeline}           |
| wavepp.bubble.ratio            | obs. gauge  | 1             | wavepp_bubble_ratio{pipeline}              |
| wavepp.stage.busy              | counter     | s             | wavepp_stage_busy_seconds_total{stage_rank}|
| wavepp.stage.idle              | obs. gauge  | s             | wavepp_stage_idle_seconds{stage_rank}      |
| wavepp.microbatches            | counter     | {microbatch}  | wavepp_microbatches_total                  |
| wavepp.speculations.discarded  | counter     | {speculation} | wavepp_speculations_discarded_total        |
| wavepp.admissions              | counter     | {request}     | wavepp_admissions_total{tenant}            |
| wavepp.agreement.duration      | histogram   | s             | wavepp_agreement_duration_seconds_*        |
| wavepp.reservation.refusals    | counter     | {refusal}     | wavepp_reservation_refusals_total{tenant}  |
| wavepp.prompt.tokens           | counter     | {token}       | wavepp_prompt_tokens_total{kind,tenant}    |
| wavepp.kv.evictions            | counter     | {block}       | wavepp_kv_evictions_total{stage_rank}      |
| wavepp.queue.depth             | obs. gauge  | {request}     | wavepp_queue_depth{queue}                  |
| wavepp.ttft                    | histogram   | s             | wavepp_ttft_seconds_*{tenant}              |
| wavepp.requests.completed      | counter     | {request}     | wavepp_requests_completed_total{outcome,tenant} |

Every series also carries ``pipeline``. ``kind`` is ``cached`` or ``new``; ``queue`` is
``intake`` (waiting for agreement) or ``prepared`` (admitted, not yet planned). The exporter adds
``otel_scope_name``/``otel_scope_version``/``otel_scope_schema_url`` labels to each series and a
``target_info`` series (the process's OTel resource).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource

from wavepp.telemetry.settings import TelemetrySettings

log = logging.getLogger(__name__)

PROMETHEUS_NAMES: tuple[str, ...] = (
    "wavepp_wave_fill_ratio",
    "wavepp_bubble_ratio",
    "wavepp_stage_busy_seconds_total",
    "wavepp_stage_idle_seconds",
    "wavepp_microbatches_total",
    "wavepp_speculations_discarded_total",
    "wavepp_admissions_total",
    "wavepp_agreement_duration_seconds",
    "wavepp_reservation_refusals_total",
    "wavepp_prompt_tokens_total",
    "wavepp_kv_evictions_total",
    "wavepp_queue_depth",
    "wavepp_ttft_seconds",
    "wavepp_requests_completed_total",
)

# Bucket bounds in seconds: agreement is a NATS round trip or two (sub-ms to 1 s); TTFT spans
# a short prompt on an idle pipeline to a long one behind a queue.
AGREEMENT_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class PrometheusExport:
    """An OpenTelemetry ``MeterProvider`` whose instruments a Prometheus scrape reads.

    Stores the provider, its ``PrometheusMetricReader`` and that reader's own
    ``prometheus_client`` registry, so that two exports in one process (tests; a gateway beside
    a scheduler) never share series. A scrape runs the provider's collection, observable-gauge
    callbacks included, in the scraping thread.

    Args:
        service_name: the OTel ``service.name`` resource attribute.
        scope_labels: add the exporter's ``otel_scope_*`` labels to every series.
        target_info: export a ``target_info`` series holding the OTel resource.
    """

    def __init__(
        self, service_name: str, *, scope_labels: bool = True, target_info: bool = True
    ) -> None:
        # NOTE: imported here, not at module top: only a process that exports pays for them.
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        reader = PrometheusMetricReader(
            disable_target_info=not target_info,
            scope_info_enabled=scope_labels,
            registry=self.registry,
        )
        self.provider = MeterProvider(
            metric_readers=[reader], resource=Resource.create({"service.name": service_name})
        )
        self._server: object | None = None

    def meter(self) -> Meter:
        return self.provider.get_meter("wavepp")

    def scrape(self) -> tuple[bytes, str]:
        """Collect now; returns (body in the Prometheus text format, its Content-Type)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``GET /metrics`` on ``host``:``port`` (0: any free port) in a daemon thread.

        Returns:
            The port actually bound.
        """
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def shutdown(self) -> None:
        """Stop the HTTP server (if serving) and the provider; a later scrape is empty."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
        try:
            self.provider.shutdown()
        except Exception as exc:
            log.warning("metrics shutdown: %s", exc)


@dataclass
class PipelineSource:
    """What the observable instruments read from one live pipeline, on each collection.

    ``wave_fill()``: in [0, 1]; ``stage_idle_s()``: per stage rank, seconds idle in the
    execution window; ``queue_depths()``: queue name -> number of requests.
    """

    pipeline: str
    wave_fill: Callable[[], float]
    stage_idle_s: Callable[[], list[float]]
    queue_depths: Callable[[], dict[str, int]]


@dataclass
class RuntimeMetrics:
    """The instruments of one process. Record through the methods of ``PipelineTelemetry``."""

    provider: MeterProvider
    sources: dict[str, PipelineSource] = field(default_factory=dict)
    port: int | None = None
    _export: PrometheusExport | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        meter = self.provider.get_meter("wavepp")
        self.stage_busy = meter.create_counter(
            "wavepp.stage.busy", unit="s", description="Time stages spent executing micro-batches"
        )
        self.microbatches = meter.create_counter(
            "wavepp.microbatches", unit="{microbatch}", description="Micro-batches published"
        )
        self.speculations_discarded = meter.create_counter(
            "wavepp.speculations.discarded",
            unit="{speculation}",
            description="Speculative plans dropped (an agreed L* differed from its prediction, "
            "an agreement was refused or failed, or the planning set changed); planned again",
        )
        self.admissions = meter.create_counter(
            "wavepp.admissions", unit="{request}", description="Requests admitted (L* agreed)"
        )
        self.agreement_duration = meter.create_histogram(
            "wavepp.agreement.duration",
            unit="s",
            description="Agreement of one request: its probe-reserve rounds until admitted",
            explicit_bucket_boundaries_advisory=list(AGREEMENT_BUCKETS_S),
        )
        self.reservation_refusals = meter.create_counter(
            "wavepp.reservation.refusals",
            unit="{refusal}",
            description="Reservations a stage refused (the request waited and retried)",
        )
        self.prompt_tokens = meter.create_counter(
            "wavepp.prompt.tokens",
            unit="{token}",
            description="Prompt tokens of admitted requests, by kind (cached: reused prefix)",
        )
        self.kv_evictions = meter.create_counter(
            "wavepp.kv.evictions", unit="{block}", description="Cached KV blocks evicted"
        )
        self.ttft = meter.create_histogram(
            "wavepp.ttft",
            unit="s",
            description="Time to first token: arrival to the last stage's result",
            explicit_bucket_boundaries_advisory=list(TTFT_BUCKETS_S),
        )
        self.requests_completed = meter.create_counter(
            "wavepp.requests.completed", unit="{request}", description="Requests finished"
        )
        meter.create_observable_gauge(
            "wavepp.wave_fill.ratio",
            callbacks=[self._observe_wave_fill],
            unit="1",
            description="Busy time of all stages / (S x wall time of the execution window)",
        )
        meter.create_observable_gauge(
            "wavepp.bubble.ratio",
            callbacks=[self._observe_bubble],
            unit="1",
            description="1 - wave fill: the bubble fraction",
        )
        meter.create_observable_gauge(
            "wavepp.stage.idle",
            callbacks=[self._observe_idle],
            unit="s",
            description="Time each stage was idle in the execution window",
        )
        meter.create_observable_gauge(
            "wavepp.queue.depth",
            callbacks=[self._observe_queues],
            unit="{request}",
            description="Requests waiting, by queue (intake: before agreement; prepared: admitted)",
        )

    def _snapshot(self) -> list[PipelineSource]:
        with self._lock:
            return list(self.sources.values())

    def _observe_wave_fill(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(s.wave_fill(), {"pipeline": s.pipeline}) for s in self._snapshot()]

    def _observe_bubble(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(1.0 - s.wave_fill(), {"pipeline": s.pipeline}) for s in self._snapshot()
        ]

    def _observe_idle(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(idle, {"pipeline": s.pipeline, "stage.rank": rank})
            for s in self._snapshot()
            for rank, idle in enumerate(s.stage_idle_s())
        ]

    def _observe_queues(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(depth, {"pipeline": s.pipeline, "queue": queue})
            for s in self._snapshot()
            for queue, depth in s.queue_depths().items()
        ]

    def register(self, source: PipelineSource) -> None:
        with self._lock:
            self.sources[source.pipeline] = source

    def unregister(self, pipeline: str) -> None:
        with self._lock:
            self.sources.pop(pipeline, None)


_metrics: RuntimeMetrics | None = None


def setup_metrics(
    settings: TelemetrySettings,
    service_name: str,
    *,
    reader: MetricReader | None = None,
    host: str = "0.0.0.0",
) -> RuntimeMetrics | None:
    """Configure this process's metrics (replacing any earlier setup).

    Args:
        settings: ``metrics_port`` None and no ``reader``: metrics off (returns None).
        service_name: the OTel ``service.name`` resource attribute.
        reader: collect with this reader (tests pass an ``InMemoryMetricReader``) instead of
            serving Prometheus ``/metrics``.
        host: the bind address of ``/metrics`` (every interface by default, as in a pod;
            ``wavepp up`` passes its ``--host``).

    Returns:
        The instruments, or None when metrics are off. ``port`` is the port actually bound.
    """
    shutdown_metrics()
    if reader is None and settings.metrics_port is None:
        return None
    global _metrics
    if reader is None:
        assert settings.metrics_port is not None
        export = PrometheusExport(service_name)
        port = export.serve(settings.metrics_port, host)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, port)
        _metrics = RuntimeMetrics(provider=export.provider, port=port, _export=export)
    else:
        provider = MeterProvider(
            metric_readers=[reader], resource=Resource.create({"service.name": service_name})
        )
        _metrics = RuntimeMetrics(provider=provider)
    return _metrics


def get_metrics() -> RuntimeMetrics | None:
    return _metrics


def shutdown_metrics() -> None:
    """Stop the HTTP server and the meter provider (a no-op when metrics are off)."""
    global _metrics
    metrics, _metrics = _metrics, None
    if metrics is None:
        return
    if metrics._export is not None:
        metrics._export.shutdown()
        return
    try:
        metrics.provider.shutdown()
    except Exception as exc:
        log.warning("metrics shutdown: %s", exc)
