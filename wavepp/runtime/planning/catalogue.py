"""Derived per-stage cost models for large models at a stated roofline.

Pure logic: no I/O, no torch. Every number comes from /work/shared/models.md ("Published
architectures of the paper's models"): the architecture table (config.json fields) and its
"Per-token prefill cost, how to derive" formulas. A stage's cost model (planner.CostModel,
t(L, x) = c + g*L + b*x + a*(2*L*x + x^2), DESIGN.md 'Cost model') is derived as::

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
  FlashMLA's sparse prefill does (models.md F2, F5): 2*H*(2*kv_lora + d_rope) FLOPs per pair and
  no re-expansion of the cache. Kimi K3 (dense MLA): MHA (non-absorbed) mode, vLLM's
  chunked-prefill path (models.md F1): 2*H*(d_nope + d_rope + d_v) FLOPs per pair, and kv_b
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

import math
from collections.abc import Callable
from dataclasses import dataclass

from wavepp.runtime.planning import CostModel

__all__ = [
    "CPU",
    "GPUSpec",
    "H200",
    "LayerCost",
    "MODELS",
    "ModelSpec",
    "derived_cost_model",
    "derived_stage_cost_models",
    "get_model",
    "list_models",
    "stage_layer_ranges",
]

# NOTE: named, not opened: the shapes below were transcribed from the project's shared models.md.
MODELS_MD = "shared/models.md"

# Bytes per weight of the served dtypes.
_BF16_BYTES = 2.0
_FP32_BYTES = 4.0
_FP8_BLOCK_BYTES = 1.0 + 4.0 / (128 * 128)  # e4m3 + one fp32 scale per 128x128 block
_MXFP4_BYTES = 0.5 + 1.0 / 32  # E2M1 + one E8M0 scale per 32 elements
_DSA_INDEXER_KEY_BYTES = 128 + 4  # d_I fp8 + 4-byte scale (models.md F7)
_DSA_TOP_K = 2048
_KDA_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class GPUSpec:
    """A device roofline.

    Attributes:
        name: device name, used in derived models' source strings.
        peak_flops: dense peak, FLOP/s (BF16 tensor cores for a GPU).
        hbm_bytes_per_s: memory bandwidth, bytes/s.
        mfu: achieved fraction of peak_flops in prefill (0, 1].
        mbu: achieved fraction of hbm_bytes_per_s (0, 1].
        overhead_s: fixed cost per micro-batch per stage, seconds (launches, sync).

    Raises:
        ValueError: a figure is not positive, or a fraction is outside (0, 1].
    """

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    mfu: float = 0.5
    mbu: float = 0.8
    overhead_s: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("peak_flops", "hbm_bytes_per_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"GPUSpec.{name}={value!r}: must be finite and > 0")
        for name in ("mfu", "mbu"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"GPUSpec.{name}={value!r}: must be in (0, 1]")
        if not math.isfinite(self.overhead_s) or self.overhead_s < 0:
            raise ValueError(f"GPUSpec.overhead_s={self.overhead_s!r}: must be finite and >= 0")

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s: peak_flops * mfu."""
        return self.peak_flops * self.mfu

    @property
    def bytes_per_s(self) -> float:
        """Achieved bytes/s: hbm_bytes_per_s * mbu."""
        return self.hbm_bytes_per_s * self.mbu


H200 = GPUSpec("H200", peak_flops=989e12, hbm_bytes_per_s=4.8e12, mfu=0.5, mbu=0.8, overhead_s=1e-3)
"""NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), 4.8 TB/s HBM3e."""

CPU = GPUSpec(
    "CPU, 2 cores", peak_flops=1.9e11, hbm_bytes_per_s=2e10, mfu=0.3, mbu=0.5, overhead_s=5e-4
)
"""A CPU-ish roofline for tiny-llama: 2 AVX-512 cores x ~3 GHz x 32 fp32 FLOP/cycle ~ 190
GFLOP/s peak, ~20 GB/s DRAM. Assumed, not measured; `wavepp calibrate` + `fit_cost_model` give
real numbers."""


