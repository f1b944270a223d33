"""One stage's block pool (mechanism) and the KV events it queues.

This module holds the operations callers use (cache-hit walks, pin, allocate, cache, free, host
loads, events); the reference mechanics they rest on (ref counts, spans, the free queue's
release and eviction, the invariants) are ``BlockRefs`` in ``wavepp.runtime.kv.refs``.

``BlockPool`` owns one stage's KV memory: capacity in blocks, the block hash -> block map, ref
counts and the LRU free queue. It queues ``KVEvent``s; its owner drains them. Pure: no I/O, no
torch, no clock reads. Ideas follow vLLM (vllm/v1/core/block_pool.py) and SGLang
(python/sglang/srt/mem_cache/radix_cache.py); no code is copied.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from wavepp.runtime.kv.events import KVEvent
from wavepp.runtime.kv.hashing import BlockHash, check_block_hash
from wavepp.runtime.kv.host import HostTier, Transfer
from wavepp.runtime.kv.refs import BlockRefs


class CacheHit(NamedTuple):
    """The result of one ``BlockPool.pin_cache_hit`` walk: the leading blocks found (and pinned),
    and the pool's ``num_evictions`` and ``num_stores`` then. While no hash has left the pool
    since, the blocks found still hold their hashes; while none has entered either, the walk
    also still stops where it stopped. (A named tuple: one per probe per stage, cheap to make.)"""

    block_ids: tuple[int, ...]
    evictions: int
    stores: int


class BlockPool(BlockRefs):
    """One stage's KV memory: capacity in blocks, hash -> block map, ref counts, LRU free queue.

    Stored state (plain lists indexed by block id, no object per block):

    - ``num_blocks`` blocks with ids ``0 .. num_blocks - 1``; each has a ref count and at most
      one block hash.
    - the hash -> block map: every hash held by exactly one block (a later block with the same
      content stays unhashed: a duplicate, never matched, reused first).
    - the free queue: exactly the blocks with ref count 0. Order invariant: LRU first; equal
      age: chain tail first (``free`` releases a request's blocks reversed); uncached blocks
      are put at the front (reused before any cached block is evicted). So the queue is the
      uncached free blocks (a stack: the last one freed is reused first) followed by the
      cached ones (an ``OrderedDict``: the least recently freed is evicted first).
    - shared-prefix pins ("spans"): a prefix that several holders pin from the same earlier
      walk (``pin_cache_hit`` with ``prior``) is pinned once, as one reference on each of its
      blocks, and counts its holders; a holder's ``free`` of ids that start with it drops one
      holder, and the last one releases the blocks. So pinning and releasing a shared prefix of
      n blocks costs O(1), not n ref count updates. Spans do not overlap; ``ref_cnt`` counts
      each holder, as if each had pinned every block. A ``free`` that cuts into a span turns
      it into plain per-block references first.
    - pending ``KVEvent``s, drained by ``take_events``.

    - the host tier below it (``host``, optional): every cached block this pool evicts is
      spilled there with its hash, and a hash this pool caches leaves it (``HostTier``: the
      tiers are exclusive). The host tier queues its own events (tier "host") and the ordered
      transfer log; ``take_events`` and ``take_transfers`` drain both.

    Args:
        num_blocks: Capacity in blocks, > 0.
        block_size: Tokens per block, > 0 (metadata here: the pool never sees tokens).
        host: The stage's host tier, or None (no host tier).

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` is not an int > 0.
    """

    span_min_blocks = 8
    """Shortest shared prefix pinned as a span (a shorter one costs little per block)."""

    def __init__(self, num_blocks: int, block_size: int, host: HostTier | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be an int > 0, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.host = host
        # NOTE: the one pinning mechanism. _ref[b] == 0: in the free queue (evictable if
        # hashed); > 0: pinned, never evicted. It counts the block's own references plus one
        # for the span holding it, if any (whose holders are counted in _holders).
        self._ref = [0] * num_blocks
        # NOTE: set once when the block is full and computed; cleared only on eviction.
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_id: dict[BlockHash, int] = {}
        self._uncached = list(range(num_blocks - 1, -1, -1))  # free, no hash; last = front
        self._lru: OrderedDict[int, None] = OrderedDict()  # free, hashed; first = evicted first
        self._spans: set[tuple[int, ...]] = set()  # the spans (shared prefixes) held
        self._span_of: list[tuple[int, ...] | None] = [None] * num_blocks
        # NOTE: by the span's first block id (no tuple hashed per pin or release): >= 1 for a
        # span's first block, else 0
        self._holders = [0] * num_blocks
        self._events: list[KVEvent] = []
        # NOTE: hashes that left / entered the map so far (when a CacheHit is still exact).
        self._evictions = 0
        self._stores = 0

    # ---- counters ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0: uncached free plus cached evictable."""
        return len(self._uncached) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash, pinned or not."""
        return len(self._hash_to_id)

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return self.num_blocks - len(self._uncached) - len(self._lru)

    @property
    def num_evictions(self) -> int:
        """Hashes that have left the pool so far (evicted blocks)."""
        return self._evictions

    @property
    def num_stores(self) -> int:
        """Hashes that have entered the pool so far (``cache_full_blocks``)."""
        return self._stores

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks with ref count 0 (reusable by a hit, or evicted by ``allocate``)."""
        return len(self._lru)

    # ---- read-only inspection (tests, telemetry) -----------------------------------------

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash block ``block_id`` holds, or None (partial, uncomputed or duplicate)."""
        return self._hash[self._check_id(block_id, "block_id")]

    def ref_cnt(self, block_id: int) -> int:
        """Ref count of block ``block_id`` (0: free; > 0: pinned by that many holders)."""
        self._check_id(block_id, "block_id")
        span = self._span_of[block_id]
        return self._ref[block_id] + (self._holders[span[0]] - 1 if span is not None else 0)

    def free_block_ids(self) -> list[int]:
        """Free queue in order: the front is reused (or evicted) first."""
        return self._uncached[::-1] + list(self._lru)

    def cached_block_hashes(self) -> frozenset[BlockHash]:
        """All hashes this pool holds (what a shadow index rebuilt from events should hold)."""
        return frozenset(self._hash_to_id)

    # ---- operations ----------------------------------------------------------------------

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest leading run of ``block_hashes`` held here; no side effects.

        Args:
            block_hashes: A prompt's full-block hashes, block order.

        Returns:
            ``[id of block_hashes[0], ..., id of block_hashes[k - 1]]`` for the largest k such
            that all k are held (pinned or evictable). Pin them before anything else runs.
        """
        block_ids: list[int] = []
        get = self._hash_to_id.get
        for block_hash in block_hashes:
            block_id = get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def pin_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        prior: CacheHit | None = None,
        num_shared: int = 0,
    ) -> CacheHit:
        """Pin the longest leading run of ``block_hashes`` held here, reusing an earlier walk.

        With ``prior`` (this pool's answer for another sequence) and ``num_shared`` (how many
        leading hashes the two sequences have in common), the shared part is not looked up
        again: while no hash has left the pool since the prior walk, the hit on it is
        ``prior.block_ids[:num_shared]``; the walk stops there if the prior's did and no hash
        has entered since, and goes on from there otherwise. A prior from before an eviction,
        or whose last shared block does not hold ``block_hashes[num_shared - 1]``, is ignored (a
        full walk). The part taken from the prior, when at least ``span_min_blocks`` long, is
        pinned as a span (one holder more, O(1)); the rest one ref count per block.
        Requests sharing a long prefix pay one dict lookup per new block.

        Args:
            block_hashes: A prompt's full-block hashes, block order.
            prior: An earlier ``pin_cache_hit`` result of this pool, or None.
            num_shared: ``block_hashes[:num_shared]`` equal the prior sequence's first
                ``num_shared`` hashes (the caller's claim; checked at its last shared block).

        Returns:
            The pinned blocks (``find_longest_cache_hit``'s ids) and the pool's counters.
        """
        start = 0
        known: tuple[int, ...] = ()
        num_hashes = len(block_hashes)
        if prior is not None and num_shared > 0 and prior.evictions == self._evictions:
            shared = prior.block_ids[:num_shared]
            last = len(shared) - 1
            # the prior's walk stopped inside the shared part: so does this one, unless a hash
            # entered since (then it goes on from there)
            stopped = len(shared) < num_shared and prior.stores == self._stores
            if (
                last >= 0
                and num_hashes >= len(shared)
                and self._hash[shared[last]] == block_hashes[last]
            ):
                known = shared
                start = num_hashes if stopped else len(shared)
            elif last < 0 and stopped:
                start = num_hashes  # the prior found nothing: neither do we
        found: list[int] = []
        if start < num_hashes:
            get = self._hash_to_id.get
            for index in range(start, num_hashes):
                block_id = get(block_hashes[index])
                if block_id is None:
                    break
                found.append(block_id)
        if known:
            if len(known) < self.span_min_blocks or not self._pin_span(known):
                self._incr_refs(known)
        if found:
            self._incr_refs(found)
            known += tuple(found)
        return CacheHit(known, self._evictions, self._stores)

    def pin(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block; a block at ref count 0 leaves the free queue.

        Args:
            block_ids: Cached blocks (from ``find_longest_cache_hit``) or blocks already
                pinned. An id may repeat (one reference per occurrence).

        Raises:
            ValueError: if an id is out of range, or names a free uncached block (its content
                is garbage: get fresh blocks from ``allocate``). Nothing changes then.
        """
        self._check_ids(block_ids)
        for block_id in block_ids:
            if self._ref[block_id] == 0 and self._hash[block_id] is None:
                raise ValueError(
                    f"block_ids: block {block_id} is free and uncached, so its content "
                    "is not reusable; pin only blocks from find_longest_cache_hit or blocks "
                    "already pinned, and use allocate for fresh blocks"
                )
        self._incr_refs(block_ids)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks from the front of the free queue, each with ref count 1.

        A taken block that held a hash is evicted (hash dropped from the map) and reported in
        one "removed" event. Uncached free blocks sit at the front, so they go first.

        Args:
            num_blocks: Blocks wanted, >= 0.

        Returns:
            Block ids in allocation order, or None when fewer than ``num_blocks`` are free
            (then nothing changes: no eviction, no event).

        Raises:
            ValueError: if ``num_blocks`` is negative.
        """
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        uncached = self._uncached
        num_uncached = len(uncached)
        if num_blocks > num_uncached + len(self._lru):
            return None
        if num_blocks <= num_uncached:
            cut = num_uncached - num_blocks
            taken = uncached[: cut - 1 if cut else None : -1]
            del uncached[cut:]
        else:
            taken = uncached[::-1]
            uncached.clear()
            evicted_hashes = self._evict(num_blocks - num_uncached, taken)
            self._events.append(KVEvent("removed", tuple(evicted_hashes), None))
        ref = self._ref
        for block_id in taken:
            ref[block_id] = 1
        return taken

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
    ) -> None:
        """Give each full, computed block its hash, and queue one "stored" event.

        A block that already holds the same hash is left alone (idempotent). When another
        block already holds the hash, this block stays unhashed: a duplicate, never matched,
        reused first when freed (block ids in block tables never change).

        Args:
            block_ids: Pinned blocks, chain order; ids must be distinct.
            block_hashes: Their hashes, same length.
            parent_block_hash: Hash of the block before ``block_ids[0]`` (None for block 0).

        Raises:
            ValueError: on a length mismatch, an id out of range or repeated, a block not
                pinned, a malformed hash, or a block already holding a different hash.
                Nothing changes then.
        """
        if len(block_ids) != len(block_hashes):
            raise ValueError(
                f"block_ids has {len(block_ids)} ids but block_hashes has {len(block_hashes)} "
                "hashes; pass one hash per block"
            )
        if parent_block_hash is not None:
            check_block_hash(parent_block_hash, "parent_block_hash")
        self._check_ids(block_ids)
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block_ids must be distinct, got {list(block_ids)}")
        hashes, ref = self._hash, self._ref
        for position, (block_id, block_hash) in enumerate(
            zip(block_ids, block_hashes, strict=True)
        ):
            check_block_hash(block_hash, f"block_hashes[{position}]")
            if ref[block_id] == 0:
                raise ValueError(
                    f"block_ids: block {block_id} is not pinned (ref count 0); cache "
                    "only blocks the caller holds"
                )
            held = hashes[block_id]
            if held is not None and held != block_hash:
                raise ValueError(
                    f"block_ids: block {block_id} already holds hash "
                    f"{held.hex()[:16]}..., not block_hashes[{position}] = "
                    f"{block_hash.hex()[:16]}...; a block gets its hash once"
                )
        if not block_ids:
            return
        hash_to_id = self._hash_to_id
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            if hashes[block_id] is not None or block_hash in hash_to_id:
                continue  # already this hash, or a duplicate of another block
            hashes[block_id] = block_hash
            hash_to_id[block_hash] = block_id
            self._stores += 1
            if self.host is not None:
                self.host.discard(block_hash)  # exclusive tiers
        self._events.append(KVEvent("stored", tuple(block_hashes), parent_block_hash))

    def free(self, block_ids: Sequence[int], *, validate: bool = True) -> None:
        """Drop one reference from each block, tail first.

        Pass a request's blocks in block order; they are released reversed, so a chain's tail
        is evicted before its prefix. At ref count 0 a cached block goes to the back of the
        free queue (evicted last: LRU) and an uncached block to the front (reused first).
        When the ids start with a span (a shared prefix pinned by ``pin_cache_hit``) and
        the rest lies outside it, that part drops one holder of the span.

        Args:
            block_ids: Blocks to release, block order; an id may repeat.
            validate: False for ids this pool handed out (a ``StageKVManager``'s own record of
                what a request holds): the range and type check of each id is skipped; the
                ref-count checks are not.

        Raises:
            ValueError: if an id is out of range or released more often than it is pinned.
                Nothing changes then.
        """
        if not block_ids:
            return
        if validate:
            self._check_ids(block_ids)
        span = self._span_of[block_ids[0]]
        if span is not None:
            num_span = len(span)
            rest = block_ids[num_span:]
            span_of = self._span_of
            if (
                span[0] == block_ids[0]
                and len(block_ids) >= num_span
                and tuple(block_ids[:num_span]) == span
                and not any([span_of[block_id] is span for block_id in rest])
            ):
                self._release(rest)
                holders = self._holders[span[0]] - 1
                if holders:
                    self._holders[span[0]] = holders
                else:
                    self._unspan(span)
                    self._release(span)
                return
        self._release(block_ids)

    def load_blocks(
        self,
        block_ids: Sequence[int],
        slots: Sequence[int],
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
    ) -> None:
        """Load pinned host slots into pinned device blocks, in chain order: each load is
        logged (``take_transfers``) and the blocks take the hashes (``cache_full_blocks``:
        one device "stored" event; a hash the device holds already leaves the copy a
        duplicate). The slots' hashes leave the host index; the caller still holds its pins.

        Raises:
            ValueError: no host tier, mismatched lengths, a slot not pinned or not holding its
                hash, or what ``cache_full_blocks`` refuses (nothing loaded then).
        """
        host = self.host
        if host is None:
            raise ValueError("slots: this pool has no host tier to load from")
        if not len(block_ids) == len(slots) == len(block_hashes):
            raise ValueError(
                f"block_ids, slots and block_hashes have {len(block_ids)}, {len(slots)} and "
                f"{len(block_hashes)} entries; pass one slot and one hash per block"
            )
        for slot, block_hash in zip(slots, block_hashes, strict=True):
            if host.ref_cnt(slot) == 0 or host.slot_hash(slot) != block_hash:
                raise ValueError(
                    f"slots: slot {slot} is not pinned or does not hold hash "
                    f"{block_hash.hex()[:16]}...; load only the slots a probe pinned"
                )
        for block_id in block_ids:
            if self._ref[self._check_id(block_id, "block_ids")] == 0:
                raise ValueError(f"block_ids: block {block_id} is not pinned (ref count 0)")
        for slot, block_id in zip(slots, block_ids, strict=True):
            host.load(slot, block_id)
        self.cache_full_blocks(block_ids, block_hashes, parent_block_hash)

    def discard_transfers(self, transfers: Sequence[Transfer]) -> None:
        """Forget what a transfer log whose copies failed (all or some of them: the engine
        raised while applying it) claims is in place, so that no later hit reads those bytes.

        Every host slot a spill of the log wrote loses its hash (``HostTier.invalidate``: a
        pinned one can no longer be loaded), and every device block a load of the log filled
        loses the hash it took (one device "removed" event; counted as an eviction, so a
        ``CacheHit`` taken before is stale). The blocks and slots keep their pins; what the
        log's copies would have brought is computed again by whoever needs it.

        Args:
            transfers: the failed log, as ``take_transfers`` returned it (its order is kept:
                nothing of this pool's bookkeeping has moved since).
        """
        if not transfers or self.host is None:
            return
        self.host.invalidate([t.slot for t in transfers if t.kind == "spill"])
        hashes, hash_to_id, lru = self._hash, self._hash_to_id, self._lru
        dropped: list[BlockHash] = []
        for transfer in transfers:
            block_id = transfer.block_id
            block_hash = hashes[block_id]
            if transfer.kind != "load" or block_hash is None:
                continue
            del hash_to_id[block_hash]
            hashes[block_id] = None
            dropped.append(block_hash)
            if block_id in lru:  # unpinned since: uncached now, reused first
                del lru[block_id]
                self._uncached.append(block_id)
        if dropped:
            self._evictions += len(dropped)
            self._events.append(KVEvent("removed", tuple(dropped), None))

    def take_events(self) -> list[KVEvent]:
        """Drain the pending events (oldest first; the host tier's after this pool's); the
        queues are empty afterwards."""
        events, self._events = self._events, []
        if self.host is not None:
            events += self.host.take_events()
        return events

    def take_transfers(self) -> list[Transfer]:
        """Drain the host tier's transfer log (``HostTier.take_transfers``); [] without one."""
        return self.host.take_transfers() if self.host is not None else []
