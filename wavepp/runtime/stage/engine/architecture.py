"""The layer families of a Hugging Face config: what each decoder layer of a checkpoint runs.

``Architecture.from_hf(cfg)`` reads the family-specific ``config.json`` fields (the generic
shape is ``hf_config.model_config_from_hf``'s) and answers, per layer index, which attention
and which feed-forward block it has:

| model_type    | attention                      | feed-forward                                  |
| ------------- | ------------------------------ | --------------------------------------------- |
| llama         | GQA                            | dense SwiGLU                                  |
| deepseek_v3   | MLA (latent cache)             | dense below ``first_k_dense_replace``, else MoE |
| minimax_m2    | GQA + QK-norm, partial RoPE    | MoE (sigmoid top-k, bias, no shared experts)  |
| glm_moe_dsa   | MLA + DSA indexer (full/shared) | ``mlp_layer_types``: dense or MoE             |
| kimi_linear   | ``layer_types``: KDA or MLA (no RoPE) | ``mlp_layer_types``: dense or MoE        |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wavepp.runtime.hf_config import normalize_hf_config
from wavepp.runtime.stage.engine.layers.dsa import DSAShape
from wavepp.runtime.stage.engine.layers.gqa import GQAShape
from wavepp.runtime.stage.engine.layers.kda import KDAShape
from wavepp.runtime.stage.engine.layers.mla import MLAShape
from wavepp.runtime.stage.engine.layers.moe import MoEShape

__all__ = ["Architecture"]


@dataclass(frozen=True)
class Architecture:
    """Per-model facts the checkpoint engine needs.

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

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Architecture:
        """Read a parsed ``config.json`` (checked by ``hf_config.model_config_from_hf`` first).

        Raises:
            ValueError: an unsupported model_type, or a field outside what the layers implement.
        """
        cfg = normalize_hf_config(cfg)
        mt = cfg.get("model_type")
        d = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        rope = cfg.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        common = {
            "model_type": mt,
            "hidden_size": d,
            "vocab_size": int(cfg["vocab_size"]),
            "num_layers": int(cfg["num_hidden_layers"]),
            "eps": eps,
            "rope_theta": theta,
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        }
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.get('hidden_act')!r}: only 'silu' is implemented")
        if mt in ("llama", "minimax_m2"):
            head_dim = int(cfg.get("head_dim") or d // heads)
            factor = float(rope.get("partial_rotary_factor", 1.0))
            if mt == "minimax_m2" and cfg.get("rotary_dim"):
                factor = int(cfg["rotary_dim"]) / head_dim
            rotary_dim = int(head_dim * factor)
            gqa = GQAShape(
                hidden_size=d,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rotary_dim=rotary_dim,
                qk_norm=mt == "minimax_m2",
                eps=eps,
            )
            if mt == "llama":
                return cls(
                    **common,
                    rotary_dim=rotary_dim,
                    gqa=gqa,
                    mla=None,
                    dense_intermediate=int(cfg["intermediate_size"]),
                    moe=None,
                    moe_layers=(False,) * common["num_layers"],
                )
            moe = MoEShape(
                hidden_size=d,
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
            if moe.shared_intermediate:
                raise ValueError(
                    f"shared_intermediate_size={moe.shared_intermediate}: MiniMax shared "
                    "experts are not implemented (the published M2 configs have 0)"
                )
            return cls(
                **common,
                rotary_dim=rotary_dim,
                gqa=gqa,
                mla=None,
                dense_intermediate=0,
                moe=moe,
                moe_layers=(True,) * common["num_layers"],
            )
        if mt in ("deepseek_v3", "glm_moe_dsa", "kimi_linear"):
            mla = MLAShape(
                hidden_size=d,
                num_heads=heads,
                q_lora_rank=None if cfg.get("q_lora_rank") is None else int(cfg["q_lora_rank"]),
                kv_lora_rank=int(cfg["kv_lora_rank"]),
                qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                v_head_dim=int(cfg["v_head_dim"]),
                # NOTE: GLM-5 always rotates interleaved pairs (no rope_interleave field).
                rope_interleave=mt == "glm_moe_dsa" or bool(cfg.get("rope_interleave", True)),
                use_rope=mt != "kimi_linear",
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
                    style="kimi" if mt == "kimi_linear" else "deepseek",
                )
                if moe.num_experts % moe.n_group:
                    raise ValueError(
                        f"n_routed_experts={moe.num_experts} must be a multiple of "
                        f"n_group={moe.n_group}"
                    )
            n = common["num_layers"]
            first_moe = int(cfg.get("first_k_dense_replace") or 0)
            moe_layers = tuple(moe is not None and i >= first_moe for i in range(n))
            if cfg.get("mlp_layer_types"):
                moe_layers = tuple(t == "sparse" for t in _per_layer(cfg, "mlp_layer_types", n))
            dsa = None
            indexer_full: tuple[bool, ...] = ()
            if mt == "glm_moe_dsa":
                if mla.q_lora_rank is None:
                    raise ValueError("glm_moe_dsa: q_lora_rank is required (the indexer reads it)")
                dsa = DSAShape(
                    hidden_size=d,
                    q_lora_rank=mla.q_lora_rank,
                    n_heads=int(cfg["index_n_heads"]),
                    head_dim=int(cfg["index_head_dim"]),
                    rope_dim=mla.qk_rope_head_dim,
                    topk=int(cfg["index_topk"]),
                )
                if cfg.get("indexer_types"):
                    indexer_full = tuple(t == "full" for t in _per_layer(cfg, "indexer_types", n))
                else:  # HF GlmMoeDsaConfig's default: every layer runs its indexer
                    indexer_full = (True,) * n
                if not indexer_full[0]:
                    raise ValueError("indexer_types[0] must be 'full' (nothing to share before it)")
            kda = None
            linear_layers: tuple[bool, ...] = ()
            if mt == "kimi_linear":
                kda = KDAShape(
                    hidden_size=d,
                    num_heads=int(cfg["linear_num_heads"]),
                    head_dim=int(cfg["linear_head_dim"]),
                    conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
                    eps=eps,
                )
                linear_layers = tuple(
                    t == "linear_attention" for t in _per_layer(cfg, "layer_types", n)
                )
            return cls(
                **common,
                rotary_dim=mla.qk_rope_head_dim,
                gqa=None,
                mla=mla,
                dense_intermediate=int(cfg["intermediate_size"]),
                moe=moe,
                moe_layers=moe_layers,
                dsa=dsa,
                indexer_full=indexer_full,
                kda=kda,
                linear_layers=linear_layers,
                mlp_prefix="block_sparse_moe." if mt == "kimi_linear" else "mlp.",
            )
        raise ValueError(f"model_type={mt!r} is not supported by the checkpoint engine")


def _per_layer(cfg: Mapping[str, Any], key: str, num_layers: int) -> list[str]:
    values = list(cfg[key])
    if len(values) != num_layers:
        raise ValueError(
            f"{key} has {len(values)} entries; it needs one per layer "
            f"(num_hidden_layers={num_layers})"
        )
    return [str(v) for v in values]