@dataclass(frozen=True)
class LayerCost:
    """FLOPs, bytes and parameters of one decoder layer (device independent).

    Attributes:
        kind: e.g. "mla+indexer+moe", "kda+dense".
        linear_flops_per_token: projections and MLP/MoE, FLOPs per new token; what models.md's
            "linear FLOPs / token / layer" column counts (2 per multiply-add).
        other_flops_per_token: x-linear FLOPs outside that column, per new token: DSA sparse
            attention at top-k keys, KDA recurrence.
        pair_flops: score+value (+ indexer) FLOPs per causal (query, key) pair.
        context_flops_per_token: FLOPs per cached context token per chunk (MLA MHA-mode
            re-expansion of the cached latent).
        kv_bytes_per_token: KV bytes per context token, read once per chunk.
        num_params: weights in the layer (all experts).
        weight_bytes: bytes of those weights at the served dtype.
    """

    kind: str
    linear_flops_per_token: float
    other_flops_per_token: float
    pair_flops: float
    context_flops_per_token: float
    kv_bytes_per_token: float
    num_params: float
    weight_bytes: float


@dataclass(frozen=True)
class ModelSpec:
    """A model's per-layer costs, from models.md.

    Attributes:
        name: key in MODELS, e.g. "glm-5.2".
        hf_repo: Hugging Face repository.
        layers: one LayerCost per decoder layer, in layer order (MTP layers excluded).
        num_embedding_params: input embedding plus lm_head weights.
        lm_head_weight_bytes: lm_head bytes at the served dtype (read by the last stage).
        attention_note: the attention mode the derivation uses, in words.
        default_gpu: the roofline derived_cost_model uses when none is given.
    """

    name: str
    hf_repo: str
    layers: tuple[LayerCost, ...]
    num_embedding_params: float
    lm_head_weight_bytes: float
    attention_note: str
    default_gpu: GPUSpec

    @property
    def num_layers(self) -> int:
        """Decoder layers (MTP excluded)."""
        return len(self.layers)

    def linear_flops_per_token(self, layers: tuple[int, int] | None = None) -> float:
        """models.md's "linear" FLOPs per token over layers [first, last) (default: all)."""
        first, last = self.layer_range(layers)
        return sum(layer.linear_flops_per_token for layer in self.layers[first:last])

    def num_params(self) -> float:
        """All weights: layers (all experts) plus embedding and lm_head."""
        return sum(layer.num_params for layer in self.layers) + self.num_embedding_params

    def kv_bytes_per_token(self) -> float:
        """KV bytes per cached token over all layers."""
        return sum(layer.kv_bytes_per_token for layer in self.layers)

    def layer_range(self, layers: tuple[int, int] | None) -> tuple[int, int]:
        """Validated [first, last) (None: all layers).

        Raises:
            ValueError: not 0 <= first < last <= num_layers.
        """
        if layers is None:
            return 0, self.num_layers
        first, last = layers
        if not 0 <= first < last <= self.num_layers:
            raise ValueError(
                f"layers={layers!r}: need 0 <= first < last <= num_layers={self.num_layers} "
                f"of {self.name}"
            )
        return first, last


# -- per-component weight counts (models.md "Per-token prefill cost, how to derive") -----------
# FLOPs of a linear layer are 2 per weight per token, so these counts double as FLOPs / 2.


def _mla_weights(
    d: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v: int, gated: bool
) -> int:
    """MLA projections incl. kv_b: d*q_lora + q_lora*H*(nope+rope) + d*(kv_lora+rope) +
    H*v*d + kv_lora*H*(nope+v) [+ gate d*H*v for K3]."""
    weights = (
        d * q_lora
        + q_lora * heads * (nope + rope)
        + d * (kv_lora + rope)
        + heads * v * d
        + kv_lora * heads * (nope + v)
    )
    return weights + (d * heads * v if gated else 0)


