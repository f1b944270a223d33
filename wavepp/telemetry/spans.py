"""Span records: one flat, process-independent form of a finished span, and a JSON-lines exporter.

A ``SpanRecord`` is what the trace tools (wave fill from spans, the timeline, tests) read; it is
built from an SDK ``ReadableSpan`` (in-memory exporter) or from a line of the JSON-lines file that
``JsonLinesSpanExporter`` writes. Times are integer nanoseconds since the epoch (OTel's unit).

One line of the file (all ids lowercase hex, ``parent_span_id`` empty for a root)::

    {"name": "stage.execute", "trace_id": "...32 hex", "span_id": "...16 hex",
     "parent_span_id": "...16 hex", "start_ns": 1, "end_ns": 2, "service": "wavepp-stage-1",
     "attributes": {"stage.rank": 1, ...}, "links": [{"trace_id": ..., "span_id": ...}],
     "status": "UNSET"}
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


@dataclass(frozen=True)
class SpanRecord:
    """A finished span, flattened. ``start_ns``/``end_ns``: nanoseconds since the epoch."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    service: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    links: tuple[tuple[str, str], ...] = ()
    status: str = "UNSET"

    @property
    def is_root(self) -> bool:
        return not self.parent_span_id

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "trace_id": self.trace_id,
                "span_id": self.span_id,
                "parent_span_id": self.parent_span_id,
                "start_ns": self.start_ns,
                "end_ns": self.end_ns,
                "service": self.service,
                "attributes": self.attributes,
                "links": [{"trace_id": t, "span_id": s} for t, s in self.links],
                "status": self.status,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpanRecord:
        return cls(
            name=str(data["name"]),
            trace_id=str(data["trace_id"]),
            span_id=str(data["span_id"]),
            parent_span_id=str(data.get("parent_span_id") or ""),
            start_ns=int(data["start_ns"]),
            end_ns=int(data["end_ns"]),
            service=str(data.get("service", "")),
            attributes=dict(data.get("attributes") or {}),
            links=tuple((str(x["trace_id"]), str(x["span_id"])) for x in data.get("links") or ()),
            status=str(data.get("status", "UNSET")),
        )

    @classmethod
    def from_span(cls, span: ReadableSpan) -> SpanRecord:
        ctx = span.context
        assert ctx is not None, "a finished SDK span has a context"
        parent = span.parent
        service = span.resource.attributes.get("service.name", "") if span.resource else ""
        return cls(
            name=span.name,
            trace_id=f"{ctx.trace_id:032x}",
            span_id=f"{ctx.span_id:016x}",
            parent_span_id=f"{parent.span_id:016x}" if parent is not None else "",
            start_ns=int(span.start_time or 0),
            end_ns=int(span.end_time or 0),
            service=str(service),
            attributes=dict(span.attributes or {}),
            links=tuple(
                (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}")
                for link in span.links
            ),
            status=span.status.status_code.name,
        )


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON line per span to ``path``.

    The file is opened with O_APPEND and each line goes out in one ``write`` call, so several
    processes may share one file without interleaving lines (Linux, local file systems).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            for span in spans:
                os.write(self._fd, (SpanRecord.from_span(span).to_json() + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_span_records(paths: Iterable[str | os.PathLike[str]]) -> list[SpanRecord]:
    """Read the JSON-lines span files ``paths`` (in order), skipping blank lines.

    Raises:
        ValueError: a line is not a span record (names the file and line number).
    """
    records: list[SpanRecord] = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(SpanRecord.from_dict(json.loads(line)))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{line_no}: not a span record: {exc}") from exc
    return records
