"""The vocabulary of the derived cost models: a GPU's roofline (``GPUSpec``, ``H200``, ``CPU``), a
layer's cost per token and per (query, key) pair (``LayerCost``), a model (``ModelShape``), and the
weight counts of the layer kinds (MLA, GQA, KDA, the DSA indexer, MLP, MoE). Formulas and
assumptions: ``wavepp.runtime.planning.catalogue``'s docstring. Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Named in each derived cost model's source, not opened: the shapes below are its tables.
MODELS_MD = "docs/model-costs.md"


# Bytes per weight of the served dtypes.
BF16_BYTES = 2.0


FP32_BYTES = 4.0


FP8_BLOCK_BYTES = 1.0 + 4.0 / (128 * 128)  # e4m3 + one fp32 scale per 128x128 block


MXFP4_BYTES = 0.5 + 1.0 / 32  # E2M1 + one E8M0 scale per 32 elements


DSA_INDEXER_KEY_BYTES = 128 + 4  # d_I fp8 + 4-byte scale (docs/model-costs.md F7)


DSA_TOP_K = 2048


KDA_CHUNK_TOKENS = 64


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
        memory_bytes: device memory of one GPU, bytes; None when the roofline has no memory
            figure (then no KV capacity is derived for it: ``planning.memory``).

    Raises:
        ValueError: a figure is not positive, or a fraction is outside (0, 1].
    """

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    mfu: float = 0.5
    mbu: float = 0.8
    overhead_s: float = 1e-3
    memory_bytes: float | None = None

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
        if self.memory_bytes is not None and (
            not math.isfinite(self.memory_bytes) or self.memory_bytes <= 0
        ):
            raise ValueError(
                f"GPUSpec.memory_bytes={self.memory_bytes!r}: must be finite and > 0, or None"
            )

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s: peak_flops * mfu."""
        return self.peak_flops * self.mfu

    @property
    def bytes_per_s(self) -> float:
        """Achieved bytes/s: hbm_bytes_per_s * mbu."""
        return self.hbm_bytes_per_s * self.mbu


H200 = GPUSpec(
    "H200",
    peak_flops=989e12,
    hbm_bytes_per_s=4.8e12,
    mfu=0.5,
    mbu=0.8,
    overhead_s=1e-3,
    memory_bytes=141e9,
)


"""NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), 4.8 TB/s HBM3e,
141 GB HBM3e (taken as 141e9 bytes; the driver reports a little more, so this is the lower
figure)."""


CPU = GPUSpec(
    "CPU, 2 cores", peak_flops=1.9e11, hbm_bytes_per_s=2e10, mfu=0.3, mbu=0.5, overhead_s=5e-4
)


"""A CPU-ish roofline for tiny-llama: 2 AVX-512 cores x ~3 GHz x 32 fp32 FLOP/cycle ~ 190
GFLOP/s peak, ~20 GB/s DRAM. Assumed, not measured; `wavepp calibrate` + `fit_cost_model` give
real numbers. No memory figure: tiny-llama's KV capacity stays a fixed default."""


@dataclass(frozen=True)
class LayerCost:
    """FLOPs, bytes and parameters of one decoder layer (device independent).

    Attributes:
        kind: e.g. "mla+indexer+moe", "kda+dense".
        linear_flops_per_token: projections and MLP/MoE, FLOPs per new token; what docs/model-costs.md's
            "linear FLOPs / token / layer" column counts (2 per multiply-add).
        other_flops_per_token: x-linear FLOPs outside that column, per new token: DSA sparse
            attention at top-k keys, KDA recurrence.
        pair_flops: score+value (+ indexer) FLOPs per causal (query, key) pair.
        context_flops_per_token: FLOPs per cached context token per chunk (MLA MHA-mode
            re-expansion of the cached latent).
        kv_bytes_per_token: KV bytes per context token, read once per chunk.
        num_params: weights in the layer (all experts).
        weight_bytes: bytes of those weights at the served dtype.
        num_kv_heads: how many ways tensor parallelism can split the layer's per-token KV:
            GQA's K KV heads; 1 for MLA, whose compressed latent (and DSA indexer key) every
            rank holds whole (vLLM's MLA backends use one KV head, replicated per TP rank).
        state_bytes_per_request: bytes the layer holds once per request whatever its length
            (KDA's recurrent state and short-convolution tails; 0 for attention layers).
        split: how the layer divides over a tensor- or expert-parallel group
            (``planning.parallel``); None where the shape does not carry it (a layer built
            from an arbitrary config.json), which then prices only one GPU per stage.
    """

    kind: str
    linear_flops_per_token: float
    other_flops_per_token: float
    pair_flops: float
    context_flops_per_token: float
    kv_bytes_per_token: float
    num_params: float
    weight_bytes: float
    num_kv_heads: int = 1
    state_bytes_per_request: float = 0.0
    split: LayerSplit | None = None


