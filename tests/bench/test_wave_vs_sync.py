"""benchmarks/wave_vs_sync.py: both modes side by side, each metric with its unit and what it
means (the replay summary's own words), and a short run of the README's command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench_support import load_benchmark

REPO = Path(__file__).resolve().parents[2]
bench = load_benchmark("wave_vs_sync")


def _summary(mode: str, tokens_per_s: float, errors: list[str]) -> dict:
    return {
        "mode": mode,
        "engine": "emulated",
        "model": "tiny-llama",
        "stages": 4,
        "requests": 10,
        "completed": 10 - len(errors),
        "failed": len(errors),
        "invalid_lines": 0,
        "prompt_tokens": 1000,
        "cached_tokens": 100,
        "new_tokens": 900,
        "cache_hit_ratio": 0.1,
        "throughput_tokens_per_s": tokens_per_s,
        "bound_tokens_per_s": 2000.0,
        "efficiency": tokens_per_s / 2000.0,
        "wave_fill": 0.5,
        "ttft_p50_s": 1.0,
        "ttft_p99_s": 2.0,
        "agreement_p50_s": 0.01,
        "agreement_p99_s": 0.02,
        "reservation_refusals": 0,
        "microbatches": 7,
        "wall_s": 3.0,
        "errors": errors,
    }


def test_each_metric_has_both_values_and_its_meaning() -> None:
    rows = bench.comparison_rows(_summary("wave", 1500.0, []), _summary("sync", 900.0, ["boom"]))
    by_label = {label: (wave, sync, meaning) for label, wave, sync, meaning in rows}
    assert by_label["throughput (tokens/s)"][:2] == ("1,500.0", "900.0")
    assert "per second of wall time" in by_label["throughput (tokens/s)"][2]
    assert by_label["wave fill"][2].startswith("time the 4 stages were busy")
    assert "mode" not in by_label  # the columns are the modes
    assert by_label["error (sync)"] == ("-", "boom", "first distinct errors")
    assert "error (wave)" not in by_label
    assert all(meaning for *_, meaning in rows)


def test_a_short_run_prints_the_table_and_the_ratio(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            *(sys.executable, str(REPO / "benchmarks" / "wave_vs_sync.py")),
            str(REPO / "data" / "traces" / "conversation_trace.jsonl"),
            *("--limit", "6", "--concurrency", "4", "--time-scale", "0.02", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200"},  # one line per row: no cell wraps
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "what it is" in out.stdout and "first arrival to last answer" in out.stdout
    assert "glm-5.2's cost model at H200 speed" in out.stdout  # what the stages sleep
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["wave"]["completed"] == result["sync"]["completed"] == 6
    ratio = result["wave"]["throughput_tokens_per_s"] / result["sync"]["throughput_tokens_per_s"]
    assert abs(result["ratio"] - ratio) < 1e-3
