"""benchmarks/engine_vs_hf.py and its pipeline sides (benchmarks/pipeline_sides.py): the
``local`` (LocalPipeline) and ``up`` (``wavepp up --config``) paths serve one spec, so the
RuntimeConfig the benchmark gives LocalPipeline is the one ``wavepp up`` plans from that spec;
the per-process CPU accounting reads this process tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_support import load_benchmark

from wavepp import cli
from wavepp.launch.up import plan_up

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


bench = load_benchmark("engine_vs_hf")
sides = load_benchmark("pipeline_sides")


def _args(*argv: str):
    args = bench.build_parser().parse_args(["--stages", "2", *argv])
    args.longest = 1000
    return args


@pytest.mark.parametrize(
    "argv", [(), ("--engine", "emulated", "--time-scale", "2"), ("--max-inflight", "8")]
)
def test_local_side_runs_the_config_wavepp_up_plans_from_the_same_spec(
    tmp_path: Path, argv: tuple[str, ...]
) -> None:
    args = _args(*argv)
    spec = sides.bench_spec(args, bench.model_config("float32"), 2)
    local = sides.runtime_config_of(spec)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    (up,) = plan_up(
        cli.build_parser(["up"]).parse_args(["up", "--config", str(path), "--port", "0"])
    ).configs
    fields = set(type(local).model_fields) - {"telemetry"}
    assert local.model_dump(include=fields) == up.model_dump(include=fields)
    assert local.num_stages == 2 and local.num_kv_blocks == [max(64, 8 * 2 * 32)]
    assert local.engine == args.engine and local.max_inflight == (args.max_inflight or None)


def test_paths_and_sources_are_checked() -> None:
    assert _args("--path", "local,up").path == ["local", "up"]
    assert _args("--source", "checkpoint").source == ["checkpoint"]
    for flag, value in (("--path", "local,cloud"), ("--source", "hub")):
        with pytest.raises(SystemExit):
            _args(flag, value)
    assert bench.main(["--no-hf"]) == 2  # only with --stages


def test_unpacked_sides_serve_a_spec_with_packing_off() -> None:
    args = _args("--pack", "on,off")
    assert args.pack == ["on", "off"]
    config = bench.model_config("float32")
    assert sides.runtime_config_of(sides.bench_spec(args, config, 2, pack=True)).pack_weights
    off = sides.runtime_config_of(sides.bench_spec(args, config, 2, pack=False))
    assert off.pack_weights is False
    for value in ("on,on", "maybe", ""):
        with pytest.raises(SystemExit):
            _args("--pack", value)


def test_interleaved_engines_each_run_every_microbatch() -> None:
    """Each engine executes every micro-batch once per pass (its cache then holds every
    prompt's keys: a later chunk's context was written by its own engine)."""
    from wavepp.runtime.stage.engine import ModelConfig
    from wavepp.runtime.stage.engine.torch_engine import TorchStageEngine

    config = ModelConfig(
        name="unit", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=8,
    )  # fmt: skip
    prompts = [[(3 * i + j) % 64 for i in range(n)] for j, n in enumerate((70, 40, 33))]
    batches = bench.microbatches(prompts, 2, 32)
    calls: dict[str, int] = {}
    engines = {}
    for name, pack in (("engine", True), ("engine-unpacked", False)):
        engine = TorchStageEngine(
            model=config, first_layer=0, last_layer=1, num_layers_total=1, pack_weights=pack
        )
        engine.allocate_kv(2 * 3, bench.BLOCK_SIZE)
        execute = engine.execute

        def counted(batch, hidden, _name=name, _execute=execute):
            calls[_name] = calls.get(_name, 0) + 1
            return _execute(batch, hidden)

        engine.execute = counted
        engines[name] = engine
    spent = bench.run_engines_interleaved(engines, batches, "cpu", rep=1)
    assert set(spent) == set(engines) and all(s > 0 for s in spent.values())
    assert calls == dict.fromkeys(engines, len(batches))


def test_process_cpu_follows_the_tree_and_leaves_out_excluded_children() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    child = subprocess.Popen(
        [sys.executable, "-c", burn + "time.sleep(30)"], stdin=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 20

        def child_share() -> float:
            # Other children of this test process (fixtures of earlier tests) count too: the
            # child's share is what excluding it takes away.
            counted = sides.process_cpu_s(os.getpid()).get("other", 0.0)
            return counted - sides.process_cpu_s(os.getpid(), exclude={child.pid}).get("other", 0.0)

        while child_share() < 0.25:
            assert time.monotonic() < deadline, "the child's CPU was never counted"
            time.sleep(0.1)
        assert sides.process_cpu_s(os.getpid())["bench"] > 0
    finally:
        child.kill()
        child.wait()


def test_concurrency_and_return_microbatches_take_lists_and_reach_the_spec() -> None:
    args = _args("--concurrency", "8,32", "--return-microbatches", "0,1")
    assert args.concurrency == [8, 32] and args.return_microbatches == [0, 1]
    spec = sides.bench_spec(args, bench.model_config("float32"), 2, return_microbatches=0)
    assert spec["engineOptions"]["returnMicrobatches"] == 0
    assert spec["engineOptions"]["kvBlocks"] == 32 * 2 * 32  # sized for the largest C
    assert sides.runtime_config_of(spec).resolved_max_inflight == 2
    for flag, value in (("--concurrency", "0"), ("--return-microbatches", "-1")):
        with pytest.raises(SystemExit):
            _args(flag, value)


def test_pass_summary_reads_the_planner_and_the_stages_from_counter_deltas() -> None:
    counters = {
        "stage-0:wavepp_stage_microbatches_run_total{stage_rank=0}": 4.0,
        "stage-0:wavepp_stage_tokens_total{kind=new,stage_rank=0}": 2000.0,
        "stage-0:wavepp_stage_tokens_total{kind=context,stage_rank=0}": 900.0,
        "stage-0:wavepp_stage_chunks_total{context=cached,stage_rank=0}": 2.0,
        "stage-0:wavepp_stage_chunks_total{context=none,stage_rank=0}": 6.0,
        "stage-0:wavepp_stage_execute_seconds_total{stage_rank=0}": 8.0,
        "stage-1:wavepp_stage_execute_seconds_total{stage_rank=1}": 5.0,
    }
    summary = sides.pass_summary(counters, {"stage-0": 3.0, "stage-1": 1.0}, 10.0, 2)
    assert summary == {
        "microbatches": 4,
        "tokens_per_microbatch": 500.0,
        "chunks_per_microbatch": 2.0,
        "cached_context_chunk_fraction": 0.25,
        "context_per_cached_chunk": 450.0,
        "busy_fraction": [0.8, 0.5],
        "cpu_s_per_1k_tokens": [1.5, 0.5],
    }


def test_timeline_summary_splits_each_stage_idle_into_gaps_and_fill_or_drain() -> None:
    from types import SimpleNamespace

    def done(rank: int, start: float, end: float, tokens: int = 100) -> SimpleNamespace:
        return SimpleNamespace(
            rank=rank, execute_start_s=start, execute_end_s=end, num_tokens=tokens
        )

    # stage 0: [0, 1] [1, 2] [3, 4] (1 s waiting inside); stage 1: [1, 2] [2, 3] [4, 5]
    dones = [done(0, 0, 1, 300), done(1, 1, 2), done(0, 1, 2, 100), done(1, 2, 3)]
    dones += [done(0, 3, 4, 200), done(1, 4, 5)]
    summary = sides.timeline_summary(dones, 10.0, 2)
    assert summary == {
        "microbatches": 3,
        "tokens_per_microbatch": 200.0,
        "tokens_min_max": [100, 300],
        "tokens_cv": 0.408,  # 300, 100, 200: standard deviation 81.6 / mean 200
        "execute_cv": 0.0,  # stage 0 ran each for 1 s
        "busy_fraction": [0.3, 0.3],
        "gap_s": [1.0, 1.0],
        "edge_s": [1.0, 1.0],  # stage 0 drains the last 1 s, stage 1 fills the first
    }
    assert sides.timeline_summary(dones[:1], 10.0, 2) == {}  # a stage with no done: nothing


def test_pin_makes_pinned_sides_whose_spec_pins_the_stages() -> None:
    args = _args("--pin", "off,on")
    assert args.pin == ["off", "on"]
    config = bench.model_config("float32")
    assert "pinCores" not in sides.bench_spec(args, config, 2)["engineOptions"]
    assert sides.bench_spec(args, config, 2, pin=True)["engineOptions"]["pinCores"] is True
    assert sides.runtime_config_of(sides.bench_spec(args, config, 2, pin=True)).pin_cores
    with pytest.raises(SystemExit):
        _args("--pin", "sometimes")


def test_compile_reaches_the_pipelines_spec() -> None:
    config = bench.model_config("float32")
    assert "torchCompile" not in sides.bench_spec(_args(), config, 2)["engineOptions"]
    spec = sides.bench_spec(_args("--compile"), config, 2)
    assert spec["engineOptions"]["torchCompile"] is True
    assert sides.runtime_config_of(spec).torch_compile


def test_the_pipeline_stages_compute_on_the_device_given() -> None:
    config = bench.model_config("bfloat16")
    on_gpu = sides.bench_spec(_args("--device", "cuda"), config, 2)
    assert on_gpu["resources"] == {"gpusPerStage": 1}
    gpu = sides.runtime_config_of(on_gpu)
    assert gpu.device == "cuda" and gpu.model.dtype == "bfloat16"
    on_cpu = sides.bench_spec(_args(), bench.model_config("float32"), 2)
    assert on_cpu["resources"] == {"gpusPerStage": 0}  # not the host's GPU, if it has one
    assert sides.runtime_config_of(on_cpu).device == "cpu"
    emulated = sides.bench_spec(_args("--engine", "emulated"), config, 2)
    assert "resources" not in emulated


def test_profile_gives_each_local_side_a_stage_profile_dir() -> None:
    spec = sides.bench_spec(_args(), bench.model_config("float32"), 2)
    assert sides.PipelineSide(spec, _args()).config.profile_dir == ""
    side = sides.PipelineSide(spec, _args("--profile"))
    assert side.config.profile_dir and Path(side.profile_dir).is_dir()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (
            ["--stages", "2", "--device", "cuda", "--engine", "emulated"],
            "--device cuda: only with --engine torch",
        ),
        (
            ["--stages", "2", "--device", "cuda", "--path", "local,up"],
            "--device cuda: only with --path local",
        ),
        (["--stages", "2", "--profile", "--path", "up"], "--profile: with --stages, only"),
        (["--stages", "2", "--engine", "emulated", "--compile"], "--compile: only with"),
        (["--stages", "2", "--batch", "8"], "--batch: only without --stages"),
        (["--stages", "1", "--chunk-tokens", "256"], "--chunk-tokens: only without --stages"),
        (["--engine", "emulated"], "--engine: only with --stages"),
        (["--pin", "on"], "--pin: only with --stages"),
        (["--concurrency", "32"], "--concurrency: only with --stages"),
        (["--return-microbatches", "1"], "--return-microbatches: only with --stages"),
    ],
)
def test_flags_the_mode_would_not_honour_are_refused(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(argv) == 2
    assert named in capsys.readouterr().err
