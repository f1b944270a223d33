"""Prefix-aware admission: a request waits for a live request computing its prefix."""

from __future__ import annotations

import asyncio

import pytest

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv.inflight import InflightPrefixIndex
from wavepp.runtime.planning import CostModel
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.serving.local import LocalPipeline


def test_index_reports_the_deepest_owner_and_forgets_on_remove() -> None:
    index = InflightPrefixIndex()
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    index.add("r1", [b, c])  # r1 agreed on [a] and computes b, c
    index.add("r2", [c, d])  # c already owned by r1: r2 owns only d
    assert index.deepest_overlap([a, b]) == ("r1", 2)
    assert index.deepest_overlap([a, b, c, d]) == ("r2", 4)
    assert index.deepest_overlap([bytes([9]) * 32]) == (None, 0)
    index.remove("r2")
    assert index.deepest_overlap([a, b, c, d]) == ("r1", 3)
    index.remove("r1")
    index.remove("unknown")
    assert index.deepest_overlap([a, b, c, d]) == (None, 0) and len(index) == 0


@pytest.mark.slow
async def test_concurrent_requests_sharing_a_prefix_reuse_it_only_with_prefix_wait(
    tmp_path,
) -> None:  # noqa: ANN001
    cost = CostModel(c=2e-3, g=1e-6, b=5e-5, a=0.0, label="derived", source="test")
    shared = list(range(512))  # 32 blocks of 16
    cached: dict[bool, int] = {}
    for prefix_wait in (False, True):
        config = RuntimeConfig(
            engine="emulated",
            cost_model=cost.to_dict(),
            num_stages=2,
            block_size=16,
            num_kv_blocks=[1024],
            mode="wave",
            chunk_tokens=256,
            prefix_wait=prefix_wait,
            admission_lookahead_tokens=1_000_000,  # admit all four at once: isolate prefix wait
        )
        async with LocalPipeline(config, cost, log_dir=str(tmp_path / str(prefix_wait))) as pipe:
            outcomes = await asyncio.gather(
                *(
                    pipe.scheduler.submit(PromptRequest(f"r{i}", shared + [600 + i] * 16))
                    for i in range(4)
                )
            )
        assert all(o.ok for o in outcomes), [o.error for o in outcomes]
        cached[prefix_wait] = sum(o.num_cached_tokens for o in outcomes)
    # Without waiting, all four agree before anyone computed the prefix: nothing to reuse.
    assert cached[False] == 0
    # With it, the three followers reuse the leader's 512 prefix tokens.
    assert cached[True] == 3 * 512
