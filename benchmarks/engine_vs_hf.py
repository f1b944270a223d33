"""WavePP's stage engine and stage pipeline against one monolithic transformers forward.

Same model, same prompts, same cores, measured side by side in one run: the random-weight Llama
of ``vs_vllm.CHECKPOINT_SHAPE`` (hidden 512, 8 layers, 8 heads, 2 KV heads, float32; seeded
weights, ``TorchStageEngine``), loaded into transformers' ``LlamaForCausalLM`` (SDPA attention)
as well. Prompts: the first ``--requests`` records of the in-repo Mooncake trace, 16 tokens per
trace block (``vs_vllm_stats.trace_prompts``), the tokens drawn anew for every repeat (and the
warm-up) so that no pass finds an earlier one's prompts in a cache: what a pipeline reuses is the
trace's own prefix sharing within the pass. Each side runs ``--repeats`` times, sides
alternated; a side's figure is the median of its repeats (prompt tokens per second of wall
time). Ratios are of medians taken in this run.

- ``hf``: ``model(ids, logits_to_keep=1)`` one prompt at a time, no cache, ``--threads`` torch
  threads (the cores the engine or the pipeline uses).
- ``engine``: one in-process engine holding every layer: ``prepare`` + ``execute`` of
  micro-batches of ``--batch`` prompts, each prompt split in chunks of ``--chunk-tokens``
  (later chunks read their earlier chunks from the paged cache), same threads. With ``--pack
  on,off`` an ``engine-unpacked`` twin runs beside it, the two interleaved micro-batch by
  micro-batch (``run_engines_interleaved``).
- ``pipeline-S`` (``--stages 1,2``): ``LocalPipeline`` (real stage processes, NATS, gloo; the
  scheduler in this process), ``--concurrency`` requests out at a time (closed loop; a list such
  as ``8,32`` runs a pass per concurrency on the same servers, alternated: sides are named
  ``NAME@C``), each
  stage with ``--threads / S`` (at least 1) torch threads; the ``hf`` side runs with
  ``--threads``.
- ``up-S`` (``--path local,up``): the same pipeline behind ``wavepp up`` (HTTP gateway,
  JetStream intake, admission service, stage processes), driven by ``vs_vllm.drive``'s HTTP
  client at the same concurrency. Both paths serve one WavePipeline spec (``bench_spec``;
  ``local`` builds its RuntimeConfig from it as ``wavepp up`` does), so they differ only in
  the control path; ``up-S / pipeline-S`` is printed. Each pass also records the CPU seconds
  of every process of the side by role (stages, admission, gateway, nats-server, this
  process), from ``/proc`` (Linux), and, for ``up`` sides, what the planner and the stages did
  in the pass from their Prometheus counters (``pass_summary``: micro-batches, tokens and
  chunks per micro-batch, chunks over a cached context, each stage's busy fraction and CPU
  seconds per 1,000 prompt tokens); for ``local`` sides, the stages' timeline from their done
  messages (``timeline_summary``: micro-batches, tokens per micro-batch, each stage's busy
  fraction, its idle seconds inside the pass and at its fill or drain). The ``hf`` side runs
  off the event loop, which the pipelines' schedulers share.
- ``--source seeded,checkpoint``: the seeded model, and the same shape as a random-weight
  Hugging Face checkpoint directory served as ``--model DIR`` serves it (checkpoint engine,
  layers split by cost: ``-ckpt`` sides). ``--engine emulated`` (``--emulate``,
  ``--time-scale``) replaces the layers by the cost model's sleeps: what is left is the
  control path. ``--no-hf`` leaves the ``hf`` side out; ``--max-inflight`` sets the
  micro-batches in flight (default: the runtime's); ``--pack on,off`` adds ``-unpacked``
  sides (the engine's projections as plain ``F.linear``, ``engineOptions.packWeights:
  false``) to the packed ones (the default) and prints each side over its unpacked twin;
  ``--return-microbatches 0,1`` makes a side per value of ``engineOptions.returnMicrobatches``
  (suffix ``-rN``; 0 is the closed-loop target without a way back, S micro-batches a round);
  ``--pin off,on`` adds ``-pinned`` sides (``engineOptions.pinCores``: each stage process on its
  share of the cores) and prints each over its floating twin.

``--profile`` adds one profiled engine pass (``torch.profiler``, the engine's named regions,
``wavepp/runtime/stage/engine/profile.py``) and prints its per-part table; with ``--stages``
it prints each stage's loop profile over the side's passes instead (receive, prepare, engine
pass, results, send, the rest; plan handling: ``wavepp/runtime/stage/loop_profile.py``).
``--device cuda --dtype bfloat16`` runs the engine, hf and ``pipeline-S`` sides on a GPU (a
local pipeline's stages share it; activations between them go through host memory). Last line with ``--json``: one JSON
object of every figure. The served-pipeline sides (spec, ``local`` and ``up`` sides, what a
pass records) are ``pipeline_sides.py``'s. This is a benchmark: it measures and prints; it
asserts nothing.

    python benchmarks/engine_vs_hf.py --requests 40 --profile
    python benchmarks/engine_vs_hf.py --requests 60 --stages 1,2 --threads 2 --json
    python benchmarks/engine_vs_hf.py --requests 24 --stages 2 --threads 2 --path local,up \
        --source seeded,checkpoint --no-hf --json
    python benchmarks/engine_vs_hf.py --engine emulated --stages 2 --path local,up --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_sides import (  # noqa: E402
    BLOCK_SIZE,
    bench_spec,
    pipeline_sides,
    progress,
    runtime_config_of,
)
from vs_vllm import CHECKPOINT_SHAPE  # noqa: E402
from vs_vllm_stats import trace_prompts  # noqa: E402

from wavepp.bench.vllm_args import DEFAULT_TRACE  # noqa: E402
from wavepp.runtime.model_config import ModelConfig  # noqa: E402
from wavepp.runtime.stage.engine.base import ChunkSpec  # noqa: E402
from wavepp.runtime.stage.engine.profile import part_table, region_totals_us  # noqa: E402
from wavepp.runtime.stage.engine.torch_engine import (  # noqa: E402
    TorchStageEngine,
    build_full_state_dict,
)
from wavepp.runtime.stage.loop_profile import loop_table  # noqa: E402


def model_config(dtype: str) -> ModelConfig:
    """The ``CHECKPOINT_SHAPE`` Llama as a ModelConfig (seeded weights)."""
    s = CHECKPOINT_SHAPE
    return ModelConfig(
        name="bench-llama",
        vocab_size=s["vocab_size"],
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_layers=s["num_hidden_layers"],
        num_heads=s["num_attention_heads"],
        num_kv_heads=s["num_key_value_heads"],
        head_dim=s["hidden_size"] // s["num_attention_heads"],
        max_position=s["max_position_embeddings"],
        dtype=dtype,
        seed=0,
    )


def hf_model(config: ModelConfig, device: str) -> Any:
    import transformers

    hf_config = transformers.LlamaConfig(**config.to_hf_llama_kwargs())
    hf_config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.load_state_dict(build_full_state_dict(config), strict=True)
    return model.to(device=device, dtype=getattr(torch, config.dtype))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf(model: Any, prompts: list[list[int]], device: str) -> float:
    """Wall seconds of one forward per prompt (last-token logits only)."""
    began = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            model(torch.tensor([p], device=device), logits_to_keep=1, use_cache=False)
    _sync(device)
    return time.perf_counter() - began


def microbatches(prompts: list[list[int]], batch: int, chunk_tokens: int) -> list[list[ChunkSpec]]:
    """Micro-batches of ``batch`` prompts; prompt i owns blocks ``[i * n, (i + 1) * n)`` of a
    batch's cache, n = blocks of the longest prompt; a prompt longer than ``chunk_tokens``
    runs as consecutive chunks in consecutive micro-batches of its group."""
    longest = max(len(p) for p in prompts)
    per_prompt = -(-longest // BLOCK_SIZE)
    out: list[list[ChunkSpec]] = []
    for g in range(0, len(prompts), batch):
        group = prompts[g : g + batch]
        rounds = max(-(-len(p) // chunk_tokens) for p in group)
        for r in range(rounds):
            mb = []
            for i, p in enumerate(group):
                lo = r * chunk_tokens
                if lo >= len(p):
                    continue
                hi = min(len(p), lo + chunk_tokens)
                blocks = tuple(range(i * per_prompt, (i + 1) * per_prompt))
                mb.append(
                    ChunkSpec(
                        request_id=f"r{g + i}",
                        context_offset=lo,
                        num_tokens=hi - lo,
                        block_ids=blocks,
                        token_ids=tuple(p[lo:hi]),
                        is_last=hi == len(p),
                    )
                )
            out.append(mb)
    return out


def run_engines_interleaved(
    engines: dict[str, TorchStageEngine], batches: list[list[ChunkSpec]], device: str, rep: int
) -> dict[str, float]:
    """One pass of ``batches`` through every engine, interleaved micro-batch by micro-batch
    (the engines' order rotated per micro-batch and per ``rep``), so that a change of load
    during the pass falls on every engine alike. Returns engine -> seconds of its calls."""
    names = list(engines)
    spent = dict.fromkeys(names, 0.0)
    for i, mb in enumerate(batches):
        shift = (i + rep) % len(names)
        for name in names[shift:] + names[:shift]:
            began = time.perf_counter()
            engines[name].execute(engines[name].prepare(mb), None)
            _sync(device)
            spent[name] += time.perf_counter() - began
    return spent


def run_engine(engine: TorchStageEngine, batches: list[list[ChunkSpec]], device: str) -> float:
    began = time.perf_counter()
    for mb in batches:
        engine.execute(engine.prepare(mb), None)
    _sync(device)
    return time.perf_counter() - began


def profile_engine(
    engine: TorchStageEngine, batches: list[list[ChunkSpec]], device: str
) -> list[str]:
    """One profiled engine pass: its per-part table (on CUDA: GPU kernel time per part)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        for mb in batches:
            engine.execute(engine.prepare(mb), None)
        _sync(device)
        wall_us = (time.perf_counter() - began) * 1e6
    field = "device_time_total" if cuda else "cpu_time_total"
    return part_table(region_totals_us(prof.key_averages(), field), wall_us, len(batches))


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    config = model_config(args.dtype)
    if args.engine == "emulated":
        args.longest = BLOCK_SIZE  # the pool's size does not change the model's vocabulary
        vocab = runtime_config_of(bench_spec(args, config, 1)).model.vocab_size
    else:
        vocab = config.vocab_size
    prompt_sets = [
        trace_prompts(args.trace, args.requests, tokens_per_block=16, vocab_size=vocab, seed=s)
        for s in range(1 + args.repeats * (len(args.concurrency) if args.stages else 1))
    ]
    prompts = prompt_sets[1]
    args.longest = max(len(p) for p in prompts)
    tokens = sum(len(p) for p in prompts)
    if "checkpoint" in args.source and args.engine == "torch":
        from vs_vllm import make_checkpoint

        args.model_dir = make_checkpoint(Path(tempfile.mkdtemp(prefix="wavepp-bench-ckpt-")))
    hf = hf_model(config, args.device) if args.engine == "torch" and not args.no_hf else None

    def hf_pass(ps: list[list[int]]) -> float:
        torch.set_num_threads(args.threads)
        return run_hf(hf, ps, args.device)

    result: dict[str, Any] = {
        "requests": len(prompts),
        "prompt_tokens": tokens,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "batch": args.batch,
        "chunk_tokens": args.chunk_tokens,
        "compile": args.compile,
        "pack": args.pack,
        "load_avg_1m": os.getloadavg()[0],
    }
    lines: list[str] = []
    if args.stages:
        result |= {
            "engine": args.engine,
            "paths": args.path,
            "sources": args.source,
            "max_inflight": args.max_inflight,
        }
        measured = asyncio.run(
            pipeline_sides(args, config, prompt_sets, hf_pass if hf else None, tokens)
        )
        tps = measured["tokens_per_s"]
        result["cpu_s"] = measured["cpu_s"]
        result["passes"] = measured["passes"]
        result["concurrency"] = args.concurrency
        result["tokens_per_s"] = tps
        for name, value in tps.items():
            versus = f"  {value / tps['hf']:.3f}x hf" if "hf" in tps else ""
            lines.append(f"{name:<12} {value:>10.0f} tokens/s{versus}")
        if {"pipeline-1", "pipeline-2"} <= tps.keys():
            r = tps["pipeline-2"] / tps["pipeline-1"]
            result["pipeline2_over_pipeline1"] = r
            lines.append(f"pipeline-2 / pipeline-1: {r:.3f}")
        if {"pipeline-1-unpacked", "pipeline-2-unpacked"} <= tps.keys():
            r = tps["pipeline-2-unpacked"] / tps["pipeline-1-unpacked"]
            result["pipeline2_over_pipeline1_unpacked"] = r
            lines.append(f"pipeline-2-unpacked / pipeline-1-unpacked: {r:.3f}")
        for name in list(tps):
            base, at_c, c_text = name.partition("@")
            pinned = f"{base}-pinned{at_c}{c_text}"
            if not base.endswith("-pinned") and pinned in tps:
                r = tps[pinned] / tps[name]
                result[f"{pinned}/{name}"] = r
                lines.append(f"{pinned} / {name}: {r:.3f}")
            if f"{name}-unpacked" in tps:
                r = tps[name] / tps[f"{name}-unpacked"]
                result[f"{name}/{name}-unpacked"] = r
                lines.append(f"{name} / {name}-unpacked: {r:.3f}")
        cs = args.concurrency
        at = [""] if len(cs) == 1 else [f"@{c}" for c in cs]
        pairs = []
        for s in args.stages:
            for c in at:
                for suffix in ("", "-ckpt"):
                    pairs.append((f"up-{s}{suffix}{c}", f"pipeline-{s}{suffix}{c}"))
                for path in ("pipeline", "up"):
                    pairs.append((f"{path}-{s}-ckpt{c}", f"{path}-{s}{c}"))
            for path in ("pipeline", "up"):
                for suffix in ("", "-ckpt"):
                    for c in at[1:]:
                        pairs.append((f"{path}-{s}{suffix}{c}", f"{path}-{s}{suffix}{at[0]}"))
        for name in list(tps):
            for r in args.return_microbatches:
                if "-r0" in name and r:
                    pairs.append((name.replace("-r0", f"-r{r}"), name))
        for top, bottom in pairs:
            if {top, bottom} <= tps.keys():
                result[f"{top}/{bottom}"] = tps[top] / tps[bottom]
                lines.append(f"{top} / {bottom}: {tps[top] / tps[bottom]:.3f}")
        for name, passes in measured["passes"].items():
            for i, summary in enumerate(passes):
                lines.append(f"{name} pass {i}: {json.dumps(summary)}")
        profiled = {k: v for k, v in measured["loop_profiles"].items() if v}
        if profiled:
            result["loop_profiles"] = profiled
        for name, profiles in profiled.items():
            for profile in profiles:
                lines.append(
                    f"{name} stage {profile['rank']} loop profile, every pass "
                    f"({profile['microbatches']} micro-batches; other = wall - parts):"
                )
                if profile["microbatches"]:
                    lines.extend(loop_table(profile))
    else:
        state = build_full_state_dict(config)
        engines = {
            "engine" + ("-unpacked" if pack == "off" else ""): TorchStageEngine(
                model=config,
                first_layer=0,
                last_layer=config.num_layers,
                num_layers_total=config.num_layers,
                device=args.device,
                state_dict=state,
                pack_weights=pack == "on",
                **({"compile": True} if args.compile else {}),
            )
            for pack in args.pack
        }
        batches = microbatches(prompts, args.batch, args.chunk_tokens)
        per_prompt = -(-args.longest // BLOCK_SIZE)
        for engine in engines.values():
            engine.allocate_kv(per_prompt * args.batch, BLOCK_SIZE)
            run_engine(engine, batches[:2], args.device)  # warm-up (and compile), not timed
        hf_pass(prompts[:2])
        names = ["hf", *engines]
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.repeats):
            for side in ["hf", "engines"] if rep % 2 == 0 else ["engines", "hf"]:
                if side == "hf":
                    times["hf"].append(hf_pass(prompts))
                else:
                    spent = run_engines_interleaved(engines, batches, args.device, rep)
                    for name, seconds in spent.items():
                        times[name].append(seconds)
            progress(f"repeat {rep}: {times}")
        tps = {name: tokens / statistics.median(t) for name, t in times.items()}
        result["tokens_per_s"] = tps
        result["microbatches"] = len(batches)
        lines.append(f"hf      {tps['hf']:>10.0f} tokens/s")
        for name in engines:
            result[f"{name}_over_hf"] = tps[name] / tps["hf"]
            lines.append(f"{name:<7} {tps[name]:>10.0f} tokens/s  {tps[name] / tps['hf']:.3f}x hf")
        if {"engine", "engine-unpacked"} <= tps.keys():
            result["engine/engine-unpacked"] = tps["engine"] / tps["engine-unpacked"]
            lines.append(f"engine / engine-unpacked: {result['engine/engine-unpacked']:.3f}")
        engine = next(iter(engines.values()))
        if args.profile:
            table = profile_engine(engine, batches, args.device)
            result["profile"] = table
            lines.append("per-part profile of one engine pass:")
            lines.extend(table)
    result["load_avg_1m_end"] = os.getloadavg()[0]
    head = (
        f"{len(prompts)} prompts, {tokens} tokens, {args.threads} threads, {args.device} "
        f"{args.dtype}, {args.engine} engine, load avg {result['load_avg_1m']:.1f} -> {result['load_avg_1m_end']:.1f}"
    )
    print(head)
    print("\n".join(lines))
    if args.json:
        print(json.dumps(result))
    return 0


def _positive_ints(flag: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: comma-separated integers >= 1")
        return values

    return parse


_stages = _positive_ints("--stages")


def _counts(flag: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: comma-separated integers >= 0")
        return values

    return parse


def _paths(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("local", "up") for v in values):
        raise argparse.ArgumentTypeError(f"--path {text!r}: comma-separated local and/or up")
    return values


def _packs(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("on", "off") for v in values) or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"--pack {text!r}: on and/or off")
    return values


def _pins(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("on", "off") for v in values) or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"--pin {text!r}: on and/or off")
    return values


def _sources(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("seeded", "checkpoint") for v in values):
        raise argparse.ArgumentTypeError(f"--source {text!r}: seeded and/or checkpoint")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4, help="prompts per engine micro-batch")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--stages", type=_stages, default=[], help="e.g. 1,2: pipeline mode")
    parser.add_argument(
        "--concurrency",
        type=_positive_ints("--concurrency"),
        default=[8],
        help="e.g. 8,32: a pass per concurrency",
    )
    parser.add_argument(
        "--path", type=_paths, default=["local"], help="pipeline mode: local,up (see docstring)"
    )
    parser.add_argument("--engine", default="torch", choices=["torch", "emulated"])
    parser.add_argument("--emulate", default="tiny-llama", help="emulated engine's cost model")
    parser.add_argument("--time-scale", type=float, default=1.0, help="emulated engine's")
    parser.add_argument("--no-hf", action="store_true", help="pipeline mode: no hf side")
    parser.add_argument(
        "--source", type=_sources, default=["seeded"], help="torch: seeded,checkpoint"
    )
    parser.add_argument(
        "--max-inflight", type=int, default=0, help="micro-batches in flight (0: the default)"
    )
    parser.add_argument(
        "--max-outstanding", type=int, default=0, help="up: gateway's (0: --concurrency)"
    )
    parser.add_argument(
        "--return-microbatches",
        type=_counts("--return-microbatches"),
        default=[],
        help="e.g. 0,1: a side per value of engineOptions.returnMicrobatches (suffix -rN)",
    )
    parser.add_argument("--request-timeout-s", type=float, default=1800.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile switch: the engine's; with --stages, engineOptions.torchCompile",
    )
    parser.add_argument(
        "--pin",
        type=_pins,
        default=["off"],
        help="off,on: pipeline sides with each stage on its share of the cores "
        "(engineOptions.pinCores; suffix -pinned) and not",
    )
    parser.add_argument(
        "--pack",
        type=_packs,
        default=["on"],
        help="on,off: sides with the engine's weights packed and (-unpacked) not",
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true")
    return parser


def _refused_flags(args: argparse.Namespace) -> str:
    """Why flags given together cannot all be honoured ("" when they can): pipeline mode
    (``--stages``) runs the torch engine's stages on ``--device`` through ``LocalPipeline``
    only (any other engine or path on the CPU), its planner choosing micro-batches and chunks
    (no ``--batch``, ``--chunk-tokens``); engine mode runs the torch engine in this process,
    with none of the pipeline's flags."""
    if args.stages:
        if args.device != "cpu" and args.engine != "torch":
            return f"--device {args.device}: only with --engine torch"
        if args.device != "cpu" and args.path != ["local"]:
            return f"--device {args.device}: only with --path local (LocalPipeline)"
        if args.profile and args.path != ["local"]:
            return "--profile: with --stages, only --path local (the stages' loop profiles)"
        if args.compile and args.engine != "torch":
            return "--compile: only with --engine torch"
        defaults = build_parser().parse_args([])
        for flag in ("batch", "chunk_tokens"):  # the pipeline's planner cuts and batches
            if getattr(args, flag) != getattr(defaults, flag):
                return f"--{flag.replace('_', '-')}: only without --stages (engine mode)"
        return ""
    defaults = build_parser().parse_args([])
    for flag in (
        "engine",
        "pin",
        "path",
        "source",
        "concurrency",
        "max_inflight",
        "max_outstanding",
        "return_microbatches",
    ):
        if getattr(args, flag) != getattr(defaults, flag):
            return f"--{flag.replace('_', '-')}: only with --stages (pipeline mode)"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.no_hf and not args.stages:
        print("--no-hf: only with --stages (the engine mode compares with hf)", file=sys.stderr)
        return 2
    refused = _refused_flags(args)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    for name in ("requests", "repeats", "threads", "batch", "chunk_tokens"):
        if getattr(args, name) < 1:
            parser_error = f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1"
            print(parser_error, file=sys.stderr)
            return 2
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
