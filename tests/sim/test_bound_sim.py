"""The simulator against the physical bound (docs/bench/bound.md).

With every control latency zero, no schedule may beat the bound: a run that did would mean the
bound (or the simulator) is wrong. And the wave scheduler must come close to it in the closed
loop once C >= S, leaving no stage idle (no closed-loop sliver; micro-batches sized by the work
in the system, not by chunk_tokens).
"""

from __future__ import annotations

import pytest

from wavepp.bench.grid import GridSpec, Setting
from wavepp.bench.workloads import ideal_cached_tokens, preset_workload
from wavepp.launch.grid import runtime_config
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.bound import RequestWork, pipeline_bound
from wavepp.sim.bus import SimLatencies
from wavepp.sim.run import simulate

ZERO = SimLatencies(kv_rtt_s=0.0, bus_latency_s=0.0, hop_s=0.0, prepare_s=0.0)


def _efficiency(
    config: RuntimeConfig,
    planner_cost: CostModel,
    reuse: str,
    concurrency: int,
    num: int,
    latencies: SimLatencies | None = None,
) -> float:
    workload = preset_workload(reuse, num, vocab_size=config.model.vocab_size)
    cached = ideal_cached_tokens(workload.prompts, config.block_size, workload.warmup)
    bound = pipeline_bound(
        [CostModel.from_dict(config.cost_model)] * config.num_stages,
        [RequestWork(len(p), c) for p, c in zip(workload.prompts, cached, strict=True)],
        concurrency=concurrency,
        max_microbatch_tokens=config.max_microbatch_tokens,
    )
    summary = simulate(
        config, planner_cost, workload, concurrency=concurrency, latencies=latencies
    ).summary()
    assert summary["failed"] == 0
    return summary["throughput_tokens_per_s"] / bound.tokens_per_s


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("reuse", ["low", "high"])
@pytest.mark.parametrize("mode", ["wave", "sync"])
def test_no_zero_latency_run_exceeds_the_bound(num_stages: int, reuse: str, mode: str) -> None:
    spec = GridSpec(time_scale=1.0, num_stages=num_stages, num_kv_blocks=65536)
    for concurrency in (1, 3, 8, 32):
        config, planner_cost = runtime_config(spec, Setting("glm-5.2", concurrency, reuse, mode))
        efficiency = _efficiency(config, planner_cost, reuse, concurrency, 4 * concurrency, ZERO)
        assert efficiency <= 1.0, (concurrency, efficiency)


@pytest.mark.parametrize(("reuse", "concurrency"), [("high", 8), ("high", 32), ("low", 16)])
def test_the_closed_loop_fills_the_pipeline(reuse: str, concurrency: int) -> None:
    """GLM-5.2 PP4 at H200 time, 32 x C requests: at least 0.95 of the bound (the closed-loop
    target gives each of the four stages a micro-batch, and a lone request is not planned as a
    sliver just before its group returns)."""
    spec = GridSpec(time_scale=1.0, num_stages=4, num_kv_blocks=65536)
    config, planner_cost = runtime_config(spec, Setting("glm-5.2", concurrency, reuse, "wave"))
    efficiency = _efficiency(config, planner_cost, reuse, concurrency, 32 * concurrency)
    assert efficiency >= 0.95, efficiency


def test_returning_requests_are_planned_together() -> None:
    """In the closed loop at C = 32 on 4 stages every micro-batch after the ramp-up holds the 8
    requests that returned together: none travels alone (the sliver) and none is cut."""
    spec = GridSpec(time_scale=1.0, num_stages=4, num_kv_blocks=65536)
    config, planner_cost = runtime_config(spec, Setting("glm-5.2", 32, "high", "wave"))
    workload = preset_workload("high", 256, vocab_size=config.model.vocab_size)
    report = simulate(config, planner_cost, workload, concurrency=32)
    tokens = list(report.stats.microbatch_tokens)
    assert set(tokens[4:-4]) == {8 * 512}, tokens
