"""Discrete-event simulation of a WavePP pipeline on a virtual clock.

What is real and what is simulated::

    real (the runtime's own objects, not copies)      simulated
    ------------------------------------------------  -----------------------------------------
    WaveScheduler: intake, admission tasks, sync       NATS: an in-process bus (``SimBus``) that
      gather, planning, publishing, completion           delivers in order after ``bus_latency_s``
    AgreementController: probe-reserve, L*,            KV request-reply: ``SimStageClient`` calls
      release, leases, refusals and backpressure         handle_kv_batch after kv_rtt_s / 2,
      (one KV round trip per agreement round)            replies after another kv_rtt_s / 2
    ChunkPlanner: dynamic / static chunking
    StageKVManager + BlockPool per stage (pins,         stage compute: sleep time_scale x the
      reservations, LRU eviction, mark_computed)         stage's CostModel.microbatch_cost_s
      and its HostTier (spill, pin, load)              host-to-device loads: time_scale x
    host_load_policy (load or recompute)                 host_load_s_per_block per block, one
                                                         link per stage, in preparation
    handle_kv_batch (the stage's KV server)            activations: hop_s between stages
                                                       preparation: prepare_s on the critical
                                                         path when local_prepare is off
                                                       scheduler host time: schedule_s per
                                                         micro-batch (sync: at least the
                                                         baseline's iteration overhead)
                                                       sync lockstep admission: no KV RTT,
                                                         every pool the smallest stage's
                                                       KV handoff to decode (``handoff``): each
                                                         stage's ModelledHandoff (real leases
                                                         on its pool) over a modelled link

Everything runs on a ``VirtualClockLoop``: sleeps take no wall time, so PP 8 or 128k-token
contexts at time scale 1 take seconds. CPU time of the real scheduling code is free in virtual
time (the emulated run pays it), which is the main difference from ``wavepp bench grid``.

A simulated stage (``sim.stage.SimStage``) drives the same ``StageCore`` as ``StageWorker``: on
a plan the core builds block tables from the stage's manager (prepared then, if local_prepare),
runs plans in order once the previous stage's activations arrive, marks computed blocks cached;
the simulated stage publishes its ``MicroBatchDone`` on the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from wavepp.runtime.agreement import AgreementController
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv import BlockPool, HostTier, StageKVManager
from wavepp.runtime.planning import CostModel, planner_for
from wavepp.runtime.planning.handoff_cost import HandoffModel
from wavepp.runtime.planning.host_load import host_load_policy
from wavepp.runtime.scheduling.admission import STRATEGIES, AdmissionStrategy
from wavepp.runtime.scheduling.scheduler import WaveScheduler
from wavepp.runtime.scheduling.transport import BusPlanTransport
from wavepp.runtime.stage.handoff_model import ModelledHandoff
from wavepp.sim.bus import SimBus, SimLatencies
from wavepp.sim.stage import SimStage, SimStageClient

log = logging.getLogger(__name__)


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
        admission: the scheduler's admission strategy class (``WaveScheduler``'s
            ``admission``; default: the one the config selects). Its ``agrees_in_lockstep``
            decides how the stages' pools and KV round trips are simulated.
        handoff: every stage hands its layers' KV to a decode instance over its modelled link
            (``runtime.stage.handoff_model``), or None (no handoff).
    """

    def __init__(
        self,
        config: RuntimeConfig,
        planner_cost_model: CostModel,
        *,
        stage_cost_models: Sequence[CostModel] | None = None,
        latencies: SimLatencies | None = None,
        admission: type[AdmissionStrategy] | None = None,
        handoff: HandoffModel | None = None,
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
        self.admission = admission or STRATEGIES[config.resolved_agreement]
        if handoff is not None and len(handoff.stages) != config.num_stages:
            raise ValueError(
                f"handoff has {len(handoff.stages)} stages; num_stages={config.num_stages}"
            )
        self.handoff = handoff
        self.bus: SimBus | None = None
        self.stages: list[SimStage] = []
        self.controller: AgreementController | None = None
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
        capacities = [config.kv_blocks_of(rank) for rank in range(config.num_stages)]
        host_capacities = [config.host_kv_blocks_of(rank) for rank in range(config.num_stages)]
        kv_rtt_s = self.latencies.kv_rtt_s
        if self.admission.agrees_in_lockstep(config):
            # TRT-LLM's ranks take the smallest pool (an allreduce MIN) and stay in lockstep
            # by identical operations: agreement is free of round trips (baseline.md).
            capacities = [min(capacities)] * config.num_stages
            host_capacities = [min(host_capacities)] * config.num_stages
            kv_rtt_s = 0.0
        for rank in range(config.num_stages):
            host = HostTier(host_capacities[rank]) if host_capacities[rank] else None
            manager = StageKVManager(
                BlockPool(capacities[rank], config.block_size, host=host),
                clock=loop.time,
                max_blocks_per_owner=config.max_blocks_per_owner,
            )
            handoff = None
            if self.handoff is not None:
                handoff = ModelledHandoff(
                    manager, self.handoff.stage_link(rank), self.handoff.stages[rank]
                )
            stage = SimStage(
                rank,
                config,
                self.stage_cost_models[rank],
                self.latencies,
                self.bus,
                manager,
                handoff=handoff,
            )
            if self.stages:
                self.stages[-1].next_stage = stage
            self.stages.append(stage)
            await self.bus.subscribe(config.subjects.plan, cb=stage.on_plan)
            self._tasks.append(asyncio.create_task(stage.compute_loop()))
        self.controller = AgreementController(
            [SimStageClient(stage, kv_rtt_s) for stage in self.stages],
            block_size=config.block_size,
            model_id=config.model_id,
            lease_s=config.lease_s,
            stage_capacities=[min(c, config.max_blocks_per_owner or c) for c in capacities],
            agreed_blocks=self._host_load_policy(host_capacities),
        )
        planner = planner_for(config, self.planner_cost_model)
        transport = BusPlanTransport(self.bus, config.subjects)  # the bus speaks nats.py's API
        self.scheduler = WaveScheduler(
            config,
            transport,
            self.controller,
            planner,
            host_overhead_s=self.latencies.schedule_s,
            admission=self.admission,
        )
        await self.scheduler.start()

    def _host_load_policy(self, host_capacities: Sequence[int]) -> Callable | None:
        """L* with host tiers: load or recompute at the stages' cost and load times (scaled,
        ``planning.host_load.host_load_policy``); None without a host tier (L* = the least
        h_s)."""
        if not any(host_capacities):
            return None
        policy = host_load_policy(self.config, self.stage_cost_models, scale=self.config.time_scale)
        return None if policy is None else policy.agreed_blocks

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
