"""The paper's models (and tiny-llama) as ``ModelShape``s, from the published shapes in
docs/model-costs.md (architecture table, config.json fields). Pure: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from wavepp.runtime.planning.shapes import (
    BF16_BYTES,
    CPU,
    DSA_INDEXER_KEY_BYTES,
    DSA_TOP_K,
    FP8_BLOCK_BYTES,
    FP32_BYTES,
    H200,
    KDA_CHUNK_TOKENS,
    MXFP4_BYTES,
    ModelShape,
    MoE,
    activation_bytes_per_token,
    gqa_weights,
    indexer_weights,
    kda_state_bytes,
    kda_weights,
    make_layer,
    mla_weights,
    mlp_activation_width,
    mlp_weights,
    moe_weight_bytes,
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
    moe: MoE,
    vocab: int,
) -> ModelShape:
    """MLA + DSA (+ MoE) models: GLM-5.2 and DeepSeek-V3.2, FP8 block-scaled weights."""
    mla = mla_weights(d, heads, q_lora, kv_lora, nope, rope, v, gated=False)
    indexer = indexer_weights(d, q_lora, index_heads, index_dim)
    mqa_pair = 2 * heads * (2 * kv_lora + rope)  # docs/model-costs.md: MLA MQA mode
    index_pair = 2 * index_heads * index_dim
    latent_bytes = (kv_lora + rope) * BF16_BYTES
    layers = []
    for index in range(num_layers):
        has_indexer = index in indexer_layers
        attention = mla + (indexer if has_indexer else 0)
        if index < num_dense:
            mlp_active = mlp_params = mlp_weights(d, dense_ffn)
            mlp_bytes = mlp_params * FP8_BLOCK_BYTES
            kind = "mla+dense"
        else:
            mlp_active = moe.active()
            mlp_params = moe.router() + moe.all_routed() + moe.shared() + moe.latent()
            mlp_bytes = moe_weight_bytes(moe, FP8_BLOCK_BYTES, FP8_BLOCK_BYTES)
            kind = "mla+moe"
        if has_indexer:
            kind = kind.replace("mla", "mla+indexer")
        layers.append(
            make_layer(
                kind,
                attention_weights=attention,
                attention_bytes_per_weight=FP8_BLOCK_BYTES,
                mlp_active_weights=mlp_active,
                mlp_bytes=mlp_bytes,
                mlp_params=mlp_params,
                other_flops_per_token=float(DSA_TOP_K * mqa_pair),
                pair_flops=float(index_pair if has_indexer else 0),
                kv_bytes_per_token=latent_bytes + (DSA_INDEXER_KEY_BYTES if has_indexer else 0),
                hidden_size=d,
                attention_width=heads * (nope + rope),
                mlp_width=dense_ffn if index < num_dense else moe.expert_ffn,
                moe=None if index < num_dense else moe,
            )
        )
    return ModelShape(
        name=name,
        hf_repo=hf_repo,
        layers=tuple(layers),
        num_embedding_params=2.0 * d * vocab,
        lm_head_weight_bytes=d * vocab * BF16_BYTES,
        attention_note=(
            f"MLA + DSA: sparse MLA in MQA (absorbed) mode, {mqa_pair} FLOPs per pair at "
            f"top-{DSA_TOP_K} keys per query (in b); lightning indexer {index_pair} FLOPs per "
            f"pair in {len(indexer_layers)} layers (in a)"
        ),
        default_gpu=H200,
        activation_bytes_per_token=activation_bytes_per_token(
            d,
            attention_width=heads * max(nope + rope, v),
            mlp_width=max(moe.activation_width(), mlp_activation_width(dense_ffn)),
        ),
    )


def _glm_5_2() -> ModelShape:
    # docs/model-costs.md: indexer in 21 "full" layers 0, 1, 2, 6, 10, ..., 74 (IndexShare).
    indexer_layers = frozenset([0, 1, 2, *range(6, 75, 4)])
    assert len(indexer_layers) == 21, "GLM-5.2 has 21 indexer layers (docs/model-costs.md)"
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
        moe=MoE(
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


def _deepseek_v3_2() -> ModelShape:
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
        moe=MoE(
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


def _minimax_m2_7() -> ModelShape:
    d, heads, kv_heads, head_dim, vocab = 3072, 48, 8, 128, 200064
    moe = MoE(
        d=d,
        num_experts=256,
        experts_per_token=8,
        expert_ffn=1536,
        num_shared=0,
        shared_ffn=0,
        expert_dim=d,
    )
    attention = gqa_weights(d, heads, kv_heads, head_dim)
    layer = make_layer(
        "gqa+moe",
        attention_weights=attention,
        attention_bytes_per_weight=FP8_BLOCK_BYTES,
        mlp_active_weights=moe.active(),
        mlp_bytes=moe_weight_bytes(moe, FP8_BLOCK_BYTES, FP8_BLOCK_BYTES),
        mlp_params=moe.router() + moe.all_routed(),
        pair_flops=float(4 * heads * head_dim),  # docs/model-costs.md: GQA 4*H*d_h*P
        kv_bytes_per_token=2 * kv_heads * head_dim * BF16_BYTES,
        num_kv_heads=kv_heads,
        hidden_size=d,
        attention_width=heads * head_dim,
        mlp_width=moe.expert_ffn,
        moe=moe,
    )
    return ModelShape(
        name="minimax-m2.7",
        hf_repo="MiniMaxAI/MiniMax-M2.7",
        layers=(layer,) * 62,
        num_embedding_params=2.0 * d * vocab,
        lm_head_weight_bytes=d * vocab * BF16_BYTES,
        attention_note="full softmax GQA in all 62 layers, 4*H*d_h FLOPs per pair",
        default_gpu=H200,
        activation_bytes_per_token=activation_bytes_per_token(
            d, attention_width=(heads + 2 * kv_heads) * head_dim, mlp_width=moe.activation_width()
        ),
    )


def _kimi_k3() -> ModelShape:
    d, vocab = 7168, 163840
    heads, q_lora, kv_lora, nope, rope, v = 96, 1536, 512, 128, 64, 128
    kda_heads, kda_dim, decay_rank, kda_conv = 96, 128, 128, 4
    # Routed experts in a 3584-wide latent; 2 full-width shared experts (docs/model-costs.md).
    moe = MoE(
        d=d,
        num_experts=896,
        experts_per_token=16,
        expert_ffn=3072,
        num_shared=2,
        shared_ffn=3072,
        expert_dim=3584,
    )
    mla = mla_weights(d, heads, q_lora, kv_lora, nope, rope, v, gated=True)
    kda = kda_weights(d, kda_heads, kda_dim, decay_rank)
    mha_pair = 2 * heads * (nope + rope + v)  # docs/model-costs.md: MLA MHA mode
    reexpand = 2 * kv_lora * heads * (nope + v)  # kv_b over the cached latent, every chunk
    recurrence = kda_heads * (6 * kda_dim * kda_dim + 10 * KDA_CHUNK_TOKENS * kda_dim)
    # 1-based MLA positions 4, 8, ..., 92, 93 -> 0-based 3, 7, ..., 91, 92.
    mla_layers = frozenset([*range(3, 92, 4), 92])
    assert len(mla_layers) == 24, "Kimi K3 has 24 MLA layers (docs/model-costs.md)"
    moe_bytes = moe_weight_bytes(moe, MXFP4_BYTES, BF16_BYTES)
    moe_params = moe.router() + moe.all_routed() + moe.shared() + moe.latent()
    layers = []
    for index in range(93):
        layer_moe: MoE | None
        if index == 0:  # first_k_dense_replace 1
            mlp_active = mlp_params = mlp_weights(d, 33792)
            mlp_bytes = mlp_params * BF16_BYTES
            mlp_kind, layer_moe, mlp_width = "dense", None, 33792
        else:
            mlp_active, mlp_params, mlp_bytes, mlp_kind = moe.active(), moe_params, moe_bytes, "moe"
            layer_moe, mlp_width = moe, moe.expert_ffn
        if index in mla_layers:
            layer = make_layer(
                f"mla+{mlp_kind}",
                attention_weights=mla,
                attention_bytes_per_weight=BF16_BYTES,
                mlp_active_weights=mlp_active,
                mlp_bytes=mlp_bytes,
                mlp_params=mlp_params,
                pair_flops=float(mha_pair),
                context_flops_per_token=float(reexpand),
                kv_bytes_per_token=(kv_lora + rope) * BF16_BYTES,
                hidden_size=d,
                attention_width=heads * (nope + rope),
                mlp_width=mlp_width,
                moe=layer_moe,
            )
        else:
            layer = make_layer(
                f"kda+{mlp_kind}",
                attention_weights=kda,
                attention_bytes_per_weight=BF16_BYTES,
                mlp_active_weights=mlp_active,
                mlp_bytes=mlp_bytes,
                mlp_params=mlp_params,
                other_flops_per_token=float(recurrence),
                state_bytes_per_request=kda_state_bytes(kda_heads, kda_dim, kda_conv),
                hidden_size=d,
                attention_width=kda_heads * kda_dim,
                mlp_width=mlp_width,
                moe=layer_moe,
            )
        layers.append(layer)
    return ModelShape(
        name="kimi-k3",
        hf_repo="moonshotai/Kimi-K3",
        layers=tuple(layers),
        num_embedding_params=2.0 * d * vocab,
        lm_head_weight_bytes=d * vocab * BF16_BYTES,
        attention_note=(
            f"24 gated-MLA layers in MHA (non-absorbed) mode, {mha_pair} FLOPs per pair, "
            f"re-expanding the cached latent every chunk ({reexpand} FLOPs per context token, "
            f"in g); 69 KDA layers without an L term (recurrence {recurrence} FLOPs per token, "
            f"in b)"
        ),
        default_gpu=H200,
        activation_bytes_per_token=activation_bytes_per_token(
            d,
            # KDA: q, k, v and the output gate, 4*H*d_k; wider than MLA's H*(nope + rope).
            attention_width=max(4 * kda_heads * kda_dim, heads * (nope + rope)),
            mlp_width=max(moe.activation_width(), mlp_activation_width(33792)),
        ),
    )


def _tiny_llama() -> ModelShape:
    """The project's "tiny-llama" preset (wavepp.runtime.stage.worker.engine.model_config), fp32 on CPU.

    Llama-style: hidden 128, 8 layers, 4 heads, 2 KV heads, head_dim 32, SwiGLU 352, vocab 1024.
    """
    d, num_layers, heads, kv_heads, head_dim, d_ff, vocab = 128, 8, 4, 2, 32, 352, 1024
    attention = gqa_weights(d, heads, kv_heads, head_dim)
    mlp = mlp_weights(d, d_ff)
    layer = make_layer(
        "gqa+dense",
        attention_weights=attention,
        attention_bytes_per_weight=FP32_BYTES,
        mlp_active_weights=mlp,
        mlp_bytes=mlp * FP32_BYTES,
        mlp_params=mlp,
        pair_flops=float(4 * heads * head_dim),
        kv_bytes_per_token=2 * kv_heads * head_dim * FP32_BYTES,
        num_kv_heads=kv_heads,
        hidden_size=d,
        attention_width=heads * head_dim,
        mlp_width=d_ff,
    )
    return ModelShape(
        name="tiny-llama",
        hf_repo="(none: random weights from a config)",
        layers=(layer,) * num_layers,
        num_embedding_params=2.0 * d * vocab,
        lm_head_weight_bytes=d * vocab * FP32_BYTES,
        attention_note="GQA 4/2 heads x 32, fp32",
        default_gpu=CPU,
        # fp32 on CPU: twice the BF16 estimate.
        activation_bytes_per_token=2.0
        * activation_bytes_per_token(
            d,
            attention_width=(heads + 2 * kv_heads) * head_dim,
            mlp_width=mlp_activation_width(d_ff),
        ),
    )


_BUILDERS: dict[str, Callable[[], ModelShape]] = {
    "glm-5.2": _glm_5_2,
    "minimax-m2.7": _minimax_m2_7,
    "kimi-k3": _kimi_k3,
    "deepseek-v3.2": _deepseek_v3_2,
    "tiny-llama": _tiny_llama,
}


MODELS: dict[str, ModelShape] = {name: build() for name, build in _BUILDERS.items()}


"""Model name -> ModelShape: the paper's GLM-5.2, MiniMax-M2.7, Kimi K3, plus DeepSeek-V3.2 and
tiny-llama."""


def list_models() -> list[str]:
    """Names accepted by derived_cost_model, in MODELS order."""
    return list(MODELS)


def get_model(model: str | ModelShape) -> ModelShape:
    """The ModelShape of a name in list_models(); a ModelShape is returned as is (e.g. one from
    a checkpoint's config.json, ``families.model_shape_from_hf``).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if isinstance(model, ModelShape):
        return model
    try:
        return MODELS[model]
    except KeyError:
        raise ValueError(f"model={model!r}: unknown; known: {list_models()}") from None
