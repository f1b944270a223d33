"""The simulator: virtual clock, real runtime objects, and agreement with the emulated run."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from wavepp.bench.grid import GridSpec, Setting, run_workload
from wavepp.bench.report import ReplayReport
from wavepp.bench.workloads import ideal_hit_ratio, preset_workload, shared_prefix_workload
from wavepp.launch.grid import runtime_config
from wavepp.runtime.agreement import AgreementController
from wavepp.runtime.config import BaselineConfig
from wavepp.runtime.kv import StageKVManager
from wavepp.runtime.planning import CostModel
from wavepp.runtime.scheduling.scheduler import WaveScheduler
from wavepp.sim.bus import SimLatencies
from wavepp.sim.clock import SimDeadlockError, VirtualClockLoop
from wavepp.sim.pipeline import SimPipeline
from wavepp.sim.run import simulate


def _run(coro_fn):  # noqa: ANN001, ANN202
    loop = VirtualClockLoop(start_s=100.0)
    try:
        return loop.run_until_complete(coro_fn(loop))
    finally:
        loop.close()


def test_virtual_clock_runs_timers_in_order_without_waiting() -> None:
    async def main(loop: VirtualClockLoop) -> list[tuple[str, float]]:
        order: list[tuple[str, float]] = []

        async def sleeper(tag: str, delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            order.append((tag, loop.time()))

        await asyncio.gather(sleeper("late", 3600.0), sleeper("early", 0.5), sleeper("mid", 7.0))
        return order

    wall = time.monotonic()
    order = _run(main)
    assert time.monotonic() - wall < 1.0
    assert order == [("early", 100.5), ("mid", 107.0), ("late", 3700.0)]


def test_virtual_clock_reports_deadlock_instead_of_hanging() -> None:
    async def main(loop: VirtualClockLoop) -> None:
        await asyncio.Event().wait()  # nobody sets it and no timer is pending

    with pytest.raises(SimDeadlockError, match="no timer pending"):
        _run(main)


def _spec(time_scale: float = 0.5) -> GridSpec:
    return GridSpec(time_scale=time_scale, num_kv_blocks=4096)


def test_sim_drives_the_real_runtime_objects() -> None:
    config, planner_cost = runtime_config(_spec(), Setting("glm-5.2", 2, "low", "wave"))

    async def main(loop: VirtualClockLoop) -> None:
        async with SimPipeline(config, planner_cost) as pipeline:
            assert isinstance(pipeline.scheduler, WaveScheduler)
            assert isinstance(pipeline.controller, AgreementController)
            assert all(isinstance(s.manager, StageKVManager) for s in pipeline.stages)

    _run(main)


def test_sync_sim_at_concurrency_1_hits_exactly_the_ideal_ratio() -> None:
    # One request at a time, ample KV: every shared prefix block is cached when the next
    # request agrees, so the measured hit ratio equals the unbounded-cache replay's.
    workload = shared_prefix_workload(
        10, num_prefix_tokens=640, num_suffix_tokens=200, num_prefixes=3, vocab_size=1024
    )
    config, planner_cost = runtime_config(_spec(), Setting("glm-5.2", 1, "high", "sync"))
    summary = simulate(config, planner_cost, workload, concurrency=1).summary()
    assert summary["completed"] == 10 and summary["failed"] == 0
    expected = ideal_hit_ratio(workload.prompts, config.block_size, workload.warmup)
    assert summary["cache_hit_ratio"] == pytest.approx(expected, abs=1e-4)
    assert expected > 0.6


def test_sim_time_is_the_cost_model_time() -> None:
    # One request, one stage, no transport costs: wall = time_scale * t(0, x) exactly.
    spec = GridSpec(time_scale=0.5, num_stages=1, num_kv_blocks=1024)
    config, planner_cost = runtime_config(spec, Setting("glm-5.2", 1, "low", "sync"))
    # no modelled host loop either (tests/sim/test_baseline.py checks that one)
    config = config.model_copy(
        update={"num_stages": 1, "baseline": BaselineConfig(iteration_overhead_s=0.0)}
    )
    workload = shared_prefix_workload(
        1, num_prefix_tokens=0, num_suffix_tokens=2048, num_prefixes=1, vocab_size=1024
    )
    zero = SimLatencies(kv_rtt_s=0.0, bus_latency_s=0.0, hop_s=0.0, prepare_s=0.0)
    report = simulate(config, planner_cost, workload, concurrency=1, latencies=zero)
    stage_cost = CostModel.from_dict(config.cost_model or {})
    assert report.wall_s == pytest.approx(0.5 * stage_cost.microbatch_cost_s([(0, 2048)]))


def _measured_latencies(report: ReplayReport, num_stages: int) -> SimLatencies:
    """What the emulated run's processes spent outside the stages' compute, as the simulator's
    inputs: ``kv_rtt_s`` the median agreement round (``RequestOutcome.agreement_s``),
    ``schedule_s`` the scheduler's mean host time per micro-batch (``WaveStats.host_s``) and
    ``hop_s`` the median wait of a stage for its input (its execute start after the previous
    stage's execute end of the same micro-batch, counted where the stage was idle by then);
    ``bus_latency_s`` and ``prepare_s`` keep their defaults (the spans do not show them)."""
    spans = {(s.microbatch_id, s.rank): s for s in report.stats.spans}
    hops = []
    for rank in range(1, num_stages):
        free_at = float("-inf")
        for span in sorted((s for s in spans.values() if s.rank == rank),
                           key=lambda s: s.execute_start_s):  # fmt: skip
            upstream = spans.get((span.microbatch_id, rank - 1))
            if upstream is not None and free_at <= upstream.execute_end_s:
                hops.append(span.execute_start_s - upstream.execute_end_s)
            free_at = span.execute_end_s
    agreement = [o.agreement_s for o in report.outcomes if o.ok]
    assert hops and agreement and report.stats.host_s, "the emulated run recorded no timings"
    return SimLatencies(
        kv_rtt_s=float(statistics.median(agreement)),
        hop_s=max(0.0, float(statistics.median(hops))),
        schedule_s=float(statistics.fmean(report.stats.host_s)),
    )


@pytest.mark.serial  # the emulated run's throughput is wall time
@pytest.mark.parametrize("mode", ["wave", pytest.param("sync", marks=pytest.mark.slow)])
def test_sim_matches_the_emulated_run_within_10_percent(mode: str) -> None:
    """Same setting, real stage processes vs the simulator, at the model's own time (time scale
    1): the same cache hits and stage busy time, and throughput within 10 %. The
    simulator is given the agreement round, hop and scheduler host time the emulated run
    measured, so a loaded machine (slower NATS round trips and wake-ups) moves both sides; what
    it must predict is the pipeline: the overlap of agreement, planning and compute."""
    spec = _spec(time_scale=1.0)
    setting = Setting("glm-5.2", 4, "low", mode)
    config, planner_cost = runtime_config(spec, setting)
    workload = preset_workload("low", 12, vocab_size=config.model.vocab_size)
    emulated_report = asyncio.run(run_workload(config, planner_cost, workload, concurrency=4))
    latencies = _measured_latencies(emulated_report, config.num_stages)
    simulated_report = simulate(config, planner_cost, workload, concurrency=4, latencies=latencies)
    emulated, simulated = emulated_report.summary(), simulated_report.summary()
    assert emulated["completed"] == simulated["completed"] == 12
    assert simulated["cache_hit_ratio"] == pytest.approx(emulated["cache_hit_ratio"], abs=0.02)
    busy = (sum(emulated["stage_busy_s"]), sum(simulated["stage_busy_s"]))
    assert busy[0] == pytest.approx(busy[1], rel=0.05), busy
    ratio = simulated["throughput_tokens_per_s"] / emulated["throughput_tokens_per_s"]
    assert 0.9 <= ratio <= 1.1, (ratio, latencies, emulated, simulated)


def test_planner_splits_short_work_only_when_it_finishes_sooner() -> None:
    """The at-least-S rule as the simulator exercises it: k minimises (S-1+k)(c+W/k)."""
    from wavepp.runtime.planning import ChunkPlanner, RequestProgress

    def num_microbatches(model: CostModel) -> int:
        planner = ChunkPlanner(model, policy="dynamic", chunk_tokens=8192, block_size=16)
        request = RequestProgress("A", 512, 0)
        count = 0
        while not request.is_fully_planned:
            planner.plan_microbatch([request], num_stages=4, num_inflight=count)
            count += 1
        return count

    # c = 0: cutting is free, fill all 4 stages.
    assert num_microbatches(CostModel(c=0.0, g=0.0, b=1e-4, a=0.0)) == 4
    # W = 25.6 ms, c = 52 ms (GLM-5.2's weight read): 4 (c + W) = 310 ms < 5 (c + W/2) = 324.
    assert num_microbatches(CostModel(c=0.052, g=0.0, b=5e-5, a=0.0)) == 1
    # W = 51.2 ms: 4 (c + W) = 413 ms > 5 (c + W/2) = 388 ms < 6 (c + W/3) = 414: two.
    assert num_microbatches(CostModel(c=0.052, g=0.0, b=1e-4, a=0.0)) == 2
    # W = 512 ms, c = 52 ms: k* = argmin -> 4 (sqrt(3 W / c) ~ 5.4, capped at idle = 4).
    assert num_microbatches(CostModel(c=0.052, g=0.0, b=1e-3, a=0.0)) == 4


@pytest.mark.parametrize("num_splits", [2, 3])
def test_a_split_target_of_k_microbatches_makes_k_not_k_plus_one(num_splits: int) -> None:
    """A lone high-reuse request (512 new tokens after 3,584 cached, 64-token blocks) on 8
    MiniMax-M2.7 stages at H200 time, planned at the closed-loop target c + W/k. Each cut
    re-pays g*L and was rounded down to a block, so for k = 2 the request came out as 192 +
    192 + 128 tokens: three micro-batches, each paying c on every stage (wave fell below sync
    at C = 1). For k = 3 (fit ~170 tokens) rounding down gave 4 x 128; one block more gives
    192 + 192 + 128."""
    from wavepp.runtime.planning import Chunk, RequestProgress, planner_for

    config, planner_cost = runtime_config(
        GridSpec(time_scale=1.0, num_stages=8), Setting("minimax-m2.7", 1, "high", "wave")
    )
    planner = planner_for(config, planner_cost)
    assert config.block_size == 64
    target_s = planner.fixed_cost_s + planner.request_work_s(3584, 4096) / num_splits
    request = RequestProgress("A", 4096, 3584)
    sizes = []
    while not request.is_fully_planned:
        chunks = planner.plan_microbatch(
            [request], num_stages=8, num_inflight=len(sizes), target_cost_s=target_s
        )
        sizes.append(sum(chunk.num_tokens for chunk in chunks))
    assert len(sizes) == num_splits, sizes
    assert all(size % 64 == 0 for size in sizes), sizes
    # One block over the target at most: the re-paid context and the rounding up, never more.
    block_s = planner.request_work_s(4096 - 64, 4096)
    offset = 3584
    for size in sizes:
        assert (
            planner.microbatch_cost_s([Chunk("A", 0, offset, size, False)]) <= target_s + block_s
        ), sizes
        offset += size


def test_wave_is_not_below_sync_for_a_lone_high_reuse_request_on_eight_stages() -> None:
    """C = 1, MiniMax-M2.7, high reuse, S = 8 (H200 time, the grid's default host time): a
    lone request split for a 2-way target becomes 2 micro-batches, not 3, so wave is not behind
    sync. 8 requests keep it short; the simulator is deterministic."""
    results = {}
    for mode in ("wave", "sync"):
        config, planner_cost = runtime_config(
            GridSpec(time_scale=1.0, num_stages=8), Setting("minimax-m2.7", 1, "high", mode)
        )
        workload = preset_workload("high", 8, vocab_size=config.model.vocab_size)
        report = simulate(
            config,
            planner_cost,
            workload,
            concurrency=1,
            latencies=SimLatencies(schedule_s=1.65e-3),
        )
        results[mode] = report.summary()
    assert results["wave"]["microbatches"] == 2 * 8, results["wave"]["microbatches"]
    assert (
        results["wave"]["throughput_tokens_per_s"] >= results["sync"]["throughput_tokens_per_s"]
    ), (results["wave"]["throughput_tokens_per_s"], results["sync"]["throughput_tokens_per_s"])


def test_a_burst_is_planned_in_full_microbatches_not_cut_to_fill_idle_stages() -> None:
    """32 high-reuse requests (512 new tokens each) arrive at once on an idle 4-stage GLM-5.2
    pipeline (H200 time). The under-full micro-batch waits for the agreements under way and is
    not cut while work is queued: the first admitted requests are not cut into small
    micro-batches to fill the idle stages (each would pay the fixed cost c, and in the closed
    loop the cut would persist)."""
    spec = GridSpec(time_scale=1.0)
    config, planner_cost = runtime_config(spec, Setting("glm-5.2", 32, "high", "wave"))
    config = config.model_copy(update={"closed_loop_fill": False})  # chunk_tokens target
    workload = preset_workload("high", 32, vocab_size=config.model.vocab_size)
    report = simulate(config, planner_cost, workload, concurrency=32)
    tokens = report.stats.microbatch_tokens
    assert sum(tokens) == 32 * 512
    # The first micro-batch is a full cost budget (8128 of GLM's 8192-token target at this
    # context); only the tail, when nothing is queued any more, is cut over the idle stages.
    assert tokens[0] >= 7680, tokens
    assert len(tokens) <= 4, tokens


def test_a_burst_is_split_into_s_equal_microbatches_by_the_closed_loop_target() -> None:
    """The same burst with the closed-loop target (the wave default): the work of all 32
    requests in the system, split S ways, so every stage gets an equal micro-batch at once (not
    two 8k micro-batches of the chunk_tokens target, leaving two stages idle)."""
    spec = GridSpec(time_scale=1.0)
    config, planner_cost = runtime_config(spec, Setting("glm-5.2", 32, "high", "wave"))
    assert config.resolved_closed_loop_fill
    workload = preset_workload("high", 32, vocab_size=config.model.vocab_size)
    report = simulate(config, planner_cost, workload, concurrency=32)
    assert list(report.stats.microbatch_tokens) == [4096] * 4


def test_a_way_back_of_one_microbatch_splits_a_round_into_s_plus_one() -> None:
    """The same burst with the way back of a round counted as one micro-batch time
    (``return_microbatches`` 1, what a served replica plans with): S + 1 micro-batches hold the
    round (whole requests of 512 tokens: 7, 7, 7, 7 and the 4 left), so stage 0 has the last
    one to run while the first one's requests come back; S + 1 are in flight at most."""
    spec = GridSpec(time_scale=1.0)
    config, planner_cost = runtime_config(spec, Setting("glm-5.2", 32, "high", "wave"))
    config = config.model_copy(update={"return_microbatches": 1})
    assert config.resolved_max_inflight == config.num_stages + 1 == 5
    workload = preset_workload("high", 32, vocab_size=config.model.vocab_size)
    report = simulate(config, planner_cost, workload, concurrency=32)
    tokens = list(report.stats.microbatch_tokens)
    assert tokens == [7 * 512] * 4 + [4 * 512], tokens
    # without the closed-loop target the way back counts for nothing: S in flight, as before
    sync = config.model_copy(update={"closed_loop_fill": False})
    assert sync.resolved_return_microbatches == 0 and sync.resolved_max_inflight == 4


def test_wavepp_sim_runs_32_x_c_requests_per_setting_by_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Few rounds let ramp-up and drain decide a wave/sync comparison (2 x C requests put
    wave below sync where 32 x C puts it above): the default is 32 x C, as the sweep's."""
    import json

    from wavepp.cli import main as cli_main

    argv = ["sim", "--model", "minimax-m2.7", "--stages", "2", "--concurrency", "1,2", "--json"]
    assert cli_main(argv) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs = [(r["concurrency"], r[mode]["requests"]) for r in results for mode in ("wave", "sync")]
    assert sorted(runs) == [(1, 32), (1, 32), (2, 64), (2, 64)]
    assert {r[mode]["model"] for r in results for mode in ("wave", "sync")} == {"minimax-m2.7"}
