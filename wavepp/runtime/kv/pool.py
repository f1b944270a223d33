"""One stage's block pool (mechanism) and the KV events it queues.

``BlockPool`` owns one stage's KV memory: capacity in blocks, the block hash -> block map, ref
counts and the LRU free queue. It queues ``KVEvent``s; its owner drains them. Pure: no I/O, no
torch, no clock reads. Ideas follow vLLM (vllm/v1/core/block_pool.py) and SGLang
(python/sglang/srt/mem_cache/radix_cache.py); no code is copied.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from wavepp.runtime.kv.hashing import BlockHash, check_block_hash


@dataclass(frozen=True)
class KVEvent:
    """A change in the set of block hashes one stage holds; queued by the pool.

    Apply events in order as set operations ("stored": add each hash, "removed": discard each
    hash) and the result equals the stage's cached hash set. A "stored" event may name a hash
    the stage already held (a duplicate block), so do not count stores.

    Attributes:
        kind: "stored" (blocks got hashes) or "removed" (blocks evicted).
        block_hashes: For "stored", a chain in block order; for "removed", eviction order.
        parent_block_hash: For "stored", the hash of the block before the first one (None when
            the first one is the prompt's block 0); None for "removed".
    """

    kind: Literal["stored", "removed"]
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("stored", "removed"):
            raise ValueError(f"kind must be 'stored' or 'removed', got {self.kind!r}")


@dataclass(frozen=True)
class CacheHit:
    """The result of one ``BlockPool.pin_cache_hit`` walk: the leading blocks found (and pinned),
    and the pool's ``num_evictions`` and ``num_stores`` then. While no hash has left the pool
    since, the blocks found still hold their hashes; while none has entered either, the walk
    also still stops where it stopped."""

    block_ids: tuple[int, ...]
    evictions: int
    stores: int


class _Block:
    """One block's metadata. Only _FreeBlockQueue touches prev_free/next_free."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # NOTE: the one pinning mechanism. 0: in the free queue (evictable if hashed);
        # > 0: pinned by that many holders, never evicted.
        self.ref_cnt = 0
        # NOTE: set once when the block is full and computed; cleared only on eviction.
        self.block_hash: BlockHash | None = None
        self.prev_free: _Block | None = None
        self.next_free: _Block | None = None


class _FreeBlockQueue:
    """Doubly linked queue of the ref-count-0 blocks, front = reused/evicted first.

    O(1) popleft, append (back), appendleft (front) and remove (any position); no allocation
    per operation. Two sentinels bracket the list, so a block is queued iff its links are set.
    """

    def __init__(self, blocks: Sequence[_Block]) -> None:
        self._head = _Block(-1)
        self._tail = _Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._num_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._num_blocks

    def __iter__(self) -> Iterator[_Block]:
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None, "free queue: broken forward link"
            yield block
            block = block.next_free

    def iter_reversed(self) -> Iterator[_Block]:
        block = self._tail.prev_free
        while block is not self._head:
            assert block is not None, "free queue: broken backward link"
            yield block
            block = block.prev_free

    def is_queued(self, block: _Block) -> bool:
        return block.prev_free is not None

    def popleft(self) -> _Block:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "free queue: popleft when empty"
        self.remove(block)
        return block

    def popleft_many(self, num_blocks: int) -> list[_Block]:
        """The first ``num_blocks`` blocks, unlinked in one splice (``num_blocks`` <= len)."""
        assert 0 <= num_blocks <= self._num_blocks, "free queue: popleft_many past the end"
        taken: list[_Block] = []
        block = self._head.next_free
        for _ in range(num_blocks):
            assert block is not None
            taken.append(block)
            next_block = block.next_free
            block.prev_free = block.next_free = None
            block = next_block
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self._num_blocks -= num_blocks
        return taken

    def remove(self, block: _Block) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        assert prev_block is not None and next_block is not None, (
            f"free queue: block {block.block_id} is not queued"
        )
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self._num_blocks -= 1

    def append(self, block: _Block) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: _Block) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev_block: _Block | None, block: _Block) -> None:
        assert prev_block is not None, "free queue: broken sentinel"
        assert block.prev_free is None and block.next_free is None, (
            f"free queue: block {block.block_id} is already queued"
        )
        next_block = prev_block.next_free
        assert next_block is not None, "free queue: broken sentinel"
        block.prev_free, block.next_free = prev_block, next_block
        prev_block.next_free = block
        next_block.prev_free = block
        self._num_blocks += 1


