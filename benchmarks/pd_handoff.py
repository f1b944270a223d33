"""WavePP prefill -> vLLM decode through the KV handoff, checked against vLLM's own prefill.

A random-weight float32 Hugging Face checkpoint of ``--family`` (made in ``--work-dir``):
``llama`` (``CHECKPOINT_SHAPE``), ``minimax_m2`` (``MINIMAX_SHAPE``: GQA with QK-norm and
partial RoPE, sigmoid-routed experts) or ``deepseek_v3`` (``DEEPSEEK_SHAPE``: MLA, a latent
cache handed over as one "head" per token, and sigmoid-routed experts) is prefilled by a WavePP pipeline of 2 stage processes (``LocalPipeline``, blocks
of ``--wavepp-block-size`` tokens) and decoded by one vLLM engine (``decode_runner`` in vLLM's
environment, ``--vllm-python``, blocks of 32 tokens (16 for MLA), ``WavePPConnector``). Prompts: the first
``--requests`` records of the Mooncake trace (``data/traces``), ``--tokens-per-block`` tokens per
trace block, so requests share prefixes as in the trace and reuse cached blocks on the stages.

Each request is submitted with ``handoff=True`` at concurrency ``--concurrency``; as its prefill
answer arrives its ``kv_transfer_params`` go to vLLM in batches of ``--decode-batch`` (while the
pipeline prefills the rest), and vLLM pulls each request's KV from both stages and decodes
``--decode-tokens`` tokens greedily. Then vLLM prefills and decodes the same prompts itself.
Both runs report per step the logprobs of their top ``--logprobs`` tokens; the two are compared
by ``wavepp.bench.greedy_agreement``: ``strict_mismatched_requests`` counts prompts whose decoded
tokens differ at all; ``mismatched_requests`` those that differ other than by a near-tie (at
the first differing step each run's token is among the other's top tokens and the reference's
logprob gap between them is at most ``tie_margin``); ``near_tie_divergences`` the others that
differ. ``logprob_noise`` is the largest |logprob difference| of one token at one step between
the runs over all steps before a divergence; ``tie_margin`` = ``tie_margin_factor`` x that,
or 0 (no divergence is a tie) where the noise exceeds ``logprob_noise_ceiling``.

Printed (``--json``: one JSON line): ``requests``, ``decode_tokens_per_request``,
``strict_mismatched_requests``, ``mismatched_requests``, ``near_tie_divergences``,
``logprob_noise``, ``tie_margin``, ``logprob_noise_ceiling``, ``failed_handoffs``, ``kv_bytes_transferred`` (sum over pulls),
``handoff_s_p50/p99`` (one request's pull from both stages and its write into vLLM's cache,
in vLLM's worker), ``prefill_s_p50`` (WavePP time to first token), ``overlapped_fraction`` (of
the stages' transfer seconds, the part during which the same stage was computing a
micro-batch), ``transfer_gb_s`` (bytes over the stages' summed transfer seconds),
``cached_fraction`` (cached prompt tokens on the stages), ``stage_pins_left`` (pinned blocks
on the stages at the end: 0 when every lease ended).

    scripts/vllm-venv.sh
    python benchmarks/pd_handoff.py --json
    python benchmarks/pd_handoff.py --json --family minimax_m2
    python benchmarks/pd_handoff.py --json --family deepseek_v3

This is a benchmark: it measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from wavepp.bench.vllm_args import add_vllm_args, add_vllm_rope_arg, missing_vllm

REPO = Path(__file__).resolve().parents[1]
STAGES = 2
VLLM_BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
CHECKPOINT_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # head_dim 32: the smallest vLLM's CPU attention takes
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


MINIMAX_SHAPE: dict[str, Any] = {
    **{k: v for k, v in CHECKPOINT_SHAPE.items() if k != "intermediate_size"},
    "head_dim": 32,
    "intermediate_size": 64,  # per expert; vLLM's CPU experts need a multiple of 32
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
    # keys of the published MiniMax-M2 config.json that vLLM's model reads and transformers'
    # MiniMaxM2Config does not write; rotary_dim = head_dim * partial_rotary_factor, so both
    # engines rotate the same 16 dims of each head
    "rotary_dim": 16,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
}
DEEPSEEK_SHAPE: dict[str, Any] = {
    **{k: v for k, v in CHECKPOINT_SHAPE.items() if k != "num_key_value_heads"},
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    # vLLM's CPU MLA backend takes only a 576-wide latent row: kv_lora_rank 512 + rope 64
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "moe_intermediate_size": 64,  # per expert; vLLM's CPU experts need a multiple of 32
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    # keys of the published DeepSeek-V3 config.json that vLLM's model reads (it loads the
    # routing bias only with noaux_tc) and transformers' DeepseekV3Config does not write
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
}
SHAPES: dict[str, dict[str, Any]] = {
    "llama": CHECKPOINT_SHAPE,
    "minimax_m2": MINIMAX_SHAPE,
    "deepseek_v3": DEEPSEEK_SHAPE,
}
"""The checkpoint of each ``--family`` (Hugging Face ``model_type``): the families whose every
layer a stage hands over (K/V, or an MLA latent) and that vLLM's CPU build loads. Of the others,
``glm_moe_dsa`` adds DSA indexer keys and ``kimi_linear`` KDA states, neither handed over."""
VLLM_BLOCK_SIZES: dict[str, int] = {"deepseek_v3": 16}
"""vLLM's block size where it is not ``VLLM_BLOCK_SIZE``: its CPU MLA backend takes 16 only."""
NATIVE_ROPE_FAMILIES = frozenset({"deepseek_v3"})
"""Families whose vLLM engine runs RoPE in PyTorch (``decode_runner --native-rope``): vLLM's CPU
RoPE kernel mis-rotates the [tokens, heads, dim] and strided views its MLA passes it, so vLLM's
own prefill and decode of an MLA model would be wrong on CPU, with or without a handoff."""


