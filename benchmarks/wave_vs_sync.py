"""WavePP (--mode wave) against the synchronous baseline (--mode sync), side by side.

Both runs replay the same trace slice through the emulated engine (stages sleep the derived
H200 cost of the named model; NATS, agreement, planning and activations are real), one after the
other in this process. The script prints one table, a row per figure of the replay summary
(the rows and words of ``wavepp replay``'s table: the unit and what each figure means), a
column per mode, and then the throughput ratio wave / sync.

    python benchmarks/wave_vs_sync.py data/traces/conversation_trace.jsonl \
        --limit 200 --concurrency 64 --emulate glm-5.2

This is a benchmark, not a test: it measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from rich.console import Console
from rich.table import Table

from wavepp.bench.replay import replay_records
from wavepp.bench.summary_text import clean_source, summary_rows
from wavepp.bench.trace import TokenMapper, load_trace
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.model_config import get_preset
from wavepp.runtime.planning.catalogue import derived_cost_model


def comparison_rows(wave: dict, sync: dict) -> list[tuple[str, str, str, str]]:
    """``(metric with unit, wave's value, sync's value, what it means)`` for each row of the
    replay summary (``summary_text.summary_rows``: the rows and words ``wavepp replay``
    prints) that both runs have, in its order; the mode row is left out (it is the columns),
    and each run's errors are rows of their own (the other column ``-``)."""
    sync_values = {label: value for label, value, _ in summary_rows(sync) if label != "error"}
    rows = [
        (label, value, sync_values[label], meaning)
        for label, value, meaning in summary_rows(wave)
        if label not in ("mode", "error") and label in sync_values
    ]
    for mode, summary in (("wave", wave), ("sync", sync)):
        for label, value, meaning in summary_rows(summary):
            if label == "error":
                pair = (value, "-") if mode == "wave" else ("-", value)
                rows.append((f"error ({mode})", *pair, meaning))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--emulate", default="glm-5.2")
    parser.add_argument("--tokens-per-block", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--kv-blocks", type=int, default=16384, help="per stage")
    parser.add_argument("--time-scale", type=float, default=0.25, help="sleep multiplier")
    parser.add_argument("--chunk-tokens", type=int, default=8192)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    records, invalid = load_trace(args.trace, args.limit)
    model = get_preset("tiny-llama")
    mapper = TokenMapper(args.tokens_per_block, model.vocab_size)
    stage_cost = derived_cost_model(args.emulate, num_stages=args.stages)
    results = {}
    for mode in ("wave", "sync"):
        config = RuntimeConfig(
            model=model,
            engine="emulated",
            cost_model=stage_cost.to_dict(),
            time_scale=args.time_scale,
            num_stages=args.stages,
            block_size=args.block_size,
            num_kv_blocks=[args.kv_blocks],
            mode=mode,
            chunk_tokens=args.chunk_tokens,
        )
        # The planner budgets with the stages' own (scaled) cost model.
        planner_cost = stage_cost.scaled(args.time_scale)
        report = asyncio.run(
            replay_records(
                records,
                mapper,
                config,
                planner_cost,
                concurrency=args.concurrency,
                invalid=invalid,
            )
        )
        # the layers are tiny-llama's placeholder: the stages sleep --emulate's cost
        results[mode] = report.summary() | {
            "model": args.emulate,
            "planner_cost_model": clean_source(planner_cost.source or planner_cost.label),
        }
    ratio = results["wave"]["throughput_tokens_per_s"] / results["sync"]["throughput_tokens_per_s"]
    table = Table(
        title=(
            f"wave vs sync: {len(records)} requests, {args.stages} stages emulating "
            f"{args.emulate} @ H200 (time x{args.time_scale}), concurrency {args.concurrency}"
        )
    )
    table.add_column("metric")
    table.add_column("wave", justify="right")
    table.add_column("sync", justify="right")
    table.add_column("what it is")
    for row in comparison_rows(results["wave"], results["sync"]):
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print(f"throughput ratio wave / sync: [bold]{ratio:.3f}[/]")
    if args.json:
        print(json.dumps({"ratio": round(ratio, 4), **{m: results[m] for m in results}}))


if __name__ == "__main__":
    main()
