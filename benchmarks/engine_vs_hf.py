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
  (later chunks read their earlier chunks from the paged cache), same threads.
- ``pipeline-S`` (``--stages 1,2``): ``LocalPipeline`` (real stage processes, NATS, gloo),
  ``--concurrency`` requests out at a time (closed loop), each stage with
  ``--threads / S`` (at least 1) torch threads; the ``hf`` side runs with ``--threads``.

``--profile`` adds one profiled engine pass (``torch.profiler``, the engine's named regions,
``wavepp/runtime/stage/engine/profile.py``) and prints its per-part table. ``--device cuda
--dtype bfloat16`` runs the engine and hf sides on a GPU. Last line with ``--json``: one JSON
object of every figure. This is a benchmark: it measures and prints; it asserts nothing.

    python benchmarks/engine_vs_hf.py --requests 40 --profile
    python benchmarks/engine_vs_hf.py --requests 60 --stages 1,2 --threads 2 --json
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_vllm import CHECKPOINT_SHAPE, DEFAULT_TRACE  # noqa: E402
from vs_vllm_stats import trace_prompts  # noqa: E402

from wavepp.runtime.model_config import ModelConfig  # noqa: E402
from wavepp.runtime.stage.engine.base import ChunkSpec  # noqa: E402
from wavepp.runtime.stage.engine.profile import part_table, region_totals_us  # noqa: E402
from wavepp.runtime.stage.engine.torch_engine import (  # noqa: E402
    TorchStageEngine,
    build_full_state_dict,
)

BLOCK_SIZE = 32


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