LM_HEAD_SCALE = 30.0
"""The random checkpoint's output projection is scaled by this: a tiny random model's logits
are nearly flat, and greedy decoding should be decided by margins far above the float32
differences between two engines' kernels (vLLM's own prefill vs WavePP's). Scaling the logits
widens every gap without touching the KV."""


def make_checkpoint(out_dir: Path, seed: int = 0, family: str = "llama") -> Path:
    """Write (once) the random-weight float32 checkpoint of ``SHAPES[family]``, its ``lm_head``
    scaled by ``LM_HEAD_SCALE``. In a MiniMax-M2 or DeepSeek-V3 checkpoint the norm weights (QK-
    or latent norms, layer norms) are 1 + N(0, 0.1^2) and the routing biases N(0, 0.05^2)
    (transformers leaves them at 1 and 0), so that the handed-over K or latent depends on the
    norms and the experts on the biases.

    Raises:
        ValueError: ``family`` is not a key of ``SHAPES``.
    """
    if family not in SHAPES:
        raise ValueError(f"family={family!r}: choose one of {sorted(SHAPES)}")
    if (out_dir / "config.json").exists():
        return out_dir
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(
        family, **SHAPES[family], bos_token_id=0, eos_token_id=1
    )
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        if family in ("minimax_m2", "deepseek_v3"):
            for param in model.parameters():
                if param.dim() == 1:
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(0.05 * torch.randn_like(buf))
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(str(out_dir))
    return out_dir


