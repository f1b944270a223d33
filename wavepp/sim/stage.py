"""A simulated pipeline stage and its KV client: the real ``StageCore`` (the stage worker's own
decisions, over a real StageKVManager) with virtual I/O and compute (the stage's CostModel time on
the virtual clock). No copy of the stage logic lives here, and no NATS module is imported.
"""

from __future__ import annotations

import asyncio
from typing import Any

from wavepp.api.messages import KVReply, KVRequestMessage, MicroBatchPlan
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv import StageKVManager
from wavepp.runtime.planning import CostModel
from wavepp.runtime.stage.core import StageCore, StageWork
from wavepp.runtime.stage.handoff_model import ModelledHandoff
from wavepp.sim.bus import SimBus, SimLatencies


class SimStageClient:
    """StageClient of one simulated stage: the stage core's KV handler after half an RTT."""

    def __init__(self, stage: SimStage, kv_rtt_s: float) -> None:
        self.stage = stage
        self.rank = stage.rank
        self.kv_rtt_s = kv_rtt_s

    async def call(self, msg: KVRequestMessage) -> KVReply:
        await asyncio.sleep(self.kv_rtt_s / 2)
        reply = self.stage.core.handle_kv(msg.model_dump_json().encode())
        await asyncio.sleep(self.kv_rtt_s / 2)
        return reply

    async def call_batch(self, payload: bytes) -> bytes:
        await asyncio.sleep(self.kv_rtt_s / 2)
        reply = self.stage.core.handle_kv_batch(payload)
        await asyncio.sleep(self.kv_rtt_s / 2)
        return reply


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


def _no_logits_token(request_id: str) -> int:
    """The simulator computes no logits: every first token is 0."""
    return 0


