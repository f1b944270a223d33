"""An asyncio event loop on a virtual clock, for discrete-event simulation.

``loop.time()`` is a number the loop advances itself: whenever no callback is ready, the loop
would block in ``select(timeout)`` until its next timer; here ``select`` instead moves the clock
forward by ``timeout`` and returns at once. So ``asyncio.sleep(t)`` takes no wall time, timers
fire in order, and code written for asyncio (the real scheduler, agreement controller, leases)
runs unchanged. CPU time spent in callbacks costs zero virtual time.

The loop has no real I/O: registering a file descriptor is accepted (the loop's own self-pipe)
but never reports readiness. A loop with no ready callback and no timer is deadlocked:
``select(None)`` raises ``SimDeadlockError`` instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Mapping
from typing import Any


class SimDeadlockError(RuntimeError):
    """Nothing is ready and no timer is pending: the simulated system waits forever."""


def _fileno(fileobj: Any) -> int:
    return fileobj if isinstance(fileobj, int) else int(fileobj.fileno())


class _VirtualSelector(selectors.BaseSelector):
    """A selector whose select() advances the virtual clock instead of waiting."""

    def __init__(self, start_s: float) -> None:
        self.now_s = start_s
        self._keys: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, _fileno(fileobj), events, data)
        self._keys[key.fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(_fileno(fileobj))

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys[_fileno(fileobj)]

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise SimDeadlockError(
                f"virtual clock {self.now_s:.6f}s: no callback ready and no timer pending"
            )
        if timeout > 0:
            self.now_s += timeout
        return []

    def close(self) -> None:
        self._keys.clear()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual (module docstring).

    Args:
        start_s: the clock's value at creation, seconds.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._virtual = _VirtualSelector(start_s)
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now_s
