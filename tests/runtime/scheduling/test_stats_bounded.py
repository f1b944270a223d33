"""Scheduler statistics are bounded snapshots.

* 6,000 requests through the admission path (the real admission controller over in-process
  stage KV managers, the real wave scheduler and planner; stages answer each plan at once
  through an in-memory transport, so it runs in seconds) keep the stats' size flat and the
  traced memory of the second 10,000 requests flat.
* A metric read after the replay's stats reset reports the new run, not the warm-up.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from typing import Any

import pytest
from agreement_support import local_stages
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from wavepp.api.messages import (
    DoneResend,
    DoneResendReply,
    MicroBatchDone,
    MicroBatchPlan,
    RequestResult,
)
from wavepp.bench.grid import GridSpec, Setting
from wavepp.bench.report import run_closed_loop
from wavepp.launch.grid import runtime_config
from wavepp.runtime.kv import StageKVManager
from wavepp.runtime.planning import ChunkPlanner
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.scheduling.scheduler import WaveScheduler
from wavepp.runtime.scheduling.stats import WaveStats
from wavepp.runtime.scheduling.transport import PlanHandlers
from wavepp.sim.clock import VirtualClockLoop
from wavepp.telemetry.metrics import setup_metrics, shutdown_metrics
from wavepp.telemetry.settings import TelemetrySettings

NUM_REQUESTS = 6_000
RECENT_OUTCOMES = (
    512  # the scheduler's outcome ring (4,096 in production): small, so few requests refill it
)
NUM_STAGES = 2
WINDOW = 128  # spans and micro-batch sizes kept; the run records ~10x more


class InstantStages:
    """A PlanTransport whose S stages finish each plan at once in wall time, and report 1 ms
    of execution per stage on a pipeline timeline of their own: stage r starts a micro-batch
    when stage r-1 finished it and stage r finished the previous one; stage 0 starts a plan
    no earlier than the last stage's end of the micro-batches reported before it was sent."""

    def __init__(self, managers: list[StageKVManager]) -> None:
        self.managers = managers
        self.handlers: PlanHandlers | None = None
        self.queue: asyncio.Queue[MicroBatchDone] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.stage_free_s = [0.0] * NUM_STAGES
        self.reported_end_s = 0.0

    async def start(self, handlers: PlanHandlers) -> None:
        self.handlers = handlers
        self.task = asyncio.create_task(self._deliver())

    async def _deliver(self) -> None:
        while True:
            done = await self.queue.get()
            if done.rank == NUM_STAGES - 1:
                self.reported_end_s = done.execute_end_s
            assert self.handlers is not None
            await self.handlers.on_done(done)

    async def publish_plan(
        self, plan: MicroBatchPlan, headers: dict[str, str] | None, data: bytes | None = None
    ) -> None:
        num_tokens = sum(len(c.token_ids) for c in plan.chunks)
        ready_s = self.reported_end_s
        for rank in range(NUM_STAGES):
            self.managers[rank].take_events()
            start = max(self.stage_free_s[rank], ready_s)
            ready_s = self.stage_free_s[rank] = start + 1e-3
            last = rank == NUM_STAGES - 1
            self.queue.put_nowait(
                MicroBatchDone(
                    rank=rank,
                    microbatch_id=plan.microbatch_id,
                    num_tokens=num_tokens,
                    prepare_start_s=start,
                    prepare_end_s=start,
                    execute_start_s=start,
                    execute_end_s=ready_s,
                    results=[
                        RequestResult(request_id=c.request_id, first_token_id=1)
                        for c in plan.chunks
                        if last and c.is_last
                    ],
                    epoch=plan.epoch,
                )
            )

    async def request_dones(self, rank: int, ask: DoneResend, timeout_s: float) -> DoneResendReply:
        raise AssertionError("no done message is lost in memory")

    async def subscribe(self, subject: str, cb: Any) -> None:
        return None

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()


def _scheduler(stats: WaveStats | None = None) -> WaveScheduler:
    spec = GridSpec(time_scale=0.01, num_stages=NUM_STAGES, num_kv_blocks=512, block_size=16)
    config, planner_cost = runtime_config(spec, Setting("glm-5.2", 16, "low", "wave"))
    config = config.model_copy(update={"chunk_tokens": 256})
    managers, controller = local_stages(
        [512] * NUM_STAGES, block_size=16, model_id=config.model_id, lease_s=config.lease_s
    )
    planner = ChunkPlanner(planner_cost, policy="dynamic", chunk_tokens=256, block_size=16)
    return WaveScheduler(config, InstantStages(managers), controller, planner, stats=stats)


