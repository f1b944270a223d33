"""The KV handoff's cost model (wavepp.runtime.planning.handoff_cost): bytes per token and per
request of each stage, per family, recomputed here from the published shapes; the link."""

from __future__ import annotations

import math

import pytest

from wavepp.runtime.planning.handoff_cost import (
    H200_RDMA,
    HandoffLink,
    LinkSpec,
    stage_handoff_bytes,
)
from wavepp.runtime.planning.published import get_model, list_models

BF16 = 2


def test_gqa_minimax_sends_k_and_v_of_its_kv_heads_per_layer() -> None:
    # MiniMax-M2.7: 62 GQA layers, 8 KV heads of 128, BF16: 2 * 8 * 128 * 2 = 4096 B/token/layer.
    per_layer = 2 * 8 * 128 * BF16
    for num_stages in (4, 8):
        stages = stage_handoff_bytes("minimax-m2.7", num_stages=num_stages)
        for stage in stages:
            first, last = stage.layers
            assert stage.kv_bytes_per_token == (last - first) * per_layer
            assert stage.state_bytes_per_request == 0
        assert sum(s.kv_bytes_per_token for s in stages) == 62 * per_layer == 253_952


def test_mla_with_dsa_sends_the_latent_the_rope_key_and_the_indexer_keys() -> None:
    # GLM-5.2: latent 512 + rope 64 in BF16 per layer (1152 B), plus the FP8 index key (128 B)
    # and its fp32 scale (4 B) in the 21 indexer layers 0, 1, 2, 6, 10, ..., 74.
    indexer = {0, 1, 2, *range(6, 75, 4)}
    stages = stage_handoff_bytes("glm-5.2", num_stages=8)
    for stage in stages:
        first, last = stage.layers
        expected = sum((512 + 64) * BF16 + (128 + 4) * (i in indexer) for i in range(first, last))
        assert stage.kv_bytes_per_token == expected
    total = sum(s.kv_bytes_per_token for s in stages)
    assert total == 78 * 1152 + 21 * 132 == 92_628  # docs/model-costs.md's table


def test_kda_layers_send_recurrent_state_per_request_not_per_token() -> None:
    # Kimi K3: 24 MLA layers (1152 B/token each) and 69 KDA layers with no per-token KV but
    # H * d_k * d_v * 4 + 3 * H * d_k * (conv - 1) * 2 bytes of state each (H 96, d 128, conv 4).
    state = 96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 2
    assert state / 2**20 == pytest.approx(6.21, abs=0.005)  # docs/model-costs.md: 6.21 MiB
    spec = get_model("kimi-k3")
    stages = stage_handoff_bytes("kimi-k3", num_stages=4)
    for stage in stages:
        kinds = [layer.kind for layer in spec.layers[stage.layers[0] : stage.layers[1]]]
        num_mla = sum(kind.startswith("mla") for kind in kinds)
        assert stage.kv_bytes_per_token == num_mla * 1152
        assert stage.state_bytes_per_request == (len(kinds) - num_mla) * state
    assert sum(s.state_bytes_per_request for s in stages) / 2**20 == pytest.approx(428.6, abs=0.1)


@pytest.mark.parametrize("model", list_models())
def test_every_catalogue_model_splits_its_bytes_over_the_stages(model: str) -> None:
    spec = get_model(model)
    for num_stages in (1, 2, 4):
        stages = stage_handoff_bytes(model, num_stages=num_stages, num_gpus_per_stage=2)
        assert [s.rank for s in stages] == list(range(num_stages))
        assert sum(s.kv_bytes_per_token for s in stages) == spec.kv_bytes_per_token()
        assert all(s.num_gpus == 2 for s in stages)


def test_bad_stage_layouts_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="num_gpus_per_stage=0"):
        stage_handoff_bytes("glm-5.2", num_stages=4, num_gpus_per_stage=0)
    with pytest.raises(ValueError, match="unknown"):
        stage_handoff_bytes("no-such-model", num_stages=4)


def test_h200_link_is_400_gbps_per_gpu_in_bytes() -> None:
    # 400 Gb/s = 50e9 B/s line rate; 0.9 of it achieved.
    assert H200_RDMA.bytes_per_s_per_gpu == pytest.approx(45e9)
    assert HandoffLink.of(H200_RDMA, 2).bytes_per_s == pytest.approx(90e9)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("gbps_per_gpu", {"gbps_per_gpu": 0.0}),
        ("gbps_per_gpu", {"gbps_per_gpu": math.inf}),
        ("efficiency", {"gbps_per_gpu": 1.0, "efficiency": 1.5}),
        ("latency_s", {"gbps_per_gpu": 1.0, "latency_s": -1e-6}),
    ],
)
def test_link_spec_refuses_bad_values_naming_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=f"LinkSpec.{field}="):
        LinkSpec("bad", **kwargs)


def test_link_serves_transfers_in_order_and_latency_does_not_hold_it() -> None:
    link = HandoffLink(bytes_per_s=1000.0, latency_s=0.5)
    first = link.send("a", 1000.0, ready_s=10.0)  # 1 s on the link
    assert (first.start_s, first.end_s, first.landed_s) == (10.0, 11.0, 11.5)
    # ready while the first is on the link: waits for it, not for its latency
    second = link.send("b", 500.0, ready_s=10.5)
    assert (second.start_s, second.end_s, second.landed_s) == (11.0, 11.5, 12.0)
    assert second.queued_s == pytest.approx(0.5)
    # ready after the link went idle: no wait
    third = link.send("c", 0.0, ready_s=20.0)
    assert (third.start_s, third.landed_s, third.queued_s) == (20.0, 20.5, 0.0)
    assert link.num_bytes == 1500.0 and link.busy_s == pytest.approx(1.5)
    with pytest.raises(ValueError, match="num_bytes"):
        link.send("d", -1.0, ready_s=21.0)
    with pytest.raises(ValueError, match="bytes_per_s"):
        HandoffLink(0.0, 0.0)
