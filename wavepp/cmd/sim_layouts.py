"""``wavepp sim --parallel`` / ``--recommend``: PP wave and sync against TP, TEP, EP and PP x TP
replicas of the same GPUs on the discrete-event simulator (``launch.sim_layouts`` resolves the
flags; ``wavepp.sim.run.simulate`` runs the real scheduler, planner and KV pools).

    wavepp sim --model glm-5.2 --parallel pp8-wave,pp8-sync,tp8,tep8,pp4xtp2 --concurrency 8,64
    wavepp sim --model minimax-m2.7 --recommend --gpus 8 --concurrency 32 --reuse high

With ``--json`` stdout holds one JSON list, one row per layout and concurrency: ``parallel``,
``gpus``, ``throughput_tokens_per_s``, ``ttft_p50_s``, ``ttft_p99_s``, ``bound_tokens_per_s``,
``efficiency`` (throughput / the layout's own physical bound), ``baseline_budget`` (the sync
layouts' budget accounting: ``exact`` unless ``--baseline-budget`` says otherwise), plus the
setting and, with ``--recommend``, ``rank`` (1 = highest throughput at that concurrency).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from wavepp.cmd.common import fail

ROW_KEYS = (
    "requests",
    "completed",
    "failed",
    "throughput_tokens_per_s",
    "bound_tokens_per_s",
    "efficiency",
    "ttft_p50_s",
    "ttft_p99_s",
    "cache_hit_ratio",
    "wave_fill",
    "microbatches",
)


def run_layouts(args: argparse.Namespace) -> int:
    from wavepp.bench.workloads import preset_workload
    from wavepp.launch.sim_layouts import plan_layouts
    from wavepp.sim.run import simulate

    if args.gpus is not None and not (args.recommend and args.parallel is None):
        return fail(
            "sim", "--gpus", "only with --recommend and without --parallel (layouts name theirs)"
        )
    if args.recommend and args.gpus is None:
        args = argparse.Namespace(**{**vars(args), "gpus": 8})
    plan = plan_layouts(args)
    sim = plan.sim
    for layout, reason in plan.refused:
        print(f"refused {layout.label}: {reason}", file=sys.stderr)
    for layout in plan.layouts:
        print(
            f"{layout.label}: {layout.describe()}, {layout.num_gpus} GPUs, KV blocks per stage "
            f"{plan.kv_blocks[layout.label]}",
            file=sys.stderr,
        )
    budget = sim.baseline_fields["budget_accounting"]
    print(f"baseline budget (sync layouts): {budget}", file=sys.stderr)
    table_out = sys.stderr if args.json else sys.stdout
    print(
        "| model | parallel | GPUs | C | reuse | prompt tokens | tok/s | bound tok/s | "
        "efficiency | TTFT p50 (s) | TTFT p99 (s) | hit ratio |\n"
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        file=table_out,
    )
    rows: list[dict[str, Any]] = []
    for concurrency in sim.concurrencies:
        num_requests = args.requests or 32 * concurrency
        for layout in plan.layouts:
            setting = plan.run(layout, concurrency)
            workload = preset_workload(
                sim.reuse,
                num_requests,
                vocab_size=setting.config.model.vocab_size,
                prompt_tokens=args.prompt_tokens,
            )
            report = simulate(
                setting.config,
                setting.planner_cost,
                workload,
                concurrency=concurrency,
                stage_cost_models=setting.stage_cost_models,
                latencies=sim.latencies,
            )
            summary = report.summary()
            row = {
                "model": sim.model,
                "parallel": layout.label,
                "layout": layout.describe(),
                "gpus": layout.num_gpus,
                "stages": layout.num_stages,
                "group": layout.group,
                "group_size": layout.group_size,
                "mode": layout.mode,
                "concurrency": concurrency,
                "reuse": sim.reuse,
                "prompt_tokens": len(workload.prompts[0]),
                "kv_blocks_per_stage": plan.kv_blocks[layout.label],
                "baseline_budget": budget,
                **{key: summary[key] for key in ROW_KEYS},
            }
            rows.append(row)
            print(
                f"| {sim.model} | {layout.label} | {layout.num_gpus} | {concurrency} | "
                f"{sim.reuse} | {row['prompt_tokens']} | {row['throughput_tokens_per_s']:.0f} | "
                f"{row['bound_tokens_per_s'] or 0:.0f} | {row['efficiency'] or 0:.2f} | "
                f"{row['ttft_p50_s']:.3f} | {row['ttft_p99_s']:.3f} | "
                f"{row['cache_hit_ratio']:.2f} |",
                file=table_out,
                flush=True,
            )
    if args.recommend:
        _print_ranking(rows, sim.concurrencies, table_out)
    if args.json:
        print(json.dumps(rows))
    return 0


def _print_ranking(rows: list[dict[str, Any]], concurrencies: list[int], out: Any) -> None:
    """Rank each concurrency's rows by throughput (ties: lower TTFT p50); sets ``rank``."""
    for concurrency in concurrencies:
        ranked = sorted(
            (row for row in rows if row["concurrency"] == concurrency),
            key=lambda row: (-row["throughput_tokens_per_s"], row["ttft_p50_s"]),
        )
        print(
            f"\nC = {concurrency}: layouts ranked by throughput\n"
            "| rank | parallel | layout | tok/s | TTFT p50 (s) | TTFT p99 (s) | efficiency |\n"
            "| ---: | --- | --- | ---: | ---: | ---: | ---: |",
            file=out,
        )
        for rank, row in enumerate(ranked, start=1):
            row["rank"] = rank
            print(
                f"| {rank} | {row['parallel']} | {row['layout']} | "
                f"{row['throughput_tokens_per_s']:.0f} | {row['ttft_p50_s']:.3f} | "
                f"{row['ttft_p99_s']:.3f} | {row['efficiency'] or 0:.2f} |",
                file=out,
            )
        fastest = min(ranked, key=lambda row: row["ttft_p50_s"])
        print(f"lowest TTFT p50: {fastest['parallel']} ({fastest['ttft_p50_s']:.3f} s)", file=out)
