"""What a stage's KV manager keeps per request: its pins, block table, hashes, lease and owner.
Pure data."""

from __future__ import annotations

import math
from dataclasses import dataclass

from wavepp.runtime.kv.hashing import BlockHash


@dataclass(slots=True)
class HeldRequest:
    request_id: str
    # pinned cached prefix from probe_pin (length = local hit h_s); tuples, not lists: a tuple
    # of ints leaves the garbage collector's lists at its first pass (runtime/heap.py)
    hit_block_ids: tuple[int, ...]
    lease_expiry_s: float  # clock() time after which expire() releases the request
    seq: int  # admission order, breaks ties between equal expiries
    # NOTE: the prompt's full-block hashes from the first probe_pin; mark_computed caches the
    # computed blocks under them. Kept here so the stage has one record per request.
    block_hashes: tuple[BlockHash, ...]
    # after reserve: h_s cached ids, then fresh ids
    block_table: tuple[int, ...] | None = None
    num_agreed_blocks: int = 0  # L*: from the first chunk (start_chunk); -1 unknown
    num_hashed_blocks: int = 0  # leading table blocks already passed to cache_full_blocks
    owner: str = ""  # who probed it (an admission instance); only it may reserve or release it
    # host slots pinned by probe_pin: the host run right after the device hit (hit_block_ids),
    # released once the first chunk loaded what L* needs (start_chunk) or with the request
    host_slots: tuple[int, ...] = ()
    num_loaded_blocks: int = 0  # table blocks after the device hit loaded from the host tier


def check_lease(lease_s: float) -> None:
    if not isinstance(lease_s, int | float) or not math.isfinite(lease_s) or lease_s <= 0:
        raise ValueError(f"lease_s must be a finite number of seconds > 0, got {lease_s!r}")
