"""Soak benchmark (not a test; not in CI): N requests of the Mooncake trace through an emulated
pipeline with real stage processes and a real nats-server, sampling over time

- the resident memory (RSS, bytes) of the scheduler process and of each stage process,
- the blocks held (pinned or reserved) and the free blocks of each stage (health probe),

then plotting them and checking that the end is flat: after the load, every stage holds no
block, and memory over the last quarter of the run grew by less than ``--max-growth`` of the
first quarter's.

    .venv/bin/python benchmarks/soak.py data/traces/conversation_trace.jsonl \\
        --limit 10000 --out /tmp/soak.png --csv /tmp/soak.csv
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import sys
import time
from pathlib import Path

from wavepp.bench.trace import TokenMapper, load_trace
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.serving.local import LocalPipeline

# ~2 ms + 2 us per new token per stage: fast enough for 10,000 requests in minutes on 2 cores.
COST = CostModel(c=2e-3, g=1e-8, b=2e-6, a=0.0, label="derived", source="soak benchmark")


def rss_bytes(pid: int | str) -> int:
    """Resident set size of a process from /proc (bytes); 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def soak(args: argparse.Namespace) -> list[dict[str, float]]:
    records, errors = load_trace(args.trace, args.limit)
    if errors:
        print(f"{len(errors)} invalid trace lines skipped; first: {errors[0]}", file=sys.stderr)
    config = RuntimeConfig(
        model=ModelConfig(num_layers=8),
        engine="emulated",
        cost_model=COST.to_dict(),
        num_stages=args.stages,
        block_size=args.tokens_per_block,
        num_kv_blocks=[int(n) for n in args.kv_blocks.split(",")],
        time_scale=args.time_scale,
    )
    mapper = TokenMapper(args.tokens_per_block, config.model.vocab_size, seed=0)
    samples: list[dict[str, float]] = []
    async with LocalPipeline(config, COST) as pipeline:
        assert pipeline.scheduler is not None and pipeline.controller is not None
        started = time.monotonic()
        num_done = num_failed = 0

        async def sample() -> None:
            replies = await pipeline.controller.health()
            row: dict[str, float] = {
                "t_s": time.monotonic() - started,
                "num_done": num_done,
                "scheduler_rss_bytes": rss_bytes("self"),
            }
            for reply, proc in zip(replies, pipeline.procs, strict=True):
                row[f"stage{reply.rank}_rss_bytes"] = rss_bytes(proc.pid)
                row[f"stage{reply.rank}_held_blocks"] = reply.num_blocks - reply.num_free_blocks
                row[f"stage{reply.rank}_free_blocks"] = reply.num_free_blocks
            samples.append(row)

        async def sampler() -> None:
            while True:
                await sample()
                await asyncio.sleep(args.sample_s)

        gate = asyncio.Semaphore(args.concurrency)

        async def one(i: int, tokens: list[int]) -> None:
            nonlocal num_done, num_failed
            async with gate:
                outcome = await pipeline.scheduler.submit(PromptRequest(f"s{i}", tokens))
            num_done += 1
            num_failed += not outcome.ok

        task = asyncio.create_task(sampler())
        await asyncio.gather(*(one(i, mapper.prompt(r)) for i, r in enumerate(records)))
        await asyncio.sleep(1.0)  # let the last releases land
        task.cancel()
        await sample()
    print(f"{num_done} requests, {num_failed} failed, {samples[-1]['t_s']:.1f} s")
    return samples


def check_flat(samples: list[dict[str, float]], max_growth: float) -> list[str]:
    """Problems at the end of the run (empty: flat). See the module docstring."""
    problems = []
    last = samples[-1]
    for key, value in last.items():
        if key.endswith("_held_blocks") and value != 0:
            problems.append(f"{key} = {value:.0f} after the load (a leak)")
    quarter = max(1, len(samples) // 4)
    for key in (k for k in last if k.endswith("_rss_bytes")):
        first = max(s[key] for s in samples[:quarter])
        end = max(s[key] for s in samples[-quarter:])
        if first and (end - first) / first > max_growth:
            problems.append(f"{key} grew {100 * (end - first) / first:.1f}% (> {max_growth:.0%})")
    return problems


def plot(samples: list[dict[str, float]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for key in (k for k in samples[0] if k.endswith("_rss_bytes")):
        axes[0].plot(t, [s[key] / 2**20 for s in samples], label=key.removesuffix("_rss_bytes"))
    axes[0].set_ylabel("RSS (MiB)")
    for key in (k for k in samples[0] if k.endswith("_held_blocks")):
        axes[1].plot(t, [s[key] for s in samples], label=key)
    axes[1].set_ylabel("held blocks (pins + reservations)")
    for key in (k for k in samples[0] if k.endswith("_free_blocks")):
        axes[2].plot(t, [s[key] for s in samples], label=key)
    axes[2].set_ylabel("free blocks")
    axes[2].set_xlabel("time (s)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--limit", type=int, default=10_000)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--kv-blocks", default="2048,1536,2048,1024")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--sample-s", type=float, default=1.0)
    parser.add_argument("--max-growth", type=float, default=0.05)
    parser.add_argument("--out", default="soak.png")
    parser.add_argument("--csv", default="")
    args = parser.parse_args()
    samples = asyncio.run(soak(args))
    plot(samples, args.out)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(samples[-1]))
            writer.writeheader()
            writer.writerows(samples)
    problems = check_flat(samples, args.max_growth)
    print("flat at the end" if not problems else "NOT flat: " + "; ".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
