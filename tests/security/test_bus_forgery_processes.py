"""Issue 13 through real processes: 3 emulated stage processes and the scheduler over a real
nats-server (``LocalPipeline``: it generates the bus key and hands it to the stages through
their environment), and a forger connected to the same server without the key.

On every genuine plan it sees, the forger publishes a plan with the next id (empty), a
last-stage done with an empty epoch answering the plan's requests with its own token, a release
of the plan's request ids to every stage, and a probe + commit hogging every block for an hour.
Every request is answered with the emulated engine's token, and no block stays held.
"""

from __future__ import annotations

import asyncio

import pytest
from forgery_support import forged_done  # noqa: E402
from reliability_support import (  # noqa: E402
    emulated_config,
    make_pipeline,
    random_tokens,
    stage_block_counts,
)

from wavepp.api.messages import (  # noqa: E402
    Commit,
    MicroBatchPlan,
    ProbePin,
    Release,
    RequestResult,
)
from wavepp.runtime.request import PromptRequest  # noqa: E402
from wavepp.runtime.transport.natsio import connect, flush_in_order  # noqa: E402

pytestmark = pytest.mark.timeout(180)

EMULATED_VOCAB = 16  # EmulatedStageEngine's default: token = (last token + position) % 16


async def test_a_forger_on_the_bus_changes_no_answer_and_holds_no_block(tmp_path) -> None:  # noqa: ANN001
    config = emulated_config([24, 24, 24], lease_s=5.0)
    subjects = config.subjects
    async with make_pipeline(config, str(tmp_path)) as pipeline:
        forger = await connect(pipeline.nats_url, name="forger")
        forged: list[int] = []

        async def on_plan(msg) -> None:  # noqa: ANN001
            plan = MicroBatchPlan.model_validate_json(msg.data)
            if not plan.chunks:
                return  # its own forgery (empty), or a plan it cannot learn from
            ids = [c.request_id for c in plan.chunks]
            next_plan = MicroBatchPlan(
                microbatch_id=plan.microbatch_id + 1, chunks=[], epoch=plan.epoch
            )
            done = forged_done(
                config.num_stages - 1,
                plan.microbatch_id,
                [RequestResult(request_id=rid, first_token_id=999) for rid in ids],
                num_tokens=0,
            )
            await forger.publish(subjects.plan, next_plan.model_dump_json().encode())
            await forger.publish(subjects.done, done.model_dump_json().encode())
            for rank in range(config.num_stages):
                kv = subjects.stage_kv(rank)
                await forger.publish(kv, Release(request_ids=ids).model_dump_json().encode())
                probe = ProbePin(request_id="hog", block_hashes=[], lease_s=3600)
                commit = Commit(
                    request_id="hog", num_agreed_blocks=0, num_total_blocks=24, lease_s=3600
                )
                await forger.publish(kv, probe.model_dump_json().encode())
                await forger.publish(kv, commit.model_dump_json().encode())
            forged.append(plan.microbatch_id)

        await forger.subscribe(subjects.plan, cb=on_plan)
        await flush_in_order(forger)
        assert pipeline.scheduler is not None
        prompts = [random_tokens(40 + i, 60 + 37 * i) for i in range(4)]
        outcomes = []
        for i, tokens in enumerate(prompts):  # one at a time: the forged next id comes first
            outcomes.append(await pipeline.scheduler.submit(PromptRequest(f"q{i}", tokens)))
            await asyncio.sleep(0.1)
        await forger.close()
        counts = await stage_block_counts(pipeline)
    assert forged, "the forger saw no plan"
    for tokens, outcome in zip(prompts, outcomes, strict=True):
        assert outcome.ok, outcome.error
        assert outcome.first_token_id == (tokens[-1] + len(tokens) - 1) % EMULATED_VOCAB
    assert counts == [(24, 24)] * 3, counts
