"""Derived per-stage cost models for large models at a stated roofline.

Pure logic: no I/O, no torch. Every number comes from docs/model-costs.md ("Published
architectures of the paper's models"): the architecture table (config.json fields) and its
"Per-token prefill cost, how to derive" formulas. A stage's cost model (planner.CostModel,
t(L, x) = c + g*L + b*x + a*(2*L*x + x^2), docs/design.md 'Cost model') is derived as::

    b = sum over the stage's layers of (linear FLOPs + other x-linear FLOPs) per token
        / (peak_flops * mfu)
    a = sum of score+value FLOPs per causal (query, key) pair / (2 * peak_flops * mfu)
        (a chunk has P = L*x + x*(x+1)/2 pairs and a*(2*L*x + x^2) ~ a * 2*P)
    g = sum of (KV bytes per context token / (hbm_bytes_per_s * mbu)
               + FLOPs per context token per chunk / (peak_flops * mfu))
    c = (weight bytes of the stage [+ lm_head on the last stage]) / (hbm_bytes_per_s * mbu)
        + overhead_s

Assumptions (stated once, here):

- Weights: a prefill micro-batch holds thousands of tokens and each token picks k of E routed
  experts, so every expert of the stage is touched: c reads *all* the stage's weights once
  (not just the active ones), at the served dtype: FP8 e4m3 with one fp32 scale per 128x128
  block (1 + 4/16384 bytes per weight) for GLM-5.2 (the official -FP8 release), MiniMax-M2.7
  and DeepSeek-V3.2; Kimi K3 routed experts MXFP4 (4.25 bits), the rest BF16. Router gates,
  embeddings and lm_head stay BF16. The weight read and the compute are added, not overlapped
  (pessimistic by at most the weight-read time). Norms, biases and the embedding gather are
  ignored (tiny).
- Compute: all FLOPs at the dense BF16 peak times mfu (conservative for FP8 GEMMs).
- MLA mode. GLM-5.2 and DeepSeek-V3.2 (DSA): the sparse MLA runs in MQA (absorbed) mode, as
  FlashMLA's sparse prefill does (docs/model-costs.md F2, F5): 2*H*(2*kv_lora + d_rope) FLOPs per pair and
  no re-expansion of the cache. Kimi K3 (dense MLA): MHA (non-absorbed) mode, vLLM's
  chunked-prefill path (docs/model-costs.md F1): 2*H*(d_nope + d_rope + d_v) FLOPs per pair, and kv_b
  re-expands the whole cached latent on every chunk, which puts 2*kv_lora*H*(d_nope + d_v)
  FLOPs per context token per MLA layer into g.
- DSA top-k (GLM-5.2, DeepSeek-V3.2): sparse attention costs the MQA-mode pair FLOPs times
  sum_i min(L + i, 2048). The quadratic form cannot hold a min, so it is taken as 2048 keys per
  query, a b term (exact once L >= 2048; over-estimates chunks of short prompts, by 12.5% of
  the sparse term for a fresh 8192-token chunk). The lightning indexer is quadratic (2*H_I*d_I
  FLOPs per pair, FP8 counted at the BF16 rate) in the layers that run it: GLM-5.2's 21
  IndexShare layers, all 61 of DeepSeek-V3.2. The top-k selection itself is not counted.
- KV read: g reads every context token's KV (BF16 latent / K,V; FP8 indexer keys, 132 B) once
  per chunk per layer; for DSA that is an upper bound. The term is tiny next to compute.
- Kimi K3: only the 24 MLA layers have an L term (a and g). The 69 KDA layers add their
  chunkwise recurrence, ~H*(6*d_k*d_v + 10*C*d_k) FLOPs per token at C = 64, to b; their
  per-sequence state (6.21 MiB per layer) read/written per chunk is ignored (~30 us per stage).
- lm_head: its weight read is in the last stage's c; its FLOPs (one logit row per request)
  are ignored (~2 GFLOP, microseconds).
- MTP layers are not part of prefill and are left out.

GPU figures: H200 SXM, NVIDIA H200 Tensor Core GPU datasheet: 1,979 TFLOP/s BF16 *with
sparsity*, so 989 TFLOP/s dense; HBM3e 4.8 TB/s; 141 GB. mfu 0.5, mbu 0.8 and 1 ms overhead per
micro-batch per stage are assumptions, not measurements.
"""

