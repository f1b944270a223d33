"""Coverage-guided fuzzing with atheris, each target in its own process for a bounded run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

HARNESS = Path(__file__).with_name("atheris_targets.py")


def test_atheris_finds_no_crash(tmp_path: Path) -> None:
    """KV ops (JSON and binary rounds), trace lines, specs and HTTP bodies: 4000
    coverage-guided inputs, no crash."""
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "-runs=4000", "-max_len=512", "-seed=1",
         f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Done 4000 runs" in proc.stderr, proc.stderr[-2000:]
