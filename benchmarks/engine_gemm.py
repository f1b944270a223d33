"""The engine's dense kernels against the pre-packed CPU paths, side by side in one run.

For the shapes of the model ``vs_vllm.py`` serves (hidden 512, intermediate 1536, 8 heads of
64, 2 KV heads, float32), at ``--tokens`` rows (a micro-batch's tokens):

- GEMM ``x [M, K] @ W^T`` for qkv [768 x 512], o [512 x 512], gate_up [3072 x 512] and down
  [512 x 1536]: ``F.linear`` (what the engine calls; MKL's sgemm on a CPU build) against
  oneDNN with a weight reordered once for ``--pack-hint`` rows, whatever M is
  (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``: ``PackedLinear``'s
  path), MKL's packed sgemm (``torch.ops.mkl._mkl_reorder_linear_weight`` +
  ``_mkl_linear``, packed for exactly M rows, as inductor's CPU freezing uses it), and, when
  this interpreter has vLLM's CPU build, vLLM's ``onednn_mm`` (``create_onednn_mm``: what its
  CPU linear layers call).
- attention of one 512-token chunk over ``--contexts`` tokens of cached context, for each
  ``--attn-shapes`` (``gqa``: 8 heads of 64 over 2 KV heads, the served model's; ``mla``: 8
  heads, keys of 192, values of 128, DeepSeek-V3's per-head MLA dims):
  ``layers.common.attend`` as the engine calls it on a CPU (``attend``: SDPA's causal kernel
  over its own K/V when the context is 0, else ``attend_over_context``, two mask-free passes
  merged) against, when the context is > 0, ``attend`` given the dense [512, L + 512]
  causal mask (``dense_mask``: the engine's CPU path before the split; the mask built once,
  outside the timing, as a micro-batch shared it across layers), with ``--flex``
  ``torch.compile``d ``flex_attention`` with a causal block mask (compiled per context
  length, the compile not timed), and for ``gqa`` vLLM's CPU attention kernel
  (``cpu_attention_with_kv_cache`` over a paged cache of 32-token blocks) when available.

Every path's output is checked against the first (max abs difference printed). Each row times
every path ``--repeats`` times, paths alternated (order rotated per repeat), each timing the
median of ``--iters`` calls; a path's figure is the median of its repeats, and its ratio is
``F.linear``'s (``attend``'s) time over its own: > 1 means faster than what the engine does.
Only the ratios mean anything on a loaded machine. ``--threads`` torch threads (default 1: a
stage's). Last line with ``--json``: one JSON object of every figure. A benchmark: it measures
and prints, it asserts nothing.

    python benchmarks/engine_gemm.py --json
    /path/to/vllm-venv/bin/python benchmarks/engine_gemm.py --json   # adds vLLM's kernels
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wavepp.runtime.stage.engine.layers.common import attend, causal_mask  # noqa: E402

# name -> (N, K) of the weight [N, K]: the served model's per-layer projections.
SHAPES = {
    "qkv": (768, 512),
    "o": (512, 512),
    "gate_up": (3072, 512),
    "down": (512, 1536),
}
CHUNK, BLOCK = 512, 32
# name -> (heads, kv_heads, d_qk, d_v) of the attention rows.
ATTN_SHAPES = {"gqa": (8, 2, 64, 64), "mla": (8, 8, 192, 128)}

Fn = Callable[[], torch.Tensor]


def _vllm_ops() -> Any | None:
    try:
        from vllm import _custom_ops as ops  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 (any failure: vLLM's CPU build is not here)
        return None
    return ops


def gemm_paths(x: torch.Tensor, w: torch.Tensor, ops: Any | None, pack_hint: int) -> dict[str, Fn]:
    """Callables computing ``F.linear(x, w)`` each way available (weights packed here, once;
    oneDNN's for ``pack_hint`` rows whatever ``x``'s, MKL's for exactly ``x``'s rows)."""
    m = x.shape[0]
    paths: dict[str, Fn] = {"F.linear": lambda: F.linear(x, w)}
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, pack_hint)
        paths["mkldnn_packed"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""
        )
    if torch.backends.mkl.is_available() and x.dtype == torch.float32:
        mkl_w = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        paths["mkl_packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl_w, w, None, m)
    if ops is not None and getattr(ops, "_supports_onednn", False):
        handler = ops.create_onednn_mm(w.t(), 32)
        paths["vllm_onednn_mm"] = lambda: ops.onednn_mm(handler, x, None)
    return paths


def attention_paths(context: int, shape: str, ops: Any | None, flex: bool) -> dict[str, Fn]:
    """Callables computing one 512-token chunk's attention over ``context`` cached tokens,
    heads and head sizes of ``ATTN_SHAPES[shape]``."""
    heads, kv_heads, d_qk, d_v = ATTN_SHAPES[shape]
    total = context + CHUNK
    q = torch.randn(CHUNK, heads, d_qk)
    k = torch.randn(total, kv_heads, d_qk)
    v = torch.randn(total, kv_heads, d_v)
    scale = d_qk**-0.5
    paths: dict[str, Fn] = {"attend": lambda: attend(q, k, v, None, scale)}
    if context > 0:
        mask = causal_mask(context, CHUNK, q.device)
        paths["dense_mask"] = lambda: attend(q, k, v, mask, scale)
        if flex:
            paths["flex"] = _flex_path(q, k, v, context, scale)
    if shape != "gqa":
        return paths
    if ops is not None and hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        blocks = (total + BLOCK - 1) // BLOCK
        # vLLM's CPU layout: [blocks, kv_heads, 2 * block, head_dim], keys then values.
        cache = torch.zeros(blocks, kv_heads, 2 * BLOCK, d_qk)
        kc, vc = cache.chunk(2, dim=2)
        # written by vLLM's own cache write (its ISA may lay a block out its own way)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(total, dtype=torch.int64), "vec")
        qsl = torch.tensor([0, CHUNK], dtype=torch.int32)
        seq_lens = torch.tensor([total], dtype=torch.int32)
        table = torch.arange(blocks, dtype=torch.int32)[None, :]
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=d_qk,
            seq_lens=seq_lens,
            dtype=q.dtype,
            query_start_loc=qsl,
            causal=True,
            sliding_window_size=-1,
            isa="vec",
            enable_kv_split=False,
        )

        def vllm_attn() -> torch.Tensor:
            out = torch.empty_like(q)
            ops.cpu_attention_with_kv_cache(
                query=q,
                key_cache=kc,
                value_cache=vc,
                output=out,
                query_start_loc=qsl,
                seq_lens=seq_lens,
                scale=scale,
                causal=True,
                alibi_slopes=None,
                sliding_window=-1,
                block_table=table,
                softcap=0.0,
                scheduler_metadata=meta,
                s_aux=None,
            )
            return out

        paths["vllm_cpu_attn"] = vllm_attn
    return paths


def _flex_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, scale: float) -> Fn:
    """``flex_attention`` compiled for these shapes with a block mask of the bottom-right
    causal rule, as an ``attend`` ([x, heads, d] layout in and out); d_qk must equal d_v
    for the compiled CPU kernel, so it pads as ``attend_over_context`` does."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    d_v = v.shape[-1]
    if d_v < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - d_v))
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

    def causal(_b, _h, qi, ki):  # noqa: ANN001, ANN202
        return ki <= qi + context

    block_mask = create_block_mask(causal, None, None, q.shape[0], k.shape[0], device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)

    def run() -> torch.Tensor:
        out = compiled(qt, kt, vt, block_mask=block_mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)[..., :d_v]

    run()  # the compile, not timed
    return run


