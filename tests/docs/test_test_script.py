"""scripts/test.sh (the README's second command, and CI) checks WAVEPP_TEST_WORKERS before it
installs anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", ["x", "-1", "2.5", "17", " 2"])
def test_a_bad_worker_count_fails_at_once_naming_the_variable_and_the_limit(value: str) -> None:
    env = {**os.environ, "WAVEPP_TEST_WORKERS": value}
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "test.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"WAVEPP_TEST_WORKERS={value}: " in result.stderr
    assert "0 to 16" in result.stderr
    assert result.stdout == ""  # nothing installed, nothing run
