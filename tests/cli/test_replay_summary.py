"""The replay summary: per-stage local hits against the agreed prefix, units, the model named
once, no machine paths, and with --json nothing but the JSON on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trace_data import TRACE

from wavepp.bench.summary_text import clean_source, stage_rows, summary_rows

ROOT = Path(__file__).resolve().parents[2]


def test_stage_rows_put_local_hits_beside_the_agreed_prefix() -> None:
    summary = {
        "stages": 2,
        "stage_local_hit_blocks": [40, 25],
        "stage_host_hit_blocks": [30, 0],
        "stage_host_reused_blocks": [15, 0],
        "agreed_prefix_blocks": 25,
        "kv_blocks_per_stage": [2048, 1024],
        "layers_per_stage": [4, 4],
        "stage_busy_s": [1.0, 1.5],
    }
    rows = stage_rows(summary)
    assert rows[0] == ("0", "4", "2,048", "40", "30", "25", "15", "15", "1.00")
    assert rows[1] == ("1", "4", "1,024", "25", "0", "25", "0", "0", "1.50")


def test_summary_words_name_units_and_strip_paths() -> None:
    assert clean_source("wavepp calibrate --out /home/me/work/fit.json, cpu") == (
        "wavepp calibrate --out fit.json, cpu"
    )
    rows = summary_rows(
        {
            "engine": "emulated",
            "model": "glm-5.2",
            "stages": 4,
            "completed": 1,
            "failed": 0,
            "requests": 1,
            "prompt_tokens": 10,
            "cached_tokens": 0,
            "new_tokens": 10,
            "throughput_tokens_per_s": 1.0,
            "bound_tokens_per_s": None,
            "planner_cost_model": "from /root/x/y/model.json",
        }  # fmt: skip
    )
    labels = [r[0] for r in rows]
    assert labels.count("model") == 1 and "throughput (tokens/s)" in labels
    assert all("/root" not in " ".join(r) for r in rows)


def test_replay_json_prints_only_json_on_stdout() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "wavepp.cli", "replay", str(TRACE), "--limit", "24",
         "--stages", "2", "--engine", "emulated", "--emulate", "glm-5.2",
         "--tokens-per-block", "16", "--time-scale", "0.05", "--concurrency", "8",
         "--kv-blocks", "512,256", "--json"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env=dict(os.environ, COLUMNS="120"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[:500]
    summary = json.loads(lines[0])
    assert summary["model"] == "glm-5.2" and "emulate" not in summary
    hits, agreed = summary["stage_local_hit_blocks"], summary["agreed_prefix_blocks"]
    assert len(hits) == 2 and all(h >= agreed for h in hits)
    assert summary["cached_tokens"] == agreed * summary["block_size"]
    assert "per stage (blocks of 16 tokens" in proc.stderr
    for text in (proc.stdout, proc.stderr):
        assert str(ROOT) not in text and str(Path.home()) + "/" not in text
