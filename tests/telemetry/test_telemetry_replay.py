"""A short traced replay (4 emulated stage processes, real NATS): the span tree, context across
processes, and the wave fill from spans against the runtime's own wave-fill metric.

The scheduler process (this test process) exports to an ``InMemorySpanExporter``. An in-memory
exporter cannot cross processes, so each stage process exports to its own JSON-lines file
(``telemetry.jsonl_path`` with ``{process}``); the test reads those back and assembles one tree
from both sources. Metrics are read with an ``InMemoryMetricReader``.
"""

from __future__ import annotations

import asyncio
import glob
import json
from collections import defaultdict
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from telemetry_support import NUM_STAGES, short_replay

from wavepp.telemetry import tracing
from wavepp.telemetry.metrics import setup_metrics, shutdown_metrics
from wavepp.telemetry.settings import TelemetrySettings
from wavepp.telemetry.spans import SpanRecord, read_span_records
from wavepp.telemetry.wavefill import wave_fill_from_spans

pytestmark = pytest.mark.timeout(120)

NUM_REQUESTS = 24


class Run:
    def __init__(self, tmp: Path) -> None:
        settings = TelemetrySettings(
            exporter="jsonl", jsonl_path=str(tmp / "spans-{process}.jsonl")
        )
        memory = InMemorySpanExporter()
        reader = InMemoryMetricReader()
        tracing.setup(settings, "wavepp-scheduler", span_exporter=memory)
        setup_metrics(settings, "wavepp-scheduler", reader=reader)
        try:
            self.report = asyncio.run(short_replay(settings, num_requests=NUM_REQUESTS))
            self.metrics = {
                m.name: m
                for rm in reader.get_metrics_data().resource_metrics
                for sm in rm.scope_metrics
                for m in sm.metrics
            }
        finally:
            tracing.shutdown()
            shutdown_metrics()
        self.scheduler_spans = [SpanRecord.from_span(s) for s in memory.get_finished_spans()]
        self.stage_files = sorted(glob.glob(str(tmp / "spans-*.jsonl")))
        self.stage_spans = read_span_records(self.stage_files)
        self.spans = self.scheduler_spans + self.stage_spans
        self.by_id = {s.span_id: s for s in self.spans}
        self.by_trace: dict[str, list[SpanRecord]] = defaultdict(list)
        for span in self.spans:
            self.by_trace[span.trace_id].append(span)

    def children(self, span: SpanRecord, name: str) -> list[SpanRecord]:
        return [
            s
            for s in self.by_trace[span.trace_id]
            if s.parent_span_id == span.span_id and s.name == name
        ]

    def gauge(self, name: str) -> float:
        points = list(self.metrics[name].data.data_points)
        assert len(points) == 1, points
        return float(points[0].value)

    def counter_by(self, name: str, key: str) -> dict[object, float]:
        out: dict[object, float] = defaultdict(float)
        for point in self.metrics[name].data.data_points:
            out[point.attributes.get(key)] += point.value
        return dict(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return Run(tmp_path_factory.mktemp("traced-replay"))


def test_replay_completed(run: Run) -> None:
    summary = run.report.summary()
    assert summary["completed"] == NUM_REQUESTS, summary["errors"]
    assert summary["cached_tokens"] > 0  # the shared prefix was reused: agreement mattered


def test_one_root_per_request_and_a_connected_tree(run: Run) -> None:
    roots = [s for s in run.spans if s.is_root]
    assert all(s.name == "request" for s in roots)
    assert sorted(s.attributes["request.id"] for s in roots) == sorted(
        o.request_id for o in run.report.outcomes
    )
    assert len({s.trace_id for s in roots}) == len(roots) == len(run.by_trace)
    for span in run.spans:  # every non-root's parent was recorded, in the same trace
        if not span.is_root:
            parent = run.by_id[span.parent_span_id]
            assert parent.trace_id == span.trace_id, span


def test_agreement_spans_precede_the_stage_spans_of_their_request(run: Run) -> None:
    for root in (s for s in run.spans if s.is_root):
        [agreement] = run.children(root, "agreement")  # no refusals at this capacity
        # one round trip: one child, no commit
        [probe_reserve] = run.children(agreement, "agreement.probe_reserve")
        assert not run.children(agreement, "agreement.commit")
        assert (
            agreement.attributes["prefix.agreed_blocks"]
            == probe_reserve.attributes["prefix.agreed_blocks"]
        )
        stage_spans = [s for s in run.by_trace[root.trace_id] if s.name.startswith("stage.")]
        assert stage_spans
        assert agreement.end_ns <= min(s.start_ns for s in stage_spans)
        assert (
            root.start_ns <= agreement.start_ns
            and max(s.end_ns for s in stage_spans) <= root.end_ns
        )


def test_one_execute_span_per_stage_and_microbatch(run: Run) -> None:
    seen: set[tuple[int, int]] = set()
    for root in (s for s in run.spans if s.is_root):
        chunks = run.children(root, "microbatch")
        num_new = sum(c.attributes["tokens.new"] for c in chunks)
        assert num_new == root.attributes["tokens.new"]  # the chunks cover the uncached prompt
        for chunk in chunks:
            mb = chunk.attributes["microbatch.id"]
            execute = run.children(chunk, "stage.execute")
            assert sorted(s.attributes["stage.rank"] for s in execute) == list(range(NUM_STAGES))
            assert all(s.attributes["microbatch.id"] == mb for s in execute)
            assert len(run.children(chunk, "planning")) == 1
            seen.update((s.attributes["stage.rank"], mb) for s in execute)
    runtime = {(s.rank, s.microbatch_id) for s in run.report.stats.spans}
    assert seen == runtime


def test_trace_context_crosses_process_boundaries(run: Run) -> None:
    assert len(run.stage_files) == NUM_STAGES  # one file per stage process
    assert run.stage_spans
    for span in run.stage_spans:
        assert span.service == f"wavepp-stage-{span.attributes['stage.rank']}"
        parent = run.by_id[span.parent_span_id]
        assert parent.name == "microbatch" and parent.service == "wavepp-scheduler"
        assert parent.trace_id == span.trace_id
        assert span.attributes["chunk.index"] == parent.attributes["chunk.index"]


def test_wave_fill_from_spans_equals_the_runtime_metric(run: Run) -> None:
    metric = run.gauge("wavepp.wave_fill.ratio")
    from_spans = wave_fill_from_spans(run.spans, NUM_STAGES)
    assert 0.0 < metric <= 1.0
    assert abs(from_spans - metric) <= 0.01 * metric
    assert metric == pytest.approx(run.report.stats.wave_fill(NUM_STAGES))
    assert run.gauge("wavepp.bubble.ratio") == pytest.approx(1.0 - metric)


def test_metrics_agree_with_the_replay_summary(run: Run) -> None:
    summary = run.report.summary()
    assert sum(run.counter_by("wavepp.admissions", "tenant").values()) == NUM_REQUESTS
    tokens = run.counter_by("wavepp.prompt.tokens", "kind")
    assert tokens["cached"] == summary["cached_tokens"]
    assert tokens["new"] == summary["new_tokens"]
    [ttft] = run.metrics["wavepp.ttft"].data.data_points
    assert ttft.count == NUM_REQUESTS
    busy = run.counter_by("wavepp.stage.busy", "stage.rank")
    expected = run.report.stats.busy_s_by_stage(NUM_STAGES)
    assert [busy[r] for r in range(NUM_STAGES)] == pytest.approx(expected)
    microbatches = run.counter_by("wavepp.microbatches", "pipeline")
    assert sum(microbatches.values()) == summary["microbatches"]


def test_replay_cli_draws_the_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from telemetry_support import short_records

    from wavepp.cli import main

    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {"timestamp": r.timestamp_ms, "input_length": r.input_length,
                 "output_length": r.output_length, "hash_ids": list(r.hash_ids)}
            ) + "\n"
            for r in short_records(12)
        )
    )  # fmt: skip
    png, spans = tmp_path / "timeline.png", tmp_path / "spans.jsonl"
    argv = [
        "replay",
        str(trace),
        "--stages",
        "4",
        "--engine",
        "emulated",
        "--tokens-per-block",
        "16",
    ]
    argv += ["--time-scale", "0.05", "--trace-out", str(spans), "--timeline", str(png), "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["completed"] == 12
    assert png.read_bytes()[:4] == b"\x89PNG"
    records = read_span_records([spans])  # every process appended to the one file
    assert {r.service for r in records} == {"wavepp-scheduler"} | {
        f"wavepp-stage-{r}" for r in range(4)
    }
    assert wave_fill_from_spans(records, 4) == pytest.approx(summary["wave_fill"], abs=1e-4)
