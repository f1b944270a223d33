"""Children started with WAVEPP_PARENT_PID leave when their parent dies without stopping them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CHILD = (
    "from wavepp.runtime.serving.lifecycle import exit_with_parent; import time; "
    "assert exit_with_parent(0.05); time.sleep(60)"
)
PARENT = (
    "import subprocess, sys, time; from wavepp.runtime.serving.lifecycle import child_env; "
    f"c = subprocess.Popen([sys.executable, '-c', {CHILD!r}], env=child_env(), "
    "start_new_session=True); print(c.pid, flush=True); time.sleep(60)"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_child_exits_after_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    try:
        time.sleep(0.3)
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child_pid), "child outlived its parent"
    finally:
        if _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_without_the_variable_nothing_watches(monkeypatch) -> None:  # noqa: ANN001
    from wavepp.runtime.serving.lifecycle import PARENT_PID_ENV, exit_with_parent

    monkeypatch.delenv(PARENT_PID_ENV, raising=False)
    assert exit_with_parent() is False
