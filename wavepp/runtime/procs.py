"""Stopping child processes: SIGTERM, a grace period, then SIGKILL.

One rule for every process this package (or its tests) starts and stops: the local supervisor
(``serving.processes.Supervisor``), the embedded nats-server (``transport.natsio``), a stage's
tensor-parallel followers (``stage.tp_launch``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from typing import Any


def _signal(proc: subprocess.Popen[Any], sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        elif proc.poll() is None:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_processes(
    procs: Iterable[subprocess.Popen[Any]], grace_s: float = 10.0, *, group: bool = False
) -> None:
    """SIGTERM every process of ``procs`` still running (in the order given), wait up to
    ``grace_s`` seconds for all of them together, then SIGKILL each one still running and reap
    it (up to 10 s). A process that already exited is only reaped.

    ``group``: each process leads its own process group (started with ``start_new_session``);
    the signals go to the whole group (the processes it started too), and what is left of a
    group once its leader exited is SIGKILLed.
    """
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM, group)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL, group)
            proc.wait(10)
        if group:
            _signal(proc, signal.SIGKILL, group)
