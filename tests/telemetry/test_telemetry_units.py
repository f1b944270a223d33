"""Tracing setup, sampling, propagation, span files, wave fill from spans, the timeline, and
``wavepp trace-view``: no pipeline, no processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError

from wavepp.api.messages import MicroBatchDone, MicroBatchPlan, PlannedChunk
from wavepp.cli import main
from wavepp.telemetry import tracing
from wavepp.telemetry.pipeline import ChunkInfo, PipelineTelemetry, StageTelemetry, tenant_of
from wavepp.telemetry.settings import TelemetrySettings
from wavepp.telemetry.spans import JsonLinesSpanExporter, SpanRecord, read_span_records
from wavepp.telemetry.timeline import draw_timeline
from wavepp.telemetry.wavefill import stage_intervals, wave_fill_from_spans

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_tracing_left_behind():
    yield
    tracing.shutdown()


class _Stats:
    spans: list = []

    def wave_fill(self, num_stages: int) -> float:
        return 0.0

    def busy_s_by_stage(self, num_stages: int) -> list[float]:
        return [0.0] * num_stages


def _execute(rank: int, mb: int, start_s: float, end_s: float, trace: str = "t") -> SpanRecord:
    return SpanRecord(
        name="stage.execute",
        trace_id=trace,
        span_id=f"{rank}-{mb}-{trace}",
        parent_span_id="p",
        start_ns=int(start_s * 1e9),
        end_ns=int(end_s * 1e9),
        attributes={"stage.rank": rank, "microbatch.id": mb, "microbatch.num_tokens": 10},
    )


def test_tracing_off_builds_nothing() -> None:
    assert tracing.setup(TelemetrySettings(), "x") is False
    assert not tracing.is_enabled()
    assert tracing.start_span("request") is None
    with tracing.span("agreement") as span:
        assert span is None
    telemetry = PipelineTelemetry("p", 2, _Stats(), dict)
    telemetry.request_arrived("r", 1.0, 10, "default")
    assert telemetry.microbatch_published(0, [ChunkInfo("r", 0, 10, 0)], 1.0, 2.0) == ("", None)


def test_jsonl_settings_need_a_path() -> None:
    with pytest.raises(ValidationError, match="jsonl_path"):
        TelemetrySettings(exporter="jsonl")
    with pytest.raises(ValidationError, match="sampling_ratio"):
        TelemetrySettings(sampling_ratio=1.5)


def test_unsampled_requests_send_no_context() -> None:
    memory = InMemorySpanExporter()
    tracing.setup(TelemetrySettings(sampling_ratio=0.0), "s", span_exporter=memory)
    telemetry = PipelineTelemetry("p", 2, _Stats(), dict)
    telemetry.request_arrived("r", 1.0, 10, "default")
    assert telemetry.microbatch_published(0, [ChunkInfo("r", 0, 10, 0)], 1.0, 2.0) == ("", None)
    telemetry.completed("r", ttft_s=1.0, finished_s=2.0)
    assert memory.get_finished_spans() == ()


def test_traceparent_round_trip_into_stage_spans() -> None:
    memory = InMemorySpanExporter()
    tracing.setup(TelemetrySettings(), "scheduler", span_exporter=memory)
    telemetry = PipelineTelemetry("p", 2, _Stats(), dict)
    telemetry.request_arrived("a", 1.0, 20, "default")
    telemetry.request_arrived("b", 1.0, 20, "default")
    traceparent, headers = telemetry.microbatch_published(
        7, [ChunkInfo("a", 1, 5, 16), ChunkInfo("b", 0, 8, 0)], 1.5, 1.6
    )
    assert headers is not None and headers["traceparent"] == traceparent
    version, _trace_id, _span_id, flags = traceparent.split("-")
    assert version == "00" and int(flags, 16) & 1  # W3C traceparent, sampled
    plan = MicroBatchPlan(
        microbatch_id=7,
        chunks=[
            PlannedChunk(
                request_id="a", chunk_index=1, context_offset=16, token_ids=[1] * 5, is_last=True
            ),
            PlannedChunk(
                request_id="b", chunk_index=0, context_offset=0, token_ids=[2] * 8, is_last=False
            ),
        ],
        traceparent=traceparent,
    )
    stage = StageTelemetry(rank=1)
    stage.plan_received(plan, headers)
    done = MicroBatchDone(
        rank=1, microbatch_id=7, num_tokens=13, prepare_start_s=2.0, prepare_end_s=2.1,
        execute_start_s=2.2, execute_end_s=2.5, num_agreed_blocks=[1, 0],
    )  # fmt: skip
    stage.microbatch_done(plan, done)
    telemetry.stage_done(done)  # rank 1 is the last of 2 stages: micro-batch spans end
    for rid in ("a", "b"):
        telemetry.completed(rid, ttft_s=2.0, finished_s=3.0)
    records = [SpanRecord.from_span(s) for s in memory.get_finished_spans()]
    by_id = {r.span_id: r for r in records}
    roots = {r.attributes["request.id"]: r for r in records if r.is_root}
    executes = [r for r in records if r.name == "stage.execute"]
    assert len(executes) == 2
    for execute in executes:
        chunk = by_id[execute.parent_span_id]
        assert chunk.name == "microbatch" and chunk.end_ns == execute.end_ns
        assert (
            by_id[chunk.parent_span_id]
            is roots["a" if execute.attributes["chunk.index"] == 1 else "b"]
        )
        assert execute.start_ns == int(2.2e9) and execute.attributes["stage.rank"] == 1
    assert {e.attributes["prefix.agreed_blocks"] for e in executes} == {0, 1}


def test_jsonl_exporter_round_trip_and_shared_file(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    memory = InMemorySpanExporter()
    tracing.setup(TelemetrySettings(), "one", span_exporter=memory)
    tracing.record_span("stage.execute", 1.0, 2.0, parent=None, attributes={"stage.rank": 0})
    exporters = [JsonLinesSpanExporter(path), JsonLinesSpanExporter(path)]  # two "processes"
    spans = memory.get_finished_spans()
    for exporter in exporters:
        exporter.export(spans)
        exporter.shutdown()
    records = read_span_records([path])
    assert len(records) == 2
    assert records[0] == SpanRecord.from_span(spans[0])
    assert (records[0].end_ns - records[0].start_ns) / 1e9 == pytest.approx(1.0)
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"spans.jsonl:3"):
        read_span_records([path])


def test_wave_fill_from_spans_deduplicates_chunks() -> None:
    # 2 stages over a 4 s window; stage 0 busy 3 s, stage 1 busy 2 s: fill = 5 / (2 * 4).
    records = [
        _execute(0, 0, 0.0, 2.0, "a"),
        _execute(0, 0, 0.0, 2.0, "b"),  # the same micro-batch seen in a second request's trace
        _execute(1, 0, 2.0, 3.0),
        _execute(0, 1, 2.0, 3.0),
        _execute(1, 1, 3.0, 4.0),
    ]
    assert len(stage_intervals(records)) == 4
    assert wave_fill_from_spans(records) == pytest.approx(5 / 8)
    assert wave_fill_from_spans(records, num_stages=4) == pytest.approx(5 / 16)
    with pytest.raises(ValueError, match="num_stages=1"):
        wave_fill_from_spans(records, num_stages=1)
    assert wave_fill_from_spans([]) == 0.0


def test_tenant_label_never_shows_a_custom_salt() -> None:
    assert tenant_of("acme", "secret") == "acme"
    assert tenant_of("", "tenant:acme") == "acme"
    assert tenant_of("", "") == "default"
    assert tenant_of("", "s3cr3t") == "salted"


def _write_trace(path: Path) -> list[SpanRecord]:
    records = [
        _execute(0, 0, 0.0, 1.0), _execute(1, 0, 1.0, 2.0),
        _execute(0, 1, 1.0, 2.0), _execute(1, 1, 2.0, 3.5),
    ]  # fmt: skip
    path.write_text("".join(r.to_json() + "\n" for r in records))
    return records


def test_timeline_png(tmp_path: Path) -> None:
    records = _write_trace(tmp_path / "t.jsonl")
    drawn = draw_timeline(records, tmp_path / "t.png", title="test")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn["wave_fill"] == pytest.approx(4.5 / (2 * 3.5))
    assert drawn["num_microbatches"] == 2
    with pytest.raises(ValueError, match="no stage.execute spans"):
        draw_timeline([], tmp_path / "empty.png")


def test_trace_view_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_trace(tmp_path / "t.jsonl")
    out = tmp_path / "view.png"
    assert main(["trace-view", str(tmp_path / "t.jsonl"), "--out", str(out), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, "with --json stdout holds the JSON only"
    summary = json.loads(lines[0])
    assert summary["wave_fill"] == pytest.approx(4.5 / 7, abs=1e-4)
    assert summary["stages"] == 2 and summary["stage_busy_s"] == [2.0, 2.5]
    assert out.stat().st_size > 0
    assert main(["trace-view", str(tmp_path / "missing.jsonl")]) == 2


def test_prometheus_exports_keep_their_series_apart() -> None:
    from wavepp.telemetry.metrics import PrometheusExport

    one = PrometheusExport("one")
    two = PrometheusExport("two", scope_labels=False, target_info=False)
    try:
        one.meter().create_counter("wavepp.one", unit="{x}").add(2, {"tenant": "a"})
        two.meter().create_counter("wavepp.two", unit="s").add(1.5)
        text_one, content_type = one.scrape()
        text_two, _ = two.scrape()
    finally:
        one.shutdown()
        two.shutdown()
    assert content_type.startswith("text/plain")
    assert b"wavepp_one_total{" in text_one and b'tenant="a"' in text_one
    assert b"otel_scope_name" in text_one and b"target_info" in text_one
    assert b"wavepp_two" not in text_one
    assert b"wavepp_two_seconds_total 1.5" in text_two
    assert b"wavepp_one" not in text_two and b"otel_scope" not in text_two
    assert b"target_info" not in text_two
    assert b"wavepp_one" not in one.scrape()[0]  # shut down: nothing left to scrape