from __future__ import annotations

from wavepp.api.layer_split import split_layers
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.published import MODELS, get_model, list_models
from wavepp.runtime.planning.shapes import CPU, H200, MODELS_MD, GPUSpec, LayerCost, ModelShape

__all__ = [
    "CPU",
    "GPUSpec",
    "H200",
    "LayerCost",
    "MODELS",
    "ModelShape",
    "derived_cost_model",
    "derived_stage_cost_models",
    "get_model",
    "list_models",
]


def _layers_cost_model(
    spec: ModelShape, gpu: GPUSpec, first: int, last: int, num_stages: int
) -> CostModel:
    layers = spec.layers[first:last]
    flops = gpu.flops_per_s
    bandwidth = gpu.bytes_per_s
    weight_bytes = sum(layer.weight_bytes for layer in layers)
    if last == spec.num_layers:
        weight_bytes += spec.lm_head_weight_bytes
    return CostModel(
        c=weight_bytes / bandwidth + gpu.overhead_s,
        g=sum(
            layer.kv_bytes_per_token / bandwidth + layer.context_flops_per_token / flops
            for layer in layers
        ),
        b=sum(layer.linear_flops_per_token + layer.other_flops_per_token for layer in layers)
        / flops,
        a=sum(layer.pair_flops for layer in layers) / (2.0 * flops),
        label="derived",
        source=_source(spec, gpu, f"layers [{first},{last}) of {spec.num_layers}", num_stages),
    )


def _source(spec: ModelShape, gpu: GPUSpec, what: str, num_stages: int) -> str:
    return (
        f"derived: {spec.name} {what}, {num_stages} stages @ {gpu.name} "
        f"({gpu.peak_flops / 1e12:g} TFLOP/s x MFU {gpu.mfu:g}, "
        f"{gpu.hbm_bytes_per_s / 1e12:g} TB/s x MBU {gpu.mbu:g}, "
        f"overhead {gpu.overhead_s * 1e3:g} ms); {MODELS_MD}"
    )


def derived_stage_cost_models(
    model: str | ModelShape, gpu: GPUSpec | None = None, *, num_stages: int
) -> list[CostModel]:
    """One derived CostModel per stage of the balanced layer split (``split_layers``).

    Args:
        model: a name from list_models().
        gpu: roofline; None uses the model's default (H200; CPU for tiny-llama).
        num_stages: S.

    Returns:
        S models, in stage order; the last includes the lm_head weight read.

    Raises:
        ValueError: unknown model, or num_stages outside [1, num_layers].
    """
    spec = get_model(model)
    gpu = spec.default_gpu if gpu is None else gpu
    return [
        _layers_cost_model(spec, gpu, first, last, num_stages)
        for first, last in split_layers(spec.num_layers, num_stages)
    ]


def derived_cost_model(
    model: str | ModelShape,
    gpu: GPUSpec | None = None,
    *,
    num_stages: int,
    layers: tuple[int, int] | None = None,
) -> CostModel:
    """Derived cost model of one stage of a large model at a roofline (module docstring).

    Args:
        model: a name from list_models().
        gpu: roofline; None uses the model's default (H200; CPU for tiny-llama).
        num_stages: S, pipeline stages.
        layers: the stage's [first, last) layer range. None: the slowest stage of the even
            split into num_stages, as the coefficient-wise maximum over the stages (an upper
            bound on every stage's cost at every (L, x); what a planner budgets against).

    Returns:
        CostModel with label "derived" and a source naming the model, layers, GPU figures and
        docs/model-costs.md.

    Raises:
        ValueError: unknown model, num_stages outside [1, num_layers], or a bad layer range.
    """
    spec = get_model(model)
    gpu = spec.default_gpu if gpu is None else gpu
    ranges = split_layers(spec.num_layers, num_stages)
    if layers is not None:
        first, last = spec.layer_range(layers)
        return _layers_cost_model(spec, gpu, first, last, num_stages)
    stages = [_layers_cost_model(spec, gpu, first, last, num_stages) for first, last in ranges]
    return CostModel(
        c=max(stage.c for stage in stages),
        g=max(stage.g for stage in stages),
        b=max(stage.b for stage in stages),
        a=max(stage.a for stage in stages),
        label="derived",
        source=_source(spec, gpu, "slowest stage (coefficient-wise max)", num_stages),
    )
