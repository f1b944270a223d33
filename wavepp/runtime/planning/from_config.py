"""A ``ModelShape`` (per-layer FLOPs, bytes, parameters) from a checkpoint's config.json.

``wavepp replay --engine emulated --emulate DIR`` emulates the model a checkpoint directory
describes, with the same formulas as the built-in published models (``published.py``,
docs/model-costs.md "Per-token prefill cost"). Pure: it takes the parsed, normalised config dict
(``hf_config.read_hf_config`` + ``normalize_hf_config``); the caller does the I/O. Each
family's ``model_shape`` in the registry (``wavepp.runtime.families``) calls one of the three
functions below:

| function          | attention                                               | weights      |
| ----------------- | ------------------------------------------------------- | ------------ |
| gqa_model_shape   | GQA (QK-norm ignored), 4 H d_h FLOPs per pair; dense or MoE | config dtype |
| mla_model_shape   | MLA in MHA mode (re-expanding the cached latent) + MoE; KDA layers (no L term) with ``linear_attention`` | config dtype |
| dsa_model_shape   | MLA + DSA as ``published._dsa_model`` (MQA mode, top-k)  | FP8 blocks, as published |

Approximations: the KDA output gate and decay are charged as ``shapes.kda_weights`` counts them
(full-rank gate, rank-d decay), HF Kimi-Linear's are low-rank; norms and biases are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from wavepp.runtime.planning.published import _dsa_model
from wavepp.runtime.planning.shapes import (
    BF16_BYTES,
    FP32_BYTES,
    H200,
    KDA_CHUNK_TOKENS,
    LayerCost,
    ModelShape,
    MoE,
    activation_bytes_per_token,
    gqa_weights,
    kda_weights,
    make_layer,
    mla_weights,
    mlp_activation_width,
    mlp_weights,
    moe_weight_bytes,
)


def _moe_layers(cfg: Mapping[str, Any], n: int, has_moe: bool) -> list[bool]:
    if cfg.get("mlp_layer_types"):
        return [t == "sparse" for t in cfg["mlp_layer_types"]]
    first = int(cfg.get("first_k_dense_replace") or 0)
    return [has_moe and i >= first for i in range(n)]


def _moe(cfg: Mapping[str, Any], d: int, expert_ffn: int) -> MoE | None:
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return None
    return MoE(
        d=d,
        num_experts=experts,
        experts_per_token=int(cfg["num_experts_per_tok"]),
        expert_ffn=expert_ffn,
        num_shared=int(cfg.get("n_shared_experts") or 0),
        shared_ffn=expert_ffn,
        expert_dim=d,
    )


def _elem(cfg: Mapping[str, Any]) -> float:
    """Bytes per weight: float32 when config.json says so, else BF16."""
    return FP32_BYTES if str(cfg.get("dtype", cfg.get("torch_dtype"))) == "float32" else BF16_BYTES


def _note(cfg: Mapping[str, Any], elem: float) -> str:
    return f"from config.json ({cfg.get('model_type')}), weights {elem:g} B"


def dsa_model_shape(cfg: Mapping[str, Any], *, name: str) -> ModelShape:
    """MLA + DSA + MoE (GLM-5): ``published._dsa_model``'s formulas on the config's fields.

    Raises:
        KeyError: a field the formulas need is missing (its name).
    """
    d, n, vocab = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    moe = _moe(cfg, d, int(cfg["moe_intermediate_size"]))
    assert moe is not None, "glm_moe_dsa has routed experts"
    types = cfg.get("indexer_types") or ["full"] * n
    return _dsa_model(
        name=name,
        hf_repo=_note(cfg, _elem(cfg)),
        num_layers=n,
        d=d,
        heads=int(cfg["num_attention_heads"]),
        q_lora=int(cfg["q_lora_rank"]),
        kv_lora=int(cfg["kv_lora_rank"]),
        nope=int(cfg["qk_nope_head_dim"]),
        rope=int(cfg["qk_rope_head_dim"]),
        v=int(cfg["v_head_dim"]),
        index_heads=int(cfg["index_n_heads"]),
        index_dim=int(cfg["index_head_dim"]),
        indexer_layers=frozenset(i for i, t in enumerate(types) if t == "full"),
        num_dense=sum(1 for t in _moe_layers(cfg, n, True) if not t),
        dense_ffn=int(cfg["intermediate_size"]),
        moe=moe,
        vocab=vocab,
    )


def gqa_model_shape(cfg: Mapping[str, Any], *, name: str, routed_experts: bool) -> ModelShape:
    """GQA layers (QK-norm ignored), 4 H d_h FLOPs per pair; dense SwiGLU, or MoE with
    ``routed_experts`` (MiniMax-M2: experts of width ``intermediate_size``).

    Raises:
        KeyError: a field the formulas need is missing (its name).
    """
    d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    elem = _elem(cfg)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or d // heads)
    moe = _moe(cfg, d, int(cfg["intermediate_size"])) if routed_experts else None
    attention = gqa_weights(d, heads, kv_heads, head_dim)
    pair = float(4 * heads * head_dim)
    kv_bytes = 2 * kv_heads * head_dim * elem
    kind = ("gqa", attention, pair, 0.0, 0.0, kv_bytes, kv_heads)
    n = int(cfg["num_hidden_layers"])
    return _assemble(cfg, name, [kind] * n, moe, (heads + 2 * kv_heads) * head_dim)


def mla_model_shape(cfg: Mapping[str, Any], *, name: str, linear_attention: bool) -> ModelShape:
    """MLA in MHA mode (re-expanding the cached latent) + MoE (DeepSeek-V3); with
    ``linear_attention`` the ``layer_types`` "linear_attention" layers are KDA (no L term,
    their chunkwise recurrence in b; Kimi-Linear).

    Raises:
        KeyError: a field the formulas need is missing (its name).
    """
    d, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    elem = _elem(cfg)
    q_lora = int(cfg.get("q_lora_rank") or 0)
    kv_lora, nope = int(cfg["kv_lora_rank"]), int(cfg["qk_nope_head_dim"])
    rope, v = int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    moe = _moe(cfg, d, int(cfg["moe_intermediate_size"]))
    # Without q_lora the query is one d x H(nope + rope) matrix.
    mla = mla_weights(d, heads, q_lora, kv_lora, nope, rope, v, gated=False)
    if not q_lora:
        mla += d * heads * (nope + rope)
    mha_pair = float(2 * heads * (nope + rope + v))
    reexpand = float(2 * kv_lora * heads * (nope + v))
    mla_kind = ("mla", mla, mha_pair, reexpand, 0.0, (kv_lora + rope) * elem, 1)
    layer_kinds = [mla_kind] * n
    attention_width = heads * (nope + rope)
    if linear_attention:
        kh, kd = int(cfg["linear_num_heads"]), int(cfg["linear_head_dim"])
        kda = kda_weights(d, kh, kd, kd)
        recurrence = float(kh * (6 * kd * kd + 10 * KDA_CHUNK_TOKENS * kd))
        kda_kind = ("kda", kda, 0.0, 0.0, recurrence, 0.0, 1)
        types = cfg.get("layer_types") or ["linear_attention"] * n
        layer_kinds = [mla_kind if t == "full_attention" else kda_kind for t in types]
        attention_width = max(attention_width, 4 * kh * kd)
    return _assemble(cfg, name, layer_kinds, moe, attention_width)


def _assemble(
    cfg: Mapping[str, Any],
    name: str,
    layer_kinds: list[tuple[str, int, float, float, float, float, int]],
    moe: MoE | None,
    attention_width: int,
) -> ModelShape:
    """The ModelShape of per-layer attention kinds ``(kind, weights, pair FLOPs, context FLOPs,
    other FLOPs, KV bytes, KV heads)`` with the config's dense or MoE feed-forward blocks."""
    mt = cfg.get("model_type")
    d, n, vocab = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    elem = _elem(cfg)
    dense_ffn = int(cfg["intermediate_size"])
    moe_flags = _moe_layers(cfg, n, moe is not None)
    layers: list[LayerCost] = []
    for index, (kind, attn, pair, context, other, kv_bytes, kv_heads) in enumerate(layer_kinds):
        if moe_flags[index] and moe is not None:
            active = moe.active()
            params = moe.router() + moe.all_routed() + moe.shared()
            ffn_bytes = moe_weight_bytes(moe, elem, elem)
            ffn_kind = "moe"
        else:
            active = params = mlp_weights(d, dense_ffn)
            ffn_bytes = params * elem
            ffn_kind = "dense"
        layers.append(
            make_layer(
                f"{kind}+{ffn_kind}",
                attention_weights=attn,
                attention_bytes_per_weight=elem,
                mlp_active_weights=active,
                mlp_bytes=ffn_bytes,
                mlp_params=params,
                other_flops_per_token=other,
                pair_flops=pair,
                context_flops_per_token=context,
                kv_bytes_per_token=kv_bytes,
                num_kv_heads=kv_heads,
            )
        )
    mlp_width = mlp_activation_width(dense_ffn)
    if moe is not None:
        mlp_width = max(mlp_width, moe.activation_width())
    return ModelShape(
        name=name,
        hf_repo=_note(cfg, elem),
        layers=tuple(layers),
        num_embedding_params=2.0 * d * vocab,
        lm_head_weight_bytes=d * vocab * elem,
        attention_note=f"{mt} from config.json",
        default_gpu=H200,
        activation_bytes_per_token=activation_bytes_per_token(
            d, attention_width=attention_width, mlp_width=mlp_width
        ),
    )
