"""A simulated pipeline stage and its KV client: the real StageKVManager and handle_kv_request, virtual
compute (the stage's CostModel time on the virtual clock).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from wavepp.api.messages import (
    Commit,
    Health,
    KVReply,
    MicroBatchDone,
    MicroBatchPlan,
    ProbePin,
    Release,
    Renew,
    RequestResult,
)
from wavepp.runtime.agreement import StageRequest, handle_kv_request
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv import StageKVManager
from wavepp.runtime.planning import CostModel
from wavepp.sim.bus import SimBus, SimLatencies


class SimStageClient:
    """StageClient of one simulated stage: the real handle_kv_request after half an RTT."""

    def __init__(self, stage: SimStage, kv_rtt_s: float) -> None:
        self.stage = stage
        self.rank = stage.rank
        self.kv_rtt_s = kv_rtt_s

    async def call(self, msg: ProbePin | Commit | Release | Renew | Health) -> KVReply:
        await asyncio.sleep(self.kv_rtt_s / 2)
        reply = handle_kv_request(
            self.stage.manager, self.rank, msg.model_dump_json().encode(), self.stage.requests
        )
        await asyncio.sleep(self.kv_rtt_s / 2)
        return reply


@dataclass
class _SimWork:
    plan: MicroBatchPlan
    pairs: list[tuple[int, int]]  # (context_offset L, num_tokens x) per chunk
    error: str
    prepared: bool
    prepare_start_s: float
    prepare_end_s: float
    num_agreed_blocks: list[int]


@dataclass
class SimStage:
    """One simulated stage: a real StageKVManager, a plan queue, and virtual compute."""

    rank: int
    config: RuntimeConfig
    cost_model: CostModel
    latencies: SimLatencies
    bus: SimBus
    manager: StageKVManager
    requests: dict[str, StageRequest] = field(default_factory=dict)
    # virtual time the last stage produced each request's result
    finished_at_s: dict[str, float] = field(default_factory=dict)
    inbox: asyncio.Queue[_SimWork] = field(default_factory=asyncio.Queue)
    activations: asyncio.Queue[tuple[int, float]] = field(default_factory=asyncio.Queue)
    next_stage: SimStage | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.config.num_stages - 1

    async def on_plan(self, msg: Any) -> None:
        now = asyncio.get_running_loop().time()
        plan = MicroBatchPlan.model_validate_json(msg.data)
        error = ""
        pairs: list[tuple[int, int]] = []
        try:
            for c in plan.chunks:
                self.manager.block_table(c.request_id)  # as StageWorker: fails if not held
                pairs.append((c.context_offset, len(c.token_ids)))
        except (KeyError, ValueError) as exc:
            error = f"stage {self.rank}: cannot build block tables: {exc!r}"
        agreed = [
            self.requests[c.request_id].num_agreed_blocks if c.request_id in self.requests else -1
            for c in plan.chunks
        ]
        prepared = not error and self.config.resolved_local_prepare
        end = now + (self.latencies.prepare_s if prepared else 0.0)
        self.inbox.put_nowait(_SimWork(plan, pairs, error, prepared, now, end, agreed))

    async def compute_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            work = await self.inbox.get()
            if work.prepared and work.prepare_end_s > loop.time():
                await asyncio.sleep(work.prepare_end_s - loop.time())
            if not self.is_first:
                microbatch_id, ready_at = await self.activations.get()
                assert microbatch_id == work.plan.microbatch_id, (
                    f"stage {self.rank}: activations of {microbatch_id}, plan "
                    f"{work.plan.microbatch_id}"
                )
                if ready_at > loop.time():
                    await asyncio.sleep(ready_at - loop.time())
            prepare_start, prepare_end = work.prepare_start_s, work.prepare_end_s
            if not work.prepared and not work.error:
                prepare_start = loop.time()
                await asyncio.sleep(self.latencies.prepare_s)
                prepare_end = loop.time()
            exec_start = loop.time()
            if not work.error:
                cost_s = self.config.time_scale * self.cost_model.microbatch_cost_s(work.pairs)
                await asyncio.sleep(cost_s)
            exec_end = loop.time()
            results = []
            if self.is_last and not work.error:
                for c in work.plan.chunks:
                    if c.is_last:
                        results.append(RequestResult(request_id=c.request_id, first_token_id=0))
                        self.finished_at_s[c.request_id] = exec_end
            if not work.error:
                for c in work.plan.chunks:
                    record = self.requests.get(c.request_id)
                    if record is None:
                        continue
                    with contextlib.suppress(KeyError):
                        self.manager.mark_computed(
                            c.request_id, c.context_offset + len(c.token_ids), record.block_hashes
                        )
            self.manager.take_events()
            done = MicroBatchDone(
                rank=self.rank,
                microbatch_id=work.plan.microbatch_id,
                num_tokens=sum(x for _, x in work.pairs),
                prepare_start_s=prepare_start,
                prepare_end_s=prepare_end,
                execute_start_s=exec_start,
                execute_end_s=exec_end,
                results=results,
                error=work.error,
                num_agreed_blocks=work.num_agreed_blocks,
                epoch=work.plan.epoch,
            )
            await self.bus.publish(self.config.subjects.done, done.model_dump_json().encode())
            if self.next_stage is not None:
                self.next_stage.activations.put_nowait(
                    (work.plan.microbatch_id, exec_end + self.latencies.hop_s)
                )
