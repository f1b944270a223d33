"""Tests for wavepp.runtime.planning.catalogue: derived cost models from docs/model-costs.md.

Reference numbers are docs/model-costs.md's "Derived per-token compute and KV" table and its parameter
cross-check, typed in here from that page (not from the code under test).
"""

from __future__ import annotations

import dataclasses

import pytest

from wavepp.runtime.planning import ChunkPlanner, CostModel, RequestProgress
from wavepp.runtime.planning.catalogue import (
    CPU,
    H200,
    MODELS,
    GPUSpec,
    derived_cost_model,
    derived_stage_cost_models,
    get_model,
    list_models,
)

PAPER_MODELS = ["glm-5.2", "minimax-m2.7", "kimi-k3", "deepseek-v3.2"]

# docs/model-costs.md "all layers" column: linear FLOPs per token over all layers.
ALL_LAYERS_FLOPS = {
    "glm-5.2": 78.7e9,
    "minimax-m2.7": 19.6e9,
    "kimi-k3": 206e9,
    "deepseek-v3.2": 73.1e9,
}
# docs/model-costs.md "linear FLOPs / token / layer" column, by layer kind.
PER_LAYER_FLOPS = {
    ("glm-5.2", "mla+moe"): 1.013e9,
    ("glm-5.2", "mla+indexer+moe"): 1.013e9 + 0.019e9,
    ("glm-5.2", "mla+indexer+dense"): 0.783e9 + 0.019e9,
    ("minimax-m2.7", "gqa+moe"): 0.316e9,
    ("kimi-k3", "kda+moe"): 2.324e9,
    ("kimi-k3", "mla+moe"): 1.901e9,
    ("kimi-k3", "kda+dense"): 2.340e9,
    ("deepseek-v3.2", "mla+indexer+moe"): 1.199e9,
}
# docs/model-costs.md "KV bytes / token (all layers)", BF16 latent / K,V (+ FP8 indexer keys).
KV_BYTES_PER_TOKEN = {
    "glm-5.2": 92_628,
    "minimax-m2.7": 253_952,
    "kimi-k3": 27_648,
    "deepseek-v3.2": 78_324,
}
# docs/model-costs.md: "parameter totals recomputed from these shapes give GLM 743B, M2.7 229B,
# K3 2.78T and DS 672B".
TOTAL_PARAMS = {
    "glm-5.2": 743e9,
    "minimax-m2.7": 229e9,
    "kimi-k3": 2.78e12,
    "deepseek-v3.2": 672e9,
}
# docs/model-costs.md score+value FLOPs per (query, key) pair per layer, in the mode the derivation uses:
# GLM/DS indexer only (sparse MLA is in b), MiniMax GQA, K3 MHA mode in the 24 MLA layers.
PAIR_FLOPS_PER_LAYER = {
    "glm-5.2": (8_192, 21),
    "minimax-m2.7": (24_576, 62),
    "kimi-k3": (61_440, 24),
    "deepseek-v3.2": (16_384, 61),
}


def test_list_models_names_the_paper_models_and_tiny_llama() -> None:
    assert list_models() == [*PAPER_MODELS[:3], "deepseek-v3.2", "tiny-llama"]
    assert set(MODELS) == set(list_models())
    with pytest.raises(ValueError, match="known"):
        get_model("gpt-2")


@pytest.mark.parametrize("model", PAPER_MODELS)
def test_all_layers_linear_flops_match_models_md(model: str) -> None:
    assert get_model(model).linear_flops_per_token() == pytest.approx(
        ALL_LAYERS_FLOPS[model], rel=0.02
    )


@pytest.mark.parametrize(("model", "kind"), sorted(PER_LAYER_FLOPS))
def test_per_layer_linear_flops_match_models_md(model: str, kind: str) -> None:
    layers = [layer for layer in get_model(model).layers if layer.kind == kind]
    assert layers, f"{model} has no {kind} layer"
    for layer in layers:
        assert layer.linear_flops_per_token == pytest.approx(
            PER_LAYER_FLOPS[(model, kind)], rel=0.005
        )


