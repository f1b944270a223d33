"""Layout conversions of the handoff: the stage reads a request's tokens out of its paged cache
(block size 4) by its block table; the vLLM side maps them to its own blocks (size 8) and
converts range and dtype for the backend's cache writer (which the end-to-end test runs)."""

from __future__ import annotations

import pytest
import torch

from wavepp.integrations.vllm.layout import kv_for_backend, slots_of
from wavepp.runtime.stage.handoff_server import overlap_seconds, read_layer_kv


def test_stage_read_follows_the_block_table() -> None:
    block, heads, dim = 4, 2, 3
    cache = torch.randn(2, 10 * block, heads, dim)
    table = [7, 2, 5]
    got = read_layer_kv(cache, table, block, 10)
    for t in range(10):
        slot = table[t // block] * block + t % block
        assert torch.equal(got[:, t], cache[:, slot])
    with pytest.raises(ValueError, match="exceeds 3 blocks"):
        read_layer_kv(cache, table, block, 13)


def test_vllm_side_slots_and_kv_conversion() -> None:
    # vLLM blocks of 8: token t of a request with blocks [4, 1] sits at slot block * 8 + row
    assert slots_of([4, 1], 8, 2, 10).tolist() == [34, 35, 36, 37, 38, 39, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="need more than 2 blocks"):
        slots_of([4, 1], 8, 10, 7)
    kv = torch.randn(2, 13, 2, 4, dtype=torch.float64)
    key, value = kv_for_backend(kv, 2, 10, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    assert key.shape == value.shape == (10, 2, 4) and key.dtype == torch.float32
    assert key.is_contiguous() and value.is_contiguous()
    assert torch.equal(key, kv[0, 2:12].float()) and torch.equal(value, kv[1, 2:12].float())
    with pytest.raises(ValueError, match=r"needs \[2, tokens, 3, 4\]"):
        kv_for_backend(kv, 0, 1, num_kv_heads=3, head_dim=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="holds 13 tokens"):
        kv_for_backend(kv, 5, 9, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def test_overlap_seconds_counts_union_of_busy_time() -> None:
    spans = [(0.0, 10.0), (20.0, 22.0)]
    busy = [(1.0, 3.0), (2.0, 4.0), (9.0, 21.0)]
    assert overlap_seconds(spans, busy) == pytest.approx(3.0 + 1.0 + 1.0)
    assert overlap_seconds(spans, []) == 0.0