class DecodeEngine:
    """``decode_runner`` in vLLM's environment: one JSON batch per line in, one answer out."""

    def __init__(
        self,
        vllm_python: Path,
        model_dir: Path,
        work: Path,
        max_model_len: int,
        block_size: int = VLLM_BLOCK_SIZE,
        save_kv_dir: Path | None = None,
        native_rope: bool = False,
    ) -> None:
        """``save_kv_dir``: a reference engine saving its own prefill's cache there
        (``decode_runner --save-kv-dir``) instead of decoding handoffs; ``native_rope``:
        ``decode_runner --native-rope``."""
        self.stats_path = work / "handoff-stats.jsonl"
        self.log_path = work / "vllm.log"
        self.stats_path.unlink(missing_ok=True)  # this engine's pulls only
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env |= {
            "PYTHONPATH": str(REPO),  # the connector: standard library, torch and vLLM only
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "all"),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one process: killing it ends the engine
        }
        self.proc = subprocess.Popen(
            [
                str(vllm_python),
                *("-m", "wavepp.integrations.vllm.decode_runner", "--model", str(model_dir)),
                *("--block-size", str(block_size), "--stats-path", str(self.stats_path)),
                *("--max-model-len", str(max_model_len)),
                *(("--save-kv-dir", str(save_kv_dir)) if save_kv_dir else ()),
                *(("--native-rope",) if native_rope else ()),
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log_path, "wb"),  # noqa: SIM115 (closed with the process)
            text=True,
            start_new_session=True,
        )
        self._lock = threading.Lock()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the engine says it is ready. RuntimeError (log tail) if it exits."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError(f"vLLM decode engine did not start:\n{self.tail()}")

    def decode(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One batch through the engine (thread-safe: one batch at a time)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write(json.dumps(batch) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM decode engine exited:\n{self.tail()}")
        return json.loads(line)

    def pulls(self) -> list[dict[str, Any]]:
        if not self.stats_path.exists():
            return []
        text = self.stats_path.read_text()
        return [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines() if x.strip()]

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def native_rope(family: str, choice: str) -> bool:
    """Whether vLLM runs RoPE in PyTorch: ``choice`` ``auto`` (for ``NATIVE_ROPE_FAMILIES``),
    ``native`` or ``kernel`` (vLLM-CPU's RoPE kernel).

    Raises:
        ValueError: ``choice`` is none of those.
    """
    if choice not in ("auto", "native", "kernel"):
        raise ValueError(f"vllm_rope={choice!r}: choose auto, native or kernel")
    return family in NATIVE_ROPE_FAMILIES if choice == "auto" else choice == "native"


def _run_of(answer: dict[str, Any]) -> tuple[list[int], list[dict[int, float]]]:
    """A decode answer as (tokens, per-step {token: logprob}); a failed one is empty."""
    if answer.get("error"):
        return [], []
    steps = [{int(t): float(lp) for t, lp in step.items()} for step in answer.get("logprobs", [])]
    return list(answer["tokens"]), steps


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from wavepp.bench.greedy_agreement import TIE_MARGIN_FACTOR, agreement
    from wavepp.bench.workloads import mooncake_workload
    from wavepp.integrations.vllm.pull import stage_stats
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.runtime.hf_config import load_model_dir
    from wavepp.runtime.planning import CostModel
    from wavepp.runtime.request import PromptRequest
    from wavepp.runtime.serving.local import LocalPipeline

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pd-handoff-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_checkpoint(work / f"model-{args.family}", family=args.family)
    prompts = mooncake_workload(
        args.trace,
        args.requests,
        tokens_per_block=args.tokens_per_block,
        vocab_size=SHAPES[args.family]["vocab_size"],
        seed=1,
    ).prompts
    max_len = max(len(p) for p in prompts) + args.decode_tokens + 1
    vllm_block_size = VLLM_BLOCK_SIZES.get(args.family, VLLM_BLOCK_SIZE)
    engine = DecodeEngine(
        Path(args.vllm_python),
        model_dir,
        work,
        max_len,
        vllm_block_size,
        native_rope=native_rope(args.family, args.vllm_rope),
    )
    config = RuntimeConfig(
        model=load_model_dir(model_dir),
        model_dir=str(model_dir),
        engine="torch",
        num_stages=STAGES,
        block_size=args.wavepp_block_size,
        num_kv_blocks=[args.kv_blocks],
        handoff_lease_s=args.lease_s,
        torch_threads=1,
    )
    cost = CostModel(
        c=1e-3,
        g=1e-6,
        b=1e-5,
        a=1e-8,
        label="derived",
        source="pd_handoff: a rough CPU cost, only for chunk sizes",
    )
    try:
        async with LocalPipeline(config, cost, log_dir=str(work / "stages")) as pipeline:
            await asyncio.to_thread(engine.wait_ready, args.startup_timeout_s)
            scheduler = pipeline.scheduler
            assert scheduler is not None
            outcomes: dict[str, Any] = {}
            handed: dict[str, tuple[list[int], list[dict[int, float]]]] = {}
            queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
            sem = asyncio.Semaphore(args.concurrency)

            async def prefill(i: int) -> None:
                async with sem:
                    o = await scheduler.submit(PromptRequest(f"p{i}", prompts[i], handoff=True))
                outcomes[o.request_id] = o
                if o.ok:
                    params = pipeline.kv_transfer_params(o)
                    await queue.put(
                        {
                            "id": o.request_id,
                            "prompt": prompts[i],
                            "max_tokens": args.decode_tokens,
                            "logprobs": args.logprobs,
                            "kv_transfer_params": params,
                        }
                    )

            async def decoder() -> None:
                done = False
                while not done:
                    batch = [await queue.get()]
                    while len(batch) < args.decode_batch and not queue.empty():
                        batch.append(queue.get_nowait())
                    if batch[-1] is None:
                        batch.pop()
                        done = True
                    if batch:
                        for answer in await asyncio.to_thread(engine.decode, batch):
                            handed[answer["id"]] = _run_of(answer)

            began = time.perf_counter()
            decoding = asyncio.create_task(decoder())
            await asyncio.gather(*(prefill(i) for i in range(len(prompts))))
            await queue.put(None)
            await decoding
            handoff_wall_s = time.perf_counter() - began
            own = await asyncio.to_thread(
                engine.decode,
                [
                    {
                        "id": f"p{i}",
                        "prompt": p,
                        "max_tokens": args.decode_tokens,
                        "logprobs": args.logprobs,
                    }
                    for i, p in enumerate(prompts)
                ],
            )
            reference = {a["id"]: _run_of(a) for a in own}
            stats = [await asyncio.to_thread(stage_stats, a) for a in pipeline.handoff_addrs]
    finally:
        engine.stop()
    pulls = engine.pulls()
    ok_pulls = [p for p in pulls if p["ok"]]
    transfer_s = sum(float(s["transfer_s"]) for s in stats)
    overlapped_s = sum(float(s["overlapped_s"]) for s in stats)
    ok = [o for o in outcomes.values() if o.ok]
    verdicts = agreement(handed, reference)
    details = []
    for rid, (tokens, _) in reference.items():
        verdict = verdicts.verdicts[rid]
        if verdict.kind == "equal":
            continue
        o = outcomes.get(rid)
        details.append(
            {
                "id": rid,
                "verdict": verdict.kind,
                "prompt_tokens": len(prompts[int(rid[1:])]),
                "cached_tokens": o.num_cached_tokens if o is not None else -1,
                "first_differing_token": verdict.step,
                "reference_gap": verdict.gap,
                "reason": verdict.reason,
                "handed_tokens": list(handed.get(rid, ((), ()))[0]),
                "own_tokens": list(tokens),
            }
        )
    details.sort(key=lambda d: d["verdict"] != "mismatch")  # real mismatches first
    return {
        "mismatches": details[:10],
        "family": args.family,
        "requests": len(prompts),
        "decode_tokens_per_request": args.decode_tokens,
        "strict_mismatched_requests": verdicts.strict_mismatches,
        "mismatched_requests": verdicts.mismatches,
        "near_tie_divergences": verdicts.near_ties,
        "logprob_noise": verdicts.noise,
        "tie_margin": verdicts.margin,
        "tie_margin_factor": TIE_MARGIN_FACTOR,
        "logprob_noise_ceiling": verdicts.ceiling,
        "logprobs_top_k": args.logprobs,
        "failed_prefills": len(prompts) - len(ok),
        "failed_handoffs": len(pulls) - len(ok_pulls),
        "kv_bytes_transferred": sum(int(p["bytes"]) for p in ok_pulls),
        "handoff_s_p50": percentile([p["seconds"] for p in ok_pulls], 0.5),
        "handoff_s_p99": percentile([p["seconds"] for p in ok_pulls], 0.99),
        "prefill_s_p50": percentile([o.ttft_s for o in ok], 0.5),
        "overlapped_fraction": overlapped_s / transfer_s if transfer_s else 0.0,
        "transfer_gb_s": sum(int(s["bytes_sent"]) for s in stats) / transfer_s / 1e9
        if transfer_s
        else 0.0,
        "cached_fraction": sum(o.num_cached_tokens for o in ok)
        / max(1, sum(o.num_prompt_tokens for o in ok)),
        "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
        "stage_pins_left": sum(int(s["pinned_blocks"]) for s in stats),
        "wall_s": handoff_wall_s,
        "wavepp_block_size": args.wavepp_block_size,
        "vllm_block_size": vllm_block_size,
        "vllm_native_rope": native_rope(args.family, args.vllm_rope),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(SHAPES), default="llama", help="model_type")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--logprobs", type=int, default=5, help="top tokens per step, >= 1")
    parser.add_argument("--wavepp-block-size", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=4096, help="per stage")
    parser.add_argument("--lease-s", type=float, default=120.0)
    add_vllm_args(parser)
    add_vllm_rope_arg(parser)
    args = parser.parse_args(argv)
    if args.logprobs < 1:
        parser.error(f"--logprobs={args.logprobs}: must be >= 1 (the tie-aware comparison)")
    if missing := missing_vllm(args):
        print(missing, file=sys.stderr)
        return 2
    report = asyncio.run(run(args))
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:28s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
