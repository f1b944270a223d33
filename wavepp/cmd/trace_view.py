"""``wavepp trace-view TRACE.jsonl``: summarise a span file and draw the pipeline's timeline.

Reads the JSON-lines spans a run wrote (``wavepp replay --trace-out``, or
``telemetry.exporter=jsonl``; several files are merged), prints the span counts, the number of
requests and micro-batches, each stage's busy time and the wave fill computed from the spans,
and with ``--out`` draws the per-stage Gantt chart of micro-batches and the throughput over time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", help="JSON-lines span file(s) of one run")
    parser.add_argument(
        "--out", default="", help="write the timeline PNG here (default: no picture)"
    )
    parser.add_argument("--stages", type=int, default=None, help="S (default: from the spans)")
    parser.add_argument("--title", default="", help="title prefix of the picture")
    parser.add_argument(
        "--json", action="store_true", help="stdout: the summary JSON only (the rest on stderr)"
    )


def run(args: argparse.Namespace) -> int:
    from wavepp.telemetry.spans import read_span_records
    from wavepp.telemetry.wavefill import num_stages_of, stage_intervals, wave_fill_from_spans

    for path in args.traces:
        if not Path(path).is_file():
            print(f"wavepp trace-view: TRACE: {path}: no such file", file=sys.stderr)
            return 2
    if args.stages is not None and args.stages < 1:
        print(f"wavepp trace-view: --stages: {args.stages}: must be >= 1", file=sys.stderr)
        return 2
    try:
        records = read_span_records(args.traces)
        intervals = stage_intervals(records)
        stages = args.stages or num_stages_of(intervals)
        fill = wave_fill_from_spans(records, stages if intervals else None)
    except ValueError as exc:
        print(f"wavepp trace-view: {exc}", file=sys.stderr)
        return 2
    busy = [0.0] * stages
    for interval in intervals:
        if interval.phase == "execute":
            busy[interval.rank] += interval.end_s - interval.start_s
    summary = {
        "spans": dict(Counter(r.name for r in records)),
        "requests": sum(1 for r in records if r.name == "request"),
        "microbatches": len({i.microbatch_id for i in intervals}),
        "stages": stages,
        "stage_busy_s": [round(b, 4) for b in busy],
        "wave_fill": round(fill, 4),
    }
    text_out = sys.stderr if args.json else sys.stdout  # --json: stdout holds JSON only
    for key, value in summary.items():
        print(f"{key:>14}: {value}", file=text_out)
    if args.out:
        from wavepp.telemetry.timeline import draw_timeline

        try:
            draw_timeline(records, args.out, num_stages=stages, title=args.title)
        except ValueError as exc:
            print(f"wavepp trace-view: --out: {exc}", file=sys.stderr)
            return 2
        print(f"{'timeline':>14}: {args.out}", file=text_out)
    if args.json:
        print(json.dumps(summary), flush=True)
    return 0