def _time_ms(fn: Fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(paths: dict[str, Fn], repeats: int, iters: int) -> dict[str, dict[str, float]]:
    """Per path: ``ms`` (median of repeats), ``ratio`` (first path's ms / this path's) and
    ``max_abs_diff`` against the first path's output."""
    names = list(paths)
    ref = paths[names[0]]()
    diffs = {n: float((paths[n]() - ref).abs().max()) for n in names}
    for fn in paths.values():  # warm-up: oneDNN primitives are created on the first call
        fn()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            samples[n].append(_time_ms(paths[n], iters))
    ms = {n: statistics.median(s) for n, s in samples.items()}
    base = ms[names[0]]
    return {
        n: {"ms": round(ms[n], 3), "ratio": round(base / ms[n], 3), "max_abs_diff": diffs[n]}
        for n in names
    }


def _print_rows(title: str, rows: dict[str, dict[str, dict[str, float]]]) -> None:
    if not rows:
        return
    names = list(dict.fromkeys(n for row in rows.values() for n in row))
    print(f"\n{title}: ms (ratio = baseline ms / path ms; max |diff| vs baseline)")
    print(f"{'':>18}" + "".join(f"{n:>26}" for n in names))
    for key, row in rows.items():
        cells = "".join(
            f"{row[n]['ms']:>9.2f} x{row[n]['ratio']:<5.2f} {row[n]['max_abs_diff']:>8.1e}"
            if n in row
            else f"{'-':>26}"
            for n in names
        )
        print(f"{key:>18}{cells}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ops = _vllm_ops()
    load0 = os.getloadavg()[0]
    gemm: dict[str, dict[str, dict[str, float]]] = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * k**-0.5
        for m in args.tokens:
            x = torch.randn(m, k)
            gemm[f"{name} M={m}"] = measure(
                gemm_paths(x, w, ops, args.pack_hint), args.repeats, args.iters
            )
            print(f"# {name} M={m} done", file=sys.stderr, flush=True)
    attn = {
        f"{shape} ctx={c}": measure(
            attention_paths(c, shape, ops, args.flex), args.repeats, args.iters
        )
        for shape in args.attn_shapes
        for c in args.contexts
    }
    load1 = os.getloadavg()[0]
    _print_rows("GEMM x[M,K] @ W[N,K]^T", gemm)
    _print_rows("attention, 512-token chunk", attn)
    totals: dict[str, float] = {}
    for row in gemm.values():
        for path, cell in row.items():
            totals[path] = totals.get(path, 0.0) + cell["ms"]
    print("\nGEMM total over every row (ms):")
    for path, ms in totals.items():
        print(f"  {path:>16}: {ms:9.2f}  F.linear / path = {totals['F.linear'] / ms:.3f}")
    print(
        f"threads {args.threads}, pack hint {args.pack_hint}, torch {torch.__version__}, vLLM ops "
        f"{'yes' if ops is not None else 'no'}, load {load0:.1f} -> {load1:.1f}"
    )
    return {
        "threads": args.threads,
        "pack_hint": args.pack_hint,
        "torch": torch.__version__,
        "vllm": ops is not None,
        "load": [load0, load1],
        "gemm": gemm,
        "attention": attn,
        "gemm_total_ms": totals,
    }


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def _shapes(text: str) -> list[str]:
    names = [t for t in text.split(",") if t]
    unknown = sorted(set(names) - set(ATTN_SHAPES))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown --attn-shapes {unknown}; known {sorted(ATTN_SHAPES)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=_ints, default=[512, 1024, 2048, 4096])
    parser.add_argument("--contexts", type=_ints, default=[0, 1024, 3072])
    parser.add_argument(
        "--attn-shapes",
        type=_shapes,
        default=["gqa"],
        help=f"attention rows' shapes, comma-separated of {sorted(ATTN_SHAPES)}",
    )
    parser.add_argument(
        "--flex", action="store_true", help="add compiled flex_attention (minutes to compile)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5, help="calls per timing (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--pack-hint", type=int, default=512, help="rows oneDNN's weight reorder is tuned for"
    )
    parser.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
