"""What each decoder layer of a model runs, as pure shapes: the engine's layer plan.

A family's :meth:`~wavepp.runtime.families.contract.ModelFamily.layer_plan` reads its
``config.json`` fields into a :class:`LayerPlan`; the checkpoint engine builds one layer module
per shape kind (``GQAShape`` -> ``engine/layers/gqa.py``, ``MLAShape`` -> ``mla.py``,
``DSAShape`` -> ``dsa.py``, ``KDAShape`` -> ``kda.py``, ``MoEShape`` -> ``moe.py``), so a family
made of existing layer kinds needs no engine code. Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GQAShape:
    """Shape of one GQA attention block.

    Attributes:
        hidden_size: model width.
        num_heads, num_kv_heads, head_dim: query heads, K/V heads, per-head width.
        rotary_dim: rotated dims of each head (<= head_dim, even).
        qk_norm: MiniMax-M2's RMSNorm on q and k (whole projection width).
        eps: RMSNorm epsilon.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    qk_norm: bool
    eps: float


@dataclass(frozen=True)
class MLAShape:
    """Shape of one MLA block (HF ``DeepseekV3Config`` names).

    Attributes:
        hidden_size, num_heads: model width, attention heads H.
        q_lora_rank: rank of the query compression, or None (a plain ``q_proj``).
        kv_lora_rank: width of the cached latent c.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per-head widths.
        rope_interleave: RoPE on interleaved pairs (DeepSeek weights, GLM) or rotate-half.
        eps: RMSNorm epsilon of ``q_a_layernorm`` / ``kv_a_layernorm`` (HF: 1e-6 fixed).
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    eps: float = 1e-6
    # NOTE: Kimi-Linear's MLA applies no positional encoding (the rope dims pass unrotated).
    use_rope: bool = True

    @property
    def qk_head_dim(self) -> int:
        """d_nope + d_rope: query/key width per head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached values per token: kv_lora_rank + d_rope."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class DSAShape:
    """Indexer shape (HF ``GlmMoeDsaConfig`` names).

    Attributes:
        hidden_size, q_lora_rank: model width and MLA's query latent width.
        n_heads, head_dim: indexer heads H_I and their width D.
        rope_dim: RoPE'd leading dims of D (``qk_rope_head_dim``).
        topk: tokens each query keeps (``index_topk``).
    """

    hidden_size: int
    q_lora_rank: int
    n_heads: int
    head_dim: int
    rope_dim: int
    topk: int


@dataclass(frozen=True)
class KDAShape:
    """Shape of one KDA layer (HF ``KimiLinearConfig``: ``linear_num_heads``,
    ``linear_head_dim``, ``linear_conv_kernel_dim``)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    conv_kernel: int
    eps: float


@dataclass(frozen=True)
class MoEShape:
    """Shape and routing of one MoE block.

    Attributes:
        hidden_size: model width.
        num_experts, top_k: routed experts and experts per token.
        expert_intermediate: each expert's FFN width.
        n_group, topk_group: grouped routing (1, 1 = plain top-k).
        norm_topk_prob: renormalise the chosen weights to sum 1.
        routed_scaling_factor: multiplier of the routed weights.
        shared_intermediate: width of the fused shared experts (0 = none).
        style: checkpoint naming (``engine/layers/moe.NAMING``): ``"deepseek"`` (``mlp.experts.{e}.gate_proj``,
            bias in ``mlp.gate``), ``"minimax"`` (``block_sparse_moe.experts.{e}.w1/w3/w2``, bias
            in ``block_sparse_moe``) or ``"kimi"`` (``block_sparse_moe``, w1/w3/w2, bias in
            ``gate``).
    """

    hidden_size: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    shared_intermediate: int
    style: str


@dataclass(frozen=True)
class LayerPlan:
    """Per-model facts the torch engine needs.

    Attributes:
        model_type: HF ``model_type``.
        hidden_size, vocab_size, num_layers: the generic shape.
        eps: RMSNorm epsilon of the decoder norms.
        rope_theta: RoPE base; rotary_dim: dims RoPE rotates per head (the table's width).
        tie_word_embeddings: ``lm_head`` is the embedding matrix.
        gqa, mla: the attention shape (one of them is None).
        dense_intermediate: width of dense MLP layers (0: none).
        moe: the MoE shape (None: no MoE layers).
        moe_layers: per layer, whether its feed-forward block is the MoE one.
        dsa: the DSA indexer shape (GLM-5), or None.
        indexer_full: per layer, whether it runs its own indexer (GLM-5 "full"); a "shared"
            layer reuses the selection of the full layer before it. Empty without DSA.
        kda: the KDA shape (Kimi-Linear), or None.
        linear_layers: per layer, whether it is a KDA (linear-attention) layer. Empty
            without KDA.
        mlp_prefix: checkpoint prefix of a dense layer's MLP inside ``model.layers.{i}.``.
    """

    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    eps: float
    rope_theta: float
    rotary_dim: int
    tie_word_embeddings: bool
    gqa: GQAShape | None
    mla: MLAShape | None
    dense_intermediate: int
    moe: MoEShape | None
    moe_layers: tuple[bool, ...]
    dsa: DSAShape | None = None
    indexer_full: tuple[bool, ...] = ()
    kda: KDAShape | None = None
    linear_layers: tuple[bool, ...] = ()
    mlp_prefix: str = "mlp."

    def is_linear(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a KDA (linear-attention) layer."""
        return self.kda is not None and self.linear_layers[layer]

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has an MoE feed-forward block."""
        return self.moe is not None and self.moe_layers[layer]

    def check_stage_start(self, first_layer: int) -> None:
        """Raise ValueError when a stage cannot begin at ``first_layer`` (a DSA "shared" layer:
        its top-k selection comes from the previous layer, on the previous stage)."""
        if self.dsa is not None and not self.indexer_full[first_layer]:
            full = [i for i, f in enumerate(self.indexer_full) if f]
            raise ValueError(
                f"partition: a stage begins at layer {first_layer}, a DSA 'shared' layer that "
                f"reuses the previous layer's top-k; stages must begin at a 'full' indexer layer "
                f"(indexer_types 'full' at layers {full})"
            )


def plan_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`LayerPlan` fields every family reads alike (the generic shape, norms, RoPE
    base, tied embeddings) from a normalised ``config.json``.

    Raises:
        ValueError: ``hidden_act`` other than ``silu`` (the only activation implemented).
    """
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.get('hidden_act')!r}: only 'silu' is implemented")
    rope = cfg.get("rope_parameters") or {}
    return {
        "model_type": cfg.get("model_type"),
        "hidden_size": int(cfg["hidden_size"]),
        "vocab_size": int(cfg["vocab_size"]),
        "num_layers": int(cfg["num_hidden_layers"]),
        "eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }
