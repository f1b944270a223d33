"""Telemetry settings: which span exporter, where, how much to sample, and the metrics port.

One pydantic model; ``RuntimeConfig.telemetry`` carries it to every stage process, so the
scheduler and the stages trace with the same exporter and sampling ratio.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SpanExporterName = Literal["none", "console", "jsonl", "otlp-grpc", "otlp-http"]


class TelemetrySettings(BaseModel):
    """Tracing and metrics of one pipeline's processes.

    ``exporter``: where spans go; ``"none"`` turns tracing off (no provider, no span objects).
    ``endpoint``: OTLP collector, e.g. ``http://otel-collector:4317`` (gRPC) or
    ``http://otel-collector:4318/v1/traces`` (HTTP); empty uses the exporter's default.
    ``sampling_ratio``: fraction of requests traced (parent-based trace-id ratio sampler; stages
    follow the scheduler's decision carried in the traceparent).
    ``jsonl_path``: with ``exporter="jsonl"``, the JSON-lines file; ``{process}`` in the path is
    replaced by the process's service name (one file per process), otherwise all processes
    append whole lines to one file.
    ``metrics_port``: serve Prometheus ``/metrics`` on this port in the scheduler process
    (``None``: no HTTP server; 0: any free port).
    """

    model_config = ConfigDict(extra="forbid")

    exporter: SpanExporterName = "none"
    endpoint: str = ""
    sampling_ratio: float = Field(1.0, ge=0.0, le=1.0)
    jsonl_path: str = ""
    metrics_port: int | None = Field(None, ge=0, le=65535)

    @model_validator(mode="after")
    def _check(self) -> TelemetrySettings:
        if self.exporter == "jsonl" and not self.jsonl_path:
            raise ValueError("telemetry.exporter=jsonl needs telemetry.jsonl_path (a file path)")
        return self

    @property
    def is_tracing(self) -> bool:
        return self.exporter != "none"
