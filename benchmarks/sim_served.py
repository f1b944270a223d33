"""The served two-stage replica of ``engine_vs_hf.py``'s ``pipeline-2`` side, simulated.

How even the closed loop's micro-batches are, and what that costs, on a virtual clock: the
runtime's scheduler, planner, agreement and KV managers (``wavepp.sim``) serve the replica
``engine_vs_hf.py --stages 2 --threads 2 --concurrency C`` builds (``bench_spec``,
``runtime_config_of``: S + 1 micro-batches in flight, blocks of 32 tokens), the planner on the
packaged planner cost model (``planner_cost_model``), each stage sleeping ``--stage-scale`` x
that model (the default: the seeded torch stages' time over it, docs/bench/engine.md). Each
``--runs`` entry ``NxC`` replays the first N records of the in-repo Mooncake trace, 16 tokens
per trace block (tokens seeded as ``engine_vs_hf.py``'s first timed pass; its warm-up's first 4 prompts
first), closed loop at C. ``--shift NxC`` adds a workload shift: N prompts of
``--short-tokens`` then N of ``--long-tokens`` (seeded random tokens, no reuse), closed loop at C
on ``--shift-model``'s low-reuse setting of the simulator sweep on two stages (``launch.grid``:
its derived H200 cost on the stages and the planner) with a way back (``return_microbatches``
1, as a served replica): on the served replica's model the fixed cost per micro-batch is small
next to a short prompt's work, so a shift has little to show there.

Per run: efficiency (prompt tokens per second / the physical bound of the stages' model,
docs/bench/bound.md), stage 0's micro-batches (count, new tokens min-max and coefficient of
variation, population standard deviation / mean), the most costly micro-batch over the median
one (stage 0's execute seconds, past the first 2 and before the last 4 micro-batches: neither
the ramp-up nor the drain), the fixed cost's share of stage 0's busy time (micro-batches x c /
busy seconds), TTFT p50 and p99 (virtual seconds). For ``--shift``, the micro-batches stage 0
started after the first long prompt arrived: their count, fixed share, and the fixed share of
the first ``--shift-window`` of them.

    python benchmarks/sim_served.py                                  # 300x8,300x32,100x8
    python benchmarks/sim_served.py --runs 64x8 --shift 300x8 --json

This is a benchmark, not a test: it measures and prints; it asserts nothing. Last line with
``--json``: one JSON object of every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_vs_hf import build_parser, model_config  # noqa: E402
from pipeline_sides import bench_spec, runtime_config_of  # noqa: E402

from wavepp.bench.grid import GridSpec, Setting  # noqa: E402
from wavepp.bench.vllm_args import DEFAULT_TRACE  # noqa: E402
from wavepp.bench.workloads import Workload, mooncake_workload  # noqa: E402
from wavepp.launch.grid import runtime_config  # noqa: E402
from wavepp.launch.replica import planner_cost_model  # noqa: E402
from wavepp.runtime.planning import CostModel  # noqa: E402
from wavepp.sim.bus import SimLatencies  # noqa: E402
from wavepp.sim.run import simulate  # noqa: E402

RAMP_UP, DRAIN = 2, 4  # micro-batches left out of the cost spread at each end


def _served_config(concurrency: int, longest: int) -> tuple[Any, Any, Any]:
    """The ``pipeline-2`` side's RuntimeConfig for prompts of at most ``longest`` tokens at
    ``concurrency`` (``engine_vs_hf.bench_spec`` from its own parser's defaults), the planner's
    cost model, and the stages' (``--stage-scale`` x the planner's)."""
    args = build_parser().parse_args(
        ["--stages", "2", "--threads", "2", "--concurrency", str(concurrency), "--no-hf"]
    )
    args.longest = longest
    config = runtime_config_of(bench_spec(args, model_config(args.dtype), 2))
    planner_cost = planner_cost_model(config)
    return config, planner_cost, planner_cost.scaled(ARGS.stage_scale)


def _grid_config(concurrency: int) -> tuple[Any, Any, Any]:
    """``--shift-model``'s low-reuse wave setting on two stages (``launch.grid``), with a way
    back (``return_microbatches`` 1, as served replicas count): its RuntimeConfig, the
    planner's cost model, and the stages' (the config's, x its time scale)."""
    config, planner_cost = runtime_config(
        GridSpec(time_scale=1.0, num_stages=2),
        Setting(ARGS.shift_model, concurrency, "low", "wave"),
    )
    config = config.model_copy(update={"return_microbatches": 1})
    return config, planner_cost, CostModel.from_dict(config.cost_model).scaled(config.time_scale)


def _trace_workload(num_requests: int, vocab_size: int) -> Workload:
    """``engine_vs_hf.py``'s first timed pass: the trace's first records, token seed 1, after
    the warm-up's first 4 prompts (token seed 0)."""
    warmup = mooncake_workload(DEFAULT_TRACE, num_requests, tokens_per_block=16, seed=0,
                               vocab_size=vocab_size)  # fmt: skip
    timed = mooncake_workload(DEFAULT_TRACE, num_requests, tokens_per_block=16, seed=1,
                              vocab_size=vocab_size)  # fmt: skip
    return dataclasses.replace(timed, warmup=warmup.prompts[:4])


def _shift_workload(num_each: int, short: int, long: int, vocab_size: int) -> Workload:
    """``num_each`` prompts of ``short`` tokens, then ``num_each`` of ``long`` (seeded random
    tokens: no prefix shared)."""
    rng = random.Random(0)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(n)]
        for n in [short] * num_each + [long] * num_each
    ]
    return Workload(
        name=f"shift {num_each} x {short} -> {num_each} x {long}",
        prompts=prompts,
        request_ids=[f"shift-{i}" for i in range(len(prompts))],
    )


