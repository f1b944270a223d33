"""End to end on real stage processes (real NATS, gloo activations): a prefix demoted to each
stage's host tier comes back through it, and the reusing request's logits equal a monolithic
forward without any cache (transformers' LlamaForCausalLM of the same weights, fp32).

Each stage holds 10 device blocks; a filler of 40 tokens needs all 10, so after it no stage's
device pool holds any block of the first prompt: the reused tokens can only be host hits.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import PIPELINE_COST, hf_llama, last_logits, small_llama

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.serving.local import LocalPipeline

pytestmark = pytest.mark.slow

MODEL = small_llama("host-llama", seed=13)
BLOCK = 4
DEVICE_BLOCKS = 10


async def test_a_prefix_demoted_to_the_host_tier_is_reused_exactly(tmp_path) -> None:  # noqa: ANN001
    config = RuntimeConfig(
        model=MODEL,
        engine="torch",
        num_stages=2,
        block_size=BLOCK,
        num_kv_blocks=[DEVICE_BLOCKS],
        num_host_kv_blocks=[32],
        chunk_tokens=16,  # several chunks per prompt
        lease_s=30.0,
    )
    rng = random.Random(29)
    shared = [rng.randrange(MODEL.vocab_size) for _ in range(4 * BLOCK)]
    first = shared + [rng.randrange(MODEL.vocab_size) for _ in range(5)]
    filler = [rng.randrange(MODEL.vocab_size) for _ in range(DEVICE_BLOCKS * BLOCK)]
    second = shared + [rng.randrange(MODEL.vocab_size) for _ in range(7)]
    async with LocalPipeline(config, PIPELINE_COST, log_dir=str(tmp_path)) as pipeline:
        scheduler = pipeline.scheduler
        a = await scheduler.submit(PromptRequest("a", first))
        f = await scheduler.submit(PromptRequest("f", filler))
        b = await scheduler.submit(PromptRequest("b", second, return_logits=True))
    assert a.ok and f.ok and b.ok, [a.error, f.error, b.error]
    assert f.num_cached_tokens == 0
    # the filler took every device block: the 4 shared blocks were host hits on both stages
    assert b.num_cached_tokens == 4 * BLOCK
    assert b.stage_hits == (4, 4), b.stage_hits
    got = torch.tensor(b.logits)
    want = last_logits(hf_llama(MODEL), second)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert b.first_token_id == int(torch.argmax(want))