_INT_TYPES = frozenset((int, bool))


def _invariant(condition: bool, message: str) -> None:
    # NOTE: explicit raise, not `assert`, so check_invariants still checks under `python -O`.
    if not condition:
        raise AssertionError(message)


class BlockPool:
    """One stage's KV memory: capacity in blocks, hash -> block map, ref counts, LRU free queue.

    Stored state:

    - ``num_blocks`` blocks with ids ``0 .. num_blocks - 1``; each has a ref count and at most
      one block hash.
    - the hash -> block map: every hash held by exactly one block (a later block with the same
      content stays unhashed: a duplicate, never matched, reused first).
    - the free queue: exactly the blocks with ref count 0. Order invariant: LRU first; equal
      age: chain tail first (``free`` releases a request's blocks reversed); uncached blocks
      are put at the front (reused before any cached block is evicted).
    - pending ``KVEvent``s, drained by ``take_events``.

    Args:
        num_blocks: Capacity in blocks, > 0.
        block_size: Tokens per block, > 0 (metadata here: the pool never sees tokens).

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` is not an int > 0.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be an int > 0, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block(block_id) for block_id in range(num_blocks)]
        self._free_queue = _FreeBlockQueue(self._blocks)
        self._hash_to_block: dict[BlockHash, _Block] = {}
        # NOTE: counters move only next to a ref count change (_incr_ref, allocate, free,
        # pin_cache_hit) or in _evict.
        self._num_pinned_blocks = 0
        self._num_evictable_blocks = 0
        self._events: list[KVEvent] = []
        # NOTE: hashes that left / entered the map so far (when a CacheHit is still exact).
        self._evictions = 0
        self._stores = 0

    # ---- counters ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0: uncached free plus cached evictable."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash, pinned or not."""
        return len(self._hash_to_block)

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return self._num_pinned_blocks

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
        return self._num_evictable_blocks

    # ---- read-only inspection (tests, telemetry) -----------------------------------------

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash block ``block_id`` holds, or None (partial, uncomputed or duplicate)."""
        return self._block_at(block_id, "block_id").block_hash

    def ref_cnt(self, block_id: int) -> int:
        """Ref count of block ``block_id`` (0: free; > 0: pinned by that many holders)."""
        return self._block_at(block_id, "block_id").ref_cnt

    def free_block_ids(self) -> list[int]:
        """Free queue in order: the front is reused (or evicted) first."""
        return [block.block_id for block in self._free_queue]

    def cached_block_hashes(self) -> frozenset[BlockHash]:
        """All hashes this pool holds (what a shadow index rebuilt from events should hold)."""
        return frozenset(self._hash_to_block)

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
        for block_hash in block_hashes:
            block = self._hash_to_block.get(block_hash)
            if block is None:
                break
            block_ids.append(block.block_id)
        return block_ids

    def pin_longest_cache_hit(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """``find_longest_cache_hit`` and ``pin`` of its result in one pass (the probe's hot
        path: one dict lookup and one ref count per block).

        Returns:
            The pinned block ids, block order (as ``find_longest_cache_hit``).
        """
        return list(self.pin_cache_hit(block_hashes).block_ids)

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
        full walk). One ref count per block either way; requests sharing a long prefix pay one
        dict lookup per new block.

        Args:
            block_hashes: A prompt's full-block hashes, block order.
            prior: An earlier ``pin_cache_hit`` result of this pool, or None.
            num_shared: ``block_hashes[:num_shared]`` equal the prior sequence's first
                ``num_shared`` hashes (the caller's claim; checked at its last shared block).

        Returns:
            The pinned blocks (``find_longest_cache_hit``'s ids) and the pool's counters.
        """
        blocks = self._blocks
        start = 0
        found: list[_Block] = []
        known_ids: tuple[int, ...] = ()
        if prior is not None and num_shared > 0 and prior.evictions == self._evictions:
            known = prior.block_ids[:num_shared]
            last = len(known) - 1
            # the prior's walk stopped inside the shared part: so does this one, unless a hash
            # entered since (then it goes on from there)
            stopped = len(known) < num_shared and prior.stores == self._stores
            if (
                last >= 0
                and len(block_hashes) >= len(known)
                and blocks[known[last]].block_hash == block_hashes[last]
            ):
                known_ids = known
                found = list(map(blocks.__getitem__, known))
                start = len(block_hashes) if stopped else len(known)
            elif last < 0 and stopped:
                start = len(block_hashes)  # the prior found nothing: neither do we
        num_known = len(found)
        if start < len(block_hashes):
            get = self._hash_to_block.get
            for index in range(start, len(block_hashes)):
                block = get(block_hashes[index])
                if block is None:
                    break
                found.append(block)
        remove = self._free_queue.remove
        for block in found:
            if block.ref_cnt == 0:
                remove(block)
                self._num_pinned_blocks += 1
                self._num_evictable_blocks -= 1  # in the map, so it holds a hash
            block.ref_cnt += 1
        if len(found) > num_known:
            known_ids += tuple([block.block_id for block in found[num_known:]])
        return CacheHit(known_ids, self._evictions, self._stores)

    def pin(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block; a block at ref count 0 leaves the free queue.

        Args:
            block_ids: Cached blocks (from ``find_longest_cache_hit``) or blocks already
                pinned. An id may repeat (one reference per occurrence).

        Raises:
            ValueError: if an id is out of range, or names a free uncached block (its content
                is garbage: get fresh blocks from ``allocate``). Nothing changes then.
        """
        blocks = [self._block_at(block_id, "block_ids") for block_id in block_ids]
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is None:
                raise ValueError(
                    f"block_ids: block {block.block_id} is free and uncached, so its content "
                    "is not reusable; pin only blocks from find_longest_cache_hit or blocks "
                    "already pinned, and use allocate for fresh blocks"
                )
        for block in blocks:
            self._incr_ref(block)

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
        if num_blocks > len(self._free_queue):
            return None
        evicted_hashes: list[BlockHash] = []
        taken = self._free_queue.popleft_many(num_blocks)
        for block in taken:
            if block.block_hash is not None:
                evicted_hashes.append(self._evict(block))
            block.ref_cnt = 1
        self._num_pinned_blocks += num_blocks
        block_ids = [block.block_id for block in taken]
        if evicted_hashes:
            self._events.append(KVEvent("removed", tuple(evicted_hashes), None))
        return block_ids

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
        blocks = [self._block_at(block_id, "block_ids") for block_id in block_ids]
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block_ids must be distinct, got {list(block_ids)}")
        for position, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            check_block_hash(block_hash, f"block_hashes[{position}]")
            if block.ref_cnt == 0:
                raise ValueError(
                    f"block_ids: block {block.block_id} is not pinned (ref count 0); cache "
                    "only blocks the caller holds"
                )
            if block.block_hash is not None and block.block_hash != block_hash:
                raise ValueError(
                    f"block_ids: block {block.block_id} already holds hash "
                    f"{block.block_hash.hex()[:16]}..., not block_hashes[{position}] = "
                    f"{block_hash.hex()[:16]}...; a block gets its hash once"
                )
        if not blocks:
            return
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or block_hash in self._hash_to_block:
                continue  # already this hash, or a duplicate of another block
            block.block_hash = block_hash
            self._hash_to_block[block_hash] = block
            self._stores += 1
        self._events.append(KVEvent("stored", tuple(block_hashes), parent_block_hash))

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, tail first.

        Pass a request's blocks in block order; they are released reversed, so a chain's tail
        is evicted before its prefix. At ref count 0 a cached block goes to the back of the
        free queue (evicted last: LRU) and an uncached block to the front (reused first).

        Args:
            block_ids: Blocks to release, block order; an id may repeat.

        Raises:
            ValueError: if an id is out of range or released more often than it is pinned.
                Nothing changes then.
        """
        if not block_ids:
            return
        blocks = self._blocks_at(block_ids)
        if len(set(block_ids)) == len(blocks):  # the usual case: each id once
            releases: dict[int, int] | Counter[int] = {}
            for block in blocks:
                if block.ref_cnt < 1:
                    releases = Counter(block_ids)
                    break
        else:
            releases = Counter(block_ids)
        for block_id, num_releases in releases.items():
            ref_cnt = self._blocks[block_id].ref_cnt
            if num_releases > ref_cnt:
                raise ValueError(
                    f"block_ids: block {block_id} released {num_releases} time(s) but its ref "
                    f"count is {ref_cnt}; free only blocks you pinned or allocated, once each"
                )
        free_queue = self._free_queue
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            self._num_pinned_blocks -= 1
            if block.block_hash is not None:
                self._num_evictable_blocks += 1
                free_queue.append(block)
            else:
                free_queue.appendleft(block)

    def take_events(self) -> list[KVEvent]:
        """Drain the pending events (oldest first); the pool's queue is empty afterwards."""
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Check every structural invariant; for tests.

        Raises:
            AssertionError: naming the first invariant that does not hold.
        """
        queued = list(self._free_queue)
        _invariant(
            [block.block_id for block in reversed(queued)]
            == [block.block_id for block in self._free_queue.iter_reversed()],
            "free queue: forward and backward links disagree",
        )
        _invariant(len(queued) == len(self._free_queue), "free queue: length counter is wrong")
        queued_ids = {block.block_id for block in queued}
        _invariant(len(queued_ids) == len(queued), "free queue: a block is queued twice")
        free_ids = set()
        num_pinned = num_evictable = num_hashed = 0
        for block in self._blocks:
            _invariant(block.ref_cnt >= 0, f"block {block.block_id}: ref count {block.ref_cnt}")
            _invariant(
                self._free_queue.is_queued(block) == (block.ref_cnt == 0),
                f"block {block.block_id}: queued={self._free_queue.is_queued(block)} but ref "
                f"count {block.ref_cnt}",
            )
            if block.ref_cnt == 0:
                free_ids.add(block.block_id)
                num_evictable += block.block_hash is not None
            else:
                num_pinned += 1
            if block.block_hash is not None:
                num_hashed += 1
                _invariant(
                    self._hash_to_block.get(block.block_hash) is block,
                    f"block {block.block_id}: its hash maps to another block",
                )
        _invariant(queued_ids == free_ids, "free queue is not exactly the ref-count-0 blocks")
        _invariant(
            self.num_free_blocks + num_pinned == self.num_blocks,
            f"free {self.num_free_blocks} + used {num_pinned} != capacity {self.num_blocks}",
        )
        _invariant(num_pinned == self._num_pinned_blocks, "pinned counter is wrong")
        _invariant(num_evictable == self._num_evictable_blocks, "evictable counter is wrong")
        _invariant(num_hashed == len(self._hash_to_block), "hash map holds unhashed blocks")
        for block_hash, block in self._hash_to_block.items():
            _invariant(block.block_hash == block_hash, f"hash map entry for block {block.block_id}")

    # ---- internals: the only places ref counts and counters move -------------------------

    def _block_at(self, block_id: int, field: str) -> _Block:
        if type(block_id) is int and 0 <= block_id < self.num_blocks:
            return self._blocks[block_id]
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(
                f"{field}: block id {block_id!r} is not in [0, {self.num_blocks}) "
                "(this pool's capacity)"
            )
        return self._blocks[block_id]

    def _blocks_at(self, block_ids: Sequence[int]) -> list[_Block]:
        """``_block_at`` of each id; one C-level pass when they are all ints in range."""
        try:
            if min(block_ids) >= 0 and set(map(type, block_ids)) <= _INT_TYPES:
                return list(map(self._blocks.__getitem__, block_ids))
        except (TypeError, IndexError):
            pass
        return [self._block_at(block_id, "block_ids") for block_id in block_ids]

    def _incr_ref(self, block: _Block) -> None:
        if block.ref_cnt == 0:
            self._free_queue.remove(block)
            self._num_pinned_blocks += 1
            if block.block_hash is not None:
                self._num_evictable_blocks -= 1
        block.ref_cnt += 1

    def _evict(self, block: _Block) -> BlockHash:
        """Drop a just-dequeued cached block's hash; returns it."""
        block_hash = block.block_hash
        assert block_hash is not None and block.ref_cnt == 0, "evicting a pinned/uncached block"
        del self._hash_to_block[block_hash]
        self._evictions += 1
        block.block_hash = None
        self._num_evictable_blocks -= 1
        return block_hash
