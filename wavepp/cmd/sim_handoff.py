"""``wavepp sim --handoff``: wave mode without and with every stage handing its layers' KV to a
decode instance over a modelled link (``wavepp.runtime.stage.handoff_model``), side by side.

    wavepp sim --handoff --model glm-5.2 --stages 8 --concurrency 128 --reuse high

Columns: prefill throughput (prompt tokens/s) and TTFT without / with the handoff and their
ratio; the handoff's p50 / p99 seconds from a request's first token to its last byte landed
from every stage; the fraction of bytes landed by the first token (overlapped with the
prefill); the busiest stage link's load (link seconds needed / window: above 1 the link bounds
throughput); the largest share of a stage's KV pool the handoff's leases held at once; prompt
tokens per second until the last byte reached decode.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from wavepp.cmd.common import finite_float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--handoff`` and its link's flags (defaults: ``planning.handoff_cost.H200_RDMA``)."""
    group = parser.add_argument_group(
        "KV handoff to a decode instance (wave mode without vs with; "
        "wavepp.runtime.planning.handoff_cost)"
    )
    group.add_argument(
        "--handoff",
        action="store_true",
        help="compare wave mode without and with the KV handoff instead of wave vs sync",
    )
    group.add_argument(
        "--handoff-gbps",
        type=finite_float,
        default=None,
        help="link line rate per GPU, Gb/s (default 400: one 400 Gb/s NIC per H200, HGX H200)",
    )
    group.add_argument(
        "--handoff-efficiency",
        type=finite_float,
        default=None,
        help="achieved fraction of the line rate, (0, 1] (default 0.9)",
    )
    group.add_argument(
        "--handoff-latency-s",
        type=finite_float,
        default=None,
        help="fixed seconds per transfer, not occupying the link (default 1e-05)",
    )


def run_handoff(
    args: argparse.Namespace,
    plan: Any,
    workload_of: Callable[[int, Any], Any],
) -> list[dict[str, Any]]:
    """Run every concurrency of ``plan`` (a ``launch.sim.SimPlan``) in wave mode without and
    with the handoff; print the table (stderr with ``--json``).

    Args:
        args: the parsed flags.
        plan: the resolved simulation.
        workload_of: (num_requests, config) -> the workload ``wavepp sim`` runs.

    Returns:
        The JSON results, one entry per concurrency.

    Raises:
        FlagError: a refused link flag or setting, naming the flag.
    """
    from wavepp.launch.handoff import plan_handoff
    from wavepp.sim.run import simulate

    config, _ = plan.config(plan.concurrencies[0], "wave")
    handoff = plan_handoff(args, model=plan.model, config=config)
    assert handoff is not None, "run_handoff runs with --handoff"
    out = sys.stderr if args.json else sys.stdout
    print(
        f"handoff link: {handoff.link.name}, {handoff.link.gbps_per_gpu:g} Gb/s x "
        f"{handoff.link.efficiency:g} per GPU, {handoff.stages[0].num_gpus} GPU(s) per stage, "
        f"{handoff.link.latency_s * 1e6:g} us per transfer; bytes per token per stage "
        f"{[round(s.kv_bytes_per_token) for s in handoff.stages]}, per request "
        f"{[round(s.state_bytes_per_request) for s in handoff.stages]}",
        file=out,
    )
    print(
        "| model | S | C | reuse | prompt tokens | tok/s without | tok/s with | ratio | "
        "TTFT p50 without/with (s) | TTFT p99 without/with (s) | handoff p50/p99 (ms) | "
        "overlapped | link load max | peak leased KV | tok/s to decode |\n"
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- | ---: | ---: "
        "| ---: | ---: |",
        file=out,
    )
    results = []
    for concurrency in plan.concurrencies:
        config, planner_cost = plan.config(concurrency, "wave")
        workload = workload_of(args.requests or 32 * concurrency, config)
        summaries = {}
        for name, model in (("without", None), ("with", handoff)):
            report = simulate(
                config,
                planner_cost,
                workload,
                concurrency=concurrency,
                latencies=plan.latencies,
                handoff=model,
            )
            summaries[name] = report.summary()
        off, on = summaries["without"], summaries["with"]
        figures = on["handoff"]
        peak_leased = max(
            blocks / capacity
            for blocks, capacity in zip(
                figures["peak_leased_blocks"], on["kv_blocks_per_stage"], strict=True
            )
        )
        ratio = on["throughput_tokens_per_s"] / max(off["throughput_tokens_per_s"], 1e-9)
        print(
            f"| {plan.model} | {config.num_stages} | {concurrency} | {plan.reuse} | "
            f"{len(workload.prompts[0])} | {off['throughput_tokens_per_s']:.0f} | "
            f"{on['throughput_tokens_per_s']:.0f} | **{ratio:.3f}** | "
            f"{off['ttft_p50_s']:.3f}/{on['ttft_p50_s']:.3f} | "
            f"{off['ttft_p99_s']:.3f}/{on['ttft_p99_s']:.3f} | "
            f"{figures['handoff_s_p50'] * 1e3:.2f}/{figures['handoff_s_p99'] * 1e3:.2f} | "
            f"{figures['overlapped_fraction']:.2f} | {max(figures['link_load']):.2f} | "
            f"{peak_leased:.3f} | "
            f"{on['prompt_tokens'] / figures['handoff_window_s']:.0f} |",
            file=out,
            flush=True,
        )
        results.append(
            {
                "concurrency": concurrency,
                "throughput_ratio": round(ratio, 4),
                "handoff_link": {
                    "gbps_per_gpu": handoff.link.gbps_per_gpu,
                    "efficiency": handoff.link.efficiency,
                    "latency_s": handoff.link.latency_s,
                    "gpus_per_stage": handoff.stages[0].num_gpus,
                },
                "kv_bytes_per_token_per_stage": [s.kv_bytes_per_token for s in handoff.stages],
                **summaries,
            }
        )
    return results