async def _closed_loop(scheduler: Any, prompts: list[list[int]], concurrency: int) -> None:
    from wavepp.runtime.request import PromptRequest

    queue = list(enumerate(prompts))
    queue.reverse()

    async def worker() -> None:
        while queue:
            i, p = queue.pop()
            outcome = await scheduler.submit(PromptRequest(f"q{i}", p))
            if not outcome.ok:
                raise RuntimeError(f"request q{i} failed: {outcome.error}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


class PipelineSide:
    """A started ``LocalPipeline`` of ``stages`` stages; ``run`` times one pass."""

    def __init__(self, config: ModelConfig, stages: int, threads: int, args: Any) -> None:
        from wavepp.runtime.config import RuntimeConfig

        per_stage = max(1, threads // stages)
        longest = args.longest
        blocks = max(64, args.concurrency * 2 * (-(-longest // BLOCK_SIZE)))
        self.config = RuntimeConfig(
            model=config,
            engine="torch",
            num_stages=stages,
            block_size=BLOCK_SIZE,
            num_kv_blocks=[blocks] * stages,
            torch_threads=per_stage,
            max_inflight=args.concurrency,
        )
        self.stages = stages
        self.pipeline: Any = None
        self.log_dir = tempfile.mkdtemp(prefix=f"wavepp-bench-s{stages}-")

    async def start(self) -> None:
        from wavepp.launch.replica import planner_cost_model
        from wavepp.runtime.serving.local import LocalPipeline

        cost = planner_cost_model(self.config)
        self.pipeline = LocalPipeline(self.config, cost, log_dir=self.log_dir)
        await self.pipeline.start()

    async def run(self, prompts: list[list[int]], concurrency: int) -> float:
        began = time.perf_counter()
        await _closed_loop(self.pipeline.scheduler, prompts, concurrency)
        return time.perf_counter() - began

    async def stop(self) -> None:
        if self.pipeline is not None:
            await self.pipeline.stop()


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


async def pipeline_sides(
    args: argparse.Namespace,
    config: ModelConfig,
    prompt_sets: list[list[list[int]]],
    hf_pass: Callable[[list[list[int]]], float],
    tokens: int,
) -> dict[str, Any]:
    """``prompt_sets[0]``: the warm-up's; ``prompt_sets[1 + r]``: repeat r's (same lengths and
    prefix sharing, other tokens, so no pass finds an earlier pass's prompts cached)."""
    sides = [PipelineSide(config, s, args.threads, args) for s in args.stages]
    times: dict[str, list[float]] = {"hf": []} | {f"pipeline-{s.stages}": [] for s in sides}
    try:
        for side in sides:
            await side.start()
            await side.run(prompt_sets[0][: min(4, len(prompt_sets[0]))], 2)  # not timed
        for rep in range(args.repeats):
            prompts = prompt_sets[1 + rep]
            order: list[Any] = ["hf", *sides]
            if rep % 2:
                order.reverse()
            for side in order:
                if side == "hf":
                    times["hf"].append(hf_pass(prompts))
                else:
                    times[f"pipeline-{side.stages}"].append(
                        await side.run(prompts, args.concurrency)
                    )
            _progress(f"repeat {rep}: {times}")
    finally:
        for side in sides:
            await side.stop()
    return {name: tokens / _median(t) for name, t in times.items()}


def _progress(message: str) -> None:
    print(f"[engine_vs_hf] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    config = model_config(args.dtype)
    prompt_sets = [
        trace_prompts(
            args.trace, args.requests, tokens_per_block=16, vocab_size=config.vocab_size, seed=s
        )
        for s in range(1 + args.repeats)
    ]
    prompts = prompt_sets[1]
    args.longest = max(len(p) for p in prompts)
    tokens = sum(len(p) for p in prompts)
    hf = hf_model(config, args.device)

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
        "load_avg_1m": os.getloadavg()[0],
    }
    lines: list[str] = []
    if args.stages:
        tps = asyncio.run(pipeline_sides(args, config, prompt_sets, hf_pass, tokens))
        result["concurrency"] = args.concurrency
        result["tokens_per_s"] = tps
        for name, value in tps.items():
            lines.append(f"{name:<12} {value:>10.0f} tokens/s  {value / tps['hf']:.3f}x hf")
        if {"pipeline-1", "pipeline-2"} <= tps.keys():
            r = tps["pipeline-2"] / tps["pipeline-1"]
            result["pipeline2_over_pipeline1"] = r
            lines.append(f"pipeline-2 / pipeline-1: {r:.3f}")
    else:
        engine = TorchStageEngine(
            model=config,
            first_layer=0,
            last_layer=config.num_layers,
            num_layers_total=config.num_layers,
            device=args.device,
            state_dict=build_full_state_dict(config),
            **({"compile": True} if args.compile else {}),
        )
        batches = microbatches(prompts, args.batch, args.chunk_tokens)
        per_prompt = -(-args.longest // BLOCK_SIZE)
        engine.allocate_kv(per_prompt * args.batch, BLOCK_SIZE)
        run_engine(engine, batches[:2], args.device)  # warm-up (and compile), not timed
        hf_pass(prompts[:2])
        times: dict[str, list[float]] = {"hf": [], "engine": []}
        for rep in range(args.repeats):
            order = ["hf", "engine"] if rep % 2 == 0 else ["engine", "hf"]
            for side in order:
                if side == "hf":
                    times["hf"].append(hf_pass(prompts))
                else:
                    times["engine"].append(run_engine(engine, batches, args.device))
            _progress(f"repeat {rep}: {times}")
        tps = {name: tokens / _median(t) for name, t in times.items()}
        result["tokens_per_s"] = tps
        result["engine_over_hf"] = tps["engine"] / tps["hf"]
        result["microbatches"] = len(batches)
        lines.append(f"hf      {tps['hf']:>10.0f} tokens/s")
        lines.append(f"engine  {tps['engine']:>10.0f} tokens/s  {result['engine_over_hf']:.3f}x hf")
        if args.profile:
            table = profile_engine(engine, batches, args.device)
            result["profile"] = table
            lines.append("per-part profile of one engine pass:")
            lines.extend(table)
    result["load_avg_1m_end"] = os.getloadavg()[0]
    head = (
        f"{len(prompts)} prompts, {tokens} tokens, {args.threads} threads, {args.device} "
        f"{args.dtype}, load avg {result['load_avg_1m']:.1f} -> {result['load_avg_1m_end']:.1f}"
    )
    print(head)
    print("\n".join(lines))
    if args.json:
        print(json.dumps(result))
    return 0


def _stages(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--stages {text!r}: comma-separated integers >= 1")
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
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compile", action="store_true", help="engine's torch.compile switch")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("requests", "repeats", "threads", "batch", "chunk_tokens", "concurrency"):
        if getattr(args, name) < 1:
            parser_error = f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1"
            print(parser_error, file=sys.stderr)
            return 2
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