@dataclass(frozen=True)
class LayerSplit:
    """The geometry tensor and expert parallelism divide (``planning.parallel`` prices it).

    Attributes:
        hidden_size: d, elements per token of the residual stream: what an all-reduce or an
            expert dispatch/combine moves per token.
        attention_flops_per_token: the attention projections' share of the layer's
            ``linear_flops_per_token`` (the rest is the MLP or MoE).
        attention_weight_bytes: the attention projections' share of ``weight_bytes``.
        attention_width: N of the attention projections tensor parallelism splits (query heads
            x head width), elements.
        mlp_width: N tensor parallelism splits in the feed-forward block: the dense MLP's d_ff,
            or one routed expert's intermediate width f.
        moe: the MoE geometry of the layer, None for a dense MLP.
    """

    hidden_size: int
    attention_flops_per_token: float
    attention_weight_bytes: float
    attention_width: int
    mlp_width: int
    moe: MoE | None = None


@dataclass(frozen=True)
class ModelShape:
    """A model's per-layer costs, from docs/model-costs.md.

    Attributes:
        name: key in MODELS, e.g. "glm-5.2".
        hf_repo: Hugging Face repository.
        layers: one LayerCost per decoder layer, in layer order (MTP layers excluded).
        num_embedding_params: input embedding plus lm_head weights.
        lm_head_weight_bytes: lm_head bytes at the served dtype (read by the last stage).
        attention_note: the attention mode the derivation uses, in words.
        default_gpu: the roofline derived_cost_model uses when none is given.
        activation_bytes_per_token: peak activation bytes per new token of a micro-batch
            inside one layer's forward (``activation_bytes_per_token()``); sizes the
            activation workspace in ``planning.memory``.
    """

    name: str
    hf_repo: str
    layers: tuple[LayerCost, ...]
    num_embedding_params: float
    lm_head_weight_bytes: float
    attention_note: str
    default_gpu: GPUSpec
    activation_bytes_per_token: float

    @property
    def num_layers(self) -> int:
        """Decoder layers (MTP excluded)."""
        return len(self.layers)

    def linear_flops_per_token(self, layers: tuple[int, int] | None = None) -> float:
        """docs/model-costs.md's "linear" FLOPs per token over layers [first, last) (default: all)."""
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