def _prompt(index: int) -> list[int]:
    return [(7 * index + j) % 1000 + 1 for j in range(40)]


def test_requests_keep_stats_and_memory_flat(monkeypatch: pytest.MonkeyPatch) -> None:
    """Traced from request 2,000 on: what is kept at 6,000 exceeds what was kept at 3,008 by
    less than 192 KiB (64 bytes a request). Every bounded ring (the scheduler's recent
    outcomes and recent works the largest, RECENT_OUTCOMES here) has been refilled since
    tracing started, so a
    ring churning in place counts about zero; NOTE: the recent-outcome dict's table is
    reallocated as it churns, which moves the figure by up to ~40 KiB either way at 512."""
    monkeypatch.setattr("wavepp.runtime.scheduling.core._RECENT_OUTCOMES", RECENT_OUTCOMES)
    monkeypatch.setattr("wavepp.runtime.scheduling.sizing._WORKS_KEPT", RECENT_OUTCOMES)
    sizes: dict[int, int] = {}
    traced: dict[int, int] = {}
    checkpoints = (2_000, 3_008, NUM_REQUESTS)  # multiples of 16, the first past the ring

    async def main() -> None:
        stats = WaveStats(window=WINDOW)
        scheduler = _scheduler(stats)
        await scheduler.start()
        try:
            for first in range(0, NUM_REQUESTS, 16):
                outcomes = await asyncio.gather(
                    *(
                        scheduler.submit(PromptRequest(f"r{i}", _prompt(i % 64)))
                        for i in range(first, first + 16)
                    )
                )
                assert all(o.ok for o in outcomes), outcomes[0].error
                if first + 16 in checkpoints:
                    gc.collect()
                    sizes[first + 16] = len(stats.spans) + len(stats.microbatch_tokens)
                    if tracemalloc.is_tracing():
                        traced[first + 16] = tracemalloc.get_traced_memory()[0]
                    else:
                        tracemalloc.start()
            assert stats.num_spans > 10 * WINDOW  # the windows were full long before
        finally:
            tracemalloc.stop()
            await scheduler.stop()

    loop = VirtualClockLoop(start_s=1_000.0)  # timers (deadline, renewal) take no wall time
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    start, mid, full = checkpoints
    assert sizes[start] == sizes[mid] == sizes[full] == 2 * WINDOW, sizes
    growth = traced[full] - traced[mid]
    print(f"traced growth over the last {full - mid} requests: {growth} bytes")
    assert growth < 192 * 1024, f"the last {full - mid} requests kept {growth} more bytes"


def test_a_metric_read_after_the_stats_reset_reports_the_new_run() -> None:
    """run_closed_loop resets the scheduler's stats after warm-up; the wave-fill gauge reads the
    live object, so a scrape after the reset reports the measured run, not the warm-up."""
    reader = InMemoryMetricReader()
    setup_metrics(TelemetrySettings(), "wavepp-scheduler", reader=reader)

    async def main() -> tuple[float, float, float]:
        scheduler = _scheduler()
        await scheduler.start()
        try:
            # Warm-up: one request at a time leaves stage 1 idle half the time.
            for i in range(4):
                await scheduler.submit(PromptRequest(f"w{i}", _prompt(i)))
            warmup_fill = _wave_fill_gauge(reader)
            report = await run_closed_loop(
                scheduler,
                scheduler.config,
                [(f"m{i}", _prompt(i)) for i in range(32)],
                concurrency=8,
            )
            return warmup_fill, _wave_fill_gauge(reader), report.stats.wave_fill(NUM_STAGES)
        finally:
            await scheduler.stop()

    try:
        warmup_fill, metric, run_fill = asyncio.run(main())
    finally:
        shutdown_metrics()
    assert metric == pytest.approx(run_fill)
    assert run_fill != pytest.approx(warmup_fill)


def _wave_fill_gauge(reader: InMemoryMetricReader) -> float:
    metrics = {
        m.name: m
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    [point] = metrics["wavepp.wave_fill.ratio"].data.data_points
    return float(point.value)
