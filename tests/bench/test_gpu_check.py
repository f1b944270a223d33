"""``scripts/gpu-check.sh``: its steps (dry run) and its refusal of unknown flags. The steps
themselves run on a GPU; ``--cpu`` runs them at toy sizes (minutes, not in CI)."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


def test_dry_run_lists_the_gpu_steps_within_ten_minutes() -> None:
    out = subprocess.run([str(SCRIPT), "--dry-run"], capture_output=True, text=True, check=True)
    steps = dict(line.split(": ", 1) for line in out.stdout.strip().splitlines())
    names = [name.split(" (")[0] for name in steps]
    assert names == ["gpu-tests", "engine-vs-hf", "engine-vs-hf-compiled", "calibrate"]
    limits = [int(name.split("limit ")[1].rstrip("s)")) for name in steps]
    assert sum(limits) <= 600
    commands = list(steps.values())
    assert "-m gpu tests/runtime/stage" in commands[0]
    assert "--device cuda --dtype bfloat16" in commands[1] and "--profile" in commands[1]
    assert commands[2].endswith("--compile")
    assert "calibrate --device cuda" in commands[3]


def test_unknown_flag_is_refused() -> None:
    out = subprocess.run([str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stderr
