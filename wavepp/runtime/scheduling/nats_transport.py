"""``PlanTransport`` over one NATS connection: the bus transport plus NATS's reconnect callback.

Not imported by the scheduler or the simulator (the serving room builds it around the process's
connection).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS

from wavepp.api.subjects import ReplicaSubjects
from wavepp.runtime.scheduling.transport import BusPlanTransport
from wavepp.runtime.transport.natsio import on_reconnect


class NatsPlanTransport(BusPlanTransport):
    """Plans and done messages over ``nc`` (owned by the caller); see ``transport``."""

    def __init__(self, nc: NATS, subjects: ReplicaSubjects) -> None:
        super().__init__(nc, subjects)

    def _on_reconnect(self, cb: Callable[[], Awaitable[None]]) -> None:
        on_reconnect(self.bus, cb)
