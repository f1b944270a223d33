"""Families of multi-head latent attention layers: DeepSeek-V3, GLM-5 (``glm_moe_dsa``: MLA +
DSA sparse attention) and Kimi-Linear (``kimi_linear``: KDA linear attention + MLA).

Config fields (HF ``DeepseekV3Config``, ``GlmMoeDsaConfig``, ``KimiLinearConfig``): the MLA
widths (``q_lora_rank`` optional, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
``v_head_dim``); routed experts (``n_routed_experts`` or ``num_local_experts``) of width
``moe_intermediate_size`` from layer ``first_k_dense_replace`` on, or per ``mlp_layer_types``;
GLM-5's indexer (``index_n_heads``, ``index_head_dim``, ``index_topk``, ``indexer_types``);
Kimi's KDA (``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``,
``layer_types``). Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from wavepp.runtime.families.contract import AttentionShape, ModelFamily, per_layer, required
from wavepp.runtime.families.layer_plan import (
    DSAShape,
    KDAShape,
    LayerPlan,
    MLAShape,
    MoEShape,
    plan_fields,
)
from wavepp.runtime.planning.from_config import dsa_model_shape, mla_model_shape
from wavepp.runtime.planning.shapes import ModelShape


def _mla_attention(
    cfg: Mapping[str, Any], where: str, cached: Callable[[int, int], float]
) -> AttentionShape:
    """H heads of width ``qk_nope + qk_rope``, H "KV heads" (the cache itself is the latent,
    ``engine/layers/mla.py``); ``cached(num_layers, latent)`` is the cached values per token
    summed over the layers (averaged here)."""
    heads = int(required(cfg, "num_attention_heads", where))
    head_dim = int(required(cfg, "qk_nope_head_dim", where)) + int(
        required(cfg, "qk_rope_head_dim", where)
    )
    n = int(required(cfg, "num_hidden_layers", where))
    latent = int(required(cfg, "kv_lora_rank", where)) + int(cfg["qk_rope_head_dim"])
    return AttentionShape(
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        kv_values_per_token_per_layer=cached(n, latent) / n,
    )


def _mla_plan(
    cfg: Mapping[str, Any], *, style: str, rope_interleave: bool | None, use_rope: bool
) -> LayerPlan:
    """MLA layers with dense or MoE feed-forward blocks (``rope_interleave`` None: the
    config's ``rope_interleave``, default true)."""
    common = plan_fields(cfg)
    d, n = common["hidden_size"], common["num_layers"]
    mla = MLAShape(
        hidden_size=d,
        num_heads=int(cfg["num_attention_heads"]),
        q_lora_rank=None if cfg.get("q_lora_rank") is None else int(cfg["q_lora_rank"]),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=(
            bool(cfg.get("rope_interleave", True)) if rope_interleave is None else rope_interleave
        ),
        use_rope=use_rope,
    )
    n_routed = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    moe = None
    if n_routed:
        moe = MoEShape(
            hidden_size=d,
            num_experts=n_routed,
            top_k=int(cfg["num_experts_per_tok"]),
            expert_intermediate=int(cfg["moe_intermediate_size"]),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            shared_intermediate=int(cfg["moe_intermediate_size"])
            * int(cfg.get("n_shared_experts") or 0),
            style=style,
        )
        if moe.num_experts % moe.n_group:
            raise ValueError(
                f"n_routed_experts={moe.num_experts} must be a multiple of n_group={moe.n_group}"
            )
    first_moe = int(cfg.get("first_k_dense_replace") or 0)
    moe_layers = tuple(moe is not None and i >= first_moe for i in range(n))
    if cfg.get("mlp_layer_types"):
        moe_layers = tuple(t == "sparse" for t in per_layer(cfg, "mlp_layer_types", n))
    return LayerPlan(
        **common,
        rotary_dim=mla.qk_rope_head_dim,
        gqa=None,
        mla=mla,
        dense_intermediate=int(cfg["intermediate_size"]),
        moe=moe,
        moe_layers=moe_layers,
    )


class DeepSeekV3(ModelFamily):
    """MLA (latent KV cache) + MoE (grouped top-k, shared experts), dense first layers."""

    model_type = "deepseek_v3"
    summary = "MLA (latent KV cache) + MoE (grouped top-k, shared experts)"
    tensor_parallel = True

    def attention(self, cfg: Mapping[str, Any], where: str) -> AttentionShape:
        return _mla_attention(cfg, where, lambda n, latent: float(latent * n))

    def layer_plan(self, cfg: Mapping[str, Any]) -> LayerPlan:
        return _mla_plan(cfg, style="deepseek", rope_interleave=None, use_rope=True)

    def model_shape(self, cfg: Mapping[str, Any], *, name: str) -> ModelShape:
        return mla_model_shape(cfg, name=name, linear_attention=False)


class GlmMoeDsa(ModelFamily):
    """MLA + DSA sparse attention (its indexer keys cached beside the latent) + MoE (GLM-5)."""

    model_type = "glm_moe_dsa"
    summary = "MLA + DSA sparse attention (indexer key cache) + MoE"
    tensor_parallel = True

    def attention(self, cfg: Mapping[str, Any], where: str) -> AttentionShape:
        def cached(n: int, latent: int) -> float:
            # the latent in every layer, the indexer key in the "full" indexer layers
            types = cfg.get("indexer_types") or ["full"] * n
            index_dim = int(required(cfg, "index_head_dim", where))
            return float(latent * n) + index_dim * sum(t == "full" for t in types)

        return _mla_attention(cfg, where, cached)

    def layer_plan(self, cfg: Mapping[str, Any]) -> LayerPlan:
        # NOTE: GLM-5 always rotates interleaved pairs (no rope_interleave field).
        plan = _mla_plan(cfg, style="deepseek", rope_interleave=True, use_rope=True)
        assert plan.mla is not None
        if plan.mla.q_lora_rank is None:
            raise ValueError("glm_moe_dsa: q_lora_rank is required (the indexer reads it)")
        dsa = DSAShape(
            hidden_size=plan.hidden_size,
            q_lora_rank=plan.mla.q_lora_rank,
            n_heads=int(cfg["index_n_heads"]),
            head_dim=int(cfg["index_head_dim"]),
            rope_dim=plan.mla.qk_rope_head_dim,
            topk=int(cfg["index_topk"]),
        )
        n = plan.num_layers
        if cfg.get("indexer_types"):
            indexer_full = tuple(t == "full" for t in per_layer(cfg, "indexer_types", n))
        else:  # HF GlmMoeDsaConfig's default: every layer runs its indexer
            indexer_full = (True,) * n
        if not indexer_full[0]:
            raise ValueError("indexer_types[0] must be 'full' (nothing to share before it)")
        return replace(plan, dsa=dsa, indexer_full=indexer_full)

    def model_shape(self, cfg: Mapping[str, Any], *, name: str) -> ModelShape:
        return dsa_model_shape(cfg, name=name)


class KimiLinear(ModelFamily):
    """``layer_types``: KDA linear attention (a state per k blocks, no per-token cache) or MLA
    without RoPE; ``mlp_layer_types``: dense or MoE."""

    model_type = "kimi_linear"
    summary = "KDA linear attention (state per k blocks) + MLA, MoE"
    # NOTE: the KDA layers are not sharded over a tensor-parallel group.
    tensor_parallel = False
    recurrent_state = True
    aliases = {
        "model_max_length": "max_position_embeddings",
        "moe_renormalize": "norm_topk_prob",
        "num_expert_group": "n_group",
        "num_experts": "num_local_experts",
        "num_experts_per_token": "num_experts_per_tok",
        "num_shared_experts": "n_shared_experts",
    }

    def attention(self, cfg: Mapping[str, Any], where: str) -> AttentionShape:
        # the latent in the MLA ("full_attention") layers; KDA layers cache nothing per token
        types = cfg.get("layer_types") or []
        full = sum(t == "full_attention" for t in types)
        return _mla_attention(cfg, where, lambda n, latent: float(latent * full))

    def layer_plan(self, cfg: Mapping[str, Any]) -> LayerPlan:
        plan = _mla_plan(cfg, style="kimi", rope_interleave=None, use_rope=False)
        kda = KDAShape(
            hidden_size=plan.hidden_size,
            num_heads=int(cfg["linear_num_heads"]),
            head_dim=int(cfg["linear_head_dim"]),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
            eps=plan.eps,
        )
        linear = tuple(
            t == "linear_attention" for t in per_layer(cfg, "layer_types", plan.num_layers)
        )
        return replace(plan, kda=kda, linear_layers=linear, mlp_prefix="block_sparse_moe.")

    def model_shape(self, cfg: Mapping[str, Any], *, name: str) -> ModelShape:
        return mla_model_shape(cfg, name=name, linear_attention=True)
