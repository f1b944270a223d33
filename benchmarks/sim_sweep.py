"""The simulator sweep at H200 time: wave and sync against the physical bound, per setting.

Models x reuse x stages x concurrency, block 64, closed loop at C with ``--requests-per-c`` x C
requests (32 by default, so ramp-up and drain weigh little), the derived H200 cost of each
model's slowest stage x ``--time-scale``, KV capacity per stage derived from the model and the
H200 (``planning.memory``). Stages, NATS and activations are simulated (virtual clock; KV RTT
1 ms, plan/done 0.5 ms, activation hop 0.2 ms); the scheduler, planner, agreement and KV
managers are the runtime's own objects. Each cell: efficiency wave/sync (throughput / the
physical bound, docs/bench/bound.md) and the ratio wave/sync.

    python benchmarks/sim_sweep.py                 # the whole sweep (about 20 min on 2 cores)
    python benchmarks/sim_sweep.py --stages 4 --concurrency 8,32,128

This is a benchmark, not a test: it measures and prints a Markdown table; it asserts nothing.
"""

from __future__ import annotations

import argparse
import time

from wavepp.bench.grid import GridSpec, Setting
from wavepp.bench.workloads import preset_workload
from wavepp.launch.grid import runtime_config
from wavepp.sim.bus import SimLatencies
from wavepp.sim.run import simulate


def _run(model: str, stages: int, reuse: str, concurrency: int, mode: str, per_c: int) -> dict:
    spec = GridSpec(time_scale=ARGS.time_scale, num_stages=stages)
    config, planner_cost = runtime_config(spec, Setting(model, concurrency, reuse, mode))
    config = config.model_copy(
        update={
            "baseline": config.baseline.model_copy(
                update={
                    "budget_accounting": ARGS.baseline_budget,
                    "iteration_overhead_s": ARGS.baseline_overhead_ms / 1e3,
                }
            ),
        }
    )
    workload = preset_workload(reuse, per_c * concurrency, vocab_size=config.model.vocab_size)
    latencies = SimLatencies(schedule_s=ARGS.schedule_ms / 1e3)
    return simulate(
        config, planner_cost, workload, concurrency=concurrency, latencies=latencies
    ).summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, default=1.0, help="default: %(default)s")
    parser.add_argument(
        "--decimals", type=int, default=2, help="digits of each efficiency; default: %(default)s"
    )
    parser.add_argument("--models", default="glm-5.2,minimax-m2.7", help="default: %(default)s")
    parser.add_argument("--stages", default="4,8", help="default: %(default)s")
    parser.add_argument(
        "--concurrency", default="1,2,4,8,16,32,64,128,256", help="default: %(default)s"
    )
    parser.add_argument("--reuse", default="low,high", help="default: %(default)s")
    parser.add_argument(
        "--requests-per-c", type=int, default=32, help="requests per cell / C; default: %(default)s"
    )
    parser.add_argument(
        "--schedule-ms",
        type=float,
        default=1.65,
        help="the scheduler's host time per micro-batch, both modes (measured on this machine); "
        "default: %(default)s",
    )
    parser.add_argument(
        "--baseline-budget",
        choices=("none", "estimated", "exact"),
        default="none",
        help="sync mode's token-budget accounting (docs/bench/baseline.md); default: %(default)s",
    )
    parser.add_argument(
        "--baseline-overhead-ms",
        type=float,
        default=5.0,
        help="sync mode's host loop per iteration (docs/bench/baseline.md); default: %(default)s",
    )
    global ARGS
    ARGS = parser.parse_args()
    concurrencies = [int(c) for c in ARGS.concurrency.split(",")]
    started = time.monotonic()
    print(
        f"Simulator, time scale {ARGS.time_scale}, {ARGS.requests_per_c} x C requests per cell, "
        f"scheduler host time {ARGS.schedule_ms} ms per micro-batch (both modes); baseline: "
        f"budget accounting {ARGS.baseline_budget}, host loop {ARGS.baseline_overhead_ms} ms, one "
        "chunk per request in flight, lockstep admission. Cells: efficiency wave/sync "
        "(throughput / physical bound), and the ratio wave/sync\n"
    )
    print("| model | reuse | S | " + " | ".join(f"C={c}" for c in concurrencies) + " |")
    print("| --- | --- | ---: | " + " | ".join("---" for _ in concurrencies) + " |")
    num_cells = num_at_bound = num_wave_ge_sync = 0
    worst = (2.0, "")
    for model in ARGS.models.split(","):
        for reuse in ARGS.reuse.split(","):
            for stages in (int(s) for s in ARGS.stages.split(",")):
                cells = []
                for concurrency in concurrencies:
                    wave, sync = (
                        _run(model, stages, reuse, concurrency, mode, ARGS.requests_per_c)
                        for mode in ("wave", "sync")
                    )
                    ratio = wave["throughput_tokens_per_s"] / sync["throughput_tokens_per_s"]
                    num_wave_ge_sync += round(ratio, 2) >= 1.0
                    if concurrency >= stages:
                        num_cells += 1
                        num_at_bound += wave["efficiency"] >= 0.95
                        label = f"{model} {reuse} S={stages} C={concurrency}"
                        worst = min(worst, (wave["efficiency"], label))
                    digits = ARGS.decimals
                    cells.append(
                        f"{wave['efficiency']:.{digits}f}/{sync['efficiency']:.{digits}f} x{ratio:.2f}"
                    )
                print(f"| {model} | {reuse} | {stages} | " + " | ".join(cells) + " |", flush=True)
    total = (
        len(ARGS.models.split(","))
        * len(ARGS.reuse.split(","))
        * len(ARGS.stages.split(","))
        * len(concurrencies)
    )
    print(
        f"\nC >= S: wave efficiency >= 0.95 in {num_at_bound} of {num_cells} cells "
        f"(lowest {worst[0]:.3f}, {worst[1]}); wave >= sync (at two decimals) in "
        f"{num_wave_ge_sync} of {total} cells. {time.monotonic() - started:.0f} s."
    )


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
