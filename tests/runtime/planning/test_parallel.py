"""Replica layouts and their cost models (wavepp.runtime.planning.parallel)."""

from __future__ import annotations

import math

import pytest

from wavepp.runtime.planning.catalogue import derived_stage_cost_models
from wavepp.runtime.planning.memory import derived_stage_memory
from wavepp.runtime.planning.parallel import (
    EP_IMBALANCES,
    H200_NVLINK,
    H200_NVLINK_RING,
    EPImbalance,
    Interconnect,
    gemm_efficiency,
    parse_layout,
    parse_layouts,
    replica_kv_blocks,
    replica_stage_cost_models,
)
from wavepp.runtime.planning.published import get_model

MODELS = ("kimi-k3", "glm-5.2", "minimax-m2.7")


@pytest.mark.parametrize("model", MODELS)
def test_one_gpu_per_stage_is_the_catalogue(model: str) -> None:
    # t = 1: no collective, no split, no loss: the catalogue's stage models exactly.
    for layout in ("pp8", "pp8xtep1", "pp4xep1-sync"):
        ours = replica_stage_cost_models(model, parse_layout(layout))
        theirs = derived_stage_cost_models(model, num_stages=parse_layout(layout).num_stages)
        for mine, ref in zip(ours, theirs, strict=True):
            for name in ("c", "g", "b", "a"):
                assert getattr(mine, name) == pytest.approx(getattr(ref, name), rel=1e-12)


def test_an_interconnect_refuses_a_negative_latency() -> None:
    with pytest.raises(ValueError, match="latency_s"):
        Interconnect("bad", 1.0, 1.0, -1.0, 8)


def test_a_fabric_without_an_all_to_all_figure_refuses_only_ep() -> None:
    """All-to-all bandwidth None: tp and tep (all-reduces only) cost as on the same fabric with
    any all-to-all figure; an ep group of a MoE model, which needs it, is refused naming it."""
    unknown = Interconnect("no a2a", 475e9, None, 25e-6, 8)
    known = Interconnect("a2a", 475e9, 370e9, 25e-6, 8)
    for layout in ("tp8", "tep8", "pp2xtep4"):
        ours = replica_stage_cost_models("kimi-k3", parse_layout(layout), link=unknown)
        ref = replica_stage_cost_models("kimi-k3", parse_layout(layout), link=known)
        assert [m.b for m in ours] == [m.b for m in ref]
    with pytest.raises(ValueError, match="alltoall_bus_bytes_per_s"):
        replica_stage_cost_models("kimi-k3", parse_layout("ep8"), link=unknown)
    with pytest.raises(ValueError, match="allreduce_bus_bytes_per_s"):
        Interconnect("bad", None, 1.0, 0.0, 8)  # type: ignore[arg-type]


def test_gemm_efficiency_by_hand() -> None:
    # One 128 x 128 tile on 132 SMs: one wave, 1/132 of the GPU busy.
    assert gemm_efficiency(128, 128) == pytest.approx(1 / 132)
    # 132 full tiles: one full wave.
    assert gemm_efficiency(128 * 132, 128) == pytest.approx(1.0)
    # 133 tiles: two waves, the second nearly empty.
    assert gemm_efficiency(128 * 133, 128) == pytest.approx(133 / 264)
    # A half tile wastes half of it.
    assert gemm_efficiency(64 * 132, 128) == pytest.approx(0.5)
    assert gemm_efficiency(128, 128, groups=132) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="m=0"):
        gemm_efficiency(0, 128)


