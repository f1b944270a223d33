"""Forgery through real processes: 3 emulated stage processes and the scheduler over a real
nats-server (``LocalPipeline``: it generates the bus key and hands it to the stages through
their environment, and the server's credentials), and a forger connected to the same server
without the key.

The server refuses an anonymous client, so the forger holds credentials: the replica's
admission user (it may publish plans and KV rounds) and the last stage's user (it hears plans
and may publish dones): what a stolen ``.creds`` gives, without the bus key.

On every genuine plan it sees, the forger publishes a plan with the next id (empty), a
last-stage done with an empty epoch answering the plan's requests with its own token, a release
of the plan's request ids to every stage, and a probe-reserve hogging every block for an hour
(unsigned rounds, on the replica-wide and on each stage's subject).
Every request is answered with the emulated engine's token, and no block stays held.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from forgery_support import forged_done  # noqa: E402
from reliability_support import (  # noqa: E402
    emulated_config,
    make_pipeline,
    random_tokens,
    stage_block_counts,
)

from wavepp.api.kv_batch import BatchOp, KVBatch, ReserveEntry, encode_batch  # noqa: E402
from wavepp.api.messages import MicroBatchPlan, RequestResult  # noqa: E402
from wavepp.runtime.request import PromptRequest  # noqa: E402
from wavepp.runtime.transport.natsio import connect, flush_in_order  # noqa: E402

pytestmark = pytest.mark.timeout(180)

EMULATED_VOCAB = 16  # EmulatedStageEngine's default: token = (last token + position) % 16


async def test_a_forger_on_the_bus_changes_no_answer_and_holds_no_block(tmp_path, caplog) -> None:  # noqa: ANN001, E501
    caplog.set_level(logging.WARNING)
    config = emulated_config([24, 24, 24], lease_s=5.0)
    subjects = config.subjects
    async with make_pipeline(config, str(tmp_path)) as pipeline:
        with pytest.raises(Exception, match="Authorization Violation"):
            await connect(pipeline.nats_url, name="anonymous", allow_reconnect=False)
        assert pipeline.auth is not None
        last = config.num_stages - 1
        forger = await connect(
            pipeline.nats_url, name="forger", creds=pipeline.auth.admission(config.pipeline)
        )
        listener = await connect(
            pipeline.nats_url, name="forger-ear", creds=pipeline.auth.stage(config.pipeline, last)
        )
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
            await listener.publish(subjects.done, done.model_dump_json().encode())
            release = encode_batch(KVBatch(BatchOp.RELEASE, tuple(ids)))
            hashes = tuple(bytes([i]) * 32 for i in range(24))
            hog = KVBatch(BatchOp.PROBE_RESERVE, (ReserveEntry("hog", hashes, 24),), 3600.0)
            for subject in [subjects.stages_kv_batch] + [
                subjects.stage_kv_batch(rank) for rank in range(config.num_stages)
            ]:
                await forger.publish(subject, release)
                await forger.publish(subject, encode_batch(hog))
            forged.append(plan.microbatch_id)

        await listener.subscribe(subjects.plan, cb=on_plan)
        await flush_in_order(listener)
        assert pipeline.scheduler is not None
        prompts = [random_tokens(40 + i, 60 + 37 * i) for i in range(4)]
        outcomes = []
        for i, tokens in enumerate(prompts):  # one at a time: the forged next id comes first
            outcomes.append(await pipeline.scheduler.submit(PromptRequest(f"q{i}", tokens)))
            await asyncio.sleep(0.1)
        await forger.close()
        await listener.close()
        counts = await stage_block_counts(pipeline)
    assert forged, "the forger saw no plan"
    # its messages reached the bus (the users may publish them) and the scheduler dropped them
    assert "Permissions Violation" not in caplog.text, caplog.text
    assert "done message without an epoch dropped" in caplog.text
    for tokens, outcome in zip(prompts, outcomes, strict=True):
        assert outcome.ok, outcome.error
        assert outcome.first_token_id == (tokens[-1] + len(tokens) - 1) % EMULATED_VOCAB
    assert counts == [(24, 24)] * 3, counts