def _gqa_weights(d: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """GQA projections: d*(H + 2K)*d_h + H*d_h*d."""
    return d * (heads + 2 * kv_heads) * head_dim + heads * head_dim * d


def _kda_weights(d: int, heads: int, head_dim: int, decay_rank: int) -> int:
    """KDA: q, k, v (3*d*H*d_k), output gate (d*H*d_v), o (H*d_v*d), plus the low-rank decay
    (d*r + r*H*d_k; r = 128 assumed, models.md) and beta (d*H) projections. d_k = d_v."""
    return 5 * d * heads * head_dim + d * decay_rank + decay_rank * heads * head_dim + d * heads


def _indexer_weights(d: int, q_lora: int, index_heads: int, index_dim: int) -> int:
    """DSA lightning indexer: q_lora*H_I*d_I + d*d_I + d*H_I."""
    return q_lora * index_heads * index_dim + d * index_dim + d * index_heads


def _mlp_weights(d: int, d_ff: int) -> int:
    """GLU MLP, 3 matrices: 3*d*d_ff."""
    return 3 * d * d_ff


@dataclass(frozen=True)
class _MoE:
    """MoE geometry: router d*E, routed experts of width f in a d_e-wide space, shared ones."""

    d: int
    num_experts: int
    experts_per_token: int
    expert_ffn: int
    num_shared: int
    shared_ffn: int
    expert_dim: int  # d_e: d, or K3's 3584-wide latent (then 2*d*d_e down/up projections)

    def router(self) -> int:
        return self.d * self.num_experts

    def latent(self) -> int:
        return 2 * self.d * self.expert_dim if self.expert_dim != self.d else 0

    def shared(self) -> int:
        return self.num_shared * _mlp_weights(self.d, self.shared_ffn)

    def active(self) -> int:
        routed = self.experts_per_token * _mlp_weights(self.expert_dim, self.expert_ffn)
        return self.router() + routed + self.shared() + self.latent()

    def all_routed(self) -> int:
        return self.num_experts * _mlp_weights(self.expert_dim, self.expert_ffn)


def _layer(
    kind: str,
    *,
    attention_weights: int,
    attention_bytes_per_weight: float,
    mlp_active_weights: int,
    mlp_bytes: float,
    mlp_params: int,
    other_flops_per_token: float = 0.0,
    pair_flops: float = 0.0,
    context_flops_per_token: float = 0.0,
    kv_bytes_per_token: float = 0.0,
) -> LayerCost:
    return LayerCost(
        kind=kind,
        linear_flops_per_token=2.0 * (attention_weights + mlp_active_weights),
        other_flops_per_token=other_flops_per_token,
        pair_flops=pair_flops,
        context_flops_per_token=context_flops_per_token,
        kv_bytes_per_token=kv_bytes_per_token,
        num_params=float(attention_weights + mlp_params),
        weight_bytes=attention_weights * attention_bytes_per_weight + mlp_bytes,
    )


def _moe_bytes(moe: _MoE, routed_bytes: float, other_bytes: float) -> float:
    return (
        moe.all_routed() * routed_bytes
        + (moe.shared() + moe.latent()) * other_bytes
        + moe.router() * _BF16_BYTES
    )


def _dsa_model(
    *,
    name: str,
    hf_repo: str,
    num_layers: int,
    d: int,
    heads: int,
    q_lora: int,
    kv_lora: int,
    nope: int,
    rope: int,
    v: int,
    index_heads: int,
    index_dim: int,
    indexer_layers: frozenset[int],
    num_dense: int,
    dense_ffn: int,
    moe: _MoE,
    vocab: int,
) -> ModelSpec:
    """MLA + DSA (+ MoE) models: GLM-5.2 and DeepSeek-V3.2, FP8 block-scaled weights."""
    mla = _mla_weights(d, heads, q_lora, kv_lora, nope, rope, v, gated=False)
    indexer = _indexer_weights(d, q_lora, index_heads, index_dim)
    mqa_pair = 2 * heads * (2 * kv_lora + rope)  # models.md: MLA MQA mode
    index_pair = 2 * index_heads * index_dim
    latent_bytes = (kv_lora + rope) * _BF16_BYTES
    layers = []
    for index in range(num_layers):
        has_indexer = index in indexer_layers
        attention = mla + (indexer if has_indexer else 0)
        if index < num_dense:
            mlp_active = mlp_params = _mlp_weights(d, dense_ffn)
            mlp_bytes = mlp_params * _FP8_BLOCK_BYTES
            kind = "mla+dense"
        else:
            mlp_active = moe.active()
            mlp_params = moe.router() + moe.all_routed() + moe.shared() + moe.latent()
            mlp_bytes = _moe_bytes(moe, _FP8_BLOCK_BYTES, _FP8_BLOCK_BYTES)
            kind = "mla+moe"
        if has_indexer:
            kind = kind.replace("mla", "mla+indexer")
        layers.append(
            _layer(
                kind,
                attention_weights=attention,
                attention_bytes_per_weight=_FP8_BLOCK_BYTES,
                mlp_active_weights=mlp_active,
                mlp_bytes=mlp_bytes,
                mlp_params=mlp_params,
                other_flops_per_token=float(_DSA_TOP_K * mqa_pair),
                pair_flops=float(index_pair if has_indexer else 0),
                kv_bytes_per_token=latent_bytes + (_DSA_INDEXER_KEY_BYTES if has_indexer else 0),
            )
        )
    return ModelSpec(
        name=name,
        hf_repo=hf_repo,
        layers=tuple(layers),
        num_embedding_params=2.0 * d * vocab,
        lm_head_weight_bytes=d * vocab * _BF16_BYTES,
        attention_note=(
            f"MLA + DSA: sparse MLA in MQA (absorbed) mode, {mqa_pair} FLOPs per pair at "
            f"top-{_DSA_TOP_K} keys per query (in b); lightning indexer {index_pair} FLOPs per "
            f"pair in {len(indexer_layers)} layers (in a)"
        ),
        default_gpu=H200,
    )


def _glm_5_2() -> ModelSpec:
    # models.md: indexer in 21 "full" layers 0, 1, 2, 6, 10, ..., 74 (IndexShare).
    indexer_layers = frozenset([0, 1, 2, *range(6, 75, 4)])
    assert len(indexer_layers) == 21, "models.md: GLM-5.2 has 21 indexer layers"
    return _dsa_model(
        name="glm-5.2",
        hf_repo="zai-org/GLM-5.2-FP8",
        num_layers=78,
        d=6144,
        heads=64,
        q_lora=2048,
        kv_lora=512,
        nope=192,
        rope=64,
        v=256,
        index_heads=32,
        index_dim=128,
        indexer_layers=indexer_layers,
        num_dense=3,
        dense_ffn=12288,
        moe=_MoE(
            d=6144,
            num_experts=256,
            experts_per_token=8,
            expert_ffn=2048,
            num_shared=1,
            shared_ffn=2048,
            expert_dim=6144,
        ),
        vocab=154880,
    )


def _deepseek_v3_2() -> ModelSpec:
    return _dsa_model(
        name="deepseek-v3.2",
        hf_repo="deepseek-ai/DeepSeek-V3.2",
        num_layers=61,
        d=7168,
        heads=128,
        q_lora=1536,
        kv_lora=512,
        nope=128,
        rope=64,
        v=128,
        index_heads=64,
        index_dim=128,
        indexer_layers=frozenset(range(61)),
        num_dense=3,
        dense_ffn=18432,
        moe=_MoE(
            d=7168,
            num_experts=256,
            experts_per_token=8,
            expert_ffn=2048,
            num_shared=1,
            shared_ffn=2048,
            expert_dim=7168,
        ),
        vocab=129280,
    )


def _minimax_m2_7() -> ModelSpec:
    d, heads, kv_heads, head_dim, vocab = 3072, 48, 8, 128, 200064
    moe = _MoE(
        d=d,
        num_experts=256,
        experts_per_token=8,
        expert_ffn=1536,
        num_shared=0,
        shared_ffn=0,
        expert_dim=d,
    )
    attention = _gqa_weights(d, heads, kv_heads, head_dim)
    layer = _layer(
        "gqa+moe",
        attention_weights=attention,
        attention_bytes_per_weight=_FP8_BLOCK_BYTES,
        mlp_active_weights=moe.active(),
        mlp_bytes=_moe_bytes(moe, _FP8_BLOCK_BYTES, _FP8_BLOCK_BYTES),
        mlp_params=moe.router() + moe.all_routed(),
        pair_flops=float(4 * heads * head_dim),  # models.md: GQA 4*H*d_h*P
        kv_bytes_per_token=2 * kv_heads * head_dim * _BF16_BYTES,
    )
    return ModelSpec(
        name="minimax-m2.7",
        hf_repo="MiniMaxAI/MiniMax-M2.7",
        layers=(layer,) * 62,
        num_embedding_params=2.0 * d * vocab,
        lm_head_weight_bytes=d * vocab * _BF16_BYTES,
        attention_note="full softmax GQA in all 62 layers, 4*H*d_h FLOPs per pair",
        default_gpu=H200,
    )


def _kimi_k3() -> ModelSpec:
    d, vocab = 7168, 163840
    heads, q_lora, kv_lora, nope, rope, v = 96, 1536, 512, 128, 64, 128
    kda_heads, kda_dim, decay_rank = 96, 128, 128
    # Routed experts in a 3584-wide latent; 2 full-width shared experts (models.md).
    moe = _MoE(
        d=d,
        num_experts=896,
        experts_per_token=16,
        expert_ffn=3072,
        num_shared=2,
        shared_ffn=3072,
        expert_dim=3584,
    )
    mla = _mla_weights(d, heads, q_lora, kv_lora, nope, rope, v, gated=True)
    kda = _kda_weights(d, kda_heads, kda_dim, decay_rank)
    mha_pair = 2 * heads * (nope + rope + v)  # models.md: MLA MHA mode
    reexpand = 2 * kv_lora * heads * (nope + v)  # kv_b over the cached latent, every chunk
    recurrence = kda_heads * (6 * kda_dim * kda_dim + 10 * _KDA_CHUNK_TOKENS * kda_dim)
    # 1-based MLA positions 4, 8, ..., 92, 93 -> 0-based 3, 7, ..., 91, 92.
    mla_layers = frozenset([*range(3, 92, 4), 92])
    assert len(mla_layers) == 24, "models.md: Kimi K3 has 24 MLA layers"
    moe_bytes = _moe_bytes(moe, _MXFP4_BYTES, _BF16_BYTES)
    moe_params = moe.router() + moe.all_routed() + moe.shared() + moe.latent()
    layers = []
    for index in range(93):
        if index == 0:  # first_k_dense_replace 1
            mlp_active = mlp_params = _mlp_weights(d, 33792)
            mlp_bytes = mlp_params * _BF16_BYTES
            mlp_kind = "dense"
        else:
            mlp_active, mlp_params, mlp_bytes, mlp_kind = moe.active(), moe_params, moe_bytes, "moe"
        if index in mla_layers:
            layer = _layer(
                f"mla+{mlp_kind}",
                attention_weights=mla,
                attention_bytes_per_weight=_BF16_BYTES,
                mlp_active_weights=mlp_active,
                mlp_bytes=mlp_bytes,
                mlp_params=mlp_params,
                pair_flops=float(mha_pair),
                context_flops_per_token=float(reexpand),
                kv_bytes_per_token=(kv_lora + rope) * _BF16_BYTES,
            )
        else:
            layer = _layer(
                f"kda+{mlp_kind}",
                attention_weights=kda,
                attention_bytes_per_weight=_BF16_BYTES,
                mlp_active_weights=mlp_active,
                mlp_bytes=mlp_bytes,
                mlp_params=mlp_params,
                other_flops_per_token=float(recurrence),
            )
        layers.append(layer)
    return ModelSpec(
        name="kimi-k3",
        hf_repo="moonshotai/Kimi-K3",
        layers=tuple(layers),
        num_embedding_params=2.0 * d * vocab,
        lm_head_weight_bytes=d * vocab * _BF16_BYTES,
        attention_note=(
            f"24 gated-MLA layers in MHA (non-absorbed) mode, {mha_pair} FLOPs per pair, "
            f"re-expanding the cached latent every chunk ({reexpand} FLOPs per context token, "
            f"in g); 69 KDA layers without an L term (recurrence {recurrence} FLOPs per token, "
            f"in b)"
        ),
        default_gpu=H200,
    )


def _tiny_llama() -> ModelSpec:
    """The project's "tiny-llama" preset (wavepp.runtime.stage.worker.engine.model_config), fp32 on CPU.

    Llama-style: hidden 128, 8 layers, 4 heads, 2 KV heads, head_dim 32, SwiGLU 352, vocab 1024.
    """
    d, num_layers, heads, kv_heads, head_dim, d_ff, vocab = 128, 8, 4, 2, 32, 352, 1024
    attention = _gqa_weights(d, heads, kv_heads, head_dim)
    mlp = _mlp_weights(d, d_ff)
    layer = _layer(
        "gqa+dense",
        attention_weights=attention,
        attention_bytes_per_weight=_FP32_BYTES,
        mlp_active_weights=mlp,
        mlp_bytes=mlp * _FP32_BYTES,
        mlp_params=mlp,
        pair_flops=float(4 * heads * head_dim),
        kv_bytes_per_token=2 * kv_heads * head_dim * _FP32_BYTES,
    )
    return ModelSpec(
        name="tiny-llama",
        hf_repo="(none: random weights from a config)",
        layers=(layer,) * num_layers,
        num_embedding_params=2.0 * d * vocab,
        lm_head_weight_bytes=d * vocab * _FP32_BYTES,
        attention_note="GQA 4/2 heads x 32, fp32",
        default_gpu=CPU,
    )


_BUILDERS: dict[str, Callable[[], ModelSpec]] = {
    "glm-5.2": _glm_5_2,
    "minimax-m2.7": _minimax_m2_7,
    "kimi-k3": _kimi_k3,
    "deepseek-v3.2": _deepseek_v3_2,
    "tiny-llama": _tiny_llama,
}

MODELS: dict[str, ModelSpec] = {name: build() for name, build in _BUILDERS.items()}
"""Model name -> ModelSpec: the paper's GLM-5.2, MiniMax-M2.7, Kimi K3, plus DeepSeek-V3.2 and
tiny-llama."""


def list_models() -> list[str]:
    """Names accepted by derived_cost_model, in MODELS order."""
    return list(MODELS)


def get_model(model: str) -> ModelSpec:
    """The ModelSpec of a name in list_models().

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return MODELS[model]
    except KeyError:
        raise ValueError(f"model={model!r}: unknown; known: {list_models()}") from None


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Even split of num_layers decoder layers over num_stages stages.

    Sizes differ by at most one; the first num_layers % num_stages stages get one more layer
    (the last stage also holds the lm_head). Same rule as the engines' balanced split
    (wavepp.runtime.stage.worker.engine.model_config.partition_layers).

    Returns:
        [first, last) per stage, in stage order, contiguous and covering [0, num_layers).

    Raises:
        ValueError: num_stages < 1 or num_stages > num_layers.
    """
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"num_stages={num_stages}: must be in [1, num_layers={num_layers}] (a stage holds "
            "at least one layer)"
        )
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if stage < extra else 0) for stage in range(num_stages)]
    ranges = []
    first = 0
    for size in sizes:
        ranges.append((first, first + size))
        first += size
    return ranges