@pytest.mark.parametrize("model", MODELS)
def test_tensor_parallel_splits_compute_and_adds_two_allreduces(model: str) -> None:
    spec = get_model(model)
    [one] = replica_stage_cost_models(model, parse_layout("pp1"))
    [tp8] = replica_stage_cost_models(model, parse_layout("tp8"))
    d = spec.layers[-1].split.hidden_size  # type: ignore[union-attr]
    per_token_allreduce = 2 * d * 2 * 7 / 8 / H200_NVLINK.allreduce_bus_bytes_per_s
    # b: at least the compute / 8 plus two all-reduces per layer; the small-shape loss only adds.
    assert tp8.b >= one.b / 8 + 2 * spec.num_layers * per_token_allreduce * (1 - 1e-9)
    collectives = 2 * spec.num_layers * per_token_allreduce
    assert tp8.b < one.b / 8 * 1.5 + collectives  # the small-shape loss stays below 1.5x
    # c: weights / 8 plus two collective latencies per layer plus the per-micro-batch overhead.
    overhead = spec.default_gpu.overhead_s
    latencies = 2 * spec.num_layers * H200_NVLINK.latency_s
    assert tp8.c == pytest.approx((one.c - overhead) / 8 + overhead + latencies, rel=1e-9)
    assert tp8.a == pytest.approx(one.a / 8)


def test_tep_and_ep_differ_from_tp_where_the_formulas_say() -> None:
    [tp8] = replica_stage_cost_models("minimax-m2.7", parse_layout("tp8"))
    [tep8] = replica_stage_cost_models("minimax-m2.7", parse_layout("tep8"))
    [ep8] = replica_stage_cost_models("minimax-m2.7", parse_layout("ep8"))
    # MiniMax's f = 1536 splits 8 ways into 192 columns: two tiles of 128 for 1.5 tiles of
    # work, so TP pays a quantization loss TEP (whole experts) does not; same collectives.
    assert tep8.b < tp8.b
    assert tep8.c == pytest.approx(tp8.c)
    # EP: the attention weights are replicated (c higher), the all-to-all moves only the
    # tokens' expert copies (b lower than two all-reduces of every token).
    assert ep8.c > tep8.c
    assert ep8.b < tep8.b
    # GQA KV: TP splits MiniMax's 8 KV heads; EP reads only its own requests' KV.
    assert tp8.g == pytest.approx(ep8.g)


def test_kv_capacity_per_layout() -> None:
    tp8 = replica_kv_blocks(
        "glm-5.2", parse_layout("tp8"), block_size=64, max_microbatch_tokens=16384
    )
    ep8 = replica_kv_blocks(
        "glm-5.2", parse_layout("ep8"), block_size=64, max_microbatch_tokens=16384
    )
    assert len(tp8) == 1 and tp8[0] > 0
    # MLA latent replicated on TP ranks; EP ranks hold their own requests' KV, less the room
    # the attention weights take whole on every rank.
    [stage] = derived_stage_memory(
        "glm-5.2", num_stages=1, block_size=64, max_microbatch_tokens=16384, num_gpus_per_stage=8
    )
    spec = get_model("glm-5.2")
    attention = sum(layer.split.attention_weight_bytes for layer in spec.layers)  # type: ignore[union-attr]
    per_rank = math.floor((stage.kv_bytes - attention * 7 / 8) / (spec.kv_bytes_per_token() * 64))
    assert ep8 == [8 * per_rank]
    assert tp8[0] < ep8[0] < 8 * tp8[0]
    with pytest.raises(ValueError, match="kimi-k3 on 1 stages of 8 x H200 does not fit"):
        replica_kv_blocks("kimi-k3", parse_layout("tep8"), block_size=64,
                          max_microbatch_tokens=16384)  # fmt: skip


