"""The simulator imports no NATS module (the import-linter contract says the same)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_simulator_loads_no_nats_module() -> None:
    code = (
        "import wavepp.sim.run, sys; "
        "assert not any(m.split('.')[0] == 'nats' for m in sys.modules), "
        "sorted(m for m in sys.modules if m.split('.')[0] == 'nats')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
