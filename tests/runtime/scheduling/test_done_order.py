"""A request is answered once every stage reported its last micro-batch.

A middle stage publishes its ``MicroBatchDone`` after sending its activations on, so the last
stage's done (carrying the result) can reach the scheduler first. The answer promises every
stage's report (``RequestOutcome.stage_agreed_blocks``; the admission service's per-stage
timings come from the same done messages), so the scheduler holds the result until the late
done arrives, and a done lost for good cannot hold it past the micro-batch's deadline.

Seen as a flaky ``tests/runtime/stage/test_pipeline_reference.py`` (``('b1', [(0, 8), (2, 8)])``: rank 1
missing); here the middle stage's done always comes last, so the race is deterministic.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agreement_support import local_stages

from wavepp.api.messages import (
    DoneResend,
    DoneResendReply,
    MicroBatchDone,
    MicroBatchPlan,
    RequestResult,
)
from wavepp.api.signing import BusKey
from wavepp.bench.grid import GridSpec, Setting
from wavepp.launch.grid import runtime_config
from wavepp.runtime.kv import StageKVManager
from wavepp.runtime.planning import ChunkPlanner
from wavepp.runtime.request import PromptRequest, RequestOutcome
from wavepp.runtime.scheduling.scheduler import WaveScheduler
from wavepp.runtime.scheduling.transport import PlanHandlers

NUM_STAGES = 3
MIDDLE = 1
BLOCK = 16


class MiddleStageLate:
    """A PlanTransport of S=3 stages that finish each plan at once; per plan the done messages
    arrive rank 0, rank 2, then rank 1 (the middle stage's last), or rank 1's never
    (``lose_middle``: lost, and not in the stage's resend log either)."""

    def __init__(
        self,
        managers: list[StageKVManager],
        *,
        lose_middle: bool = False,
        resend_middle: bool = False,
        bus_key: BusKey | None = None,
    ) -> None:
        self.managers = managers
        self.bus_key = bus_key  # signs the done messages (the scheduler checks them)
        self.wire: dict[int, bytes | None] = {}  # the JSON each plan was published as
        self.lose_middle = lose_middle
        self.resend_middle = resend_middle  # the lost done is in the stage's resend log
        self.plans: dict[int, MicroBatchPlan] = {}
        self.handlers: PlanHandlers | None = None
        self.queue: asyncio.Queue[MicroBatchDone] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    async def start(self, handlers: PlanHandlers) -> None:
        self.handlers = handlers
        self.task = asyncio.create_task(self._deliver())

    async def _deliver(self) -> None:
        while True:
            done = await self.queue.get()
            assert self.handlers is not None
            await self.handlers.on_done(done)

    def _done(self, plan: MicroBatchPlan, rank: int) -> MicroBatchDone:
        last = rank == NUM_STAGES - 1
        done = MicroBatchDone(
            rank=rank,
            microbatch_id=plan.microbatch_id,
            num_tokens=sum(len(c.token_ids) for c in plan.chunks),
            prepare_start_s=0.0,
            prepare_end_s=0.0,
            execute_start_s=0.0,
            execute_end_s=0.0,
            num_agreed_blocks=[0 for _ in plan.chunks],
            results=[
                RequestResult(request_id=c.request_id, first_token_id=1)
                for c in plan.chunks
                if last and c.is_last
            ],
            epoch=plan.epoch,
        )
        return done if self.bus_key is None else self.bus_key.sign(done)

    async def publish_plan(
        self, plan: MicroBatchPlan, headers: dict[str, str] | None, data: bytes | None = None
    ) -> None:
        self.plans[plan.microbatch_id] = plan
        self.wire[plan.microbatch_id] = data
        for manager in self.managers:
            manager.take_events()
        for rank in (0, NUM_STAGES - 1, MIDDLE):
            if rank == MIDDLE and self.lose_middle:
                continue
            self.queue.put_nowait(self._done(plan, rank))

    async def request_dones(self, rank: int, ask: DoneResend, timeout_s: float) -> DoneResendReply:
        if not (self.resend_middle and rank == MIDDLE):
            return DoneResendReply(rank=rank, dones=[])
        dones = [self._done(self.plans[i], rank) for i in ask.microbatch_ids if i in self.plans]
        return DoneResendReply(rank=rank, dones=dones)

    async def subscribe(self, subject: str, cb: Any) -> None:
        return None

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()


def _scheduler(
    *,
    lose_middle: bool = False,
    resend_middle: bool = False,
    deadline_s: float = 300.0,
    bus_key: BusKey | None = None,
) -> tuple[WaveScheduler, dict[str, list[tuple[int, int]]]]:
    """A real scheduler over in-process stage KV managers; the returned dict gets, for each
    request, its ``stage_agreed_blocks`` as they were when it was answered."""
    spec = GridSpec(time_scale=0.01, num_stages=NUM_STAGES, num_kv_blocks=256, block_size=BLOCK)
    config, planner_cost = runtime_config(spec, Setting("glm-5.2", 16, "low", "wave"))
    config = config.model_copy(update={"chunk_tokens": 64, "microbatch_deadline_s": deadline_s})
    managers, controller = local_stages(
        [256] * NUM_STAGES,
        block_size=BLOCK,
        model_id=config.model_id,
        lease_s=config.lease_s,
        bus_key=bus_key,
    )
    planner = ChunkPlanner(planner_cost, policy="dynamic", chunk_tokens=64, block_size=BLOCK)
    answered: dict[str, list[tuple[int, int]]] = {}

    def on_outcome(outcome: RequestOutcome) -> None:
        answered[outcome.request_id] = list(outcome.stage_agreed_blocks)

    transport = MiddleStageLate(
        managers, lose_middle=lose_middle, resend_middle=resend_middle, bus_key=bus_key
    )
    scheduler = WaveScheduler(config, transport, controller, planner, on_outcome=on_outcome)
    return scheduler, answered


def _prompt(index: int, num_tokens: int) -> list[int]:
    return [(7 * index + j) % 1000 + 1 for j in range(num_tokens)]


def test_a_request_is_answered_after_every_stage_reported_it() -> None:
    """The middle stage's done comes after the last stage's result: the answer waits for it."""

    async def main() -> list[RequestOutcome]:
        scheduler, answered = _scheduler()
        await scheduler.start()
        try:
            outcomes = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        scheduler.submit(PromptRequest(f"r{i}", _prompt(i, 40 + 50 * i)))
                        for i in range(4)
                    )
                ),
                timeout=30,
            )
        finally:
            await scheduler.stop()
        for outcome in outcomes:
            ranks = {rank for rank, _ in answered[outcome.request_id]}
            assert ranks == set(range(NUM_STAGES)), (outcome.request_id, answered)
        return outcomes

    outcomes = asyncio.run(main())
    assert all(o.ok and o.first_token_id == 1 for o in outcomes), [o.error for o in outcomes]


