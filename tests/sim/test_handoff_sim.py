"""The KV handoff in the simulator (SimPipeline with a HandoffModel) and ``wavepp sim
--handoff``: compute never waits for the link, leases hold blocks until their bytes land, and
the flags are checked."""

from __future__ import annotations

import asyncio
import json

import pytest

from wavepp.bench.grid import GridSpec, Setting
from wavepp.bench.workloads import shared_prefix_workload
from wavepp.cli import main as cli_main
from wavepp.launch.grid import runtime_config
from wavepp.runtime.planning.handoff_cost import HandoffModel, LinkSpec, stage_handoff_bytes
from wavepp.runtime.request import PromptRequest
from wavepp.sim.clock import VirtualClockLoop
from wavepp.sim.pipeline import SimPipeline
from wavepp.sim.run import simulate

MODEL = "minimax-m2.7"


def _setting(concurrency: int, num_kv_blocks: int = 4096):  # noqa: ANN202
    spec = GridSpec(models=(MODEL,), num_stages=4, time_scale=1.0, num_kv_blocks=num_kv_blocks)
    return runtime_config(spec, Setting(MODEL, concurrency, "high", "wave"))


def _workload(num_requests: int, num_prefix_tokens: int = 1536):  # noqa: ANN202
    return shared_prefix_workload(
        num_requests,
        num_prefix_tokens=num_prefix_tokens,
        num_suffix_tokens=2048 - num_prefix_tokens,
        num_prefixes=2,
        vocab_size=1024,
    )


def _handoff(gbps: float, num_stages: int = 4) -> HandoffModel:
    return HandoffModel(
        LinkSpec(f"{gbps} Gb/s", gbps_per_gpu=gbps),
        tuple(stage_handoff_bytes(MODEL, num_stages=num_stages)),
    )


def test_with_ample_bandwidth_the_handoff_changes_no_stage_timing() -> None:
    config, planner_cost = _setting(4)
    workload = _workload(24)
    without = simulate(config, planner_cost, workload, concurrency=4)
    with_ = simulate(config, planner_cost, workload, concurrency=4, handoff=_handoff(400.0))
    # the same micro-batches at the same virtual times: every first token, and every stage's
    # busy time, is where it was without the handoff
    assert [o.finished_s - o.arrival_s for o in with_.outcomes] == [
        o.finished_s - o.arrival_s for o in without.outcomes
    ]
    off, on = without.summary(), with_.summary()
    assert on["wall_s"] == off["wall_s"] and on["stage_busy_s"] == off["stage_busy_s"]
    assert "handoff" not in off
    figures = on["handoff"]
    assert figures["handoff_requests"] == 24
    # every stage sends the whole prompt's KV: 2048 tokens x its layers' bytes per token
    per_token = sum(s.kv_bytes_per_token for s in _handoff(400.0).stages)
    assert figures["kv_bytes_transferred"] == round(24 * 2048 * per_token)
    assert 0 < figures["overlapped_fraction"] < 1  # earlier chunks and stages land first
    assert 0 < figures["handoff_s_p50"] <= figures["handoff_s_p99"] < 0.1
    assert max(figures["link_load"]) < 1
    assert figures["handoff_window_s"] == pytest.approx(
        on["wall_s"] + figures["handoff_s_max"], abs=0.05
    )


def test_a_slow_link_holds_blocks_and_slows_admission_not_compute() -> None:
    # 1 Gb/s: each request's ~130 MB per stage takes about a second on the link while a
    # micro-batch takes milliseconds; a pool of 160 blocks (5 prompts of 32 blocks, sharing
    # one) fills with leased blocks, so admission waits: lower throughput, every request still
    # served, and no pin left once the last byte landed.
    config, planner_cost = _setting(4, num_kv_blocks=160)
    workload = _workload(12, num_prefix_tokens=64)
    handoff = _handoff(1.0)

    async def main(loop: VirtualClockLoop) -> tuple[list, list[int], float]:
        async with SimPipeline(config, planner_cost, handoff=handoff) as pipeline:
            scheduler = pipeline.scheduler
            assert scheduler is not None
            limiter = asyncio.Semaphore(4)

            async def one(index: int, prompt: list[int]) -> object:
                async with limiter:
                    return await scheduler.submit(
                        PromptRequest(f"r{index}", prompt, arrival_s=loop.time())
                    )

            start = loop.time()
            outcomes = await asyncio.gather(*(one(i, p) for i, p in enumerate(workload.prompts)))
            elapsed = loop.time() - start
            leased_peak = [s.handoff.peak_leased_blocks for s in pipeline.stages if s.handoff]
            last_landed_s = max(
                record.landed_s
                for stage in pipeline.stages
                if stage.handoff
                for record in stage.handoff.records.values()
            )
            assert any(s.handoff and s.handoff.num_leased for s in pipeline.stages)
            await asyncio.sleep(last_landed_s - loop.time() + 1e-3)
            for stage in pipeline.stages:
                assert stage.handoff is not None and stage.handoff.num_leased == 0
                assert stage.manager.pool.num_pinned_blocks == 0
                stage.manager.pool.check_invariants()
            return outcomes, leased_peak, elapsed

    loop = VirtualClockLoop(start_s=100.0)
    try:
        outcomes, leased_peak, elapsed = loop.run_until_complete(main(loop))
    finally:
        loop.close()
    assert all(o.ok for o in outcomes)
    assert max(leased_peak) >= 96  # at least 3 requests' blocks held at once by leases
    without = simulate(config, planner_cost, workload, concurrency=4)
    assert elapsed > 2 * without.wall_s  # admission waited for the link


def test_wavepp_sim_handoff_prints_with_and_without(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--handoff", "--model", MODEL, "--stages", "2", "--concurrency", "2"]
    assert cli_main([*argv, "--requests", "8", "--json"]) == 0
    captured = capsys.readouterr()
    (result,) = json.loads(captured.out.strip().splitlines()[-1])
    assert result["without"]["requests"] == result["with"]["requests"] == 8
    assert "handoff" not in result["without"] and result["with"]["handoff"]["handoff_requests"] == 8
    assert result["handoff_link"] == {
        "gbps_per_gpu": 400.0,
        "efficiency": 0.9,
        "latency_s": 1e-05,
        "gpus_per_stage": 1,
    }
    assert result["throughput_ratio"] == pytest.approx(
        result["with"]["throughput_tokens_per_s"] / result["without"]["throughput_tokens_per_s"],
        abs=1e-4,
    )
    assert "| tok/s without | tok/s with | ratio |" in captured.err


@pytest.mark.parametrize(
    ("flags", "named", "why"),
    [
        (["--handoff-gbps", "100"], "--handoff-gbps", "needs --handoff"),
        (["--handoff-latency-s", "0.001"], "--handoff-latency-s", "needs --handoff"),
        (["--handoff", "--handoff-gbps", "0"], "--handoff-gbps", "must be a number > 0"),
        (["--handoff", "--handoff-efficiency", "1.5"], "--handoff-efficiency", "(0, 1]"),
        (["--handoff", "--handoff-latency-s", "-1"], "--handoff-latency-s", "[0, 1]"),
    ],
)
def test_bad_handoff_flags_are_refused_naming_the_flag(
    flags: list[str], named: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--model", MODEL, "--stages", "2", "--concurrency", "1", "--requests", "1"]
    assert cli_main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert f"wavepp sim: {named}: " in err and why in err
