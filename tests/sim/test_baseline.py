"""The baseline's fidelity switches (docs/bench/baseline.md): each changes the sync schedule
as its TensorRT-LLM behaviour says, and none changes wave mode."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from wavepp.bench.grid import GridSpec, Setting
from wavepp.bench.workloads import preset_workload, shared_prefix_workload
from wavepp.cmd.sim import add_arguments
from wavepp.launch.grid import runtime_config
from wavepp.launch.sim import plan_sim
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import ChunkPlanner, CostModel, RequestProgress
from wavepp.runtime.request import PromptRequest
from wavepp.sim.bus import SimLatencies
from wavepp.sim.clock import VirtualClockLoop
from wavepp.sim.pipeline import SimPipeline
from wavepp.sim.run import simulate

ZERO = SimLatencies(kv_rtt_s=0.0, bus_latency_s=0.0, hop_s=0.0, prepare_s=0.0)
SPEC = GridSpec(time_scale=1.0, num_stages=4, num_kv_blocks=65536)


def _config(mode: str, concurrency: int = 8, **fields: object) -> tuple[RuntimeConfig, CostModel]:
    config, planner_cost = runtime_config(SPEC, Setting("glm-5.2", concurrency, "high", mode))
    return RuntimeConfig.model_validate({**config.model_dump(), **fields}), planner_cost


# -- budget accounting: the planner -------------------------------------------------------------


def _first_chunks(num_credited_tokens: int | None) -> list[int]:
    """Four 4,096-token prompts with 3,584 cached (high reuse), budget 8,192, blocks of 64."""
    planner = ChunkPlanner(
        CostModel(c=0.0, g=0.0, b=1.0, a=0.0), policy="static", chunk_tokens=8192, block_size=64
    )
    requests = [
        RequestProgress(f"r{i}", 4096, 3584, num_credited_tokens=num_credited_tokens)
        for i in range(4)
    ]
    chunks = planner.plan_microbatch(requests, num_stages=4, num_inflight=0)
    return [chunk.num_tokens for chunk in chunks]


def test_budget_none_charges_the_whole_prompt() -> None:
    # 8,192 / 4,096 = 2 requests, each computing its 512 new tokens: (budget / P) x new.
    assert _first_chunks(0) == [512, 512]


def test_budget_exact_charges_new_tokens_only() -> None:
    assert _first_chunks(None) == [512] * 4
    assert _first_chunks(3584) == [512] * 4  # an estimate that found the whole prefix


def test_budget_estimated_partial_credit_shifts_the_cut_chunk() -> None:
    # 1,024 of 3,584 cached credited: each whole request is charged 512 + 2,560 = 3,072; two
    # fit (6,144); the third gets k = 2,048 charged, which after the shift past its cached
    # prefix covers all its 512 new tokens (setPrepopulatedPromptLen); the budget is spent.
    assert _first_chunks(1024) == [512, 512, 512]


def test_budget_counts_cached_tokens_only_on_the_first_chunk() -> None:
    request = RequestProgress("r", 4096, 3584, num_credited_tokens=0, num_planned_chunks=1)
    assert request.num_charged_tokens == 512


# -- the switches in the simulator ---------------------------------------------------------------


def _microbatch_tokens(config: RuntimeConfig, planner_cost: CostModel, num: int) -> list[int]:
    workload = preset_workload("high", num, vocab_size=config.model.vocab_size)
    report = simulate(config, planner_cost, workload, concurrency=8, latencies=ZERO)
    assert report.summary()["failed"] == 0
    return list(report.stats.microbatch_tokens)


@pytest.mark.parametrize(
    ("accounting", "largest"), [("none", 1024), ("estimated", 1024), ("exact", 4096)]
)
def test_sync_microbatch_size_follows_the_budget_accounting(accounting: str, largest: int) -> None:
    """C = 8, 4,096-token prompts with 3,584 cached: "none" packs 2 requests (1,024 new
    tokens) per micro-batch; "exact" all 8 returning requests (4,096); "estimated" credits only
    prefix blocks that started live requests hold, and the 8 in flight use the preset's 8
    different prefixes (round-robin), so it is "none" here."""
    config, planner_cost = _config("sync", baseline={"budget_accounting": accounting})
    tokens = _microbatch_tokens(config, planner_cost, 128)
    assert max(tokens[len(tokens) // 2 :]) == largest, tokens  # after the cold warm-up


def _spans_by_microbatch(config: RuntimeConfig, planner_cost: CostModel) -> dict:
    # One 20,000-token request: three chunks of chunk_tokens = 8,192 at most.
    workload = shared_prefix_workload(
        1, num_prefix_tokens=0, num_suffix_tokens=20_000, num_prefixes=1, vocab_size=1024
    )
    report = simulate(config, planner_cost, workload, concurrency=1, latencies=ZERO)
    spans: dict[int, dict[int, tuple[float, float]]] = {}
    for span in report.stats.spans:
        spans.setdefault(span.microbatch_id, {})[span.rank] = (
            span.execute_start_s,
            span.execute_end_s,
        )
    return spans


@pytest.mark.parametrize("one_chunk", [True, False])
def test_sync_keeps_one_chunk_of_a_request_in_flight(one_chunk: bool) -> None:
    config, planner_cost = _config("sync", 1, baseline={"one_chunk_inflight": one_chunk})
    spans = _spans_by_microbatch(config, planner_cost)
    ids = sorted(spans)[-3:]  # the request's three chunks (after the warm-up)
    overlaps = [spans[b][0][0] < spans[a][3][1] for a, b in zip(ids, ids[1:], strict=False)]
    # On: chunk k+1 starts on stage 0 only after chunk k left the last stage. Off: pipelined.
    assert overlaps == [not one_chunk] * 2, spans


async def _admission(config: RuntimeConfig, planner_cost: CostModel) -> tuple[float, list[int]]:
    """Virtual seconds one request takes, and the stages' pool capacities."""
    latencies = SimLatencies(kv_rtt_s=0.004, bus_latency_s=0.0, hop_s=0.0, prepare_s=0.0)
    async with SimPipeline(config, planner_cost, latencies=latencies) as pipeline:
        assert pipeline.scheduler is not None
        loop = asyncio.get_running_loop()
        start_s = loop.time()
        outcome = await pipeline.scheduler.submit(
            PromptRequest("r", list(range(1, 600)), arrival_s=start_s)
        )
        assert not outcome.error
        return loop.time() - start_s, [s.manager.pool.num_blocks for s in pipeline.stages]


