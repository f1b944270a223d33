"""``wavepp replay TRACE``: replay a Mooncake trace through a local pipeline.

Starts its own nats-server and S stage processes, replays (closed loop at ``--concurrency``, or
at the trace's timestamps with ``--timed``), prints a progress bar (stderr) and the summary:
each number with its unit and meaning, and per stage the local hit against the agreed prefix
(``wavepp.bench.summary_text``); with ``--json`` stdout is one JSON object only (the replay
contract) and the tables go to stderr. ``--profile-stages``: each stage's loop profile per
micro-batch (``wavepp.runtime.stage.loop_profile``) as a table per stage, and in the JSON as
``stage_loop_profile``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

from wavepp.cmd.common import finite_float, progress_bar


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="Mooncake trace (JSON lines)")
    parser.add_argument("--limit", type=int, default=None, help="first N trace lines only")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages S")
    parser.add_argument(
        "--mode",
        choices=["wave", "sync"],
        default="wave",
        help="wave: WavePP; sync: the TensorRT-LLM-like baseline",
    )
    parser.add_argument(
        "--engine",
        choices=["torch", "emulated"],
        default="torch",
        help="torch: real layers on the CPU; emulated: sleep the --emulate cost model",
    )
    parser.add_argument(
        "--concurrency", type=int, default=32, help="closed-loop requests in flight"
    )
    parser.add_argument(
        "--tokens-per-block",
        type=int,
        default=512,
        help="tokens per trace hash id (512 = the trace's own; smaller scales prompts down)",
    )
    parser.add_argument(
        "--json", action="store_true", help="stdout: the summary JSON only (the table on stderr)"
    )
    parser.add_argument("--timed", action="store_true", help="arrive at the trace's timestamps")
    parser.add_argument(
        "--profile-stages",
        action="store_true",
        help="time each stage's loop per micro-batch (receive, prepare, engine pass, results, "
        "send, the rest; plan handling on the loop thread) and print it per stage "
        "(wavepp.runtime.stage.loop_profile)",
    )
    parser.add_argument(
        "--speedup", type=finite_float, default=1.0, help="with --timed: time compression"
    )
    parser.add_argument(
        "--model",
        default="tiny-llama",
        help="model preset (random torch weights), or a Hugging Face checkpoint directory "
        "(config.json + safetensors; torch engine: llama, deepseek_v3, glm_moe_dsa, minimax_m2, "
        "kimi_linear)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument(
        "--kv-blocks",
        default=None,
        help="KV capacity per stage in blocks: one number, or S comma-separated (unequal "
        "stages). Default: torch engine 4096; emulated engine derived per stage from --emulate's "
        "weights, activations of the largest micro-batch and KV bytes per token at H200 memory (141 GB x "
        "0.9; wavepp.runtime.planning.memory), 4096 for tiny-llama",
    )
    parser.add_argument(
        "--host-memory-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="host memory per GPU for each stage's host KV tier (0: none; spec "
        "cache.hostMemoryGiB): blocks from --emulate's KV bytes per token per GPU (an H200 "
        "model), else the model's KV bytes per token per layer x the stage's layers",
    )
    parser.add_argument(
        "--chunk-tokens", type=int, default=8192, help="static chunk budget (new tokens)"
    )
    parser.add_argument(
        "--emulate",
        default="glm-5.2",
        help="emulated engine: cost model of this model at H200 (see "
        "`wavepp.runtime.planning.catalogue`), or of a checkpoint directory's config.json",
    )
    parser.add_argument(
        "--time-scale", type=finite_float, default=1.0, help="emulated: sleep multiplier"
    )
    parser.add_argument(
        "--cost-model",
        default="",
        help="planner cost model JSON (calibrate --out; default: the emulated model's, or the "
        "packaged tiny-llama CPU fit)",
    )
    # ablations: each mechanism's switch, (wave's value, sync's value)
    for flag, (wave, sync) in (
        ("--chunk-policy", ("dynamic", "static")),
        ("--agreement", ("async", "sync")),
        ("--local-prepare", ("on", "off")),
    ):
        parser.add_argument(
            flag,
            choices=[wave, sync],
            default=None,
            help=f"ablation (default: from --mode: wave {wave}, sync {sync})",
        )
    parser.add_argument(
        "--max-inflight", type=int, default=None, help="micro-batches in flight (default: S)"
    )
    parser.add_argument("--seed", type=int, default=0, help="token mapping and weight seed")
    parser.add_argument("--cache-salt", default="", help="cache salt (tenant) of every request")
    parser.add_argument(
        "--state-interval-blocks",
        type=int,
        default=1,
        help="hybrid models (kimi_linear): keep the linear-attention state after every k-th "
        "block; the agreed prefix is a multiple of k blocks (default 1)",
    )
    telemetry = parser.add_argument_group("telemetry")
    telemetry.add_argument(
        "--trace-exporter",
        choices=["none", "console", "jsonl", "otlp-grpc", "otlp-http"],
        default=None,
        help="span exporter (default: none; jsonl when --trace-out or --timeline is given)",
    )
    telemetry.add_argument("--trace-out", default="", help="JSON-lines span file (all processes)")
    telemetry.add_argument("--otlp-endpoint", default="", help="OTLP collector endpoint")
    telemetry.add_argument(
        "--trace-sampling",
        type=finite_float,
        default=1.0,
        help="fraction of requests traced [0, 1]",
    )
    telemetry.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port"
    )
    telemetry.add_argument(
        "--timeline",
        default="",
        help="draw the per-stage timeline of micro-batches (from the spans) into this PNG",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from wavepp.bench.replay import replay_records
    from wavepp.bench.summary_text import clean_source, stage_rows, summary_rows
    from wavepp.bench.trace import load_trace
    from wavepp.launch.replay import plan_replay

    err = Console(stderr=True)
    plan = plan_replay(args)
    config, planner_model, mapper = plan.config, plan.planner_cost_model, plan.mapper
    capacity, model, telemetry = plan.capacity, config.model, config.telemetry
    profile_dir = ""
    if args.profile_stages:
        profile_dir = tempfile.mkdtemp(prefix="wavepp-stage-profile-")
        config = config.model_copy(update={"profile_dir": profile_dir})
    records, invalid = load_trace(args.trace, args.limit)
    for error in invalid:
        err.print(f"[yellow]skipped invalid trace line[/]: {error}")
    served = (
        f"{args.emulate} (emulated at H200 speed)"
        if args.engine == "emulated"
        else f"{model.name} ({model.num_layers} layers in all"
        + (f", split {config.partition}" if config.partition else "")
        + ")"
    )
    err.print(
        f"replaying {len(records)} requests: {served} on {config.num_stages} {config.engine} "
        f"stages, mode={config.mode}, {args.tokens_per_block} tokens per trace block, "
        f"block size {config.block_size} tokens, KV capacity {capacity.num_kv_blocks} blocks "
        f"per stage ({capacity.kv_blocks_source}), concurrency {args.concurrency}"
    )
    if any(config.num_host_kv_blocks):
        err.print(
            f"host KV tier: {config.num_host_kv_blocks} blocks per stage ({capacity.host_source})"
        )
    with progress_bar(err) as progress:
        task = progress.add_task("prefill", total=len(records))
        report = asyncio.run(
            replay_records(
                records,
                mapper,
                config,
                planner_model,
                concurrency=args.concurrency,
                timed=args.timed,
                speedup=args.speedup,
                invalid=invalid,
                on_outcome=lambda _o: progress.advance(task),
                cache_salt=args.cache_salt,
            )
        )
    summary = report.summary()
    if args.engine == "emulated":
        summary["model"] = args.emulate  # the torch preset only lends its vocabulary here
    summary["kv_blocks_source"] = clean_source(capacity.kv_blocks_source)
    summary["host_kv_blocks"] = list(config.num_host_kv_blocks)
    summary["planner_cost_model"] = clean_source(planner_model.source or planner_model.label)
    # NOTE: with --json, stdout holds the JSON line only; the tables go to stderr.
    out = err if args.json else Console()
    table = Table(title=f"wavepp replay: {Path(args.trace).name}")
    for column, justify in (("metric", "left"), ("value", "right"), ("meaning", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in summary_rows(summary):
        table.add_row(*row)
    out.print(table)
    stages = Table(title=f"per stage (blocks of {config.block_size} tokens, summed over requests)")
    for column in ("stage", "layers", "KV capacity", "local hit", "host hit", "agreed prefix",
                   "from host", "held, not shared", "busy (s)"):  # fmt: skip
        stages.add_column(column, justify="right")
    for row in stage_rows(summary):
        stages.add_row(*row)
    out.print(stages)
    out.print(
        "local hit: blocks of each prompt the stage held (host hit: those in its host tier); "
        "agreed prefix: the blocks every stage held (min over stages), the only ones reused "
        "(from host: loaded from that stage's host tier); held, not shared: recomputed "
        "although that stage had them (unequal --kv-blocks evict differently)."
    )
    if profile_dir:
        from wavepp.runtime.stage.loop_profile import loop_table, read_profiles

        profiles = read_profiles(profile_dir)
        shutil.rmtree(profile_dir, ignore_errors=True)
        summary["stage_loop_profile"] = profiles
        for profile in profiles:
            out.print(
                f"stage {profile['rank']} loop profile ({profile['microbatches']} micro-batches; "
                "other = wall - parts):"
            )
            if profile["microbatches"]:
                out.print("\n".join(loop_table(profile)), highlight=False)
        if len(profiles) < config.num_stages:
            err.print(f"[yellow]{config.num_stages - len(profiles)} stage(s) wrote no profile[/]")
    if args.timeline:
        from wavepp.telemetry.spans import read_span_records
        from wavepp.telemetry.timeline import draw_timeline

        drawn = draw_timeline(
            read_span_records([telemetry.jsonl_path]),
            args.timeline,
            num_stages=config.num_stages,
            title=f"wavepp replay --mode {config.mode}",
        )
        err.print(
            f"timeline: {args.timeline} (wave fill from spans {drawn['wave_fill']:.4f}, "
            f"runtime {summary['wave_fill']:.4f})"
        )
    if args.json:
        print(json.dumps(summary), flush=True)
    return 0 if summary["completed"] + summary["failed"] == summary["requests"] else 1
