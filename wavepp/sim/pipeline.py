"""Discrete-event simulation of a WavePP pipeline on a virtual clock.

What is real and what is simulated::

    real (the runtime's own objects, not copies)      simulated
    ------------------------------------------------  -----------------------------------------
    WaveScheduler: intake, admission tasks, sync       NATS: an in-process bus (``SimBus``) that
      gather, planning, publishing, completion           delivers in order after ``bus_latency_s``
    AdmissionController: probe-pin, L*, commit,        KV request-reply: ``SimStageClient`` calls
      release, leases, refusals and backpressure         handle_kv_request after kv_rtt_s / 2,
    ChunkPlanner: dynamic / static chunking              replies after another kv_rtt_s / 2
    StageKVManager + BlockPool per stage (pins,         stage compute: sleep time_scale x the
      reservations, LRU eviction, mark_computed)         stage's CostModel.microbatch_cost_s
    handle_kv_request (the stage's KV server)          activations: hop_s between stages
                                                       preparation: prepare_s on the critical
                                                         path when local_prepare is off

Everything runs on a ``VirtualClockLoop``: sleeps take no wall time, so PP 8 or 128k-token
contexts at time scale 1 take seconds. CPU time of the real scheduling code is free in virtual
time (the emulated run pays it), which is the main difference from ``wavepp bench grid``.

A simulated stage mirrors ``StageWorker``: on a plan it builds block tables from its manager
(and prepares then, if local_prepare), executes plans in order once the previous stage's
activations arrive, marks computed blocks cached, publishes ``MicroBatchDone``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
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
from wavepp.runtime.agreement import AdmissionController, StageRequest, handle_kv_request
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.planning import ChunkPlanner, CostModel
from wavepp.runtime.scheduling.scheduler import WaveScheduler

log = logging.getLogger(__name__)

__all__ = ["SimBus", "SimLatencies", "SimPipeline", "SimStage", "SimStageClient"]


@dataclass(frozen=True)
class SimLatencies:
    """Simulated costs outside the stages' compute, seconds (virtual, not scaled).

    Defaults: the order of what ``wavepp bench admission`` and the emulated runs measure on this
    machine (a NATS request-reply ~1 ms, a publish ~0.5 ms); change them to model a network.
    """

    kv_rtt_s: float = 1e-3
    bus_latency_s: float = 5e-4
    hop_s: float = 2e-4
    prepare_s: float = 2e-4

    def __post_init__(self) -> None:
        for name in ("kv_rtt_s", "bus_latency_s", "hop_s", "prepare_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"SimLatencies.{name}={value}: must be >= 0 seconds")


@dataclass
class _SimMsg:
    subject: str
    data: bytes


class _SimSubscription:
    def __init__(self, bus: SimBus, subject: str, cb: Callable[[Any], Awaitable[None]]) -> None:
        self.bus = bus
        self.subject = subject
        self.cb = cb
        self.queue: asyncio.Queue[tuple[float, _SimMsg]] = asyncio.Queue()
        self.task = asyncio.create_task(self._deliver())

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            deliver_at, msg = await self.queue.get()
            if deliver_at > loop.time():
                await asyncio.sleep(deliver_at - loop.time())
            try:
                await self.cb(msg)
            except Exception:  # as nats.py: a failing callback is logged, delivery goes on
                log.exception("sim bus: callback for %s failed", self.subject)

    async def unsubscribe(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        with contextlib.suppress(ValueError):
            self.bus.subscriptions.remove(self)


class SimBus:
    """The part of a NATS client the scheduler uses: subscribe(cb), publish, flush.

    A message reaches every subscriber of its exact subject ``latency_s`` after publish, in
    publish order per subscriber, one callback at a time (as nats.py runs a subscription).
    """

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.subscriptions: list[_SimSubscription] = []

    async def subscribe(
        self, subject: str, queue: str = "", cb: Callable[[Any], Awaitable[None]] | None = None
    ) -> _SimSubscription:
        if cb is None:
            raise ValueError(f"subscribe({subject!r}): the simulated bus needs a callback (cb=)")
        sub = _SimSubscription(self, subject, cb)
        self.subscriptions.append(sub)
        return sub

    async def publish(
        self, subject: str, data: bytes = b"", reply: str = "", headers: Any = None
    ) -> None:
        deliver_at = asyncio.get_running_loop().time() + self.latency_s
        for sub in self.subscriptions:
            if sub.subject == subject:
                sub.queue.put_nowait((deliver_at, _SimMsg(subject, data)))

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        for sub in list(self.subscriptions):
            await sub.unsubscribe()


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


class SimPipeline:
    """A pipeline of S simulated stages driven by the real scheduler; ``async with`` it.

    Same surface as ``LocalPipeline`` for a driver: ``.scheduler`` after start. Must run on a
    ``VirtualClockLoop`` to be fast (it works on any loop, in real time).

    Args:
        config: the runtime configuration (mode, ablation switches, capacities, time_scale).
        planner_cost_model: what the planner budgets with (already scaled, as for LocalPipeline).
        stage_cost_models: per-stage cost models (unscaled; the stage multiplies by
            config.time_scale); default: CostModel.from_dict(config.cost_model) on every stage.
        latencies: simulated transport and preparation costs.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        planner_cost_model: CostModel,
        *,
        stage_cost_models: Sequence[CostModel] | None = None,
        latencies: SimLatencies | None = None,
    ) -> None:
        if stage_cost_models is None:
            if config.cost_model is None:
                raise ValueError("config.cost_model: the simulator needs the stages' cost model")
            stage_cost_models = [CostModel.from_dict(config.cost_model)] * config.num_stages
        if len(stage_cost_models) != config.num_stages:
            raise ValueError(
                f"stage_cost_models has {len(stage_cost_models)} entries; "
                f"num_stages={config.num_stages}"
            )
        self.config = config
        self.planner_cost_model = planner_cost_model
        self.stage_cost_models = list(stage_cost_models)
        self.latencies = latencies or SimLatencies()
        self.bus: SimBus | None = None
        self.stages: list[SimStage] = []
        self.controller: AdmissionController | None = None
        self.scheduler: WaveScheduler | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> SimPipeline:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def finished_at_s(self, request_id: str) -> float | None:
        """Virtual time the last stage produced the request's first token, or None."""
        return self.stages[-1].finished_at_s.get(request_id) if self.stages else None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        config = self.config
        self.bus = SimBus(self.latencies.bus_latency_s)
        for rank in range(config.num_stages):
            manager = StageKVManager(
                BlockPool(config.kv_blocks_of(rank), config.block_size), clock=loop.time
            )
            stage = SimStage(
                rank, config, self.stage_cost_models[rank], self.latencies, self.bus, manager
            )
            if self.stages:
                self.stages[-1].next_stage = stage
            self.stages.append(stage)
            await self.bus.subscribe(config.subjects.plan, cb=stage.on_plan)
            self._tasks.append(asyncio.create_task(stage.compute_loop()))
        self.controller = AdmissionController(
            [SimStageClient(stage, self.latencies.kv_rtt_s) for stage in self.stages],
            block_size=config.block_size,
            model_id=config.model_id,
            lease_s=config.lease_s,
            stage_capacities=[config.kv_blocks_of(r) for r in range(config.num_stages)],
        )
        planner = ChunkPlanner(
            self.planner_cost_model,
            policy=config.resolved_chunk_policy,
            chunk_tokens=config.chunk_tokens,
            block_size=config.block_size,
        )
        self.scheduler = WaveScheduler(config, self.bus, self.controller, planner)  # type: ignore[arg-type]
        await self.scheduler.start()

    async def stop(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.stop()
            self.scheduler = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.bus is not None:
            await self.bus.close()
