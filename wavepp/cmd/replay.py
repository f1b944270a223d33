"""``wavepp replay TRACE``: replay a Mooncake trace through a local pipeline.

Starts its own nats-server and S stage processes, replays (closed loop at ``--concurrency``, or
at the trace's timestamps with ``--timed``), prints a progress bar (stderr) and the summary:
each number with its unit and meaning, and per stage the local hit against the agreed prefix
(``wavepp.bench.summary_text``); with ``--json`` stdout is one JSON object only (the replay
contract) and the tables go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from importlib import resources
from pathlib import Path

from wavepp.cmd.common import finite_float


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
    parser.add_argument(
        "--chunk-policy",
        choices=["dynamic", "static"],
        default=None,
        help="ablation (default: from --mode: wave dynamic, sync static)",
    )
    parser.add_argument(
        "--agreement",
        choices=["async", "sync"],
        default=None,
        help="ablation (default: from --mode: wave async, sync sync)",
    )
    parser.add_argument(
        "--local-prepare",
        choices=["on", "off"],
        default=None,
        help="ablation (default: from --mode: wave on, sync off)",
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


_MAX_DERIVED_KV_BLOCKS = 1 << 22


def _fail(flag: str, message: str) -> int:
    print(f"wavepp replay: {flag}: {message}", file=sys.stderr)
    return 2


def _checkpoint_partition(model_dir: str, num_stages: int) -> list[int]:
    """``engine.balance.checkpoint_partition``, imported only for a checkpoint: it imports torch
    (~2 s of CPU), which this process needs for nothing else (its stages import their own)."""
    from wavepp.runtime.stage.engine.balance import checkpoint_partition

    return checkpoint_partition(model_dir, num_stages)


def _validation_summary(exc: object) -> str:
    """One line per error: the field path and pydantic's message, without input dumps."""
    lines = []
    for error in exc.errors():  # type: ignore[attr-defined]
        where = ".".join(str(p) for p in error.get("loc", ())) or "<config>"
        lines.append(f"{where}: {error['msg']}")
    return "; ".join(lines)


def _packaged_cost_model(name: str) -> dict[str, object]:
    path = resources.files("wavepp.runtime.planning") / "calibration" / name
    return json.loads(path.read_text())


