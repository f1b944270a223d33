"""KV cache bookkeeping, per stage: block hashing, the block pool, the request-level manager.

Layers, each pure (no I/O, no torch, no NATS; the clock is injected)::

    hashing   root_block_hash, hash_block_tokens, hash_prompt_blocks  (chained sha256),
              PromptHasher (the same, not hashing again what a recent prompt shared)
    pool      BlockPool: capacity, block hash -> block map, ref counts, LRU; queues KVEvents
    refs      BlockRefs: BlockPool's reference mechanics (ref counts, spans, release,
              eviction) and its invariants
    host      HostTier: the host-memory tier below the pool (spilled blocks, LRU, pins) and
              the ordered transfer log (Transfer) the engine applies
    manager   StageKVManager: probe/pin, reserve, mark computed, release, leases
    recent    RecentPrefixes: per owner and root, the latest probe-reserve entry's hashes (the
              prefixes a round names by reference)
    inflight  InflightPrefixIndex: prefixes being computed right now (admission side)

Callers import from this package; the modules are its internals.
"""

from wavepp.runtime.kv.hashing import (
    PromptHasher,
    hash_block_tokens,
    hash_prompt_blocks,
    root_block_hash,
)
from wavepp.runtime.kv.host import HostTier, Transfer
from wavepp.runtime.kv.manager import StageKVManager
from wavepp.runtime.kv.pool import BlockPool, CacheHit, KVEvent
from wavepp.runtime.kv.recent import RecentPrefixes

__all__ = [
    "BlockPool",
    "CacheHit",
    "HostTier",
    "KVEvent",
    "PromptHasher",
    "RecentPrefixes",
    "StageKVManager",
    "Transfer",
    "hash_block_tokens",
    "hash_prompt_blocks",
    "root_block_hash",
]