def _cv(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return round(statistics.pstdev(values) / mean, 3) if mean else 0.0


def _fixed_share(spans: list[Any], fixed_s: float) -> float:
    busy = sum(s.execute_end_s - s.execute_start_s for s in spans)
    return round(len(spans) * fixed_s / busy, 3) if busy else 0.0


def run_one(configs: tuple[Any, Any, Any], workload: Workload, concurrency: int) -> dict:
    """Simulate ``workload`` closed loop at ``concurrency`` on ``configs`` (RuntimeConfig,
    planner and stage cost models; the scheduler's host time ``--schedule-ms`` per
    micro-batch); the figures the module docstring lists."""
    config, planner_cost, stage_cost = configs
    started = time.monotonic()
    report = simulate(
        config,
        planner_cost,
        workload,
        concurrency=concurrency,
        stage_cost_models=[stage_cost] * config.num_stages,
        latencies=SimLatencies(schedule_s=ARGS.schedule_ms / 1e3),
    )
    summary = report.summary()
    spans = sorted((s for s in report.stats.spans if s.rank == 0), key=lambda s: s.execute_start_s)
    tokens = [s.num_tokens for s in spans]
    costs = [s.execute_end_s - s.execute_start_s for s in spans][RAMP_UP:-DRAIN]
    out = {
        "workload": workload.name,
        "requests": len(workload.prompts),
        "concurrency": concurrency,
        "max_inflight": config.resolved_max_inflight,
        "efficiency": summary["efficiency"],
        "microbatches": len(spans),
        "tokens_mean": round(statistics.fmean(tokens), 1),
        "tokens_min_max": [min(tokens), max(tokens)],
        "tokens_cv": _cv(tokens),
        "max_over_median_cost": round(max(costs) / statistics.median(costs), 2),
        "fixed_share": _fixed_share(spans, stage_cost.c),
        "ttft_p50_s": summary["ttft_p50_s"],
        "ttft_p99_s": summary["ttft_p99_s"],
        "sim_wall_s": round(time.monotonic() - started, 1),
    }
    if workload.name.startswith("shift"):
        first_long_s = min(
            o.arrival_s for o in report.outcomes if o.num_prompt_tokens == ARGS.long_tokens
        )
        after = [s for s in spans if s.execute_start_s >= first_long_s]
        out["after_shift"] = {
            "microbatches": len(after),
            "fixed_share": _fixed_share(after, stage_cost.c),
            f"fixed_share_first_{ARGS.shift_window}": _fixed_share(
                after[: ARGS.shift_window], stage_cost.c
            ),
        }
    return out


def _pairs(flag: str, text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: comma-separated NxC, N and C >= 1")
    return pairs  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs",
        type=lambda t: _pairs("--runs", t),
        default=[(300, 8), (300, 32), (100, 8)],
        help="trace runs, e.g. 300x8,100x8: N records at concurrency C; default: %(default)s",
    )
    parser.add_argument(
        "--shift",
        type=lambda t: _pairs("--shift", t),
        default=[],
        help="shift runs NxC: N short prompts then N long ones at C; default: none",
    )
    parser.add_argument(
        "--shift-model", default="minimax-m2.7", help="the shift runs' model; default: %(default)s"
    )
    parser.add_argument("--short-tokens", type=int, default=512, help="default: %(default)s")
    parser.add_argument("--long-tokens", type=int, default=8192, help="default: %(default)s")
    parser.add_argument(
        "--shift-window",
        type=int,
        default=64,
        help="micro-batches after the shift whose fixed share is reported; default: %(default)s",
    )
    parser.add_argument(
        "--stage-scale",
        type=float,
        default=45.0,
        help="stage seconds / planner-model seconds; default: %(default)s",
    )
    parser.add_argument(
        "--schedule-ms",
        type=float,
        default=1.65,
        help="the scheduler's host time per micro-batch (as sim_sweep.py's); default: %(default)s",
    )
    parser.add_argument("--json", action="store_true", help="last line: every figure as JSON")
    global ARGS
    ARGS = args = parser.parse_args(argv)
    for flag, value in (("--short-tokens", args.short_tokens), ("--long-tokens", args.long_tokens),
                        ("--shift-window", args.shift_window)):  # fmt: skip
        if value < 1:
            parser.error(f"{flag} {value}: must be >= 1")
    if args.short_tokens >= args.long_tokens:
        parser.error(f"--short-tokens {args.short_tokens}: must be < --long-tokens")
    if args.stage_scale <= 0 or args.schedule_ms < 0:
        parser.error(f"--stage-scale {args.stage_scale} must be > 0, --schedule-ms >= 0")
    result: dict[str, Any] = {"load_avg_1m": os.getloadavg()[0], "runs": []}
    print(
        f"load avg {result['load_avg_1m']:.1f}; served: stages sleep {args.stage_scale} x the "
        f"planner's model; shift: {args.shift_model} low, 2 stages, r = 1"
    )
    print("| workload | N, C | efficiency | micro-batches | tokens min-max | tokens CV | "
          "max / median cost | fixed share | TTFT p50 / p99 s |")  # fmt: skip
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for kind, num, concurrency in [("trace", n, c) for n, c in args.runs] + [
        ("shift", n, c) for n, c in args.shift
    ]:
        if kind == "trace":
            vocab_size = _served_config(concurrency, 32)[0].model.vocab_size
            workload = _trace_workload(num, vocab_size)
            longest = max(len(p) for p in [*workload.prompts, *workload.warmup])
            configs = _served_config(concurrency, longest)
        else:
            configs = _grid_config(concurrency)
            vocab_size = configs[0].model.vocab_size
            workload = _shift_workload(num, args.short_tokens, args.long_tokens, vocab_size)
        out = run_one(configs, workload, concurrency)
        result["runs"].append(out)
        lo, hi = out["tokens_min_max"]
        print(
            f"| {kind} | {num}, {concurrency} | {out['efficiency']:.3f} | "
            f"{out['microbatches']} | {lo:,}-{hi:,} | {out['tokens_cv']:.2f} | "
            f"{out['max_over_median_cost']:.2f} | {out['fixed_share']:.3f} | "
            f"{out['ttft_p50_s']:.2f} / {out['ttft_p99_s']:.2f} |",
            flush=True,
        )
        if "after_shift" in out:
            print(f"  after the shift: {json.dumps(out['after_shift'])}", flush=True)
    result["load_avg_1m_end"] = os.getloadavg()[0]
    print(f"load avg end {result['load_avg_1m_end']:.1f}")
    if args.json:
        print(json.dumps(result))
    return 0


ARGS: argparse.Namespace

if __name__ == "__main__":
    raise SystemExit(main())
