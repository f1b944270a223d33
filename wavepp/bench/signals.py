"""SIGTERM as an orderly exit for the benchmark scripts that start servers.

Python's default SIGTERM ends the process at once: no ``finally`` block and no context manager
exit runs, so a benchmark killed that way (``kill``, a CI timeout, a batch scheduler) leaves the
vLLM and ``wavepp up`` servers it started running, each in its own session. After
:func:`exit_on_sigterm` a SIGTERM raises ``SystemExit(128 + SIGTERM)`` in the main thread
instead, so the script's clean-up runs as it does on Ctrl-C.
"""

from __future__ import annotations

import signal
from types import FrameType


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit(143)`` in the main thread (call it from there, before
    starting servers)."""
    signal.signal(signal.SIGTERM, _raise_exit)
