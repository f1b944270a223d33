"""End to end: real stage processes, real NATS, gloo activations; logits vs Hugging Face.

Stages have unequal KV capacity, so after some traffic their local prefix hits differ; the
pipelined, chunked, prefix-reusing run must still produce the last-token logits of a monolithic
forward of the same weights (transformers' LlamaForCausalLM) within 1e-4 in fp32, and every stage
must have used the same cached length (L*) for every request.
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

MODEL = small_llama("ref-llama", seed=7, num_layers=6)
BLOCK = 4


@pytest.mark.parametrize("mode", ["wave", "sync"])
async def test_pipelined_prefix_reuse_matches_monolithic_forward(mode: str, tmp_path) -> None:  # noqa: ANN001
    config = RuntimeConfig(
        model=MODEL,
        engine="torch",
        num_stages=3,
        block_size=BLOCK,
        num_kv_blocks=[96, 26, 64],  # stage 1 evicts first: local hits differ
        mode=mode,
        chunk_tokens=16,  # several chunks per prompt
        lease_s=30.0,
    )
    rng = random.Random(3)
    shared = [rng.randrange(MODEL.vocab_size) for _ in range(32)]  # 8 full blocks

    def prompt(n: int) -> list[int]:
        return shared + [rng.randrange(MODEL.vocab_size) for _ in range(n)]

    async with LocalPipeline(config, PIPELINE_COST, log_dir=str(tmp_path)) as pipeline:
        scheduler = pipeline.scheduler
        first = await scheduler.submit(PromptRequest("a", prompt(9), return_logits=True))
        # Fillers (one at a time) push stage 1 (26 blocks) to evict the shared chain's tail.
        fillers = [
            await scheduler.submit(PromptRequest(f"f{i}", [rng.randrange(256) for _ in range(40)]))
            for i in range(2)
        ]
        # Then concurrent requests sharing the prefix: packed micro-batches, reuse on all stages.
        import asyncio

        prompts = {f"b{i}": prompt(5 + 7 * i) for i in range(3)}
        reused = await asyncio.gather(
            *(
                scheduler.submit(PromptRequest(rid, toks, return_logits=True))
                for rid, toks in prompts.items()
            )
        )
    outcomes = [first, *reused]
    assert all(o.ok for o in [first, *fillers, *reused]), [o.error for o in outcomes]
    expected_prompts = {"a": None, **prompts}
    differing_hits = 0
    for outcome in outcomes:
        # every stage reported the same L* for every chunk of the request, equal to the ticket's
        agreed = {value for _, value in outcome.stage_agreed_blocks}
        ranks = {rank for rank, _ in outcome.stage_agreed_blocks}
        assert ranks == {0, 1, 2}, (outcome.request_id, outcome.stage_agreed_blocks)
        assert agreed == {outcome.num_cached_tokens // BLOCK}
        if len(set(outcome.stage_hits)) > 1:
            differing_hits += 1
    assert differing_hits >= 1, [o.stage_hits for o in outcomes]
    assert any(o.num_cached_tokens > 0 for o in reused)
    reference = hf_llama(MODEL)
    for outcome in reused:
        got = torch.tensor(outcome.logits)
        want = last_logits(reference, expected_prompts[outcome.request_id])
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
        assert outcome.first_token_id == int(torch.argmax(want))