def _run_admission(lockstep: bool) -> tuple[float, list[int]]:
    config, planner_cost = _config(
        "sync",
        1,
        num_kv_blocks=[900, 700, 800, 1000],
        baseline={"lockstep_admission": lockstep, "iteration_overhead_s": 0.0},
    )
    loop = VirtualClockLoop(start_s=10.0)
    try:
        return loop.run_until_complete(_admission(config, planner_cost))
    finally:
        loop.close()


def test_lockstep_admission_is_free_and_takes_the_smallest_capacity() -> None:
    lockstep_s, lockstep_capacities = _run_admission(True)
    messages_s, capacities = _run_admission(False)
    assert lockstep_capacities == [700] * 4 and capacities == [900, 700, 800, 1000]
    # Without lockstep: one probe-reserve, one 4 ms round trip on the critical path (the
    # two-phase agreement, probe then commit, paid two).
    assert messages_s - lockstep_s == pytest.approx(0.004)


def _one_request_wall_s(config: RuntimeConfig, planner_cost: CostModel, **latency) -> float:
    workload = shared_prefix_workload(
        1, num_prefix_tokens=0, num_suffix_tokens=2048, num_prefixes=1, vocab_size=1024
    )
    latencies = SimLatencies(kv_rtt_s=0.0, bus_latency_s=0.0, hop_s=0.0, prepare_s=0.0, **latency)
    return simulate(config, planner_cost, workload, concurrency=1, latencies=latencies).wall_s


def test_iteration_overhead_is_paid_before_each_sync_microbatch() -> None:
    base, planner_cost = _config("sync", 1, baseline={"iteration_overhead_s": 0.0})
    slow, _ = _config("sync", 1, baseline={"iteration_overhead_s": 0.015})
    delta_s = _one_request_wall_s(slow, planner_cost) - _one_request_wall_s(base, planner_cost)
    assert delta_s == pytest.approx(0.015)
    # The scheduler's own host time counts toward it (a top-up, not an addition) ...
    assert _one_request_wall_s(slow, planner_cost, schedule_s=0.004) == pytest.approx(
        _one_request_wall_s(slow, planner_cost)
    )