def mla_weights(
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


def gqa_weights(d: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """GQA projections: d*(H + 2K)*d_h + H*d_h*d."""
    return d * (heads + 2 * kv_heads) * head_dim + heads * head_dim * d


def kda_weights(d: int, heads: int, head_dim: int, decay_rank: int) -> int:
    """KDA: q, k, v (3*d*H*d_k), output gate (d*H*d_v), o (H*d_v*d), plus the low-rank decay
    (d*r + r*H*d_k; r = 128 assumed, docs/model-costs.md) and beta (d*H) projections. d_k = d_v."""
    return 5 * d * heads * head_dim + d * decay_rank + decay_rank * heads * head_dim + d * heads


def indexer_weights(d: int, q_lora: int, index_heads: int, index_dim: int) -> int:
    """DSA lightning indexer: q_lora*H_I*d_I + d*d_I + d*H_I."""
    return q_lora * index_heads * index_dim + d * index_dim + d * index_heads


def mlp_weights(d: int, d_ff: int) -> int:
    """GLU MLP, 3 matrices: 3*d*d_ff."""
    return 3 * d * d_ff


@dataclass(frozen=True)
class MoE:
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
        return self.num_shared * mlp_weights(self.d, self.shared_ffn)

    def active(self) -> int:
        routed = self.experts_per_token * mlp_weights(self.expert_dim, self.expert_ffn)
        return self.router() + routed + self.shared() + self.latent()

    def all_routed(self) -> int:
        return self.num_experts * mlp_weights(self.expert_dim, self.expert_ffn)

    def activation_width(self) -> int:
        """Elements per token live in a fused MoE forward: per routed copy (k per token) the
        gate/up output 2f, the activated f and the down output d_e (vLLM ``fused_moe``'s
        intermediate caches 1-3), plus the shared experts' 2*f_s."""
        routed = self.experts_per_token * (3 * self.expert_ffn + self.expert_dim)
        return routed + self.num_shared * mlp_activation_width(self.shared_ffn)


def activation_bytes_per_token(d: int, attention_width: int, mlp_width: int) -> float:
    """Peak activation bytes per new token inside one layer's forward, BF16.

    Live at once: the residual stream, the normed layer input and the received (or next sent)
    hidden state, 3*d, plus the widest intermediate of the layer: attention (projected
    queries / attention output) or MLP (``mlp_activation_width``). An estimate of what vLLM's
    profiling forward at the largest token budget would measure, not a measurement.
    """
    return BF16_BYTES * (3 * d + max(attention_width, mlp_width))


def mlp_activation_width(d_ff: int) -> int:
    """Dense GLU MLP: gate and up outputs, 2*d_ff elements per token."""
    return 2 * d_ff


def make_layer(
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
    num_kv_heads: int = 1,
    state_bytes_per_request: float = 0.0,
    hidden_size: int = 0,
    attention_width: int = 0,
    mlp_width: int = 0,
    moe: MoE | None = None,
) -> LayerCost:
    """One LayerCost; with ``hidden_size`` > 0 it carries its ``LayerSplit`` (the attention
    share of FLOPs and weight bytes follows from ``attention_weights``)."""
    split = None
    if hidden_size > 0:
        split = LayerSplit(
            hidden_size=hidden_size,
            attention_flops_per_token=2.0 * attention_weights,
            attention_weight_bytes=attention_weights * attention_bytes_per_weight,
            attention_width=attention_width,
            mlp_width=mlp_width,
            moe=moe,
        )
    return LayerCost(
        kind=kind,
        linear_flops_per_token=2.0 * (attention_weights + mlp_active_weights),
        other_flops_per_token=other_flops_per_token,
        pair_flops=pair_flops,
        context_flops_per_token=context_flops_per_token,
        kv_bytes_per_token=kv_bytes_per_token,
        num_params=float(attention_weights + mlp_params),
        weight_bytes=attention_weights * attention_bytes_per_weight + mlp_bytes,
        num_kv_heads=num_kv_heads,
        state_bytes_per_request=state_bytes_per_request,
        split=split,
    )


def kda_state_bytes(heads: int, head_dim: int, conv_kernel: int) -> float:
    """KDA state per request and layer (docs/model-costs.md "KV bytes per token" [K4]): the fp32
    recurrent state H*d_k*d_v*4 (d_k = d_v) plus the BF16 short-convolution tails of q, k and v,
    3*H*d_k*(conv_kernel - 1)*2."""
    return (
        heads * head_dim * head_dim * FP32_BYTES
        + 3 * heads * head_dim * (conv_kernel - 1) * BF16_BYTES
    )


def moe_weight_bytes(moe: MoE, routed_bytes: float, other_bytes: float) -> float:
    return (
        moe.all_routed() * routed_bytes
        + (moe.shared() + moe.latent()) * other_bytes
        + moe.router() * BF16_BYTES
    )
