"""End to end on real stage processes: a handed-off request's KV, pulled from both stages over the
handoff protocol, equals the K/V a monolithic Hugging Face forward of the same weights caches
(post-RoPE K, V; fp32); leases end cleanly (pulled, wrong token, unpulled expiry) and leave no
pinned block on any stage."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from hf_reference import PIPELINE_COST, hf_llama, small_llama

from wavepp.api.kv_handoff import PARAMS_KEY, HandoffError, HandoffParams
from wavepp.integrations.vllm.pull import pull_request, pull_stage, stage_stats
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.serving.local import LocalPipeline

pytestmark = pytest.mark.slow

MODEL = small_llama("handoff-llama", seed=11)
BLOCK = 4


def hf_kv(token_ids: list[int]) -> list[torch.Tensor]:
    """Per layer [2, num_tokens, num_kv_heads, head_dim] as transformers' Llama caches it."""
    model = hf_llama(MODEL)
    with torch.inference_mode():
        cache = model(torch.tensor([token_ids]), use_cache=True).past_key_values
    out = []
    for i in range(MODEL.num_layers):
        k, v = cache.layers[i].keys, cache.layers[i].values
        out.append(torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)]))
    return out


async def _wait_no_pins(pipeline: LocalPipeline, timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [await asyncio.to_thread(stage_stats, a) for a in pipeline.handoff_addrs]
        if all(s["pinned_blocks"] == 0 and s["leases"] == 0 for s in stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"pins left on the stages: {stats}")
        await asyncio.sleep(0.2)


async def test_pulled_kv_matches_hf_and_leases_end_cleanly(tmp_path) -> None:  # noqa: ANN001
    config = RuntimeConfig(
        model=MODEL,
        engine="torch",
        num_stages=2,
        block_size=BLOCK,
        num_kv_blocks=[64],
        chunk_tokens=8,  # several chunks per prompt
        handoff_lease_s=20.0,
    )
    rng = random.Random(5)
    shared = [rng.randrange(MODEL.vocab_size) for _ in range(12)]
    prompts = {f"r{i}": shared + [rng.randrange(256) for _ in range(3 + 5 * i)] for i in range(3)}
    async with LocalPipeline(config, PIPELINE_COST, log_dir=str(tmp_path)) as pipeline:
        assert all(pipeline.handoff_addrs), pipeline.handoff_addrs
        start = [await asyncio.to_thread(stage_stats, a) for a in pipeline.handoff_addrs]
        scheduler = pipeline.scheduler
        first = await scheduler.submit(PromptRequest("r0", prompts["r0"], handoff=True))
        rest = await asyncio.gather(
            *(
                scheduler.submit(PromptRequest(r, p, handoff=True))
                for r, p in prompts.items()
                if r != "r0"
            )
        )
        outcomes = [first, *rest]
        assert all(o.ok for o in outcomes), [o.error for o in outcomes]
        assert any(o.num_cached_tokens for o in rest), "the shared prefix was reused"
        params = {
            o.request_id: HandoffParams.from_json(pipeline.kv_transfer_params(o)[PARAMS_KEY])
            for o in outcomes
        }
        # a wrong token is refused and leaves the lease in place
        forged = HandoffParams(**{**params["r1"].__dict__, "token": "00" * 32})
        with pytest.raises(HandoffError, match="token: not valid"):
            await asyncio.to_thread(pull_stage, forged, forged.stages[0])
        pulled_kv = {r: await asyncio.to_thread(pull_request, params[r]) for r in ("r0", "r1")}
        for rid, pulled in pulled_kv.items():
            assert pulled.num_bytes == MODEL.num_layers * 2 * len(prompts[rid]) * 2 * 16 * 4
            want = hf_kv(prompts[rid])
            assert len(pulled.layers) == MODEL.num_layers
            for got, ref in zip(pulled.layers, want, strict=False):
                assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
        # r2 is never pulled: its lease ends after handoff_lease_s, releasing its pins
        stats = await _wait_no_pins(pipeline, timeout_s=40.0)
        assert [s["free_blocks"] for s in stats] == [s["free_blocks"] for s in start]
        assert sum(s["expired"] for s in stats) == 2  # r2 on both stages
        assert sum(s["refused"] for s in stats) == 1
        # a pull after the lease ended is refused with the cause named
        with pytest.raises(HandoffError, match="ended|holds no handoff lease"):
            await asyncio.to_thread(pull_request, params["r2"])