def _layers_cost_model(
    spec: ModelSpec, gpu: GPUSpec, first: int, last: int, num_stages: int
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


def _source(spec: ModelSpec, gpu: GPUSpec, what: str, num_stages: int) -> str:
    return (
        f"derived: {spec.name} {what}, {num_stages} stages @ {gpu.name} "
        f"({gpu.peak_flops / 1e12:g} TFLOP/s x MFU {gpu.mfu:g}, "
        f"{gpu.hbm_bytes_per_s / 1e12:g} TB/s x MBU {gpu.mbu:g}, "
        f"overhead {gpu.overhead_s * 1e3:g} ms); {MODELS_MD}"
    )


def derived_stage_cost_models(
    model: str, gpu: GPUSpec | None = None, *, num_stages: int
) -> list[CostModel]:
    """One derived CostModel per stage of an even layer split (stage_layer_ranges).

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
        for first, last in stage_layer_ranges(spec.num_layers, num_stages)
    ]


def derived_cost_model(
    model: str,
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
        models.md.

    Raises:
        ValueError: unknown model, num_stages outside [1, num_layers], or a bad layer range.
    """
    spec = get_model(model)
    gpu = spec.default_gpu if gpu is None else gpu
    ranges = stage_layer_ranges(spec.num_layers, num_stages)
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
