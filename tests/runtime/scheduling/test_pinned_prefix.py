"""The wave admission and the prefixes live requests hold pinned (cached on every stage):

- prefix wait: a request waits only for a live request *computing* its prefix, never for one
  merely agreeing on a prefix that is cached already;
- the lookahead (a budget of new tokens): an agreeing request counts its prompt less the
  pinned prefix, not its whole prompt.

Simulated stages on a virtual clock (``wavepp.sim``) drive the real scheduler, admission and KV
managers; nothing is mocked.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from wavepp.bench.grid import GridSpec, Setting
from wavepp.bench.workloads import shared_prefix_workload
from wavepp.launch.grid import runtime_config
from wavepp.runtime.request import PromptRequest, RequestOutcome
from wavepp.sim.clock import VirtualClockLoop
from wavepp.sim.pipeline import SimPipeline
from wavepp.sim.run import simulate

PREFIX_TOKENS = 2048  # 32 blocks of 64
SUFFIX_TOKENS = 256


def _tokens(seed: int, num: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, num).tolist()


@dataclass
class Burst:
    outcomes: list[RequestOutcome]
    num_prefix_waits: int  # admissions of the burst that waited for a prefix owner
    num_rounds: int  # agreement rounds the burst took


def _burst(*, warm_prefix: bool, num_requests: int, prefix_tokens: int = PREFIX_TOKENS) -> Burst:
    """``num_requests`` requests sharing a prefix (each with its own ``SUFFIX_TOKENS``) arrive
    at once on a 2-stage MiniMax-M2.7 pipeline (H200 time) while a long request with the same
    prefix is in flight. With ``warm_prefix`` the prefix was computed before, so the long
    request holds it pinned as its agreed prefix; without, the long request computes it."""
    spec = GridSpec(time_scale=1.0, num_stages=2, num_kv_blocks=65536)
    config, planner_cost = runtime_config(spec, Setting("minimax-m2.7", 8, "high", "wave"))
    vocab = config.model.vocab_size
    prefix = _tokens(1, prefix_tokens, vocab)

    async def main() -> Burst:
        async with SimPipeline(config, planner_cost) as pipe:
            scheduler = pipe.scheduler
            assert scheduler is not None
            if warm_prefix:
                warm = await scheduler.submit(PromptRequest("warm", prefix + [1]))
                assert warm.ok, warm.error
            long = asyncio.ensure_future(
                scheduler.submit(PromptRequest("long", prefix + _tokens(2, 8192, vocab)))
            )
            await asyncio.sleep(0.01)  # admitted (two KV round trips), its first chunk running
            assert scheduler.core.is_live("long")
            assert pipe.controller is not None
            waits_before = scheduler.num_prefix_waits
            rounds_before = pipe.controller.num_rounds
            outcomes = await asyncio.gather(
                *(
                    scheduler.submit(
                        PromptRequest(f"r{i}", prefix + _tokens(10 + i, SUFFIX_TOKENS, vocab))
                    )
                    for i in range(num_requests)
                )
            )
            num_rounds = pipe.controller.num_rounds - rounds_before
            assert (await long).ok
            return Burst(list(outcomes), scheduler.num_prefix_waits - waits_before, num_rounds)

    loop = VirtualClockLoop(start_s=100.0)
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_requests_sharing_a_pinned_prefix_agree_together_without_waiting() -> None:
    """8 requests sharing a prefix that is cached and pinned: none waits for another's
    agreement (a prefix live requests hold pinned is not claimed by the agreeing one), and
    each reuses the whole prefix."""
    burst = _burst(warm_prefix=True, num_requests=8)
    assert all(o.ok for o in burst.outcomes), [o.error for o in burst.outcomes]
    assert burst.num_prefix_waits == 0
    assert [o.num_cached_tokens for o in burst.outcomes] == [PREFIX_TOKENS] * 8


def test_requests_sharing_a_prefix_being_computed_still_wait_for_it() -> None:
    """The wait is still there for what it is for: the long request computes the prefix, so
    the burst waits for it and reuses it instead of computing it again."""
    burst = _burst(warm_prefix=False, num_requests=4)
    assert all(o.ok for o in burst.outcomes), [o.error for o in burst.outcomes]
    assert burst.num_prefix_waits >= 1
    assert [o.num_cached_tokens for o in burst.outcomes] == [PREFIX_TOKENS] * 4


def test_requests_sharing_a_pinned_prefix_count_only_their_new_tokens_against_the_lookahead() -> (
    None
):
    """8 agentic-sized requests (16k-token pinned prefix, 256 new tokens each) on 2 stages,
    whose lookahead is 3 x 8,192 new tokens: they agree in one round, each counting only its
    new tokens against the lookahead, not its whole 16,640-token prompt."""
    burst = _burst(warm_prefix=True, num_requests=8, prefix_tokens=16384)
    assert all(o.ok for o in burst.outcomes), [o.error for o in burst.outcomes]
    assert [o.num_cached_tokens for o in burst.outcomes] == [16384] * 8
    assert burst.num_rounds == 1


def test_a_returning_group_over_few_prefixes_is_planned_whole() -> None:
    """Closed loop, 2 stages, C = 64 requests of 512 new tokens over 2 shared prefixes: the
    in-flight work is exactly 2 micro-batches at the engine's 16k-token cap, each a group of 32
    requests (16 per prefix) that returns together: the group's prefix-sharing agreements run
    together, so it is planned whole, not split into under-full parts that each pay c and a
    slot."""
    spec = GridSpec(time_scale=1.0, num_stages=2, num_kv_blocks=65536)
    config, planner_cost = runtime_config(spec, Setting("minimax-m2.7", 64, "high", "wave"))
    workload = shared_prefix_workload(
        6 * 64,
        num_prefix_tokens=3584,
        num_suffix_tokens=512,
        num_prefixes=2,
        vocab_size=config.model.vocab_size,
    )
    report = simulate(config, planner_cost, workload, concurrency=64)
    assert report.summary()["failed"] == 0
    assert list(report.stats.microbatch_tokens) == [16384] * 12
