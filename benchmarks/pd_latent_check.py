"""The KV a WavePP pipeline hands over, layer by layer, against the cache vLLM's own prefill
writes for the same prompt.

The checkpoint, prompts and pipeline of ``pd_handoff`` (``--family``, the Mooncake trace's
first ``--requests`` records): the prompts ``--prompts`` (indices) are prefilled by WavePP on 2
stages with a handoff and pulled from both stages (``pull.pull_request``, what the vLLM
connector receives); then one vLLM engine (``decode_runner --save-kv-dir``: vLLM's example
connector saving what its own prefill wrote into its cache; RoPE as ``pd_handoff`` runs the
family, or as ``--vllm-rope`` says) prefills each prompt alone. For
every layer the two caches' first ``(len - 1) // block * block`` tokens (what that connector
stores) are compared: ``max_abs`` (largest |difference|) and ``rel`` (``max_abs`` over the
largest |value| of vLLM's), for the whole row and, for MLA, the latent ([:kv_lora_rank]) and
the roped key ([kv_lora_rank:]) apart. A K/V layer is compared as K and V where the example
connector saves plain [2, tokens, heads, dim] rows (a backend with plain pages; vLLM-CPU's K/V
backend packs its pages, so this check is for MLA there).

    python benchmarks/pd_latent_check.py --json --family deepseek_v3 --prompts 3,4,17

This is a benchmark: it measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import pd_handoff

from wavepp.bench.vllm_args import add_vllm_args, add_vllm_rope_arg, missing_vllm

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def compare(ours: Any, theirs: Any) -> dict[str, float]:
    """``max_abs`` = max |ours - theirs| and ``rel`` = ``max_abs`` / max |theirs| (0 when
    ``theirs`` is all zero) of two same-shaped tensors.

    Raises:
        ValueError: the shapes differ.
    """
    if tuple(ours.shape) != tuple(theirs.shape):
        raise ValueError(f"shapes differ: {tuple(ours.shape)} vs {tuple(theirs.shape)}")
    diff = float((ours.double() - theirs.double()).abs().max()) if ours.numel() else 0.0
    scale = float(theirs.double().abs().max()) if theirs.numel() else 0.0
    return {"max_abs": diff, "rel": diff / scale if scale else 0.0}


def compare_layer(ours: Any, theirs: Any, kv_lora_rank: int | None) -> dict[str, Any]:
    """One layer: ``ours`` as handed over ([1, tokens, 1, width] for MLA, else [2, tokens,
    heads, dim]), ``theirs`` as vLLM's example connector saved it ([tokens, width] for MLA, else
    [tokens, 2, ...] or [2, tokens, ...]). Only the first ``len(theirs)`` tokens count."""
    if kv_lora_rank is not None:
        rows = ours[0, : theirs.shape[0], 0]
        return {
            "tokens": int(theirs.shape[0]),
            "row": compare(rows, theirs),
            "latent": compare(rows[:, :kv_lora_rank], theirs[:, :kv_lora_rank]),
            "rope_key": compare(rows[:, kv_lora_rank:], theirs[:, kv_lora_rank:]),
        }
    kv = theirs if theirs.shape[0] == 2 else theirs.transpose(0, 1)
    n = int(kv.shape[1])
    return {
        "tokens": n,
        "key": compare(ours[0, :n].reshape(kv[0].shape), kv[0]),
        "value": compare(ours[1, :n].reshape(kv[1].shape), kv[1]),
    }


async def handed_over(
    args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], work: Path
) -> dict[int, list[Any]]:
    """Prompt index -> its layers as pulled from the stages (``pull.pull_request``)."""
    from wavepp.api.kv_handoff import PARAMS_KEY, HandoffParams
    from wavepp.integrations.vllm.pull import pull_request
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.runtime.hf_config import load_model_dir
    from wavepp.runtime.planning import CostModel
    from wavepp.runtime.request import PromptRequest
    from wavepp.runtime.serving.local import LocalPipeline

    config = RuntimeConfig(
        model=load_model_dir(model_dir),
        model_dir=str(model_dir),
        engine="torch",
        num_stages=pd_handoff.STAGES,
        block_size=args.wavepp_block_size,
        num_kv_blocks=[4096],
        handoff_lease_s=120.0,
        torch_threads=1,
    )
    cost = CostModel(
        c=1e-3, g=1e-6, b=1e-5, a=1e-8, label="derived", source="pd_latent_check: chunk sizes"
    )
    out: dict[int, list[Any]] = {}
    async with LocalPipeline(config, cost, log_dir=str(work / "stages")) as pipeline:
        assert pipeline.scheduler is not None
        for i in args.prompt_indices:
            outcome = await pipeline.scheduler.submit(
                PromptRequest(f"p{i}", prompts[i], handoff=True)
            )
            if not outcome.ok:
                raise RuntimeError(f"prefill of p{i} failed: {outcome}")
            params = HandoffParams.from_json(pipeline.kv_transfer_params(outcome)[PARAMS_KEY])
            pulled = await asyncio.to_thread(pull_request, params)
            out[i] = [t.clone() for t in pulled.layers]
    return out


def vllm_caches(
    args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], work: Path
) -> dict[int, dict[int, Any]]:
    """Prompt index -> layer -> what vLLM's own prefill wrote into its cache (one prompt per
    engine call, so each new folder of the example connector is that prompt's)."""
    from safetensors.torch import load_file

    store = work / "vllm-kv"
    store.mkdir(parents=True, exist_ok=True)
    block = pd_handoff.VLLM_BLOCK_SIZES.get(args.family, pd_handoff.VLLM_BLOCK_SIZE)
    max_len = max(len(prompts[i]) for i in args.prompt_indices) + 2
    engine = pd_handoff.DecodeEngine(
        Path(args.vllm_python),
        model_dir,
        work,
        max_len,
        block,
        save_kv_dir=store,
        native_rope=pd_handoff.native_rope(args.family, args.vllm_rope),
    )
    out: dict[int, dict[int, Any]] = {}
    try:
        engine.wait_ready(args.startup_timeout_s)
        for i in args.prompt_indices:
            before = {p.name for p in store.iterdir()}
            engine.decode([{"id": f"p{i}", "prompt": prompts[i], "max_tokens": 1}])
            new = [p for p in store.iterdir() if p.name not in before]
            if len(new) != 1:
                raise RuntimeError(f"p{i}: expected one new cache folder, found {len(new)}")
            layers = {}
            for f in new[0].glob("*.safetensors"):
                match = _LAYER.search(f.name)
                if match is not None:
                    layers[int(match.group(1))] = load_file(str(f))["kv_cache"]
            out[i] = layers
    finally:
        engine.stop()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from wavepp.bench.workloads import mooncake_workload

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pd-latent-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = pd_handoff.make_checkpoint(work / f"model-{args.family}", family=args.family)
    prompts = mooncake_workload(
        args.trace,
        args.requests,
        tokens_per_block=args.tokens_per_block,
        vocab_size=pd_handoff.SHAPES[args.family]["vocab_size"],
        seed=1,
    ).prompts
    ours = asyncio.run(handed_over(args, model_dir, prompts, work))
    theirs = vllm_caches(args, model_dir, prompts, work)
    kv_lora_rank = pd_handoff.SHAPES[args.family].get("kv_lora_rank")
    per_prompt = {}
    worst = 0.0
    for i in args.prompt_indices:
        layers = {
            layer: compare_layer(ours[i][layer], theirs[i][layer], kv_lora_rank)
            for layer in sorted(theirs[i])
        }
        per_prompt[f"p{i}"] = {"prompt_tokens": len(prompts[i]), "layers": layers}
        for entry in layers.values():
            worst = max(worst, *(v["rel"] for v in entry.values() if isinstance(v, dict)))
    return {
        "family": args.family,
        "vllm_rope": args.vllm_rope,
        "prompts": per_prompt,
        "max_rel": worst,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(pd_handoff.SHAPES), default="deepseek_v3")
    parser.add_argument("--prompts", default="3,4,17", help="comma-separated prompt indices")
    parser.add_argument("--requests", type=int, default=50, help="trace records read")
    parser.add_argument("--wavepp-block-size", type=int, default=16)
    add_vllm_args(parser)
    add_vllm_rope_arg(parser)
    args = parser.parse_args(argv)
    try:
        args.prompt_indices = [int(x) for x in args.prompts.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--prompts={args.prompts!r}: comma-separated integers")
    if not args.prompt_indices or not all(0 <= i < args.requests for i in args.prompt_indices):
        parser.error(f"--prompts={args.prompts!r}: indices in [0, {args.requests})")
    if missing := missing_vllm(args):
        print(missing, file=sys.stderr)
        return 2
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        for name, entry in report["prompts"].items():
            for layer, cmp in entry["layers"].items():
                parts = {
                    k: f"{v['max_abs']:.2e}/{v['rel']:.2e}" for k, v in cmp.items() if k != "tokens"
                }
                print(f"{name} layer {layer} ({cmp['tokens']} tokens) max_abs/rel {parts}")
        print(f"max_rel {report['max_rel']:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
