"""Whether the NATS server answers this gateway: the bus's own liveness, told apart from a
replica's.

A paused or restarting server holds the replicas' heartbeats too, so while it is silent a
replica unheard has not left the pool, and a request waiting for its answer does not fail for it
(``Gateway._route``). The watch asks the server for its JetStream account info every
``BUS_CHECK_S`` seconds; with no answer for ``BUS_SILENT_S`` the bus is silent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.js.errors import APIError

from wavepp.gateway.metrics import JetStreamStore

BUS_CHECK_S = 0.5
BUS_SILENT_S = 2.0


class BusWatch:
    """One round trip to the server per ``BUS_CHECK_S`` while started.

    ``answered_s``: when the server last answered (``clock`` seconds); None until started.
    ``store``: the account's JetStream store as the last account info said (None: none yet).
    """

    def __init__(self, nc: NATS, clock: Callable[[], float]) -> None:
        self.nc = nc
        self.clock = clock
        self.answered_s: float | None = None
        self.store: JetStreamStore | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.answered_s = self.clock()
        self._task = asyncio.create_task(self._run(), name="bus-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        """Keep ``answered_s``: any answer counts, a refusal too (JetStream disabled); none
        within ``BUS_SILENT_S`` does not. An answer also updates ``store``. (Not ``nc.flush``: a
        flush that times out leaves its PONG's future cancelled in nats-py 2.16, and the late
        PONG then ends the connection's read loop.)"""
        js = self.nc.jetstream(timeout=BUS_SILENT_S)
        while True:
            try:
                info = await js.account_info()
                self.answered_s = self.clock()
                self.store = JetStreamStore.from_account_info(info.storage, info.limits.max_storage)
            except (APIError, NoRespondersError):
                self.answered_s = self.clock()
            except Exception:  # noqa: BLE001, S110 - no answer (paused, reconnecting): silent
                pass
            await asyncio.sleep(BUS_CHECK_S)

    def is_silent(self, now: float) -> bool:
        """The server has not answered for ``BUS_SILENT_S`` (never, before ``start``)."""
        return self.answered_s is not None and now - self.answered_s > BUS_SILENT_S
