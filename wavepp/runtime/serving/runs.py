"""The admission service's runs: one run of an intake key on the scheduler at a time.

A run is the scheduler's work for one key: its task, its scheduler id
(``{key}@{instance}.{n}``, n counting this instance's runs, so a rerun never shares an id with
a withdrawn run that may still hold its pins), the arrivals of the intake messages waiting on
it, and whether it was withdrawn (it then answers nobody). No I/O.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from wavepp.api.prefill import PrefillResult


@dataclass(eq=False)
class Run:
    """One run of an intake key on the scheduler: its task, its scheduler id, the arrivals
    (``IntakeRequest.arrival_s``) of the messages waiting on it, and whether it was withdrawn
    (it then answers nobody)."""

    task: asyncio.Task[PrefillResult]
    scheduler_id: str
    arrivals: set[float] = field(default_factory=set)
    withdrawn: bool = False


class Runs:
    """The current run of each key (a run leaves when its task ends)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self._by_key: dict[str, Run] = {}
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: str) -> Run | None:
        """``key``'s current run (withdrawn or not), or None."""
        return self._by_key.get(key)

    def is_running(self, key: str) -> bool:
        """``key`` has a run that a message may join (not withdrawn)."""
        run = self._by_key.get(key)
        return run is not None and not run.withdrawn

    def of_scheduler_id(self, scheduler_id: str) -> Run | None:
        """The current, not withdrawn run with this scheduler id, or None."""
        run = self._by_key.get(scheduler_id.rpartition("@")[0])
        if run is None or run.withdrawn or run.scheduler_id != scheduler_id:
            return None
        return run

    def start(self, key: str, execute: Callable[[str], asyncio.Task[PrefillResult]]) -> Run:
        """A new run of ``key`` under a scheduler id no earlier run of this instance used;
        ``execute(scheduler_id)`` gives its task. It replaces ``key``'s current run, if any."""
        scheduler_id = f"{key}@{self.instance}.{next(self._numbers)}"
        run = Run(execute(scheduler_id), scheduler_id)
        self._by_key[key] = run
        run.task.add_done_callback(lambda _t: self._end(key, run))
        return run

    def _end(self, key: str, run: Run) -> None:
        if self._by_key.get(key) is run:
            del self._by_key[key]
