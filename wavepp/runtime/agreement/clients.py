"""How the coordinator reaches one stage's KV manager: the ``StageClient`` protocol, an in-process
client (tests, simulator) and the error a transport raises. The NATS client lives in
``wavepp.runtime.agreement.nats_client`` so that importing this package pulls in no NATS module.
"""

from __future__ import annotations

from typing import Protocol

from wavepp.api.messages import (
    KVReply,
    KVRequestMessage,
)
from wavepp.api.signing import BusKey
from wavepp.runtime.agreement.stage_handler import handle_kv_batch, handle_kv_request
from wavepp.runtime.kv import StageKVManager


class StageClient(Protocol):
    """How the controller reaches one stage's KV manager (NATS, or in-process for tests/sim)."""

    rank: int

    async def call(self, msg: KVRequestMessage) -> KVReply: ...

    async def call_batch(self, payload: bytes) -> bytes:
        """Send one encoded ``KVBatch``; return the stage's encoded ``KVBatchReply``."""
        ...


class LocalStageClient:
    """In-process stage client over a ``StageKVManager`` (tests, simulator); ``bus_key``: the
    stage side's key (messages are checked as on the bus)."""

    def __init__(
        self, manager: StageKVManager, rank: int, *, bus_key: BusKey | None = None
    ) -> None:
        self.manager = manager
        self.rank = rank
        self.bus_key = bus_key

    async def call(self, msg: KVRequestMessage) -> KVReply:
        return handle_kv_request(
            self.manager, self.rank, msg.model_dump_json().encode(), bus_key=self.bus_key
        )

    async def call_batch(self, payload: bytes) -> bytes:
        return handle_kv_batch(self.manager, self.rank, payload, bus_key=self.bus_key)


class StageUnavailableError(RuntimeError):
    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"stage {rank}: {detail}")
        self.rank = rank