def test_a_lost_middle_done_cannot_hold_a_result_past_the_deadline() -> None:
    """Rank 1's done never comes (and its resend has nothing): the result is answered at the
    micro-batch deadline, as it is, without rank 1's report."""

    async def main() -> tuple[RequestOutcome, list[tuple[int, int]]]:
        scheduler, answered = _scheduler(lose_middle=True, deadline_s=0.2)
        await scheduler.start()
        try:
            outcome = await asyncio.wait_for(
                scheduler.submit(PromptRequest("lost", _prompt(0, 40))), timeout=30
            )
        finally:
            await scheduler.stop()
        return outcome, answered["lost"]

    outcome, stage_agreed = asyncio.run(main())
    assert outcome.ok and outcome.first_token_id == 1, outcome.error
    assert {rank for rank, _ in stage_agreed} == {0, NUM_STAGES - 1}


def test_a_lost_middle_done_is_pulled_soon_instead_of_waiting_for_the_deadline() -> None:
    """Rank 1's done is lost on the bus but kept in its resend log: the held result asks rank 1
    for it after HELD_PULL_DELAY_S and is answered with every stage's report, long before the
    300 s micro-batch deadline: a done lost while nothing else arrives does not hold the answer
    until the deadline."""

    async def main() -> tuple[RequestOutcome, list[tuple[int, int]], float]:
        scheduler, answered = _scheduler(lose_middle=True, resend_middle=True)
        await scheduler.start()
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            outcome = await asyncio.wait_for(
                scheduler.submit(PromptRequest("pulled", _prompt(0, 40))), timeout=30
            )
        finally:
            await scheduler.stop()
        return outcome, answered["pulled"], loop.time() - started

    outcome, stage_agreed, elapsed_s = asyncio.run(main())
    assert outcome.ok and outcome.first_token_id == 1, outcome.error
    assert {rank for rank, _ in stage_agreed} == set(range(NUM_STAGES))
    assert elapsed_s < 10.0


def test_each_plan_goes_out_as_its_signed_json_serialised_once() -> None:
    """The scheduler hands the transport the plan's wire JSON (signing serialised it already):
    it decodes to exactly the plan kept for resend, with a valid tag, chunk for chunk the token
    ids of the prompt."""
    key = BusKey(bytes(range(32))).for_replica("p")
    prompts = {f"r{i}": _prompt(i, 40 + 50 * i) for i in range(4)}

    async def main() -> tuple[list[RequestOutcome], MiddleStageLate]:
        scheduler, _ = _scheduler(bus_key=key)
        await scheduler.start()
        try:
            outcomes = await asyncio.wait_for(
                asyncio.gather(
                    *(scheduler.submit(PromptRequest(rid, p)) for rid, p in prompts.items())
                ),
                timeout=30,
            )
        finally:
            await scheduler.stop()
        assert isinstance(scheduler.transport, MiddleStageLate)
        return outcomes, scheduler.transport

    outcomes, transport = asyncio.run(main())
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]  # dones checked with key
    assert transport.plans and set(transport.wire) == set(transport.plans)
    for microbatch_id, plan in transport.plans.items():
        data = transport.wire[microbatch_id]
        assert data is not None, f"micro-batch {microbatch_id}: published without its JSON"
        decoded = MicroBatchPlan.model_validate_json(data)
        assert decoded == plan and key.verify(decoded)
        assert data == plan.model_dump_json().encode()
        for chunk in decoded.chunks:
            start = chunk.context_offset
            assert (
                chunk.token_ids == prompts[chunk.request_id][start : start + len(chunk.token_ids)]
            )
