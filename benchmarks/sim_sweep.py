"""The grid's settings on the simulator (virtual clock), wave / sync at a chosen time scale.

Same settings as ``wavepp bench grid`` (models x concurrency x reuse, 4 stages, block 64,
8192-token chunks, max(64, 2 C) requests per setting, closed loop at C), but stages, NATS and
activations are simulated: no CPU overhead, only the derived H200 cost (x time scale) and the
simulated latencies (KV RTT 1 ms, plan/done 0.5 ms, activation hop 0.2 ms). At time scale 1 the
ratios are those of H200 time; at 0.1 they are comparable with the emulated grid.

    python benchmarks/sim_sweep.py --time-scale 1

This is a benchmark, not a test: it measures and prints a Markdown table; it asserts nothing.
"""

from __future__ import annotations

import argparse

from wavepp.bench.grid import GridSpec, Setting, runtime_config
from wavepp.bench.workloads import preset_workload
from wavepp.sim.run import simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--models", default="glm-5.2,minimax-m2.7")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--reuse", default="low,high")
    args = parser.parse_args()
    spec = GridSpec(time_scale=args.time_scale)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    print(f"Simulator, time scale {args.time_scale}: wave / sync throughput (ratio)\n")
    print("| model | reuse | " + " | ".join(f"C={c}" for c in concurrencies) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in concurrencies) + " |")
    wins = ties = total = 0
    for model in args.models.split(","):
        for reuse in args.reuse.split(","):
            cells = []
            for concurrency in concurrencies:
                throughput = {}
                for mode in ("wave", "sync"):
                    config, planner_cost = runtime_config(
                        spec, Setting(model, concurrency, reuse, mode)
                    )
                    workload = preset_workload(
                        reuse, max(64, 2 * concurrency), vocab_size=config.model.vocab_size
                    )
                    report = simulate(config, planner_cost, workload, concurrency=concurrency)
                    throughput[mode] = report.summary()["throughput_tokens_per_s"]
                ratio = throughput["wave"] / throughput["sync"]
                wins += round(ratio, 2) > 1.0
                ties += round(ratio, 2) == 1.0
                total += 1
                cells.append(f"{ratio:.2f}")
            print(f"| {model} | {reuse} | " + " | ".join(cells) + " |", flush=True)
    print(
        f"\nwave > sync (ratio > 1.00 at two decimals) in {wins} of {total} settings; "
        f"{ties} equal at two decimals; {total - wins - ties} below"
    )


if __name__ == "__main__":
    main()
