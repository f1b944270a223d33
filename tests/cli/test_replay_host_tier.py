"""``wavepp replay --host-memory-gib`` with a device pool of 8 blocks a stage: a three-line
trace whose middle request (8 blocks) empties every device pool, so the last request's 4-block
prefix can only come back through the stages' host tiers. On the emulated engine it does with
the tier and not without; on the torch engine (the README's replay, real bytes copied through
each stage's host buffers) every stage loads the prefix from its host tier and nothing fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16
# A: 4 shared trace blocks + 1 own; F: 8 blocks, the whole device pool; B: the 4 shared + 1
TRACE = [
    {"timestamp": 0, "input_length": 5 * 512, "output_length": 1, "hash_ids": [0, 1, 2, 3, 10]},
    {"timestamp": 1, "input_length": 8 * 512, "output_length": 1, "hash_ids": list(range(100, 108))},
    {"timestamp": 2, "input_length": 5 * 512, "output_length": 1, "hash_ids": [0, 1, 2, 3, 20]},
]  # fmt: skip
# 0.001 GiB: 2^30 / 1000 / (512 B x 4 layers x 16 tokens) = 32 host blocks per stage
HOST_GIB = "0.001"
EMULATED = ("--engine", "emulated", "--emulate", "tiny-llama")


def _replay(trace: Path, *extra: str, engine: tuple[str, ...] = EMULATED) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "wavepp.cli", "replay", str(trace), *engine,
         "--stages", "2", "--tokens-per-block", str(BLOCK),
         "--block-size", str(BLOCK), "--kv-blocks", "8", "--concurrency", "1",
         "--time-scale", "0.01", "--json", *extra],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_replay_reuses_through_the_host_tier_what_the_device_evicted(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(record) + "\n" for record in TRACE))
    without = _replay(trace)
    with_tier = _replay(trace, "--host-memory-gib", HOST_GIB)
    for summary in (without, with_tier):
        assert summary["completed"] == 3 and summary["failed"] == 0, summary["errors"]
    assert without["cached_tokens"] == 0
    assert with_tier["cached_tokens"] == 4 * BLOCK
    assert with_tier["host_kv_blocks"] == [32, 32] and without["host_kv_blocks"] == [0]
    # per tier and stage: the 4 prefix blocks came from each stage's host tier
    assert with_tier["stage_host_reused_blocks"] == [4, 4]
    assert with_tier["stage_host_hit_blocks"] == [4, 4]
    assert without["stage_host_reused_blocks"] == without["stage_host_hit_blocks"] == [0, 0]


def test_torch_replay_loads_the_prefix_from_every_stage_host_tier(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(record) + "\n" for record in TRACE))
    summary = _replay(trace, "--host-memory-gib", HOST_GIB, engine=("--engine", "torch"))
    assert summary["completed"] == 3 and summary["failed"] == 0, summary["errors"]
    # tiny-llama's 4 layers a stage: 2^30 / 1000 / (32 KiB a block) = 32 host blocks
    assert summary["host_kv_blocks"] == [32, 32]
    assert summary["stage_host_reused_blocks"] == [4, 4]  # host hits on every stage
    assert summary["cached_tokens"] == 4 * BLOCK
