"""nats-server restarted (same port) with real stage processes and the scheduler connected."""

from __future__ import annotations

import asyncio
import time

import pytest
from reliability_support import emulated_config, make_pipeline, random_tokens, stage_block_counts

from wavepp.runtime.agreement import PromptRequest

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


@pytest.mark.xfail(
    strict=False,  # passes when no plan was in flight at the restart (1 run in 3 here)
    reason="plans and done messages are core NATS (at most once): a plan published while a "
    "stage reconnects is lost for that stage, the stages' activation streams desynchronise",
)
async def test_nats_restart_under_load_loses_no_request(tmp_path) -> None:  # noqa: ANN001
    config = emulated_config([256], microbatch_deadline_s=2.0)
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
        await asyncio.to_thread(pipeline.server.restart)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=15)
    assert [o.error for o in outcomes if not o.ok] == []
