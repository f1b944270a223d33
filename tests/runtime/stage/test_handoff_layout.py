"""Layout conversions of the handoff, checked against an independent reference: the stage reads
a request's tokens out of its paged cache (block size 4), and the vLLM side writes them into
vLLM's CPU cache (block size 8, head-major, K rows then V rows per block and head) where vLLM's
CPU attention finds them (its view [B, H, 2N, C] split in halves)."""

from __future__ import annotations

import pytest
import torch

from wavepp.integrations.vllm.layout import slots_of, write_cpu_cache
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


def test_vllm_cpu_cache_write_matches_the_backend_view() -> None:
    num_blocks, heads, block, dim = 6, 2, 8, 4
    cache = torch.zeros(num_blocks, heads, block, 2 * dim, dtype=torch.float32)
    kv = torch.randn(2, 13, heads, dim, dtype=torch.float64)  # dtype converted on write
    table = [4, 1]
    write_cpu_cache(cache, kv, table, start=2, count=10)
    # how vLLM's CPU attention reads it: view [B, H, 2N, C], K = first N rows, V = the rest
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block, dim).chunk(2, dim=2)
    for t in range(13):
        b, row = table[t // block], t % block
        written = 2 <= t < 12
        for h in range(heads):
            want_k = kv[0, t, h].float() if written else torch.zeros(dim)
            want_v = kv[1, t, h].float() if written else torch.zeros(dim)
            assert torch.equal(key_cache[b, h, row], want_k), (t, h)
            assert torch.equal(value_cache[b, h, row], want_v), (t, h)
    assert cache[[0, 2, 3, 5]].abs().sum() == 0  # no other block touched


def test_write_refuses_mismatched_shapes() -> None:
    cache = torch.zeros(4, 2, 8, 8)
    with pytest.raises(ValueError, match=r"needs \[2, tokens, 2, 4\]"):
        write_cpu_cache(cache, torch.zeros(2, 5, 3, 4), [0], 0, 5)
    with pytest.raises(ValueError, match="need more than 1 blocks"):
        write_cpu_cache(cache, torch.zeros(2, 12, 2, 4), [0], 0, 12)
    with pytest.raises(ValueError, match="contiguous"):
        write_cpu_cache(torch.zeros(4, 2, 8, 7), torch.zeros(2, 1, 2, 4), [0], 0, 1)
    assert slots_of([3, 1], 8, 6, 4).tolist() == [30, 31, 8, 9]


def test_overlap_seconds_counts_union_of_busy_time() -> None:
    spans = [(0.0, 10.0), (20.0, 22.0)]
    busy = [(1.0, 3.0), (2.0, 4.0), (9.0, 21.0)]
    assert overlap_seconds(spans, busy) == pytest.approx(3.0 + 1.0 + 1.0)
    assert overlap_seconds(spans, []) == 0.0
