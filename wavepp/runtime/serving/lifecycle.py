"""Child processes that leave with their parent.

``wavepp replay`` and ``wavepp up`` start stage, admission and gateway processes in their own
sessions (so a Ctrl-C reaches only the parent, which stops them in order). If the parent itself
dies without stopping them (SIGKILL, a test runner's timeout), they would live on as orphans
holding ports and CPU. A parent that wants its children to follow it sets
``WAVEPP_PARENT_PID`` in their environment; ``exit_with_parent`` then watches for the parent to go
away and ends the process. Pods do not set it (their parent is the container runtime).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping

PARENT_PID_ENV = "WAVEPP_PARENT_PID"


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: os.environ) plus ``WAVEPP_PARENT_PID`` = this process's pid."""
    return {**(os.environ if base is None else base), PARENT_PID_ENV: str(os.getpid())}


def exit_with_parent(interval_s: float = 1.0) -> bool:
    """If ``WAVEPP_PARENT_PID`` is set, exit (status 1) once that parent is gone.

    Returns:
        True when a watcher was started.
    """
    value = os.environ.get(PARENT_PID_ENV, "")
    if not value.isdigit():
        return False
    parent = int(value)

    def _watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=_watch, name="exit-with-parent", daemon=True).start()
    return True
