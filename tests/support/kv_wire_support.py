"""Helpers shared by the agreement wire tests: chained block hashes, a probe-reserve batch, a
stage with a prefix already cached, and an in-process stage that records each probe-reserve
payload it gets."""

from __future__ import annotations

import hashlib

from wavepp.api.kv_batch import REFERENCED, BatchOp, KVBatch, ReserveEntry, decode_batch
from wavepp.runtime.agreement import LocalStageClient
from wavepp.runtime.kv import StageKVManager


def chain(n: int, root: int = 1) -> tuple[bytes, ...]:
    """``n`` chained 32-byte hashes under root ``root`` (a prompt's block hashes)."""
    out, parent = [], bytes([root]) * 32
    for i in range(n):
        parent = hashlib.sha256(parent + bytes([i])).digest()
        out.append(parent)
    return tuple(out)


def reserve_batch(
    *entries: ReserveEntry, owner: str = "adm", seq: int = 1, releases: tuple[str, ...] = ()
) -> KVBatch:
    """A probe-reserve batch of ``entries`` (lease 5 s) from ``owner``, op number ``seq``."""
    return KVBatch(BatchOp.PROBE_RESERVE, entries, 5.0, owner=owner, seq=seq, releases=releases)


def warm(
    manager: StageKVManager, hashes: tuple[bytes, ...] | list[bytes], rid: str = "warm"
) -> None:
    """Cache ``hashes``' blocks on a stage: request ``rid`` pins, reserves, computes them (the
    pool's block size) and is released, so they stay cached and unpinned."""
    hashes = tuple(hashes)
    manager.probe_pin(rid, hashes, 5.0)
    assert manager.reserve(rid, len(hashes), 5.0) is not None
    manager.mark_computed(rid, len(hashes) * manager.pool.block_size, hashes)
    manager.release(rid)


class CountingClient(LocalStageClient):
    """An in-process stage that records each probe-reserve payload it got: (bytes, whether an
    entry named its prefix by reference)."""

    def __init__(self, manager: StageKVManager, rank: int) -> None:
        super().__init__(manager, rank)
        self.payloads: list[tuple[int, bool]] = []

    async def call_batch(self, payload: bytes) -> bytes:
        if payload[4] == BatchOp.PROBE_RESERVE:
            shares = decode_batch(payload).shares
            referenced = any(share[0] == REFERENCED for share in shares)
            self.payloads.append((len(payload), referenced))
        return await super().call_batch(payload)
