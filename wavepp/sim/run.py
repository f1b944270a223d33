"""Drive a workload through a ``SimPipeline`` on a virtual clock and report as a replay does.

``simulate(config, planner_cost_model, workload, concurrency=C)`` mirrors
``wavepp.bench.grid.run_workload`` (warm-up, then closed loop at C) with virtual time: the
returned ``ReplayReport``'s wall time, TTFTs and stage spans are virtual seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from wavepp.bench.report import ReplayReport, run_closed_loop
from wavepp.bench.workloads import Workload
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.handoff_cost import HandoffModel
from wavepp.runtime.stage.handoff_model import summarize_handoffs
from wavepp.sim.bus import SimLatencies
from wavepp.sim.clock import VirtualClockLoop
from wavepp.sim.pipeline import SimPipeline


async def _simulate(
    config: RuntimeConfig,
    planner_cost_model: CostModel,
    workload: Workload,
    concurrency: int,
    stage_cost_models: Sequence[CostModel] | None,
    latencies: SimLatencies | None,
    handoff: HandoffModel | None,
) -> ReplayReport:
    loop = asyncio.get_running_loop()
    pipeline = SimPipeline(
        config,
        planner_cost_model,
        stage_cost_models=stage_cost_models,
        latencies=latencies,
        handoff=handoff,
    )
    async with pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None, "pipeline started without a scheduler"
        # The scheduler stamps finish times with time.time(); use the virtual clock's.
        report = await run_closed_loop(
            scheduler,
            config,
            list(zip(workload.request_ids, workload.prompts, strict=True)),
            concurrency=concurrency,
            clock=loop.time,
            finished_at=pipeline.finished_at_s,
            extra={"engine": "sim", "virtual_clock": True},
            warmup=workload.warmup,
            stage_cost_models=[m.scaled(config.time_scale) for m in stage_cost_models]
            if stage_cost_models
            else None,
        )
        handoffs = [stage.handoff for stage in pipeline.stages if stage.handoff is not None]
        if handoffs:
            first_token_s = {o.request_id: o.finished_s for o in report.outcomes if o.ok}
            report.extra["handoff"] = {
                "link": handoff.link.name if handoff is not None else "",
                **summarize_handoffs(handoffs, first_token_s, wall_s=report.wall_s),
            }
        # hits per tier and stage: device hits are the summary's stage_local_hit_blocks (both
        # tiers); what came from the host tier, per stage
        report.extra["host_loaded_blocks_per_stage"] = [
            stage.num_loaded_blocks for stage in pipeline.stages
        ]
        report.extra["host_kv_blocks_per_stage"] = [
            config.host_kv_blocks_of(rank) for rank in range(config.num_stages)
        ]
        return report


def simulate(
    config: RuntimeConfig,
    planner_cost_model: CostModel,
    workload: Workload,
    *,
    concurrency: int,
    stage_cost_models: Sequence[CostModel] | None = None,
    latencies: SimLatencies | None = None,
    handoff: HandoffModel | None = None,
) -> ReplayReport:
    """Simulate ``workload`` (warm-up, then closed loop at ``concurrency``) on a virtual clock.

    Args:
        config: runtime configuration; ``config.cost_model`` is every stage's unless
            ``stage_cost_models`` is given; stages sleep ``config.time_scale`` x their cost.
        planner_cost_model: the planner's model (scale it by time_scale, as for real runs).
        workload: prompts and warm-up prompts.
        concurrency: closed-loop requests in flight (>= 1).
        stage_cost_models: optional per-stage models.
        latencies: simulated transport costs (SimLatencies defaults if None).
        handoff: every stage hands its KV to a decode instance over its modelled link; the
            report's ``extra["handoff"]`` then holds ``summarize_handoffs``' figures.

    Returns:
        The report; its times are virtual seconds.

    Raises:
        ValueError: concurrency < 1 or an inconsistent configuration.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: must be >= 1")
    loop = VirtualClockLoop(start_s=1_000_000.0)
    try:
        return loop.run_until_complete(
            _simulate(
                config,
                planner_cost_model,
                workload,
                concurrency,
                stage_cost_models,
                latencies,
                handoff,
            )
        )
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