@pytest.mark.parametrize("model", PAPER_MODELS)
def test_kv_bytes_and_params_match_models_md(model: str) -> None:
    spec = get_model(model)
    assert spec.kv_bytes_per_token() == KV_BYTES_PER_TOKEN[model]
    assert spec.num_params() == pytest.approx(TOTAL_PARAMS[model], rel=0.01)


@pytest.mark.parametrize("model", PAPER_MODELS)
def test_pair_flops_and_layer_counts(model: str) -> None:
    spec = get_model(model)
    pair_flops, num_attention_layers = PAIR_FLOPS_PER_LAYER[model]
    with_pairs = [layer.pair_flops for layer in spec.layers if layer.pair_flops > 0]
    assert with_pairs == [pair_flops] * num_attention_layers


def test_layer_layouts() -> None:
    glm = get_model("glm-5.2")
    indexer = [i for i, layer in enumerate(glm.layers) if "indexer" in layer.kind]
    assert indexer[:4] == [0, 1, 2, 6] and indexer[-1] == 74 and len(indexer) == 21
    k3 = get_model("kimi-k3")
    mla = [i + 1 for i, layer in enumerate(k3.layers) if layer.kind.startswith("mla")]
    assert mla[:3] == [4, 8, 12] and mla[-2:] == [92, 93] and len(mla) == 24  # 1-based
    assert k3.layers[0].kind == "kda+dense"
    # KDA layers have no L term; only the MLA layers do.
    for layer in k3.layers:
        has_l_term = layer.pair_flops > 0 or layer.kv_bytes_per_token > 0
        assert has_l_term == layer.kind.startswith("mla")
    assert [get_model(m).num_layers for m in PAPER_MODELS] == [78, 62, 93, 61]


def test_sparse_attention_and_recurrence_terms() -> None:
    # DSA: MQA-mode pairs (docs/model-costs.md 139,264 / 278,528) x top-2048 keys, per token per layer.
    assert {layer.other_flops_per_token for layer in get_model("glm-5.2").layers} == {
        2048 * 139_264
    }
    assert {layer.other_flops_per_token for layer in get_model("deepseek-v3.2").layers} == {
        2048 * 278_528
    }
    # K3 KDA recurrence ~17 MFLOP per token (docs/model-costs.md); MLA re-expansion in g.
    kda = [layer for layer in get_model("kimi-k3").layers if layer.kind.startswith("kda")]
    assert kda[0].other_flops_per_token == pytest.approx(17e6, rel=0.05)
    mla = [layer for layer in get_model("kimi-k3").layers if layer.kind.startswith("mla")]
    assert mla[0].context_flops_per_token == 2 * 512 * 96 * (128 + 128)


def test_kimi_stage_without_mla_layers_has_no_l_term() -> None:
    # Layers [0, 3) of K3 are all KDA: no context-dependent cost.
    stage = derived_cost_model("kimi-k3", num_stages=31, layers=(0, 3))
    assert stage.a == 0.0 and stage.g == 0.0 and stage.b > 0


def test_derived_seconds_follow_the_roofline() -> None:
    spec = get_model("minimax-m2.7")
    model = derived_cost_model("minimax-m2.7", H200, num_stages=2, layers=(0, 31))
    layer = spec.layers[0]
    flops = H200.peak_flops * H200.mfu
    assert model.b == pytest.approx(31 * layer.linear_flops_per_token / flops)
    assert model.a == pytest.approx(31 * 24_576 / (2 * flops))
    assert model.g == pytest.approx(31 * 4096 / (H200.hbm_bytes_per_s * H200.mbu))
    # a*(2Lx + x^2) ~ pair FLOPs x P / flops, P = xL + x(x+1)/2.
    L, x = 10_000, 2_000
    pairs = x * L + x * (x + 1) / 2
    assert model.a * (2 * L * x + x * x) == pytest.approx(31 * 24_576 * pairs / flops, rel=1e-3)
    # Weights of 31 FP8 layers (~3.7 G each) over 3.84 TB/s: ~30 ms, plus 1 ms overhead.
    assert 0.025 < model.c < 0.035


def test_source_names_model_gpu_and_models_md() -> None:
    model = derived_cost_model("glm-5.2", num_stages=4)
    assert model.label == "derived"
    for word in ("glm-5.2", "H200", "989", "4.8", "docs/model-costs.md", "4 stages"):
        assert word in model.source
    assert CostModel.from_dict(model.to_dict()) == model


