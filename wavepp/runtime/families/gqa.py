"""Families of grouped-query attention layers: Llama (dense SwiGLU) and MiniMax-M2 (MoE).

Config fields (HF ``LlamaConfig``, ``MiniMaxM2Config``): ``head_dim`` (default
``hidden_size / num_attention_heads``), ``num_key_value_heads`` (default the heads);
MiniMax-M2 adds QK-norm, partial RoPE (``rotary_dim`` or ``rope_parameters.
partial_rotary_factor``) and sigmoid top-k routing over ``num_local_experts`` experts of width
``intermediate_size``, no shared experts (``scoring_func``, when present, must be ``"sigmoid"``).
Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from wavepp.runtime.families.contract import AttentionShape, ModelFamily, required
from wavepp.runtime.families.layer_plan import GQAShape, LayerPlan, MoEShape, plan_fields
from wavepp.runtime.planning.from_config import gqa_model_shape
from wavepp.runtime.planning.shapes import ModelShape


def _gqa_shape(cfg: Mapping[str, Any], *, qk_norm: bool, rotary_dim: int | None) -> GQAShape:
    """The attention block; ``rotary_dim`` None: ``head_dim * partial_rotary_factor``."""
    d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or d // heads)
    factor = float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if rotary_dim is not None:
        factor = rotary_dim / head_dim
    return GQAShape(
        hidden_size=d,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rotary_dim=int(head_dim * factor),
        qk_norm=qk_norm,
        eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )


class _GQAFamily(ModelFamily):
    """A GQA family's attention reader and cost shape; ``routed_experts``: its MLP is MoE."""

    tensor_parallel = True
    routed_experts: ClassVar[bool]

    def attention(self, cfg: Mapping[str, Any], where: str) -> AttentionShape:
        heads = int(required(cfg, "num_attention_heads", where))
        return AttentionShape(
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(required(cfg, "hidden_size", where)) // heads),
        )

    def model_shape(self, cfg: Mapping[str, Any], *, name: str) -> ModelShape:
        return gqa_model_shape(cfg, name=name, routed_experts=self.routed_experts)


class Llama(_GQAFamily):
    """RMSNorm, RoPE, GQA, dense SwiGLU (HF ``LlamaForCausalLM``)."""

    model_type = "llama"
    summary = "RMSNorm, RoPE, GQA, SwiGLU"
    routed_experts = False

    def layer_plan(self, cfg: Mapping[str, Any]) -> LayerPlan:
        common = plan_fields(cfg)
        gqa = _gqa_shape(cfg, qk_norm=False, rotary_dim=None)
        return LayerPlan(
            **common,
            rotary_dim=gqa.rotary_dim,
            gqa=gqa,
            mla=None,
            dense_intermediate=int(cfg["intermediate_size"]),
            moe=None,
            moe_layers=(False,) * common["num_layers"],
        )


class MiniMaxM2(_GQAFamily):
    """GQA with QK-norm and partial RoPE + MoE (sigmoid top-k, bias, no shared experts)."""

    model_type = "minimax_m2"
    summary = "GQA with QK-norm and partial RoPE + MoE (sigmoid top-k)"
    routed_experts = True

    def layer_plan(self, cfg: Mapping[str, Any]) -> LayerPlan:
        common = plan_fields(cfg)
        rotary = int(cfg["rotary_dim"]) if cfg.get("rotary_dim") else None
        gqa = _gqa_shape(cfg, qk_norm=True, rotary_dim=rotary)
        moe = MoEShape(
            hidden_size=common["hidden_size"],
            num_experts=int(cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            expert_intermediate=int(cfg["intermediate_size"]),
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            shared_intermediate=int(cfg.get("shared_intermediate_size") or 0),
            style="minimax",
        )
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(
                f"scoring_func={scoring!r}: MiniMax-M2 experts are routed by sigmoid scores "
                "(the published configs' 'sigmoid'); no other scoring is implemented"
            )
        if moe.shared_intermediate:
            raise ValueError(
                f"shared_intermediate_size={moe.shared_intermediate}: MiniMax shared "
                "experts are not implemented (the published M2 configs have 0)"
            )
        return LayerPlan(
            **common,
            rotary_dim=gqa.rotary_dim,
            gqa=gqa,
            mla=None,
            dense_intermediate=0,
            moe=moe,
            moe_layers=(True,) * common["num_layers"],
        )
