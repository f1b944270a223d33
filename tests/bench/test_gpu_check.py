"""``scripts/gpu-check.sh``: its steps (dry run) and its refusal of unknown flags. The steps
themselves run on a GPU; ``--cpu`` runs them at toy sizes (minutes, not in CI)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

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
    assert "! grep -q '^SKIPPED'" in commands[0]  # on a GPU a skipped GPU test fails the step
    assert "--device cuda --dtype bfloat16" in commands[1] and "--profile" in commands[1]
    assert commands[2].endswith("--compile")
    assert "calibrate --device cuda" in commands[3]


def test_unknown_flag_is_refused() -> None:
    out = subprocess.run([str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without a CUDA device")
def test_without_a_cuda_device_it_stops_before_any_step(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(SCRIPT)],
        capture_output=True,
        text=True,
        env=os.environ | {"OUT": str(tmp_path)},
        timeout=120,
    )
    assert out.returncode == 1 and "no CUDA device" in out.stderr
    assert "==" not in out.stdout and not list(tmp_path.glob("*.log"))
