"""``scripts/gpu-check.sh``: its steps (dry run), its refusal of unknown flags and of a host
without CUDA, and its pipeline step run on the CPU at toy sizes (``--cpu --only``). The steps
themselves run on a GPU; the whole ``--cpu`` run takes minutes (not in CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


def test_dry_run_lists_the_gpu_steps_within_ten_minutes() -> None:
    out = subprocess.run([str(SCRIPT), "--dry-run"], capture_output=True, text=True, check=True)
    steps = dict(line.split(": ", 1) for line in out.stdout.strip().splitlines())
    names = [name.split(" (")[0] for name in steps]
    assert names == [
        "gpu-tests",
        "engine-vs-hf",
        "engine-vs-hf-compiled",
        "pipeline-vs-hf",
        "calibrate",
    ]
    limits = [int(name.split("limit ")[1].rstrip("s)")) for name in steps]
    assert sum(limits) <= 600
    commands = list(steps.values())
    assert "-m gpu tests/runtime/stage" in commands[0]
    assert "! grep -q '^SKIPPED'" in commands[0]  # on a GPU a skipped GPU test fails the step
    assert "--device cuda --dtype bfloat16" in commands[1] and "--profile" in commands[1]
    assert commands[2].endswith("--compile")
    assert "--device cuda --dtype bfloat16 --stages 2" in commands[3] and "--profile" in commands[3]
    assert "calibrate --device cuda" in commands[4]
    only = subprocess.run(
        [str(SCRIPT), "--dry-run", "--only", "pipeline-vs-hf"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert only.stdout.strip() == f"pipeline-vs-hf (limit 90s): {commands[3]}"


@pytest.mark.parametrize(
    "argv", [["--bogus"], ["--only"], ["--dry-run", "--only", "engine"]], ids=str
)
def test_unknown_flag_or_step_is_refused(argv: list[str]) -> None:
    out = subprocess.run([str(SCRIPT), *argv], capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stderr and not out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without a CUDA device")
@pytest.mark.parametrize("argv", [[], ["--only", "pipeline-vs-hf"]], ids=str)
def test_without_a_cuda_device_it_stops_before_any_step(tmp_path: Path, argv: list[str]) -> None:
    out = subprocess.run(
        [str(SCRIPT), *argv],
        capture_output=True,
        text=True,
        env=os.environ | {"OUT": str(tmp_path)},
        timeout=120,
    )
    assert out.returncode == 1 and "no CUDA device" in out.stderr
    assert "==" not in out.stdout and not list(tmp_path.glob("*.log"))


@pytest.mark.slow
def test_pipeline_step_runs_on_the_cpu_and_prints_each_stage_loop_profile(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(SCRIPT), "--cpu", "--only", "pipeline-vs-hf"],
        capture_output=True,
        text=True,
        env=os.environ | {"OUT": str(tmp_path), "PYTHON": sys.executable},
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:]
    assert "== 0 step(s) failed" in out.stdout
    log = (tmp_path / "pipeline-vs-hf.log").read_text()
    result = json.loads(log.strip().splitlines()[-1])
    assert set(result["tokens_per_s"]) == {"hf", "pipeline-2"}
    assert result["device"] == "cpu" and result["engine"] == "torch"
    first, last = result["loop_profiles"]["pipeline-2"]
    assert first["parts_s"]["send"] > 0 and last["parts_s"]["recv"] > 0
    for rank in (0, 1):
        assert f"pipeline-2 stage {rank} loop profile" in log
