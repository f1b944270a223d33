"""A served pipeline (``LocalPipeline``: real NATS, real stage processes, emulated engine) agrees
with the host load policy in force (``planning.host_load.serving_agreed_blocks``): a prefix held
only in the stages' host tiers is loaded when the link is fast, recomputed when loading would
cost more than computing it.

Each stage holds 10 device blocks; a filler of 40 tokens takes all 10, so afterwards the shared
prefix of 4 blocks is in the host tiers only (h_s = 4, d_s = 0 on every stage).
"""

from __future__ import annotations

import random

import pytest

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.catalogue import derived_cost_model
from wavepp.runtime.planning.host_load import HostLoadPolicy, serving_agreed_blocks
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.serving.local import LocalPipeline

pytestmark = pytest.mark.slow

BLOCK = 4
DEVICE_BLOCKS = 10
COST = derived_cost_model("tiny-llama", num_stages=2)


def _config(load_s_per_block: float) -> RuntimeConfig:
    return RuntimeConfig(
        engine="emulated",
        cost_model=COST.to_dict(),
        time_scale=0.01,
        num_stages=2,
        block_size=BLOCK,
        num_kv_blocks=[DEVICE_BLOCKS],
        num_host_kv_blocks=[32],
        host_load_s_per_block=[load_s_per_block],
        chunk_tokens=16,
    )


def test_the_served_policy_is_the_emulated_stages_cost_against_the_link() -> None:
    """Pure: the served replica's choice for h = 4 host blocks, d = 0 on both stages."""
    compute_4 = HostLoadPolicy([COST], [0.0], BLOCK).compute_s(0, 4)
    fast = serving_agreed_blocks(_config(compute_4 / 100), COST.scaled(7.0))
    slow = serving_agreed_blocks(_config(compute_4), COST.scaled(7.0))
    assert fast is not None and slow is not None
    assert fast([4, 4], [4, 4], 10) == 4  # 4 loads cost 4 % of computing the blocks
    assert slow([4, 4], [4, 4], 10) == 0  # 4 loads cost 4x computing them: recompute
    no_tier = RuntimeConfig(engine="emulated", cost_model=COST.to_dict(), num_stages=2)
    assert serving_agreed_blocks(no_tier, COST) is None
    # the torch engine (no stage cost model in the config) weighs at the planner's model
    torch_config = RuntimeConfig(
        num_stages=2, num_host_kv_blocks=[8], host_load_s_per_block=[compute_4]
    )
    cheap = CostModel(c=0.0, g=1e-12, b=1e-12, a=0.0, label="measured")
    assert serving_agreed_blocks(torch_config, cheap)([4, 4], [4, 4], 10) == 0  # type: ignore[misc]


async def test_a_local_pipeline_recomputes_where_loading_costs_more(tmp_path) -> None:  # noqa: ANN001
    """With the policy ignored the stages would load the 4 host blocks (L* = 4): one block's
    load costs 100x computing all four, so the served pipeline agrees L* = 0. (The policy's
    choice with a fast link, and the load itself, are the pure test above and
    tests/runtime/stage/test_host_tier_pipeline.py.)"""
    compute_4 = HostLoadPolicy([COST], [0.0], BLOCK).compute_s(0, 4)
    load_s = 100 * compute_4
    rng = random.Random(29)
    shared = [rng.randrange(1000) for _ in range(4 * BLOCK)]
    first = shared + [rng.randrange(1000) for _ in range(5)]
    filler = [rng.randrange(1000) for _ in range(DEVICE_BLOCKS * BLOCK)]
    second = shared + [rng.randrange(1000) for _ in range(7)]
    async with LocalPipeline(_config(load_s), COST, log_dir=str(tmp_path)) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None
        a = await scheduler.submit(PromptRequest("a", first))
        f = await scheduler.submit(PromptRequest("f", filler))
        b = await scheduler.submit(PromptRequest("b", second))
    assert a.ok and f.ok and b.ok, [a.error, f.error, b.error]
    assert f.num_cached_tokens == 0
    # both stages held the prefix (in their host tiers); the policy chose to recompute it
    assert b.stage_hits == (4, 4), b.stage_hits
    assert b.num_cached_tokens == 0