def _telemetry_settings(args: argparse.Namespace):  # noqa: ANN202 - TelemetrySettings
    """Telemetry flags -> settings; --timeline needs the spans in a JSON-lines file."""
    import tempfile

    from wavepp.telemetry.settings import TelemetrySettings

    exporter = args.trace_exporter
    path = args.trace_out
    if exporter is None:
        exporter = "jsonl" if (path or args.timeline) else "none"
    if args.timeline and exporter != "jsonl":
        raise ValueError(
            f"--timeline reads a JSON-lines span file; got --trace-exporter {exporter}"
        )
    if exporter == "jsonl" and not path:
        path = str(Path(tempfile.mkdtemp(prefix="wavepp-trace-")) / "spans.jsonl")
    if path and Path(path).exists():
        Path(path).unlink()  # one run per file: the timeline and trace-view read all of it
    return TelemetrySettings(
        exporter=exporter,
        endpoint=args.otlp_endpoint,
        sampling_ratio=args.trace_sampling,
        jsonl_path=path,
        metrics_port=args.metrics_port,
    )


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    from rich.table import Table

    from wavepp.bench.replay import replay_records
    from wavepp.bench.summary_text import clean_source, stage_rows, summary_rows
    from wavepp.bench.trace import TokenMapper, load_trace
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.runtime.hf_config import load_model_dir, normalize_hf_config, read_hf_config
    from wavepp.runtime.model_config import get_preset
    from wavepp.runtime.planning import CostModel
    from wavepp.runtime.planning.catalogue import ModelSpec, derived_cost_model, list_models
    from wavepp.runtime.planning.from_config import spec_from_hf_config
    from wavepp.runtime.planning.memory import FIXED_KV_BLOCKS
    from wavepp.runtime.serving.from_spec import default_emulated_kv_blocks

    err = Console(stderr=True)
    try:
        telemetry = _telemetry_settings(args)
    except ValueError as exc:
        return _fail("--trace-exporter/--trace-out/--timeline", str(exc))
    if not Path(args.trace).is_file():
        return _fail("TRACE", f"{args.trace}: no such file")
    if args.limit is not None and args.limit < 1:
        return _fail("--limit", f"{args.limit}: must be >= 1")
    if args.concurrency < 1:
        return _fail("--concurrency", f"{args.concurrency}: must be >= 1")
    model_dir: str | None = None
    try:
        if Path(args.model).is_dir():
            if args.engine != "torch":
                return _fail(
                    "--model", f"{args.model}: a checkpoint directory needs --engine torch"
                )
            model_dir = str(Path(args.model).resolve())
            model = load_model_dir(model_dir).model_copy(update={"seed": args.seed})
        else:
            model = get_preset(args.model).model_copy(update={"seed": args.seed})
        kv_blocks = (
            [int(v) for v in str(args.kv_blocks).split(",")] if args.kv_blocks is not None else []
        )
    except ValueError as exc:
        return _fail("--model/--kv-blocks", str(exc))
    kv_blocks_source = "--kv-blocks" if kv_blocks else f"fixed default {FIXED_KV_BLOCKS}"
    stage_cost: CostModel | None = None
    emulate: str | ModelSpec = args.emulate
    if args.engine == "emulated":
        if Path(args.emulate).is_dir():
            try:
                emulate = spec_from_hf_config(
                    normalize_hf_config(read_hf_config(args.emulate)),
                    name=load_model_dir(args.emulate).name,
                )
            except (ValueError, KeyError) as exc:
                return _fail("--emulate", f"{args.emulate}: {exc}")
        elif args.emulate not in list_models():
            return _fail(
                "--emulate", f"{args.emulate!r}: choose one of {list_models()} or a checkpoint DIR"
            )
        try:
            stage_cost = derived_cost_model(emulate, num_stages=args.stages)
        except ValueError as exc:
            return _fail("--stages", str(exc))
    try:
        config = RuntimeConfig(
            model=model,
            model_dir=model_dir,
            partition=_checkpoint_partition(model_dir, args.stages) if model_dir else None,
            state_interval_blocks=args.state_interval_blocks,
            engine=args.engine,
            cost_model=stage_cost.to_dict() if stage_cost else None,
            time_scale=args.time_scale,
            num_stages=args.stages,
            block_size=args.block_size,
            num_kv_blocks=kv_blocks or [FIXED_KV_BLOCKS],
            mode=args.mode,
            chunk_tokens=args.chunk_tokens,
            chunk_policy=args.chunk_policy,
            agreement=args.agreement,
            local_prepare=None if args.local_prepare is None else args.local_prepare == "on",
            max_inflight=args.max_inflight,
            telemetry=telemetry,
        )
        mapper = TokenMapper(args.tokens_per_block, model.vocab_size, seed=args.seed)
    except ValidationError as exc:
        return _fail("configuration", _validation_summary(exc))
    except ValueError as exc:
        return _fail("configuration", str(exc))
    if args.engine == "emulated" and not kv_blocks:
        try:
            derived, kv_blocks_source = default_emulated_kv_blocks(config, emulate)
        except ValueError as exc:
            return _fail("--kv-blocks (default)", str(exc))
        if max(derived) > _MAX_DERIVED_KV_BLOCKS:
            # NOTE: a tiny checkpoint emulated at H200 derives tens of millions of blocks; a
            # block pool that size takes minutes to build.
            return _fail(
                "--kv-blocks (default)",
                f"derived {max(derived)} blocks per stage ({kv_blocks_source}); above "
                f"{_MAX_DERIVED_KV_BLOCKS}: give --kv-blocks",
            )
        config = RuntimeConfig.model_validate(config.model_dump() | {"num_kv_blocks": derived})
    kv_blocks = config.num_kv_blocks
    if args.cost_model:
        planner_model = CostModel.from_dict(json.loads(Path(args.cost_model).read_text()))
    elif stage_cost is not None:
        planner_model = stage_cost
    else:
        planner_model = CostModel.from_dict(_packaged_cost_model("tiny-llama-cpu-2layers.json"))

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
        f"block size {config.block_size} tokens, KV capacity {kv_blocks} blocks per stage "
        f"({kv_blocks_source}), concurrency {args.concurrency}"
    )
    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    )
    with progress:
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
    summary["kv_blocks_source"] = clean_source(kv_blocks_source)
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
    for column in ("stage", "layers", "KV capacity", "local hit", "agreed prefix",
                   "held, not shared", "busy (s)"):  # fmt: skip
        stages.add_column(column, justify="right")
    for row in stage_rows(summary):
        stages.add_row(*row)
    out.print(stages)
    out.print(
        "local hit: blocks of each prompt the stage held; agreed prefix: the blocks every "
        "stage held (min over stages), the only ones reused; held, not shared: recomputed "
        "although that stage had them (unequal --kv-blocks evict differently)."
    )
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