class SimStage:
    """One simulated stage: the real ``StageCore`` over a real ``StageKVManager``.

    The core decides everything a stage decides (plan order, block tables, results, the done
    message, caching computed blocks), exactly as in ``StageWorker``; this class only stands
    in for the stage's I/O on the virtual clock:

    * plans arrive from the ``SimBus`` (``on_plan``, subscribed to ``config.subjects.plan``);
    * preparation is a sleep of ``latencies.prepare_s`` plus the host tier's loads (on arrival
      in wave mode, else on the critical path): ``time_scale`` x ``host_load_s_per_block`` per
      block over one host-to-device link per stage (a load waits for the link to be free);
      execution a sleep of ``time_scale`` x the stage's cost-model time;
    * activations reach ``next_stage`` ``latencies.hop_s`` after execution;
    * ``MicroBatchDone`` goes out on ``config.subjects.done``; KV events are drained and
      dropped (nothing subscribes to them in the simulator);
    * with a ``handoff``, each micro-batch's KV is queued on the stage's modelled link at its
      end (before its done message goes out) and the handoff's leases end on timers at their
      landing times; the compute loop never waits for the link.

    Args:
        rank: the stage's rank.
        config: the runtime configuration.
        cost_model: this stage's cost model (unscaled; multiplied by ``config.time_scale``).
        latencies: simulated transport and preparation costs.
        bus: the simulated bus the done messages go out on.
        manager: the stage's KV manager (its clock should be the loop's).
        handoff: the stage's modelled KV handoff over ``manager``, or None (no handoff).
    """

    def __init__(
        self,
        rank: int,
        config: RuntimeConfig,
        cost_model: CostModel,
        latencies: SimLatencies,
        bus: SimBus,
        manager: StageKVManager,
        handoff: ModelledHandoff | None = None,
    ) -> None:
        self.rank = rank
        self.handoff = handoff
        self.config = config
        self.cost_model = cost_model
        self.latencies = latencies
        self.bus = bus
        self.core = StageCore(
            manager,
            rank=rank,
            num_stages=config.num_stages,
            local_prepare=config.resolved_local_prepare,
            clock=_loop_time,
        )
        # virtual time the last stage produced each request's result
        self.finished_at_s: dict[str, float] = {}
        self.inbox: asyncio.Queue[StageWork] = asyncio.Queue()
        self.activations: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
        self.next_stage: SimStage | None = None
        self.load_s_per_block = config.time_scale * config.host_load_s_of(rank)
        self._link_free_at_s = 0.0  # virtual time this stage's host-to-device link is free
        self.num_loaded_blocks = 0

    def _prepare_end_s(self, work: StageWork, start_s: float) -> float:
        """When the preparation started at ``start_s`` ends: ``prepare_s``, and the plan's
        loads once the link is free."""
        end_s = start_s + self.latencies.prepare_s
        if work.num_loads:
            self.num_loaded_blocks += work.num_loads
            begin_s = max(start_s, self._link_free_at_s)
            self._link_free_at_s = begin_s + work.num_loads * self.load_s_per_block
            end_s = max(end_s, self._link_free_at_s)
        return end_s

    @property
    def manager(self) -> StageKVManager:
        return self.core.manager

    @property
    def is_first(self) -> bool:
        return self.core.is_first

    @property
    def is_last(self) -> bool:
        return self.core.is_last

    def _finish_handoffs(self) -> None:
        assert self.handoff is not None, "a handoff timer without a handoff"
        self.handoff.finish_due(asyncio.get_running_loop().time())

    async def on_plan(self, msg: Any) -> None:
        plan = MicroBatchPlan.model_validate_json(msg.data)
        core = self.core
        due = core.receive_plan(plan)
        if core.sequencer.gap() is not None:
            # The simulated bus loses no plan: a hole can only be the ids before this epoch's
            # first plan, which no stage ever got (the worker learns that from a resend).
            due += core.sequencer.flush_held()
        for ready, _ in due:
            work = core.accept(ready)
            if work.prepare_on_arrival:
                work.prepare_end_s = self._prepare_end_s(work, work.prepare_start_s)
            self.inbox.put_nowait(work)

    async def compute_loop(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        while True:
            work = await self.inbox.get()
            if work.prepare_on_arrival and work.prepare_end_s > loop.time():
                await asyncio.sleep(work.prepare_end_s - loop.time())
            if not self.is_first:
                microbatch_id, ready_at = await self.activations.get()
                assert microbatch_id == work.plan.microbatch_id, (
                    f"stage {self.rank}: activations of {microbatch_id}, plan "
                    f"{work.plan.microbatch_id}"
                )
                if ready_at > loop.time():
                    await asyncio.sleep(ready_at - loop.time())
            if not work.prepare_on_arrival and not work.error:
                work.prepare_start_s = loop.time()
                await asyncio.sleep(self._prepare_end_s(work, loop.time()) - loop.time())
                work.prepare_end_s = loop.time()
            exec_start = loop.time()
            if not work.error:
                cost_s = self.config.time_scale * self.cost_model.microbatch_cost_s(
                    work.chunk_shapes
                )
                await asyncio.sleep(cost_s)
            exec_end = loop.time()
            results = core.results(work, _no_logits_token)
            for result in results:
                self.finished_at_s[result.request_id] = exec_end
            done = core.done_message(
                work, execute_start_s=exec_start, execute_end_s=exec_end, results=results
            )
            core.complete(work, done)
            if self.handoff is not None:
                last = {c.request_id for c in work.plan.chunks if c.is_last}
                for transfer in self.handoff.microbatch_done(work, exec_end):
                    if transfer.request_id in last:  # the lease ends when it lands
                        loop.call_at(transfer.landed_s, self._finish_handoffs)
            core.manager.take_events()  # nothing subscribes to KV events in the simulator
            await self.bus.publish(self.config.subjects.done, done.model_dump_json().encode())
            if self.next_stage is not None:
                self.next_stage.activations.put_nowait(
                    (work.plan.microbatch_id, exec_end + self.latencies.hop_s)
                )