def test_an_idle_baseline_loop_pays_its_host_time_after_the_request_arrives() -> None:
    """At C = 1 the baseline's loop has nothing to run when a request comes back: TensorRT-LLM
    blocks in ``_fetch_new_requests``, then broadcasts, schedules and prepares the request it
    got, so every request pays the host loop after it arrives (docs/bench/baseline.md, row 4).
    Three requests pay it three times (a delta of 45 ms), not only the first (counting from the
    slot freed a whole round earlier would give 15 ms)."""

    def wall_s(config: RuntimeConfig, planner_cost: CostModel) -> float:
        workload = shared_prefix_workload(
            3, num_prefix_tokens=0, num_suffix_tokens=2048, num_prefixes=3, vocab_size=1024
        )
        return simulate(config, planner_cost, workload, concurrency=1, latencies=ZERO).wall_s

    base, planner_cost = _config("sync", 1, baseline={"iteration_overhead_s": 0.0})
    slow, _ = _config("sync", 1, baseline={"iteration_overhead_s": 0.015})
    assert wall_s(slow, planner_cost) - wall_s(base, planner_cost) == pytest.approx(3 * 0.015)


def test_wave_pays_its_own_host_time_per_microbatch() -> None:
    config, planner_cost = _config("wave", 1)
    delta_s = _one_request_wall_s(config, planner_cost, schedule_s=0.0027) - _one_request_wall_s(
        config, planner_cost
    )
    # one micro-batch per published plan; a lone 2,048-token request may be split S ways
    assert delta_s > 0 and delta_s == pytest.approx(0.0027 * round(delta_s / 0.0027))


def test_wave_mode_ignores_the_baseline_switches() -> None:
    plain, planner_cost = _config("wave")
    switched, _ = _config(
        "wave",
        baseline={
            "budget_accounting": "exact",
            "one_chunk_inflight": False,
            "lockstep_admission": False,
            "iteration_overhead_s": 0.015,
        },
    )
    assert plain.baseline.budget_accounting == "none"  # the defaults were on, then off
    workload = preset_workload("high", 48, vocab_size=plain.model.vocab_size)
    reports = [
        simulate(config, planner_cost, workload, concurrency=8) for config in (plain, switched)
    ]
    assert list(reports[0].stats.microbatch_tokens) == list(reports[1].stats.microbatch_tokens)
    assert reports[0].wall_s == reports[1].wall_s


# -- prefix reuse (TensorRT-LLM enable_block_reuse; off for DSA models, PR 8405) ---------------


def _cached_and_tokens(prefix_reuse: bool) -> tuple[int, int, int]:
    """Cached prompt tokens, prompt tokens and computed micro-batch tokens of 24 high-reuse
    requests on the sync baseline."""
    config, planner_cost = _config("sync", baseline={"prefix_reuse": prefix_reuse})
    workload = preset_workload("high", 24, vocab_size=config.model.vocab_size)
    report = simulate(config, planner_cost, workload, concurrency=8, latencies=ZERO)
    assert report.summary()["failed"] == 0
    outcomes = report.outcomes
    return (
        sum(o.num_cached_tokens for o in outcomes),
        sum(o.num_prompt_tokens for o in outcomes),
        sum(report.stats.microbatch_tokens),
    )


def test_baseline_without_prefix_reuse_computes_every_prompt_token() -> None:
    cached_on, prompt_on, computed_on = _cached_and_tokens(True)
    cached_off, prompt_off, computed_off = _cached_and_tokens(False)
    assert prompt_on == prompt_off
    assert cached_on > prompt_on // 2  # high reuse: most of each later prompt is cached
    assert computed_on == prompt_on - cached_on
    assert cached_off == 0 and computed_off == prompt_off


def test_wave_mode_reuses_prefixes_whatever_the_baseline_switch_says() -> None:
    config, _ = _config("wave", baseline={"prefix_reuse": False})
    assert config.resolved_baseline.prefix_reuse is True


def test_an_unknown_prefix_reuse_value_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="baseline.prefix_reuse"):
        _config("sync", baseline={"prefix_reuse": "sometimes"})


def test_wavepp_sim_flag_reaches_the_sync_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plan = plan_sim(parser.parse_args(["--stages", "4", "--no-baseline-prefix-reuse"]))
    config, _ = plan.config(8, "sync")
    assert config.resolved_baseline.prefix_reuse is False
    default = plan_sim(parser.parse_args(["--stages", "4"]))
    assert default.config(8, "sync")[0].resolved_baseline.prefix_reuse is True
    # The wave vs sync comparison's budget default stays the paper's baseline (the layouts'
    # is exact: tests/sim/test_layouts.py).
    assert default.config(8, "sync")[0].resolved_baseline.budget_accounting == "none"
