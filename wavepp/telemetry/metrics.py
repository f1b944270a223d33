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
from typing import Literal

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource

from wavepp.telemetry.settings import TelemetrySettings

log = logging.getLogger(__name__)

# Bucket bounds in seconds: agreement is a NATS round trip or two (sub-ms to 1 s); TTFT spans
# a short prompt on an idle pipeline to a long one behind a queue.
AGREEMENT_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# The Prometheus suffix of each unit used here (the exporter's mapping; "1" and an annotation
# such as "{request}" add none).
_UNIT_SUFFIX = {"s": "seconds", "By": "bytes"}


@dataclass(frozen=True)
class Instrument:
    """One OpenTelemetry instrument as declared: the one place its name, kind, unit and
    description are written; the instrument (``attach``) and its Prometheus series name
    (``prometheus_name``) both come from it.

    ``kind``: ``counter`` and ``histogram`` are recorded into, ``gauge`` and
    ``observable_counter`` read by a callback at each collection. ``unit``: UCUM ("" none).
    ``attr``: the owner's attribute (``attach``): the instrument itself for a recorded kind,
    the callback for an observable one. ``buckets``: a histogram's bucket bounds, in ``unit``.
    """

    name: str
    kind: Literal["counter", "histogram", "gauge", "observable_counter"]
    unit: str
    attr: str
    description: str
    buckets: tuple[float, ...] = ()

    @property
    def prometheus_name(self) -> str:
        """The series the Prometheus exporter makes of it: dots to underscores, the unit's
        suffix (``_seconds``, ``_bytes``), ``_total`` for a counter (a histogram's series are
        this name plus ``_bucket``, ``_count`` and ``_sum``)."""
        name = self.name.replace(".", "_")
        suffix = _UNIT_SUFFIX.get(self.unit)
        if suffix and not name.endswith(f"_{suffix}"):
            name += f"_{suffix}"
        return name + "_total" if self.kind in ("counter", "observable_counter") else name


def attach(owner: object, meter: Meter, instruments: Iterable[Instrument]) -> None:
    """Create each of ``instruments`` on ``meter`` for ``owner``: a recorded one becomes
    ``owner.<attr>``; an observable one calls ``owner.<attr>`` (``CallbackOptions`` ->
    ``Observation``s) at each collection."""
    for i in instruments:
        common = {"unit": i.unit, "description": i.description}
        if i.kind == "counter":
            setattr(owner, i.attr, meter.create_counter(i.name, **common))
        elif i.kind == "histogram":
            bounds = list(i.buckets)
            histogram = meter.create_histogram(
                i.name, **common, explicit_bucket_boundaries_advisory=bounds
            )
            setattr(owner, i.attr, histogram)
        else:
            create = (
                meter.create_observable_gauge
                if i.kind == "gauge"
                else meter.create_observable_counter
            )
            create(i.name, callbacks=[getattr(owner, i.attr)], **common)


# fmt: off
RUNTIME_INSTRUMENTS = (
    Instrument("wavepp.wave_fill.ratio", "gauge", "1", "_observe_wave_fill",
               "Busy time of all stages / (S x wall time of the execution window)"),
    Instrument("wavepp.bubble.ratio", "gauge", "1", "_observe_bubble",
               "1 - wave fill: the bubble fraction"),
    Instrument("wavepp.stage.busy", "counter", "s", "stage_busy",
               "Time stages spent executing micro-batches"),
    Instrument("wavepp.stage.idle", "gauge", "s", "_observe_idle",
               "Time each stage was idle in the execution window"),
    Instrument("wavepp.microbatches", "counter", "{microbatch}", "microbatches",
               "Micro-batches published"),
    Instrument("wavepp.speculations.discarded", "counter", "{speculation}",
               "speculations_discarded",
               "Speculative plans dropped (an agreed L* differed from its prediction, an "
               "agreement was refused or failed, or the planning set changed); planned again"),
    Instrument("wavepp.admissions", "counter", "{request}", "admissions",
               "Requests admitted (L* agreed)"),
    Instrument("wavepp.agreement.duration", "histogram", "s", "agreement_duration",
               "Agreement of one request: its probe-reserve rounds until admitted",
               AGREEMENT_BUCKETS_S),
    Instrument("wavepp.reservation.refusals", "counter", "{refusal}", "reservation_refusals",
               "Reservations a stage refused (the request waited and retried)"),
    Instrument("wavepp.prompt.tokens", "counter", "{token}", "prompt_tokens",
               "Prompt tokens of admitted requests, by kind (cached: reused prefix)"),
    Instrument("wavepp.kv.evictions", "counter", "{block}", "kv_evictions",
               "Cached KV blocks evicted"),
    Instrument("wavepp.queue.depth", "gauge", "{request}", "_observe_queues",
               "Requests waiting, by queue (intake: before agreement; prepared: admitted)"),
    Instrument("wavepp.ttft", "histogram", "s", "ttft",
               "Time to first token: arrival to the last stage's result", TTFT_BUCKETS_S),
    Instrument("wavepp.requests.completed", "counter", "{request}", "requests_completed",
               "Requests finished"),
)
# fmt: on
PROMETHEUS_NAMES = tuple(i.prometheus_name for i in RUNTIME_INSTRUMENTS)


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
        attach(self, self.provider.get_meter("wavepp"), RUNTIME_INSTRUMENTS)

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
