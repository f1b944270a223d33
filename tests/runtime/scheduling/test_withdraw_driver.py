"""``WaveScheduler.withdraw`` with the real scheduler, both admission strategies, in the simulator
(virtual clock): a long prompt withdrawn after its first micro-batch is published gets no
further chunk planned and its caller is answered at once; a request withdrawn while its
agreement is under way is never admitted and its reservation is released; one withdrawn while
it queues is never agreed; a request submitted after them is served; nothing stays pinned on
any stage. A withdrawn request that filled the admission lookahead makes room for the next."""

from __future__ import annotations

import asyncio

import pytest

from wavepp.bench.grid import GridSpec, Setting
from wavepp.launch.grid import runtime_config
from wavepp.runtime.planning import Chunk
from wavepp.runtime.request import PromptRequest, RequestOutcome
from wavepp.runtime.scheduling.admission import AdmissionStrategy, AsyncAdmission, SyncAdmission
from wavepp.runtime.scheduling.core import WITHDRAWN_ERROR
from wavepp.sim.bus import SimLatencies
from wavepp.sim.clock import VirtualClockLoop
from wavepp.sim.pipeline import SimPipeline

ZERO = SimLatencies(kv_rtt_s=0.001, bus_latency_s=0.0, hop_s=0.0, prepare_s=0.0)
LONG_TOKENS = 39960  # the prompt of the defect: five chunks of chunk_tokens=8192


def _prompt(index: int, num_tokens: int) -> list[int]:
    return [1 + (index * 131 + t) % 900 for t in range(num_tokens)]


async def _serve(
    strategy: type[AdmissionStrategy],
) -> tuple[dict[str, RequestOutcome], dict[str, int], list[set[str]], list[str]]:
    spec = GridSpec(time_scale=1.0, num_stages=2, num_kv_blocks=4096)
    config, cost = runtime_config(spec, Setting("glm-5.2", 2, "low", "wave"))
    async with SimPipeline(config, cost, latencies=ZERO, admission=strategy) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None
        loop = asyncio.get_running_loop()
        planned_tokens: dict[str, int] = {}
        take_planned = scheduler.core.take_planned

        def counting(chunks: list[Chunk], planning_started_s: float):  # noqa: ANN202
            for chunk in chunks:
                if chunk.request_id not in planned_tokens:
                    planned_tokens[chunk.request_id] = 0
                    if chunk.request_id == "long":  # its first micro-batch: then withdrawn
                        loop.call_soon(scheduler.withdraw, "long")
                planned_tokens[chunk.request_id] += chunk.num_tokens
            return take_planned(chunks, planning_started_s)

        scheduler.core.take_planned = counting  # type: ignore[method-assign]
        agree = scheduler.controller.agree
        agreed: list[str] = []
        agreeing = asyncio.Event()
        go_on = asyncio.Event()

        async def held(request: PromptRequest):  # noqa: ANN202
            agreed.append(request.request_id)
            if request.request_id == "agreeing":
                agreeing.set()
                await go_on.wait()
            return await agree(request)

        scheduler.controller.agree = held  # type: ignore[method-assign]
        outcomes: dict[str, RequestOutcome] = {}
        outcomes["long"] = await scheduler.submit(PromptRequest("long", _prompt(1, LONG_TOKENS)))
        pending = asyncio.create_task(scheduler.submit(PromptRequest("agreeing", _prompt(2, 256))))
        await agreeing.wait()
        assert scheduler.withdraw("agreeing")
        go_on.set()
        outcomes["agreeing"] = await pending
        queued = asyncio.create_task(scheduler.submit(PromptRequest("queued", _prompt(3, 256))))
        await asyncio.sleep(0)  # in the intake, not yet taken
        assert scheduler.withdraw("queued")
        outcomes["queued"] = await queued
        outcomes["next"] = await scheduler.submit(PromptRequest("next", _prompt(4, 256)))
        await asyncio.sleep(1.0)  # the releases in the background
        held_after = [
            set(stage.core.manager.request_ids()) for stage in pipeline.stages
        ]  # what every stage still holds
        held_after.append(set(scheduler.controller.live_request_ids))
    return outcomes, planned_tokens, held_after, agreed


@pytest.mark.parametrize("strategy", [AsyncAdmission, SyncAdmission])
def test_withdrawn_requests_stop_being_served_and_leave_nothing_pinned(
    strategy: type[AdmissionStrategy],
) -> None:
    loop = VirtualClockLoop(start_s=10.0)
    try:
        outcomes, planned, held, agreed = loop.run_until_complete(_serve(strategy))
    finally:
        loop.close()
    for name in ("long", "agreeing", "queued"):
        assert outcomes[name].error == WITHDRAWN_ERROR, name
    assert outcomes["next"].ok, outcomes["next"].error
    # the long prompt: only what its first micro-batch(es) in flight carried was planned
    assert 0 < planned["long"] < LONG_TOKENS
    assert "agreeing" not in planned and "queued" not in planned and "queued" not in agreed
    assert planned["next"] == 256
    *stages, controller = held
    assert stages == [set(), set()]  # every pin released, the withdrawn ones' too
    assert controller == set()  # no lease renewed for any of them


async def _behind_a_withdrawn_one() -> RequestOutcome:
    """An admitted request that fills the admission lookahead is withdrawn before any chunk of
    it is planned (the plans held, as while the stages re-form); the request waiting for room
    in the lookahead is then admitted and answered."""
    spec = GridSpec(time_scale=1.0, num_stages=2, num_kv_blocks=4096)
    config, cost = runtime_config(spec, Setting("glm-5.2", 2, "low", "wave"))
    config = config.model_copy(update={"admission_lookahead_tokens": 4096})
    async with SimPipeline(config, cost, latencies=ZERO, admission=AsyncAdmission) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None
        scheduler.pause_plans()
        big = asyncio.create_task(scheduler.submit(PromptRequest("big", _prompt(1, 8192))))
        while not scheduler.core.is_live("big"):
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(scheduler.submit(PromptRequest("waiting", _prompt(2, 256))))
        await asyncio.sleep(0.1)
        assert not scheduler.core.is_live("waiting")  # no room in the lookahead
        assert scheduler.withdraw("big")
        assert (await big).error == WITHDRAWN_ERROR
        scheduler.reopen_plans()
        return await asyncio.wait_for(waiting, 5.0)


def test_a_withdrawal_makes_room_in_the_admission_lookahead() -> None:
    loop = VirtualClockLoop(start_s=10.0)
    try:
        outcome = loop.run_until_complete(_behind_a_withdrawn_one())
    finally:
        loop.close()
    assert outcome.ok, outcome.error
