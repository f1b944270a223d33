"""nats-server restarted (same port) with real stage processes and the scheduler connected."""

from __future__ import annotations

import asyncio
import time

import pytest
from reliability_support import emulated_config, make_pipeline, random_tokens, stage_block_counts

from wavepp.runtime.request import PromptRequest

pytestmark = pytest.mark.slow


async def test_nats_restart_between_waves_every_client_reconnects(tmp_path) -> None:  # noqa: ANN001
    """Restart the server right after a request: the stages and the scheduler reconnect
    (unlimited reconnects, 0.2 s apart) and the next request runs with its prefix cached. The
    release sent after the first result is lost with the server; the scheduler must carry on
    (it once aborted its bookkeeping and the next request waited for a prefix owner that was
    gone) and the lease (2 s) frees the pins."""
    config = emulated_config([128], request_timeout_s=3.0, microbatch_deadline_s=3.0, lease_s=2.0)
    async with make_pipeline(config, str(tmp_path)) as pipeline:
        prompt = random_tokens(1, 160)
        first = await pipeline.scheduler.submit(PromptRequest("before", prompt))
        await asyncio.to_thread(pipeline.server.restart)
        restarted = time.monotonic()
        again = await asyncio.wait_for(
            pipeline.scheduler.submit(PromptRequest("after", prompt)), timeout=10
        )
        recovery_s = time.monotonic() - restarted
        deadline = time.monotonic() + 10
        while (counts := await stage_block_counts(pipeline)) != [(128, 128)] * 3:
            assert time.monotonic() < deadline, counts
            await asyncio.sleep(0.1)
        pins_freed_s = time.monotonic() - restarted
    assert first.ok and again.ok, (first.error, again.error)
    assert again.num_cached_tokens == 144, "the stages kept their KV cache across the restart"
    assert counts == [(128, 128)] * 3
    print(
        f"nats restart after a request: next request answered {recovery_s:.2f} s after the "
        f"restart, all pins free after {pins_freed_s:.2f} s"
    )


async def test_nats_restart_under_load_loses_no_request(tmp_path) -> None:  # noqa: ANN001
    """Restart the server while 6 requests run: plans in flight to a stage and done messages in
    flight to the scheduler are lost with it (core NATS). Every request must still be answered
    once, ok: stages fetch missed plans from the scheduler (``{p}.plan.resend``), the scheduler
    republishes outstanding plans and pulls missed done messages after its reconnect, and an
    agreement whose reply was lost is retried: no stage runs a plan on the previous plan's
    activations, and the scheduler never waits for a done message that never comes.
    """
    config = emulated_config(
        [256], microbatch_deadline_s=8.0, request_timeout_s=1.0, agreement_retry_s=20.0
    )
    async with make_pipeline(config, str(tmp_path)) as pipeline:
        done: list[object] = []
        gate = asyncio.Semaphore(6)

        async def one(i: int):  # noqa: ANN202
            async with gate:
                outcome = await pipeline.scheduler.submit(
                    PromptRequest(f"n{i}", random_tokens(i, 200))
                )
                done.append(outcome)
                return outcome

        tasks = [asyncio.create_task(one(i)) for i in range(40)]
        while len(done) < 10:
            await asyncio.sleep(0.01)
        restarted = time.monotonic()
        await asyncio.to_thread(pipeline.server.restart)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        recovered_s = time.monotonic() - restarted
        scheduler = pipeline.scheduler
        deadline = time.monotonic() + 10
        while (counts := await stage_block_counts(pipeline)) != [(256, 256)] * 3:
            assert time.monotonic() < deadline, counts
            await asyncio.sleep(0.1)
    assert [o.error for o in outcomes if not o.ok] == []
    assert sorted(o.request_id for o in outcomes) == sorted(f"n{i}" for i in range(40))
    print(
        f"nats restart under load: 40 of 40 answered, last {recovered_s:.2f} s after the "
        f"restart; plans resent {scheduler.num_plans_resent}, done messages recovered "
        f"{scheduler.num_dones_recovered}, agreements retried {scheduler.num_agreement_retries}"
    )
