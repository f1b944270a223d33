"""The simulator's message bus and latencies: an in-process stand-in for NATS on a virtual clock.

``SimBus`` delivers each subject's messages in order after ``latency_s``; ``SimLatencies`` holds every
simulated latency (bus, KV round trip, activation hop, preparation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimLatencies:
    """Simulated costs outside the stages' compute, seconds (virtual, not scaled).

    Defaults: the order of a NATS request-reply (~1 ms) and a publish (~0.5 ms) between
    processes on one host, as ``wavepp bench agreement`` and the emulated runs measure them;
    change them to model a network.

    ``schedule_s``: the scheduler's own host time per micro-batch on the critical path (done
    handling, planning, plan serialisation), which the virtual clock otherwise gets for free;
    both modes pay it (sync mode at least ``BaselineConfig.iteration_overhead_s``).
    Default 0 here so that unit tests isolate what they test; ``wavepp sim`` charges 1.65 ms,
    the scheduler's mean host time per micro-batch as a replay reports it (replay JSON
    ``scheduler_host_ms_mean``; docs/bench/simulator.md).
    """

    kv_rtt_s: float = 1e-3
    bus_latency_s: float = 5e-4
    hop_s: float = 2e-4
    prepare_s: float = 2e-4
    schedule_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("kv_rtt_s", "bus_latency_s", "hop_s", "prepare_s", "schedule_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"SimLatencies.{name}={value}: must be >= 0 seconds")


@dataclass
class _SimMsg:
    subject: str
    data: bytes


class _SimSubscription:
    def __init__(self, bus: SimBus, subject: str, cb: Callable[[Any], Awaitable[None]]) -> None:
        self.bus = bus
        self.subject = subject
        self.cb = cb
        self.queue: asyncio.Queue[tuple[float, _SimMsg]] = asyncio.Queue()
        self.task = asyncio.create_task(self._deliver())

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            deliver_at, msg = await self.queue.get()
            if deliver_at > loop.time():
                await asyncio.sleep(deliver_at - loop.time())
            try:
                await self.cb(msg)
            except Exception:  # as nats.py: a failing callback is logged, delivery goes on
                log.exception("sim bus: callback for %s failed", self.subject)

    async def unsubscribe(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        with contextlib.suppress(ValueError):
            self.bus.subscriptions.remove(self)


class SimBus:
    """The part of a NATS client the scheduler uses: subscribe(cb), publish, flush.

    A message reaches every subscriber of its exact subject ``latency_s`` after publish, in
    publish order per subscriber, one callback at a time (as nats.py runs a subscription).
    """

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.subscriptions: list[_SimSubscription] = []

    async def subscribe(
        self, subject: str, queue: str = "", cb: Callable[[Any], Awaitable[None]] | None = None
    ) -> _SimSubscription:
        if cb is None:
            raise ValueError(f"subscribe({subject!r}): the simulated bus needs a callback (cb=)")
        sub = _SimSubscription(self, subject, cb)
        self.subscriptions.append(sub)
        return sub

    async def publish(
        self, subject: str, data: bytes = b"", reply: str = "", headers: Any = None
    ) -> None:
        deliver_at = asyncio.get_running_loop().time() + self.latency_s
        for sub in self.subscriptions:
            if sub.subject == subject:
                sub.queue.put_nowait((deliver_at, _SimMsg(subject, data)))

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        for sub in list(self.subscriptions):
            await sub.unsubscribe()
