"""Looking at the processes a test started (Linux ``/proc``)."""

from __future__ import annotations

from pathlib import Path


def children_running(pid: int, module: str) -> list[int]:
    """Child processes of ``pid`` whose command line names ``module`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and module in args:
            found.append(int(entry.name))
    return found