def test_parse_layouts() -> None:
    layout = parse_layout("pp4xtp2")
    assert (layout.num_stages, layout.group, layout.group_size, layout.mode) == (4, "tp", 2, "wave")
    assert layout.num_gpus == 8
    assert parse_layout("pp8-sync").mode == "sync"
    tep = parse_layout("TEP8")
    assert (tep.num_stages, tep.group, tep.group_size, tep.mode) == (1, "tep", 8, "sync")
    assert [x.label for x in parse_layouts("pp8-wave, tp8,pp2xtep4-sync")] == [
        "pp8-wave",
        "tp8",
        "pp2xtep4-sync",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tp16", r"t=16 must be in \[1, 8\]"),
        ("pp4xtp0", r"t=0 must be in \[1, 8\]"),
        ("pp0", "S=0 must be >= 1"),
        ("dp8", "expected pp<S>"),
        ("tp8-wave", "expected pp<S>"),
        ("", "at least one layout"),
        ("tp8,tp8", r"\['tp8'\] given more than once"),
    ],
)
def test_bad_layouts_name_the_limit(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_layouts(text)


def test_small_shape_loss_grows_with_the_split() -> None:
    # MiniMax-M2.7 per-token b over t: the split costs more than 1/t of the compute once the
    # shards stop filling tiles (and the collectives grow with (t-1)/t).
    [one] = replica_stage_cost_models("minimax-m2.7", parse_layout("pp1"))
    ratios = []
    for t in (2, 4, 8):
        [model] = replica_stage_cost_models("minimax-m2.7", parse_layout(f"tp{t}"))
        ratios.append(model.b * t / one.b)
    assert all(r > 1 for r in ratios)
    assert ratios == sorted(ratios)
    assert math.isfinite(ratios[-1])


def test_ep_imbalance_slows_only_expert_parallel_moe() -> None:
    layout = parse_layout("tep8")
    [even] = replica_stage_cost_models("glm-5.2", layout)
    [skewed] = replica_stage_cost_models("glm-5.2", layout, ep_imbalance=1.5)
    assert skewed.b > even.b and skewed.c == even.c and skewed.a == even.a
    [tp_even] = replica_stage_cost_models("glm-5.2", parse_layout("tp8"))
    [tp_skewed] = replica_stage_cost_models("glm-5.2", parse_layout("tp8"), ep_imbalance=1.5)
    assert tp_skewed.b == tp_even.b  # TP holds every expert on every rank: no imbalance
    with pytest.raises(ValueError, match="ep_imbalance=0.5: must be finite and >= 1"):
        replica_stage_cost_models("glm-5.2", layout, ep_imbalance=0.5)


def test_published_ep_imbalances_are_valid_and_order_eplb_below_no_eplb() -> None:
    assert all(name == entry.name for name, entry in EP_IMBALANCES.items())
    assert EP_IMBALANCES["uniform"].busiest_over_mean == 1.0
    with_eplb = EP_IMBALANCES["trtllm-ep32-eplb"].busiest_over_mean
    without = EP_IMBALANCES["trtllm-ep32-no-eplb"].busiest_over_mean
    assert 1.0 < with_eplb < without  # (max - mean) / mean 0.109 and 1.564, plus one
    layout = parse_layout("tep8")
    [even] = replica_stage_cost_models("kimi-k3", layout)
    [uniform] = replica_stage_cost_models(
        "kimi-k3", layout, ep_imbalance=EP_IMBALANCES["uniform"].busiest_over_mean
    )
    [skewed] = replica_stage_cost_models("kimi-k3", layout, ep_imbalance=without)
    assert uniform == even and skewed.b > even.b
    with pytest.raises(ValueError, match="EPImbalance.busiest_over_mean=0.9: must be finite"):
        EPImbalance("bad", 0.9, "a mean cannot exceed the busiest rank")


def test_ring_all_reduce_slows_only_the_tensor_parallel_collectives() -> None:
    assert H200_NVLINK_RING.allreduce_bus_bytes_per_s < H200_NVLINK.allreduce_bus_bytes_per_s
    [nvls] = replica_stage_cost_models("kimi-k3", parse_layout("tep8"))
    [ring] = replica_stage_cost_models("kimi-k3", parse_layout("tep8"), link=H200_NVLINK_RING)
    assert ring.b > nvls.b and (ring.c, ring.g, ring.a) == (nvls.c, nvls.g, nvls.a)
    pp = parse_layout("pp8")
    terms = [
        [(m.c, m.g, m.b, m.a) for m in replica_stage_cost_models("kimi-k3", pp, link=link)]
        for link in (H200_NVLINK, H200_NVLINK_RING)
    ]
    assert terms[0] == terms[1]  # one GPU per stage: no collective to slow
