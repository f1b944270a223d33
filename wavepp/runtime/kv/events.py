"""``KVEvent``: a change in the set of block hashes one tier of one stage holds. Pure data,
queued by ``BlockPool`` (device) and ``HostTier`` (host)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from wavepp.runtime.kv.hashing import BlockHash


@dataclass(frozen=True)
class KVEvent:
    """A change in the set of block hashes one stage holds; queued by the pool.

    Apply one tier's events in order as set operations ("stored": add each hash, "removed":
    discard each hash) and the result equals that tier's cached hash set on the stage. A
    "stored" event may name a hash the stage already held (a duplicate block), so do not count
    stores.

    Attributes:
        kind: "stored" (blocks got hashes) or "removed" (blocks evicted).
        block_hashes: For "stored", a chain in block order (a host "stored" event: spill
            order); for "removed", eviction order.
        parent_block_hash: For a device "stored", the hash of the block before the first one
            (None when the first one is the prompt's block 0); None otherwise.
        tier: "device" (the GPU pool) or "host" (the stage's host tier, ``HostTier``).
    """

    kind: Literal["stored", "removed"]
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None = None
    tier: Literal["device", "host"] = "device"

    def __post_init__(self) -> None:
        if self.kind not in ("stored", "removed"):
            raise ValueError(f"kind must be 'stored' or 'removed', got {self.kind!r}")
        if self.tier not in ("device", "host"):
            raise ValueError(f"tier must be 'device' or 'host', got {self.tier!r}")
