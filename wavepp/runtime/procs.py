"""Stopping child processes: SIGTERM, a grace period, then SIGKILL.

One rule for every process this package (or its tests) starts and stops: the local supervisor
(``serving.processes.Supervisor``), the embedded nats-server (``transport.natsio``), a stage's
tensor-parallel followers (``stage.tp_launch``).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["stop_processes"]


def stop_processes(procs: Iterable[subprocess.Popen[Any]], grace_s: float = 10.0) -> None:
    """SIGTERM every process of ``procs`` still running (in the order given), wait up to
    ``grace_s`` seconds for all of them together, then SIGKILL each one still running and reap
    it (up to 10 s). A process that already exited is only reaped."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
