"""The simulator with host tiers: prefixes the device pools cannot hold come back from the host
tier (loads on every stage, charged at the link's time), so more is reused than without it;
and ``wavepp sim`` resolves and refuses ``--host-memory-gib``."""

from __future__ import annotations

import argparse
import json

import pytest

from wavepp.bench.grid import GridSpec, Setting
from wavepp.bench.workloads import shared_prefix_workload
from wavepp.cmd.sim import add_arguments
from wavepp.launch.flags import FlagError
from wavepp.launch.grid import runtime_config
from wavepp.launch.sim import plan_sim
from wavepp.runtime.config import RuntimeConfig
from wavepp.sim.bus import SimLatencies
from wavepp.sim.run import simulate

SPEC = GridSpec(time_scale=1.0, num_stages=2, num_kv_blocks=64, block_size=64)
ZERO = SimLatencies(kv_rtt_s=0.0, bus_latency_s=0.0, hop_s=0.0, prepare_s=0.0)


def _run(num_host_blocks: int, load_s: float = 2e-4) -> dict:
    config, planner_cost = runtime_config(SPEC, Setting("glm-5.2", 2, "high", "wave"))
    config = RuntimeConfig.model_validate(
        {
            **config.model_dump(),
            "num_kv_blocks": [64],
            "num_host_kv_blocks": [num_host_blocks],
            "host_load_s_per_block": [load_s],
        }
    )
    # 8 prefixes of 16 blocks, round-robin: 128 blocks of prefixes, a 64-block device pool
    workload = shared_prefix_workload(
        24, num_prefix_tokens=1024, num_suffix_tokens=64, num_prefixes=8, warm=False
    )
    report = simulate(config, planner_cost, workload, concurrency=2, latencies=ZERO)
    return report.summary()


def test_host_tier_brings_back_what_the_device_evicted() -> None:
    without, with_host = _run(0), _run(512)
    assert with_host["failed"] == without["failed"] == 0
    assert without["host_loaded_blocks_per_stage"] == [0, 0]
    assert min(with_host["host_loaded_blocks_per_stage"]) > 0  # host hits on every stage
    # the summary's per-tier split, from the agreement's replies, agrees with the stages' loads
    assert with_host["stage_host_reused_blocks"] == with_host["host_loaded_blocks_per_stage"]
    assert all(
        reused <= host <= hit
        for reused, host, hit in zip(
            with_host["stage_host_reused_blocks"],
            with_host["stage_host_hit_blocks"],
            with_host["stage_local_hit_blocks"],
            strict=True,
        )
    )
    assert without["stage_host_hit_blocks"] == without["stage_host_reused_blocks"] == [0, 0]
    assert with_host["cached_tokens"] > 2 * without["cached_tokens"]
    assert with_host["throughput_tokens_per_s"] > without["throughput_tokens_per_s"]


def test_a_link_slower_than_computing_recomputes_instead() -> None:
    slow = _run(512, load_s=10.0)
    assert slow["host_loaded_blocks_per_stage"] == [0, 0]
    assert slow["failed"] == 0


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--stages", "4", "--block-size", "512", *argv])


def test_sim_resolves_host_memory_per_gpu_into_blocks_and_load_time() -> None:
    plan = plan_sim(_args("--host-memory-gib", "64"))
    blocks = plan.capacity.num_host_kv_blocks
    load_s = plan.capacity.host_load_s_per_block
    assert len(blocks) == len(load_s) == 4 and min(blocks) > 0
    # twice the memory, twice the blocks; the load time does not depend on it
    plan2 = plan_sim(_args("--host-memory-gib", "128"))
    assert plan2.capacity.num_host_kv_blocks == [pytest.approx(2 * b, abs=1) for b in blocks]
    assert plan2.capacity.host_load_s_per_block == load_s
    config, _ = plan.config(64, "wave")
    assert config.num_host_kv_blocks == blocks
    off = plan_sim(_args())
    assert off.capacity.num_host_kv_blocks == [0]


@pytest.mark.parametrize("value", ["-1", "4096"])
def test_sim_refuses_host_memory_out_of_range(value: str) -> None:
    with pytest.raises(FlagError) as caught:
        plan_sim(_args("--host-memory-gib", value))
    assert caught.value.flag == "--host-memory-gib" and "1024" in str(caught.value)


def test_sim_replays_a_trace_slice_beside_its_infinite_cache_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pathlib import Path

    from wavepp.cmd.sim import run

    trace = Path(__file__).resolve().parents[2] / "data" / "traces" / "conversation_trace.jsonl"
    args = _args(
        "--concurrency",
        "8",
        "--trace",
        str(trace),
        "--requests",
        "40",
        "--modes",
        "wave",
        "--host-memory-gib",
        "16",
        "--json",
    )
    assert run(args) == 0
    out, err = capsys.readouterr()
    (result,) = json.loads(out)
    wave = result["wave"]
    assert wave["requests"] == 40 and wave["failed"] == 0
    assert wave["cached_tokens"] <= wave["prompt_tokens"]
    assert 0 < wave["throughput_tokens_per_s"]
    bound = wave["infinite_cache_hit_ratio"]
    assert 0 < wave["cached_tokens"] / wave["prompt_tokens"] <= bound + 1e-4
    assert "infinite-cache bound" in err


@pytest.mark.parametrize(("model", "stages", "gib"), [("glm-5.2", 4, "64"), ("tiny-llama", 2, "1")])
def test_sim_and_a_spec_derive_the_same_capacity(model: str, stages: int, gib: str) -> None:
    """``wavepp sim`` and a WavePipeline spec of the same emulated model, stages, block size,
    chunk budget and host memory run with the same device pool and host tier per stage: an
    H200 model from its catalogue figures, tiny-llama (no memory figure) from its preset's KV
    bytes per token per layer."""
    from wavepp.api.spec import WavePipelineSpec
    from wavepp.launch.runtime_config import runtime_configs_from_spec

    plan = plan_sim(_args("--model", model, "--host-memory-gib", gib, "--stages", str(stages)))
    raw = {
        "engine": "emulated",
        "model": {"name": model},
        "stages": stages,
        "cache": {"blockSize": 512, "hostMemoryGiB": float(gib)},
        "scheduler": {"chunkTokens": 8192},
    }
    (config,) = runtime_configs_from_spec(WavePipelineSpec.model_validate(raw), pool="p")
    sim_config, _ = plan.config(8, "wave")
    for name in ("num_kv_blocks", "num_host_kv_blocks", "host_load_s_per_block"):
        assert getattr(config, name) == getattr(sim_config, name), name
    assert min(config.num_host_kv_blocks) > 0
