"""The log of a ``wavepp gateway`` or ``wavepp admission`` process (what ``wavepp up`` and a
pod write to the component's log): every record once, in the component's format, the bus key's
start-up warning included (it is logged before the process connects anywhere, so logging must
be configured before it: a record emitted earlier reaches logging's last-resort handler and
loses its time and component). Real processes: the test's own logging is not theirs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gateway_support import tiny_gateway_config

from wavepp.runtime.config import RuntimeConfig

ROOT = Path(__file__).resolve().parents[2]
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (\S+) (INFO|WARNING|ERROR) (\S+): ")


@pytest.mark.parametrize("command", ["gateway", "admission"])
def test_a_component_logs_each_record_once_in_its_format(command: str, tmp_path: Path) -> None:
    if command == "gateway":
        path = tmp_path / "gateway.json"
        path.write_text(tiny_gateway_config().model_dump_json())
        argv = ["--gateway-config", str(path)]
        component = "gateway"
    else:
        path = tmp_path / "runtime.json"
        path.write_text(RuntimeConfig(num_stages=2, pipeline="p-r0").model_dump_json())
        argv = ["--runtime-config", str(path), "--pool", "p"]
        component = "admission[p-r0]"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAVEPP_BUS_KEY")}
    proc = subprocess.run(
        [sys.executable, "-m", "wavepp.cli", command, *argv, "--nats-url", "nats://127.0.0.1:1",
         "--nats-connect-timeout-s", "0.3"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    records = [line for line in lines if RECORD.match(line)]
    others = [line for line in lines if not RECORD.match(line)]
    # the unreachable NATS: the command's one-line error (a print, not a record)
    assert len(others) == 1 and others[0].startswith(f"wavepp {command}: --nats-url"), lines
    warnings = [r for r in records if "no bus key" in r]
    assert len(warnings) == 1, lines
    match = RECORD.match(warnings[0])
    assert match is not None
    assert match.groups() == (component, "WARNING", "wavepp.runtime.transport.buskey"), lines
    assert len({r.split(" ", 2)[2] for r in records}) == len(records), lines  # each record once
