"""A benchmark that gets SIGTERM runs its clean-up: the servers it started do not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import subprocess, sys, time
    from wavepp.bench.signals import exit_on_sigterm
    if sys.argv[1] == "on":
        exit_on_sigterm()
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)
    try:
        print(server.pid, flush=True)
        time.sleep(60)
    finally:
        server.kill()
        server.wait()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def _run(mode: str) -> tuple[int, int]:
    """(the script's exit code after SIGTERM, the pid of the server it started)."""
    bench = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE, text=True
    )
    assert bench.stdout is not None
    server_pid = int(bench.stdout.readline())
    bench.send_signal(signal.SIGTERM)
    return bench.wait(30), server_pid


def test_sigterm_runs_the_scripts_finally_and_stops_its_server() -> None:
    code, server_pid = _run("on")
    assert code == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(server_pid)


def test_without_it_the_server_outlives_the_script() -> None:
    """The control: Python's default SIGTERM skips the finally (what the module fixes)."""
    code, server_pid = _run("off")
    try:
        assert code == -signal.SIGTERM
        assert _alive(server_pid)
    finally:
        os.kill(server_pid, signal.SIGKILL)
