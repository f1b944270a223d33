"""A stage process SIGKILLed mid-wave (real processes, real nats-server, emulated engine).

What the runtime does today: the micro-batches in flight fail after ``microbatch_deadline_s``
with an error naming the micro-batch; requests admitted later retry their agreement for
``agreement_retry_s`` and then fail naming the dead stage; no request is answered twice; the surviving stages hold no pin or
reservation. Recovery: restarting every stage process with a new dist url (a broken gloo group
cannot be rejoined) re-forms the replica under the same scheduler; new requests and the failed
ones, resubmitted, are answered correctly."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import pytest
from reliability_support import (
    STARTUP_TIMEOUT_S,
    emulated_config,
    make_pipeline,
    random_tokens,
    stage_block_counts,
)

from wavepp.api.messages import Health
from wavepp.runtime.agreement import StageUnavailableError
from wavepp.runtime.agreement.nats_client import NatsStageClient
from wavepp.runtime.request import PromptRequest

pytestmark = pytest.mark.slow

# The micro-batch deadline: how soon the killed stage's micro-batches are given up. 2 s was
# shorter than freshly started stage processes sometimes need on 2 busy cores (a CI flake:
# 'not finished within 2.0 s (0 of 3 stages reported it)' for requests planned right after
# the re-form).
DEADLINE_S = 5.0
# How long a request whose agreement starts after the kill retries it before it fails naming
# the dead stage (a few retries: 0.1, 0.2, 0.4 s apart). The 8-10 such requests go 4 at a time
# and each waits this long, so 5 s (the deadline's value before) made the run ~16 s after the
# kill; 1 s: ~7.5 s. Which requests expire instead is settled at the kill, not by this.
RETRY_S = 1.0


async def test_stage_killed_mid_wave_fails_inflight_once_and_leaves_no_pins(
    tmp_path,  # noqa: ANN001
) -> None:
    config = emulated_config(
        [256], microbatch_deadline_s=DEADLINE_S, time_scale=4.0, agreement_retry_s=RETRY_S
    )
    async with make_pipeline(config, str(tmp_path)) as pipeline:
        scheduler = pipeline.scheduler
        answers: Counter[str] = Counter()
        previous = scheduler.on_outcome
        scheduler.on_outcome = lambda o: (answers.update([o.request_id]), previous and previous(o))
        finished: list[float] = []
        gate = asyncio.Semaphore(4)

        async def one(i: int):  # noqa: ANN202
            async with gate:
                outcome = await scheduler.submit(PromptRequest(f"k{i}", random_tokens(i, 400)))
                finished.append(time.monotonic())
                return outcome

        tasks = [asyncio.create_task(one(i)) for i in range(16)]
        deadline = time.monotonic() + 30
        while len(finished) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        num_before_kill = len(finished)
        os.kill(pipeline.procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=DEADLINE_S + 20)
        all_answered_s = time.monotonic() - killed
        survivors = [
            await NatsStageClient(pipeline.nc, config.subject_prefix, rank, 2.0).call(Health())
            for rank in (0, 2)
        ]
        with pytest.raises(StageUnavailableError):
            await NatsStageClient(pipeline.nc, config.subject_prefix, 1, 2.0).call(Health())
    assert 0 < num_before_kill < 16, "the kill must land mid-load"
    failed = [o for o in outcomes if not o.ok]
    expired = [o for o in failed if "not finished within microbatch_deadline_s" in o.error]
    assert failed and expired, [o.error for o in failed]
    for outcome in failed:
        assert "microbatch_deadline_s" in outcome.error or "stage 1" in outcome.error, outcome
    assert set(answers.values()) == {1}, "a request was answered twice"
    assert sorted(answers) == sorted([f"k{i}" for i in range(16)])
    for reply in survivors:
        assert reply.num_free_blocks == reply.num_blocks, f"stage {reply.rank} holds a pin"
    print(
        f"stage kill: {num_before_kill} done before, {len(outcomes) - len(failed)} ok, "
        f"{len(expired)} expired, {len(failed) - len(expired)} refused at agreement; all "
        f"answered {all_answered_s:.2f} s after the kill"
    )


async def test_replica_reformed_after_stage_kill_answers_new_and_resubmitted_requests(
    tmp_path,  # noqa: ANN001
) -> None:
    """Kill stage 1 mid-wave, restart all stages with a new dist url, same scheduler: a new
    request (the prompt of one answered before the kill) gets the same first token, and every
    failed request, resubmitted, is answered once and correctly. Times kill -> first answer.

    Pinned: a request admitted while the deadline expiry rebinds the scheduler's active list
    is planned (the list is read after the await, not bound before it); and a request admitted
    on the old stages but not yet planned goes back to admission at the re-form
    (``resume_plans(readmit=True)``), not planned on stages that never heard of it ("request
    'k7' is not committed on this stage", failing it and the new request).
    """
    # A request whose agreement starts while the stages restart retries it until they are
    # back: for as long as the restart may take (the pipeline's startup timeout), not the
    # default 30 s, which a restart on 2 busy cores (3 processes importing torch while the
    # other test worker runs) outlasted ("agreement failed: stage 0: no stage listens").
    config = emulated_config(
        [256],
        microbatch_deadline_s=DEADLINE_S,
        time_scale=4.0,
        agreement_retry_s=STARTUP_TIMEOUT_S,
    )
    async with make_pipeline(config, str(tmp_path)) as pipeline:
        scheduler = pipeline.scheduler
        answers: Counter[str] = Counter()
        previous = scheduler.on_outcome
        scheduler.on_outcome = lambda o: (answers.update([o.request_id]), previous and previous(o))
        prompts = {f"k{i}": random_tokens(i, 400) for i in range(12)}
        finished: list[str] = []
        gate = asyncio.Semaphore(4)

        async def one(request_id: str):  # noqa: ANN202
            async with gate:
                outcome = await scheduler.submit(PromptRequest(request_id, prompts[request_id]))
                finished.append(request_id)
                return outcome

        tasks = [asyncio.create_task(one(request_id)) for request_id in prompts]
        deadline = time.monotonic() + 30
        while len(finished) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        os.kill(pipeline.procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        await pipeline.restart_stages()
        formed_s = time.monotonic() - killed
        reference_id = finished[0]  # answered before the kill
        fresh = await asyncio.wait_for(
            scheduler.submit(PromptRequest("after", prompts[reference_id])), timeout=20
        )
        first_answer_s = time.monotonic() - killed
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=DEADLINE_S + 20)
        reference = next(o for o in outcomes if o.request_id == reference_id)
        # The state the first re-form attempt hung in: every old request answered, then one more.
        settled = await asyncio.wait_for(
            scheduler.submit(PromptRequest("settled", prompts[reference_id])), timeout=10
        )
        failed = [o for o in outcomes if not o.ok]
        again = await asyncio.wait_for(
            asyncio.gather(*(one(o.request_id) for o in failed)), timeout=20
        )
        counts = await stage_block_counts(pipeline)
    assert reference.ok, reference.error
    assert fresh.ok, fresh.error
    assert fresh.first_token_id == reference.first_token_id
    assert fresh.num_cached_tokens == 0, "the restarted stages start with empty caches"
    assert settled.ok, settled.error
    assert settled.first_token_id == reference.first_token_id
    for outcome in failed:  # only micro-batches in flight past the deadline fail
        assert "microbatch_deadline_s" in outcome.error, outcome.error
    assert all(o.ok for o in again), [o.error for o in again]
    by_id = {o.request_id: o for o in again}
    assert sorted(by_id) == sorted(o.request_id for o in failed)
    assert answers["after"] == answers["settled"] == 1
    assert all(n == 2 for rid, n in answers.items() if rid in by_id), answers
    assert all(n == 1 for rid, n in answers.items() if rid not in by_id), answers
    for num_free_blocks, num_blocks in counts:
        assert num_free_blocks == num_blocks, counts
    print(
        f"stage kill recovery: stages re-formed {formed_s:.2f} s after the kill, first answer "
        f"{first_answer_s:.2f} s after it; {scheduler.num_readmitted} admitted requests "
        f"re-admitted on the new stages; {len(failed)} failed requests resubmitted, all ok"
    )
