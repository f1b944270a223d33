"""`wavepp replay` as a user runs it: real processes, the --json contract, bad trace lines."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from trace_data import TRACE

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning.memory import default_kv_blocks

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONTRACT_KEYS = {
    "requests",
    "completed",
    "failed",
    "prompt_tokens",
    "cached_tokens",
    "throughput_tokens_per_s",
    "wave_fill",
    "ttft_p50_s",
    "ttft_p99_s",
    "mode",
    "stages",
    "engine",
}


def run_replay(*args: str, timeout_s: float = 240) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "wavepp.cli", "replay", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last), proc.stderr


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    lines = TRACE.read_text().splitlines()[:12]
    bad = [
        '{"timestamp": 0, "input_length": 1000, "hash_ids": [0]}',  # needs 2 ids
        "{not json",
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines[:5] + bad + lines[5:]) + "\n")
    return path


def test_invalid_lines_are_reported_by_line_and_field_and_the_rest_run(small_trace: Path) -> None:
    summary, stderr = run_replay(
        str(small_trace), "--stages", "2", "--tokens-per-block", "8", "--engine", "torch"
    )
    assert CONTRACT_KEYS <= summary.keys()
    assert summary["requests"] == 14 and summary["completed"] == 12 and summary["failed"] == 2
    assert "line 6: field 'hash_ids'" in stderr and "line 7: field '<line>'" in stderr
    assert summary["mode"] == "wave" and summary["stages"] == 2 and summary["engine"] == "torch"
    assert "stage_loop_profile" not in summary and "loop profile" not in stderr


def test_profile_stages_prints_each_stage_loop_profile(small_trace: Path) -> None:
    summary, stderr = run_replay(
        str(small_trace),
        "--stages",
        "2",
        "--tokens-per-block",
        "8",
        "--engine",
        "torch",
        "--profile-stages",
    )
    profiles = summary["stage_loop_profile"]
    assert [p["rank"] for p in profiles] == [0, 1]
    assert profiles[0]["parts_s"]["send"] > 0 and profiles[1]["parts_s"]["recv"] > 0
    for p in profiles:
        assert p["microbatches"] >= 1 and p["parts_s"]["plan_decode"] > 0
        assert f"stage {p['rank']} loop profile ({p['microbatches']} micro-batches" in stderr
        wall_ms = p["wall_s"] * 1e3 / p["microbatches"]
        assert re.search(rf"^wall +{wall_ms:.3f} +100.0%$", stderr, re.MULTILINE), stderr[-2000:]


def test_sync_mode_on_the_emulated_engine(small_trace: Path) -> None:
    summary, _ = run_replay(
        str(small_trace),
        "--stages",
        "3",
        "--mode",
        "sync",
        "--engine",
        "emulated",
        "--emulate",
        "tiny-llama",
        "--tokens-per-block",
        "32",
        "--concurrency",
        "4",
    )
    assert summary["completed"] == 12 and summary["mode"] == "sync"
    assert 0.0 < summary["wave_fill"] <= 1.0
    # tiny-llama's roofline has no memory figure: it keeps the fixed default.
    assert summary["kv_blocks_per_stage"] == [4096] * 3
    assert summary["kv_blocks_source"].startswith("fixed default 4096")
    # The emulated stages' cost is known, so the replay reports the physical bound (a run can
    # only come under it); the torch engine's is measured, not known: no bound there.
    assert summary["bound_tokens_per_s"] > 0
    assert 0.0 < summary["efficiency"] <= 1.0


def test_emulated_default_kv_capacity_replays_the_first_300_trace_requests() -> None:
    """The capacity derived from GLM-5.2 on 4 H200 stages holds the trace's longest prompts:
    all 300 complete (a fixed 4,096 blocks of 16 would fail 12 of them)."""
    summary, stderr = run_replay(
        str(TRACE),
        "--limit",
        "300",
        "--engine",
        "emulated",
        "--emulate",
        "glm-5.2",
        "--stages",
        "4",
        "--time-scale",
        "0.01",
    )
    assert summary["requests"] == 300
    assert summary["completed"] == 300 and summary["failed"] == 0, summary["errors"]
    # The engine's largest micro-batch: the scheduler's cap where the config has one.
    largest = max(RuntimeConfig().max_microbatch_tokens, 8192)
    blocks, _ = default_kv_blocks(
        "glm-5.2", num_stages=4, block_size=16, max_microbatch_tokens=largest
    )
    assert summary["kv_blocks_per_stage"] == blocks
    assert summary["kv_blocks_source"].startswith("derived: glm-5.2, 4 stages of 2 x H200")
    assert "KV capacity [" in stderr and "(derived: glm-5.2" in stderr


def test_explicit_kv_blocks_win_over_the_derived_default(small_trace: Path) -> None:
    summary, _ = run_replay(
        str(small_trace),
        "--engine",
        "emulated",
        "--emulate",
        "glm-5.2",
        "--stages",
        "2",
        "--kv-blocks",
        "700,600",
        "--tokens-per-block",
        "16",
        "--time-scale",
        "0.01",
    )
    assert summary["kv_blocks_per_stage"] == [700, 600]
    assert summary["kv_blocks_source"] == "--kv-blocks"
    assert summary["completed"] == 12


def test_replay_help_says_where_the_kv_default_comes_from() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "wavepp.cli", "replay", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    )
    text = " ".join(proc.stdout.split())
    assert "Default: torch engine 4096; emulated engine derived per stage" in text
    assert "H200 memory (141 GB x 0.9" in text


def test_readme_first_command_replays_200_requests() -> None:
    """The README's first command (minus the install step), exactly as written."""
    readme = (ROOT / "README.md").read_text()
    first = next(line for line in readme.splitlines() if "wavepp replay" in line)
    replay = re.search(r"\.venv/bin/wavepp (replay .*)$", first)
    assert replay, first
    args = shlex.split(replay.group(1))[1:]
    summary, _ = run_replay(*args, timeout_s=280)
    assert summary["requests"] == 200
    assert summary["completed"] == 200 and summary["failed"] == 0
    assert summary["cached_tokens"] > 0
    assert summary["stages"] == 4 and summary["engine"] == "torch"


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--engine", "emulated", "--stages", "0"], "--stages"),
        (["--engine", "emulated", "--stages", "100"], "--stages"),
        (["--stages", "9"], "stages=9 exceeds the model's 8 layers"),
        (["--kv-blocks", "10,20"], "--kv-blocks: 10,20: 2 entries; give one (every stage) or one"),
        (["--concurrency", "0"], "--concurrency"),
    ],
)
def test_bad_flags_exit_2_with_the_flag_named_and_no_traceback(args: list[str], flag: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "wavepp.cli", "replay", str(TRACE), "--limit", "5", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "errors.pydantic.dev" not in proc.stderr
