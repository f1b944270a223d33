"""Emulated cost models from a checkpoint's config.json (``planning.from_config``)."""

from __future__ import annotations

import pytest

from wavepp.runtime.families import model_shape_from_hf
from wavepp.runtime.hf_config import normalize_hf_config
from wavepp.runtime.planning.catalogue import derived_cost_model, get_model

# Published config.json fields (docs/model-costs.md): GLM-5.2 and MiniMax-M2.7.
GLM_5_2 = {
    "model_type": "glm_moe_dsa",
    "hidden_size": 6144,
    "num_hidden_layers": 78,
    "vocab_size": 154880,
    "num_attention_heads": 64,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "indexer_types": ["full" if i in {0, 1, 2, *range(6, 75, 4)} else "shared" for i in range(78)],
}
MINIMAX_M2_7 = {
    "model_type": "minimax_m2",
    "hidden_size": 3072,
    "num_hidden_layers": 62,
    "vocab_size": 200064,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 1536,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
}


@pytest.mark.parametrize(
    ("cfg", "published"), [(GLM_5_2, "glm-5.2"), (MINIMAX_M2_7, "minimax-m2.7")]
)
def test_config_json_gives_the_published_models_compute(cfg, published) -> None:
    spec = model_shape_from_hf(cfg, name="x")
    ref = get_model(published)
    assert spec.num_layers == ref.num_layers
    assert spec.linear_flops_per_token() == pytest.approx(ref.linear_flops_per_token())
    assert [layer.pair_flops for layer in spec.layers] == [layer.pair_flops for layer in ref.layers]


def test_every_family_gives_a_stage_cost_model() -> None:
    from wavepp.bench.checkpoints import hf_config_kwargs
    from wavepp.runtime.families import FAMILIES

    transformers = pytest.importorskip("transformers")
    for family in FAMILIES:
        kwargs = hf_config_kwargs(family, num_layers=6)
        cfg = normalize_hf_config(transformers.AutoConfig.for_model(family, **kwargs).to_dict())
        spec = model_shape_from_hf(cfg, name=family)
        assert spec.num_layers == 6
        kinds = {layer.kind for layer in spec.layers}
        if family in ("deepseek_v3", "glm_moe_dsa", "kimi_linear"):
            assert any("dense" in k for k in kinds) and any("moe" in k for k in kinds)
        if family == "kimi_linear":
            assert any(k.startswith("kda") for k in kinds) and any(
                k.startswith("mla") for k in kinds
            )
        cost = derived_cost_model(spec, num_stages=3)
        assert cost.b > 0 and cost.c > 0


def test_unknown_model_type_is_refused() -> None:
    with pytest.raises(ValueError, match="model_type='qwen3_next'"):
        model_shape_from_hf({**MINIMAX_M2_7, "model_type": "qwen3_next"}, name="x")
