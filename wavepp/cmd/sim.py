"""``wavepp sim``: wave vs sync on the discrete-event simulator (virtual clock).

The real scheduler, agreement controller, planner and per-stage BlockPools run; stages, NATS and
activations are simulated (``wavepp.sim.pipeline``). For settings too big or too slow to run in
real time: PP 8, long contexts, time scale 1.

    wavepp sim --model glm-5.2 --stages 8 --concurrency 32,128 --reuse high --prompt-tokens 32768
"""

from __future__ import annotations

import argparse
import json
import sys

from wavepp.cmd import sim_handoff
from wavepp.cmd.common import finite_float

BARE_IS_USAGE = [()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="glm-5.2", help="derived H200 cost model")
    parser.add_argument(
        "--stages",
        type=int,
        default=None,
        help="pipeline stages S (default 4; not with --parallel)",
    )
    parser.add_argument(
        "--concurrency", default="128", help="closed-loop requests in flight, comma-separated"
    )
    parser.add_argument(
        "--reuse",
        choices=["low", "high", "agentic", "chat"],
        default="high",
        help="workload preset (bench.workloads.REUSE_PRESETS)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="scale the reuse preset to this prompt length (default 0: the preset's 4096)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        help="requests per setting; default: 32 x concurrency (few rounds let ramp-up and "
        "drain dominate the comparison: docs/bench/bound.md)",
    )
    parser.add_argument(
        "--time-scale",
        type=finite_float,
        default=1.0,
        help="stage time multiplier (1.0 = H200 time)",
    )
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV capacity per stage in blocks (default: derived per stage from --model's "
        "weights, activations of the largest micro-batch and KV bytes per token at H200 memory, 141 GB x "
        "0.9; wavepp.runtime.planning.memory)",
    )
    parser.add_argument(
        "--chunk-tokens", type=int, default=8192, help="static chunk budget (baseline), tokens"
    )
    parser.add_argument("--kv-rtt-ms", type=finite_float, default=1.0, help="KV request-reply RTT")
    parser.add_argument(
        "--bus-ms", type=finite_float, default=0.5, help="plan/done publish latency"
    )
    parser.add_argument("--hop-ms", type=finite_float, default=0.2, help="activation hop latency")
    parser.add_argument(
        "--schedule-ms",
        type=finite_float,
        default=1.65,
        help="scheduler host time per micro-batch on the critical path, both modes (default "
        "%(default)s: its mean measured on this machine, replay JSON scheduler_host_ms_mean)",
    )
    baseline = parser.add_argument_group(
        "baseline (--mode sync) fidelity, docs/bench/baseline.md; wave mode ignores these"
    )
    baseline.add_argument(
        "--baseline-budget",
        choices=["none", "estimated", "exact"],
        default=None,
        help="what a first chunk is charged against --chunk-tokens before its cached prefix is "
        "known: none = the whole prompt (TRT-LLM before PR 11637), estimated = minus the prefix "
        "live requests hold (PR 11637 under MAX_UTILIZATION, before PR 15066), exact = new "
        "tokens only. Default (launch.sim): exact with --parallel / --recommend (the layout "
        "comparison: vLLM's and SGLang's schedulers count new tokens only, and a single-stage "
        "engine charged its cached tokens fits one request per chunk at high reuse); "
        "none for the wave vs sync pipeline comparison (the paper's TRT-LLM PP "
        "baseline; docs/bench/baseline.md)",
    )
    baseline.add_argument(
        "--baseline-overhead-ms",
        type=finite_float,
        default=5.0,
        help="TRT-LLM host loop per micro-batch (fetch, schedule, prepare resources and "
        "inputs), ms on the critical path; range 5/10/15 (default %(default)s)",
    )
    baseline.add_argument(
        "--baseline-one-chunk",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="at most one chunk of a request in flight (TRT-LLM _add_inflight_ids; default "
        "%(default)s)",
    )
    baseline.add_argument(
        "--baseline-lockstep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lockstep admission: no KV round trips, every stage the smallest capacity "
        "(default %(default)s)",
    )
    baseline.add_argument(
        "--baseline-prefix-reuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the prefix every stage holds (TRT-LLM enable_block_reuse); off: every "
        "request computes its whole prompt, as TRT-LLM's DSA cache manager requires for MLA + "
        "DSA models (PR 8405; default %(default)s)",
    )
    sim_handoff.add_arguments(parser)
    layouts = parser.add_argument_group(
        "layouts: PP wave/sync against TP, TEP, EP and PP x TP on the same GPUs "
        "(wavepp.runtime.planning.parallel; docs/bench/layouts.md)"
    )
    layouts.add_argument(
        "--parallel",
        default=None,
        help="comma-separated layouts, all of one GPU count: pp<S>[x<tp|tep|ep><t>][-wave|-sync] "
        "(a pipeline, default wave) or <tp|tep|ep><t> (one stage, chunked prefill at "
        "--chunk-tokens); e.g. pp8-wave,pp8-sync,tp8,tep8,pp4xtp2",
    )
    layouts.add_argument(
        "--recommend",
        action="store_true",
        help="rank layouts by throughput (TTFT beside): those of --parallel, or every layout of "
        "--gpus GPUs that holds the model",
    )
    layouts.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs of the replica for --recommend without --parallel (default 8)",
    )
    parser.add_argument(
        "--host-memory-gib",
        type=finite_float,
        default=0.0,
        help="host KV tier per GPU, GiB (0: none); capacity and load time derived from the "
        "model's KV bytes per token and PCIe 5.0 x16 (wavepp.launch.capacity)",
    )
    parser.add_argument(
        "--trace",
        default=None,
        help="replay this Mooncake trace (JSONL; --requests: its first N, default all) instead "
        "of --reuse; prints the trace's infinite-cache bound beside the cached fraction",
    )
    parser.add_argument(
        "--modes", default="wave,sync", help="modes run per concurrency (default %(default)s)"
    )
    parser.add_argument(
        "--json", action="store_true", help="stdout: the JSON results only (the table on stderr)"
    )


