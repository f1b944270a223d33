"""benchmarks/vs_vllm.py and its pure vs_vllm_stats.py: prompts from the trace, the KV capacity, the stats and the JSON shape
(no vLLM needed); and, where the vLLM environment exists, one small end-to-end run (slow)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_support import load_benchmark

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
SCRIPT = BENCHMARKS / "vs_vllm.py"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


vs = load_benchmark("vs_vllm_stats")
script = load_benchmark("vs_vllm")


def _write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


TRACE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]},
    {"timestamp": 5, "input_length": 300, "output_length": 1, "hash_ids": [7]},
]


def test_trace_prompts_keep_lengths_and_shared_blocks(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", TRACE)
    prompts = vs.trace_prompts(trace, 3, tokens_per_block=16, vocab_size=100, seed=3)
    # 16 tokens per full block; the partial last block scaled: ceil(76 * 16 / 512) = 3.
    assert [len(p) for p in prompts] == [32, 35, math.ceil(300 * 16 / 512)]
    assert prompts[1][:32] == prompts[0]  # blocks 0 and 1 shared
    assert prompts[2][:10] != prompts[0][:10]
    assert all(0 <= t < 100 for p in prompts for t in p)
    again = vs.trace_prompts(trace, 3, tokens_per_block=16, vocab_size=100, seed=3)
    other = vs.trace_prompts(trace, 3, tokens_per_block=16, vocab_size=100, seed=4)
    assert again == prompts
    assert [len(p) for p in other] == [len(p) for p in prompts] and other != prompts
    assert len(vs.trace_prompts(trace, 2, tokens_per_block=16, vocab_size=100, seed=0)) == 2


def test_trace_prompts_refuse_bad_input(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        vs.trace_prompts(tmp_path / "none.jsonl", 3, tokens_per_block=16, vocab_size=100, seed=0)
    bad = _write_trace(tmp_path / "bad.jsonl", [{"timestamp": 0}])
    with pytest.raises(ValueError, match="no valid record"):
        vs.trace_prompts(bad, 1, tokens_per_block=16, vocab_size=100, seed=0)
    good = _write_trace(tmp_path / "t.jsonl", TRACE)
    with pytest.raises(ValueError, match="tokens_per_block"):
        vs.trace_prompts(good, 1, tokens_per_block=0, vocab_size=100, seed=0)


def test_round_seeds_are_distinct_and_never_the_warmups() -> None:
    seeds = [vs.round_seed(c, r, 3) for c in range(2) for r in range(3)]
    assert len(set(seeds)) == 6 and 0 not in seeds


def test_kv_capacity_of_the_benchmark_checkpoint() -> None:
    # 1 GiB over 4 layers x (K + V) x 2 heads x 64 dims x 4 bytes = 262,144 tokens.
    tokens = vs.kv_capacity_tokens(
        2**30, layers_per_stage=4, kv_heads=2, head_dim=64, dtype_bytes=4
    )
    assert tokens == 262_144
    with pytest.raises(ValueError, match="kv_heads=0"):
        vs.kv_capacity_tokens(2**30, layers_per_stage=4, kv_heads=0, head_dim=64, dtype_bytes=4)


def test_vllm_num_blocks_reads_the_cache_config_metric() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="32",enable_prefix_caching="True",'
        'num_gpu_blocks="8192",num_cpu_blocks="None"} 1.0\n'
    )
    assert vs.vllm_num_blocks(text) == 8192
    assert vs.vllm_num_blocks("vllm:num_requests_running 0\n") is None


def _run(server: str, c: int, rep: int, wall: float, tokens: list, cached: int | None = 10):
    return vs.RunResult(
        server=server,
        concurrency=c,
        repeat=rep,
        wall_s=wall,
        prompt_tokens=100,
        cached_tokens=cached,
        ttfts_s=[0.1 * (i + 1) for i in range(len(tokens))],
        first_tokens=tokens,
    )


def test_percentile_ignores_failed_requests() -> None:
    assert vs.percentile([1.0, float("nan"), 3.0], 50) == 2.0
    assert vs.percentile([float("nan")], 50) is None
    assert vs.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)


def test_mismatches_count_prompts_whose_token_differs() -> None:
    a = _run("vllm", 8, 0, 1.0, [5, 6, 7, None])
    b = _run("wavepp", 8, 0, 1.0, [5, 9, 7, 3])
    # Prompt 1 differs; prompt 3 failed in one run: neither a mismatch nor compared.
    assert vs.first_token_mismatches([a, b]) == (1, 3)
    assert vs.first_token_mismatches([a, a]) == (0, 3)
    assert vs.first_token_mismatches([]) == (0, 0)
    with pytest.raises(ValueError, match="same prompts"):
        vs.first_token_mismatches([a, _run("wavepp", 8, 0, 1.0, [5])])


def test_summarize_medians_ratio_and_mismatches_per_round() -> None:
    runs = [
        _run("vllm", 8, 0, 0.1, [1, 2]),  # 1000 tokens/s
        _run("wavepp", 8, 0, 0.2, [1, 2]),  # 500
        _run("wavepp", 8, 1, 0.125, [3, 4]),  # 800
        _run("vllm", 8, 1, 0.05, [3, 5], cached=None),  # 2000; one mismatch
        _run("vllm", 32, 0, 0.1, [1, 1]),
        _run("wavepp", 32, 0, 0.1, [1, 1]),
    ]
    rows = vs.summarize(runs)
    assert [r["concurrency"] for r in rows] == [8, 32]
    row = rows[0]
    assert row["vllm"]["tokens_per_s"] == [1000.0, 2000.0]
    assert row["vllm"]["median_tokens_per_s"] == 1500.0
    assert row["wavepp"]["median_tokens_per_s"] == 650.0
    assert row["ratio"] == pytest.approx(650 / 1500, abs=1e-4)
    assert row["first_token_mismatches"] == 1 and row["first_tokens_compared"] == 4
    # Cached fraction over the runs that report it: 10 of 100 tokens.
    assert row["vllm"]["cached_fraction"] == 0.1
    assert row["wavepp"]["ttft_p50_s"] == pytest.approx(0.15)
    assert rows[1]["ratio"] == 1.0 and rows[1]["first_token_mismatches"] == 0
    with pytest.raises(ValueError, match="no wavepp run"):
        vs.summarize([_run("vllm", 8, 0, 1.0, [1])])


def test_report_json_shape_and_table() -> None:
    runs = [_run("vllm", 8, 0, 0.1, [1]), _run("wavepp", 8, 0, 0.2, [1])]
    rows = vs.summarize(runs)
    report = vs.report_json(rows, {"requests": 1}, runs)
    decoded = json.loads(json.dumps(report))
    assert set(decoded) == {"benchmark", "setup", "results", "runs"}
    result = decoded["results"][0]
    assert set(result) == {
        "concurrency",
        "vllm",
        "wavepp",
        "ratio",
        "first_token_mismatches",
        "first_tokens_compared",
    }
    assert set(result["wavepp"]) == {
        "tokens_per_s",
        "median_tokens_per_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "cached_fraction",
        "errors",
    }
    assert [r["server"] for r in decoded["runs"]] == ["vllm", "wavepp"]
    assert decoded["runs"][1]["tokens_per_s"] == 500.0
    lines = vs.table_lines(rows)
    assert len(lines) == 3 and lines[2].split("|")[3].strip() == "0.500"


def test_parse_concurrency_names_the_flag() -> None:
    assert vs.parse_concurrency("8,32") == [8, 32]
    for bad in ("", "0", "8,x"):
        with pytest.raises(ValueError, match="--concurrency"):
            vs.parse_concurrency(bad)


def test_missing_vllm_environment_is_a_clear_exit(tmp_path: Path) -> None:
    code = script.main(["--vllm-python", str(tmp_path / "none" / "python"), "--requests", "1"])
    assert code == 2


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM environment at {VLLM_PYTHON} (make it with scripts/vllm-venv.sh)",
)
@pytest.mark.skipif(
    os.environ.get("WAVEPP_BENCH_E2E") != "1",
    reason="a benchmark's smoke run (about 4 min: vLLM compiles at start); "
    "WAVEPP_BENCH_E2E=1 runs it",
)
def test_small_run_end_to_end(tmp_path: Path) -> None:
    trace = REPO / "data" / "traces" / "conversation_trace.jsonl"
    assert trace.exists(), f"the trace ships with the repository: {trace}"
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--requests",
            "8",
            "--concurrency",
            "4",
            "--repeats",
            "1",
            "--warmup",
            "2",
            "--json",
            "--trace",
            str(trace),
            "--work-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=2300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    row = report["results"][0]
    assert row["first_token_mismatches"] == 0 and row["first_tokens_compared"] == 8
    assert row["vllm"]["errors"] == 0 and row["wavepp"]["errors"] == 0
    assert row["vllm"]["median_tokens_per_s"] > 0 and row["wavepp"]["median_tokens_per_s"] > 0