def test_slowest_stage_bounds_every_stage() -> None:
    slowest = derived_cost_model("kimi-k3", num_stages=4)
    for stage in derived_stage_cost_models("kimi-k3", num_stages=4):
        for L, x in [(0, 16), (0, 8192), (100_000, 2048)]:
            assert stage.chunk_cost_s(L, x) <= slowest.chunk_cost_s(L, x) + 1e-15
            assert stage.c <= slowest.c


def test_gpu_choice_scales_costs() -> None:
    slow = dataclasses.replace(H200, name="half-H200", peak_flops=H200.peak_flops / 2)
    fast_model = derived_cost_model("deepseek-v3.2", num_stages=4, layers=(0, 16))
    slow_model = derived_cost_model("deepseek-v3.2", slow, num_stages=4, layers=(0, 16))
    assert slow_model.b == pytest.approx(2 * fast_model.b)
    assert slow_model.a == pytest.approx(2 * fast_model.a)
    assert slow_model.c == pytest.approx(fast_model.c)  # bandwidth-bound
    assert "half-H200" in slow_model.source
    # tiny-llama defaults to the CPU roofline.
    assert "CPU" in derived_cost_model("tiny-llama", num_stages=2).source
    assert get_model("tiny-llama").default_gpu is CPU


def test_gpu_spec_validation() -> None:
    with pytest.raises(ValueError, match="mfu"):
        GPUSpec("x", peak_flops=1e12, hbm_bytes_per_s=1e12, mfu=1.5)
    with pytest.raises(ValueError, match="peak_flops"):
        GPUSpec("x", peak_flops=0.0, hbm_bytes_per_s=1e12)


def test_bad_layer_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="layers"):
        derived_cost_model("glm-5.2", num_stages=4, layers=(10, 79))
    with pytest.raises(ValueError, match="layers"):
        derived_cost_model("glm-5.2", num_stages=4, layers=(5, 5))


def test_tiny_llama_matches_the_engine_preset() -> None:
    model_config = pytest.importorskip("wavepp.runtime.model_config")
    preset = model_config.get_preset("tiny-llama")
    spec = get_model("tiny-llama")
    assert spec.num_layers == preset.num_layers
    layer = spec.layers[0]
    assert layer.kv_bytes_per_token == preset.kv_bytes_per_token_per_layer()
    d, heads, kv_heads, head_dim = (
        preset.hidden_size,
        preset.num_heads,
        preset.num_kv_heads,
        preset.head_dim,
    )
    weights = d * (heads + 2 * kv_heads) * head_dim + heads * head_dim * d
    weights += 3 * d * preset.intermediate_size
    assert layer.linear_flops_per_token == 2 * weights
    assert spec.num_embedding_params == 2 * d * preset.vocab_size


@pytest.mark.parametrize(
    ("model", "max_dynamic_spread", "min_static_spread"),
    [
        # Full attention: static chunk 15 of a 128k prompt costs ~7x chunk 0.
        ("minimax-m2.7", 1.03, 5.0),
        # DSA: the sparse attention is linear in x, only the indexer is quadratic: ~1.2x.
        ("glm-5.2", 1.02, 1.1),
    ],
)
def test_dynamic_planner_balances_derived_stages(
    model: str, max_dynamic_spread: float, min_static_spread: float
) -> None:
    # End to end: on a model's 4 derived stage models, a 128k-token prompt's micro-batches
    # (but the last) cost about the same under dynamic chunking, not under static chunking.
    stages = derived_stage_cost_models(model, num_stages=4)
    spreads = {}
    for policy in ("dynamic", "static"):
        planner = ChunkPlanner(stages, policy=policy, chunk_tokens=8192, block_size=16)
        request = RequestProgress("long", 131_072, 0)
        costs = []
        while chunks := planner.plan_microbatch([request], num_stages=4, num_inflight=4):
            costs.append(planner.microbatch_cost_s(chunks))
        spreads[policy] = max(costs[:-1]) / min(costs[:-1])
    assert spreads["dynamic"] < max_dynamic_spread
    assert spreads["static"] > min_static_spread