def run(args: argparse.Namespace) -> int:
    from wavepp.bench.workloads import ideal_hit_ratio, mooncake_workload, preset_workload
    from wavepp.launch.handoff import check_handoff_flags
    from wavepp.launch.sim import plan_sim
    from wavepp.sim.run import simulate

    if args.parallel is not None or args.recommend:
        from wavepp.cmd.sim_layouts import run_layouts

        return run_layouts(args)
    plan = plan_sim(args)
    check_handoff_flags(args)
    capacity, latencies, baseline_fields = plan.capacity, plan.latencies, plan.baseline_fields
    print(
        f"kv blocks per stage: {capacity.num_kv_blocks} ({capacity.kv_blocks_source})",
        file=sys.stderr,
    )
    print(
        f"host tier blocks per stage: {capacity.num_host_kv_blocks} ({capacity.host_source})",
        file=sys.stderr,
    )
    print(
        f"baseline (sync): {baseline_fields}; scheduler host time {latencies.schedule_s * 1e3:g} "
        f"ms per micro-batch (both modes); requests per setting: "
        f"{args.requests or '32 x C'} (docs/bench/bound.md: 32 x C keeps ramp-up and drain "
        "small)",
        file=sys.stderr,
    )

    def workload_of(num_requests: int, config):  # noqa: ANN001, ANN202 - a RuntimeConfig
        return preset_workload(
            args.reuse,
            num_requests,
            vocab_size=config.model.vocab_size,
            prompt_tokens=args.prompt_tokens,
        )

    if args.handoff:
        handoff_results = sim_handoff.run_handoff(args, plan, workload_of)
        if args.json:
            print(json.dumps(handoff_results))
        return 0
    results = []
    table_out = sys.stderr if args.json else sys.stdout  # --json: stdout holds JSON only
    print(
        "| model | S | C | reuse | prompt tokens | tok/s wave | tok/s sync | ratio | bound tok/s | "
        "efficiency wave/sync | TTFT p50 wave/sync (s) | wave fill wave/sync |\n"
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
        file=table_out,
    )
    bound = None
    for concurrency in plan.concurrencies:
        num_requests = args.requests or 32 * concurrency
        summaries = {}
        for mode in plan.modes:
            config, planner_cost = plan.config(concurrency, mode)
            if plan.trace is not None:
                workload = mooncake_workload(
                    plan.trace, args.requests or None, vocab_size=config.model.vocab_size
                )
                if bound is None:
                    bound = ideal_hit_ratio(workload.prompts, config.block_size)
            else:
                workload = workload_of(num_requests, config)
            report = simulate(
                config, planner_cost, workload, concurrency=concurrency, latencies=latencies
            )
            # the model simulated (its cost); the config's ModelConfig only shapes the tokens
            summaries[mode] = report.summary() | {"model": plan.model}
            if bound is not None:
                summary = summaries[mode]
                fraction = summary["cache_hit_ratio"]
                summary["infinite_cache_hit_ratio"] = round(bound, 4)
                print(
                    f"{mode} C={concurrency}: {summary['requests']} requests, cached fraction "
                    f"{fraction:.4f}, infinite-cache bound {bound:.4f} "
                    f"({fraction / bound if bound else 0.0:.3f} of it); host loads per stage {summary['host_loaded_blocks_per_stage']}",
                    file=sys.stderr,
                )
        if set(summaries) != {"wave", "sync"}:
            results.append({"concurrency": concurrency, "host": capacity.host_fields, **summaries})
            continue
        w, s = summaries["wave"], summaries["sync"]
        ratio = w["throughput_tokens_per_s"] / max(s["throughput_tokens_per_s"], 1e-9)
        print(
            f"| {args.model} | {plan.grid.num_stages} | {concurrency} | {args.reuse} | "
            f"{len(workload.prompts[0])} | {w['throughput_tokens_per_s']:.0f} | "
            f"{s['throughput_tokens_per_s']:.0f} | **{ratio:.2f}** | "
            f"{w['bound_tokens_per_s']:.0f} | {w['efficiency']:.2f}/{s['efficiency']:.2f} | "
            f"{w['ttft_p50_s']:.3f}/{s['ttft_p50_s']:.3f} | "
            f"{w['wave_fill']:.2f}/{s['wave_fill']:.2f} |",
            file=table_out,
            flush=True,
        )
        results.append(
            {
                "concurrency": concurrency,
                "ratio": round(ratio, 4),
                "kv_blocks_per_stage": capacity.num_kv_blocks,
                "kv_blocks_source": capacity.kv_blocks_source,
                "baseline": baseline_fields,
                "schedule_s": latencies.schedule_s,
                "host": capacity.host_fields,
                **summaries,
            }
        )
    if args.json:
        print(json.dumps(results))
    return 0
