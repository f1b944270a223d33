"""Real stage processes and a real nats-server (emulated engine): tenant isolation, unequal KV
capacity under reuse, memory pressure (backpressure, no deadlock), and a dead controller's pins
released by lease expiry."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
from reliability_support import (
    BLOCK_SIZE,
    emulated_config,
    make_pipeline,
    random_tokens,
    stage_block_counts,
)

from wavepp.runtime.agreement import AgreementController
from wavepp.runtime.agreement.nats_client import NatsStageClient
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.transport.natsio import connect


async def _no_pins_left(pipeline, timeout_s: float = 5.0) -> list[tuple[int, int]]:  # noqa: ANN001
    """Poll the stages until every block has ref count 0; return the last counts."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = await stage_block_counts(pipeline)
        if all(free == total for free, total in counts) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------------------


@pytest.mark.serial  # compares time-to-first-token of cold and warm prompts
async def test_tenant_b_replaying_tenant_a_prompts_gets_no_hit_and_no_timing_signal(
    tmp_path,  # noqa: ANN001
) -> None:
    """Tenant A runs 4 prompts twice (its repeat hits its own cache); tenant B then replays the
    same prompts. B must see 0 cached tokens on every stage, and B's TTFT must look like a cold
    prompt, not like A's warm repeat (the salt changes B's block hashes)."""
    prompts = [random_tokens(100 + i, 320) for i in range(4)]  # 20 full blocks each
    # The stages sleep 5x the cost model, so the compute a hit saves stays large next to the
    # fixed per-request costs (NATS, scheduling), which grow on a loaded machine.
    config = emulated_config([128], time_scale=5.0)
    async with make_pipeline(config, str(tmp_path)) as pipeline:
        submit = pipeline.scheduler.submit

        async def run(tag: str, salt: str) -> list:
            return [
                await submit(PromptRequest(f"{tag}-{i}", toks, cache_salt=salt))
                for i, toks in enumerate(prompts)
            ]

        a_cold = await run("a-cold", "tenant:A")
        a_warm = await run("a-warm", "tenant:A")
        b_replay = await run("b", "tenant:B")
        assert await _no_pins_left(pipeline) == [(128, 128)] * 3
    for outcome in a_cold + a_warm + b_replay:
        assert outcome.ok, outcome.error
    # the test can fail: A's own repeat does hit (L* is one token short of the prompt)
    assert all(o.num_cached_tokens == 320 - BLOCK_SIZE for o in a_warm)
    assert all(o.num_cached_tokens == 0 and o.stage_hits == (0, 0, 0) for o in b_replay)
    ttft = {
        name: statistics.median(o.ttft_s for o in outcomes)
        for name, outcomes in (("a_cold", a_cold), ("a_warm", a_warm), ("b", b_replay))
    }
    # B is as slow as a cold prompt and far from A's warm repeat: no timing signal of A's cache
    assert ttft["b"] > 2.5 * ttft["a_warm"], ttft
    assert ttft["b"] > 0.6 * ttft["a_cold"], ttft
    print("tenant isolation: median TTFT (s)", {k: round(v, 4) for k, v in ttft.items()})


# ------------------------------------------------------------------------------


