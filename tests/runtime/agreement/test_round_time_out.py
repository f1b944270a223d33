"""A round's time-out blames a stage only for time its replies could have been read: a caller
whose own event loop blocked past the time-out (a long synchronous call in the caller's
process) still reads the replies that arrived meanwhile (``nats_client.LATE_S``), a stage that
never answers is still named; and a caller cancelled in the loop pass its call failed leaves
no "exception was never retrieved" behind (``natsio.fail_on_reconnect``)."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
from agreement_support import served_stages
from nats.aio.client import Client as NATS

from wavepp.api.subjects import ReplicaSubjects
from wavepp.runtime.agreement import AgreementController, StageUnavailableError
from wavepp.runtime.agreement.nats_client import NatsStageClient, serve_stage_kv
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.transport.natsio import fail_on_reconnect, flush_in_order

BLOCK = 4
MODEL_ID = "tiny-llama:seed=0"
TIME_OUT_S = 0.5


async def test_a_caller_blocked_past_the_time_out_still_reads_the_replies(nc) -> None:  # noqa: ANN001
    managers, controller = await served_stages(
        nc, "wavepp.to", [64, 64], block_size=BLOCK, model_id=MODEL_ID, timeout_s=TIME_OUT_S
    )
    assert await controller.agree(PromptRequest("a", list(range(9))))
    release = asyncio.ensure_future(controller.release(["a"]))
    await asyncio.sleep(0)  # the round is sent
    time.sleep(2 * TIME_OUT_S)  # the caller's loop blocks past the time-out
    await asyncio.wait_for(release, timeout=10)  # not StageUnavailableError
    assert [m.num_requests for m in managers] == [0, 0]


async def test_a_silent_stage_is_still_named_after_the_caller_blocked(nc) -> None:  # noqa: ANN001
    await serve_stage_kv(nc, "wavepp.ts", 0, StageKVManager(BlockPool(64, BLOCK)))
    subjects = ReplicaSubjects("wavepp.ts")

    async def silent(msg) -> None:  # noqa: ANN001 - hears rounds, never answers them
        return None

    async def health(msg) -> None:  # noqa: ANN001 - alive: the liveness check names nobody
        await msg.respond(b'{"rank": 1, "ok": true}')

    await nc.subscribe(subjects.stages_kv_batch, cb=silent)
    await nc.subscribe(subjects.stage_kv(1), cb=health)
    await flush_in_order(nc)
    clients = NatsStageClient.for_replica(nc, "wavepp.ts", 2, TIME_OUT_S)
    controller = AgreementController(clients, block_size=BLOCK, model_id=MODEL_ID)
    agree = asyncio.ensure_future(controller.agree(PromptRequest("a", list(range(9)))))
    for _ in range(1000):  # the round in flight (its reply subscription made first)
        if clients[0].batch_mux._calls:
            break
        await asyncio.sleep(0.001)
    assert clients[0].batch_mux._calls, "the round was never sent"
    began = time.monotonic()
    time.sleep(2 * TIME_OUT_S)
    with pytest.raises(StageUnavailableError, match="stage 1: no reply") as failed:
        await asyncio.wait_for(agree, timeout=10)
    # the time-out ran late, so the round had graces first (at most TIME_OUT_S of them)
    assert "s of graces (this caller's event loop ran its time-out late)" in str(failed.value)
    assert time.monotonic() - began < 2 * TIME_OUT_S + 2 * TIME_OUT_S + 1.0


async def _fail_and_cancel_in_one_pass() -> None:
    """A ``fail_on_reconnect`` call whose outcome fails in the loop pass its caller is
    cancelled in; returns once the caller ended (dropping both)."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[bytes] = loop.create_future()
    caller = asyncio.ensure_future(fail_on_reconnect(NATS(), lambda: outcome))
    await asyncio.sleep(0)

    def fail_and_cancel() -> None:
        outcome.set_exception(StageUnavailableError(0, "no reply"))
        caller.cancel()

    loop.call_soon(fail_and_cancel)
    with pytest.raises(asyncio.CancelledError):
        await caller


async def test_a_caller_cancelled_as_its_call_fails_leaves_no_unretrieved_error() -> None:
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
    try:
        await _fail_and_cancel_in_one_pass()
        gc.collect()  # an unretrieved error is reported when its future is collected
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert reported == []
