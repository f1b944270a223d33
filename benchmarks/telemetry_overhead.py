"""Tracing off vs on: throughput of the same short replay, measured side by side.

Replays the same trace slice through the emulated engine (4 stage processes, real NATS and
agreement) with tracing off (``exporter=none``) and on (every request sampled, spans of all
processes written to a JSON-lines file), alternating ``--repeats`` times, and prints each run's
throughput and the median ratio on / off.

    python benchmarks/telemetry_overhead.py data/traces/conversation_trace.jsonl --limit 100

This is a benchmark, not a test: it measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from wavepp.bench.replay import replay_records
from wavepp.bench.trace import TokenMapper, load_trace
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.model_config import get_preset
from wavepp.runtime.planning.catalogue import derived_cost_model
from wavepp.telemetry.settings import TelemetrySettings
from wavepp.telemetry.spans import read_span_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--emulate", default="glm-5.2")
    parser.add_argument("--tokens-per-block", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    records, _invalid = load_trace(args.trace, args.limit)
    model = get_preset("tiny-llama")
    cost = derived_cost_model(args.emulate, num_stages=args.stages)
    out_dir = Path(tempfile.mkdtemp(prefix="wavepp-telemetry-bench-"))
    results: dict[str, list[float]] = {"off": [], "on": []}
    print(f"{'run':>4} {'tracing':>8} {'tokens/s':>12} {'wave fill':>10} {'spans':>7}")
    for repeat in range(args.repeats):
        for label in ("off", "on"):
            path = out_dir / f"spans-{repeat}.jsonl"
            telemetry = (
                TelemetrySettings(exporter="jsonl", jsonl_path=str(path))
                if label == "on"
                else TelemetrySettings()
            )
            config = RuntimeConfig(
                model=model,
                engine="emulated",
                cost_model=cost.to_dict(),
                time_scale=args.time_scale,
                num_stages=args.stages,
                block_size=16,
                num_kv_blocks=[16384],
                telemetry=telemetry,
            )
            mapper = TokenMapper(args.tokens_per_block, model.vocab_size)
            report = asyncio.run(
                replay_records(records, mapper, config, cost, concurrency=args.concurrency)
            )
            summary = report.summary()
            num_spans = len(read_span_records([path])) if label == "on" else 0
            results[label].append(summary["throughput_tokens_per_s"])
            print(
                f"{repeat:>4} {label:>8} {summary['throughput_tokens_per_s']:>12.1f} "
                f"{summary['wave_fill']:>10.4f} {num_spans:>7}",
                flush=True,
            )
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"median tokens/s: off {off:.1f}, on {on:.1f}, on/off = {on / off:.4f}")


if __name__ == "__main__":
    main()