async def test_unequal_kv_capacity_under_reuse_keeps_stages_in_agreement(
    tmp_path,  # noqa: ANN001
) -> None:
    """Stages of 96, 14 and 40 blocks; 48 requests over 3 shared 4-block prefixes with 1..3 own
    blocks, 8 at a time. Stage 1 evicts first, so local hits differ; every stage must still run
    each request with the same L*, and no pin or reservation may survive."""
    prefixes = [random_tokens(7 + p, 4 * BLOCK_SIZE) for p in range(3)]
    requests = [
        PromptRequest(f"u{i}", prefixes[i % 3] + random_tokens(1000 + i, (1 + i % 3) * 16 - 3))
        for i in range(48)
    ]
    async with make_pipeline(emulated_config([96, 14, 40]), str(tmp_path)) as pipeline:
        gate = asyncio.Semaphore(8)

        async def one(request: PromptRequest):  # noqa: ANN202
            async with gate:
                return await pipeline.scheduler.submit(request)

        outcomes = await asyncio.gather(*(one(r) for r in requests))
        counts = await _no_pins_left(pipeline)
    assert [o.error for o in outcomes if not o.ok] == []
    assert counts == [(96, 96), (14, 14), (40, 40)], "a pin or reservation leaked"
    num_differing = 0
    for outcome in outcomes:
        reported = {num_agreed for _, num_agreed in outcome.stage_agreed_blocks}
        assert {rank for rank, _ in outcome.stage_agreed_blocks} == {0, 1, 2}
        assert reported == {outcome.num_cached_tokens // BLOCK_SIZE}, outcome
        assert outcome.num_cached_tokens // BLOCK_SIZE <= min(outcome.stage_hits)
        num_differing += len(set(outcome.stage_hits)) > 1
    assert num_differing > 0, "capacities should make local hits differ"
    assert sum(o.num_cached_tokens for o in outcomes) > 0, "the load should reuse prefixes"
    print(f"unequal capacity: {num_differing}/48 requests with differing local hits, "
          f"{sum(o.num_cached_tokens for o in outcomes)} cached tokens")  # fmt: skip


# ------------------------------------------------------------------------------


async def test_memory_pressure_waits_instead_of_failing_and_never_deadlocks(
    tmp_path,  # noqa: ANN001
) -> None:
    """Stage 1 holds 8 blocks; each prompt needs 7. 12 distinct prompts at once: only one fits
    at a time, the rest are refused and wait (backpressure) and all finish; a prompt that can
    never fit (9 blocks) fails at once with an error naming the stage and its capacity."""
    async with make_pipeline(emulated_config([24, 8, 16]), str(tmp_path)) as pipeline:
        submit = pipeline.scheduler.submit
        started = time.monotonic()
        fitting = [submit(PromptRequest(f"p{i}", random_tokens(200 + i, 100))) for i in range(12)]
        too_long = submit(PromptRequest("too-long", random_tokens(999, 9 * BLOCK_SIZE)))
        outcomes = await asyncio.wait_for(asyncio.gather(*fitting, too_long), timeout=60)
        elapsed_s = time.monotonic() - started
        counts = await _no_pins_left(pipeline)
    *fitted, refused = outcomes
    assert [o.error for o in fitted if not o.ok] == []
    assert sum(o.num_refusals for o in fitted) > 0, "the pool should have refused some"
    assert not refused.ok and "stage 1 holds 8" in refused.error, refused.error
    assert counts == [(24, 24), (8, 8), (16, 16)]
    assert elapsed_s < 60
    print(f"memory pressure: 12 requests in {elapsed_s:.2f} s, "
          f"{sum(o.num_refusals for o in fitted)} refusals, 0 failed")  # fmt: skip


# ------------------------------------------------------------------------------


@pytest.mark.serial  # the recovery has a 0.25 s margin
async def test_dead_controller_pins_are_released_by_lease_expiry(tmp_path) -> None:  # noqa: ANN001
    """A second agreement controller pins and reserves 3 requests on every stage with a 1 s
    lease, then dies (its NATS connection closes without a release). The stages' expiry loops
    must free every block within lease + one expiry period; then the live scheduler can admit
    a prompt that needs the whole of the smallest stage."""
    config = emulated_config([12, 10, 12], lease_s=1.0)
    async with make_pipeline(config, str(tmp_path)) as pipeline:
        assert pipeline.auth is not None  # a member: it holds the admission user's creds
        nc = await connect(
            pipeline.nats_url,
            name="doomed-controller",
            creds=pipeline.auth.admission(config.pipeline),
        )
        doomed = AgreementController(
            [NatsStageClient(nc, config.subject_prefix, r) for r in range(3)],
            block_size=BLOCK_SIZE,
            model_id=config.model_id,
            lease_s=config.lease_s,
            bus_key=pipeline.bus_key.for_replica(config.pipeline),  # a member: it holds the key
        )
        tickets = [
            await doomed.agree(PromptRequest(f"d{i}", random_tokens(300 + i, 48))) for i in range(3)
        ]
        assert all(t is not None for t in tickets)
        held = await stage_block_counts(pipeline)
        await nc.close()  # dies: no release, no renewal
        died = time.monotonic()
        counts = await _no_pins_left(pipeline, timeout_s=10.0)
        recovery_s = time.monotonic() - died
        whole = await pipeline.scheduler.submit(PromptRequest("whole", random_tokens(5, 160)))
    assert held == [(3, 12), (1, 10), (3, 12)], held
    assert counts == [(12, 12), (10, 10), (12, 12)], counts
    # lease 1 s; the stages check every min(1, lease/4) = 0.25 s
    assert recovery_s < 1.0 + 0.25 + 1.0, recovery_s
    assert whole.ok, whole.error
    print(f"dead controller: pins released {recovery_s:.2f} s after it died (lease 1 s)")
