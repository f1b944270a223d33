"""Block hashing, one stage's block pool, and the per-stage manager that speaks in requests.

Three layers, each pure (no I/O, no torch, no clock reads except the injected one):

- hashing: ``root_block_hash``, ``hash_block_tokens``, ``hash_prompt_blocks``. Chained sha256
  over a canonical byte encoding, so every stage (and every process) computes the same block
  hashes for the same tokens, model and cache salt.
- mechanism: ``BlockPool`` owns one stage's KV memory: capacity in blocks, the block hash ->
  block map, ref counts and the LRU free queue. It queues ``KVEvent``s; its owner drains them.
- policy: ``StageKVManager`` turns admission steps (probe/pin, commit/reserve, mark computed,
  release, lease expiry) into pool calls, keyed by request id.

Style and ideas follow vLLM (vllm/v1/core/block_pool.py, kv_cache_utils.py,
kv_cache_manager.py) and SGLang (python/sglang/srt/mem_cache/radix_cache.py); no code is copied.
"""

from __future__ import annotations

import hashlib
import math
import operator
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BLOCK_HASH_NUM_BYTES",
    "BlockHash",
    "BlockPool",
    "KVEvent",
    "PinReceipt",
    "StageKVManager",
    "hash_block_tokens",
    "hash_prompt_blocks",
    "root_block_hash",
]

BlockHash = bytes
"""A 32-byte sha256 digest naming a full block and, through the chain, its whole prefix."""

BLOCK_HASH_NUM_BYTES = 32

# NOTE: domain tags keep a root hash from ever equalling a block hash of some token sequence,
# and version the encoding: changing the encoding must change the tag.
_ROOT_TAG = b"wavepp.root_block_hash.v1\x00"
_MAX_TOKEN_ID = 2**32 - 1


# --------------------------------------------------------------------------------------------
# Hashing
# --------------------------------------------------------------------------------------------


def _encode_str(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def _is_token_id(value: object) -> bool:
    try:
        return 0 <= operator.index(value) <= _MAX_TOKEN_ID  # type: ignore[arg-type]
    except TypeError:
        return False


def _check_block_hash(value: object, field: str) -> None:
    if not isinstance(value, bytes) or len(value) != BLOCK_HASH_NUM_BYTES:
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise ValueError(
            f"{field} must be a {BLOCK_HASH_NUM_BYTES}-byte sha256 digest (BlockHash), got {got}; "
            "compute it with root_block_hash/hash_block_tokens"
        )


def root_block_hash(model_id: str, cache_salt: str) -> BlockHash:
    """Hash h_{-1} that seeds a prompt's block hash chain (DESIGN.md, "block hash").

    Encoding (all integers little-endian)::

        sha256(b"wavepp.root_block_hash.v1\\x00"
               || u32 len(model_id_utf8) || model_id_utf8
               || u32 len(cache_salt_utf8) || cache_salt_utf8)

    Independent of the process (no Python ``hash()``, no random seed), so all stages agree.

    Args:
        model_id: Model name or path; part of the seed so two models never share blocks.
        cache_salt: Per-tenant salt; ``""`` means the shared (unsalted) namespace.

    Returns:
        32-byte digest.

    Raises:
        ValueError: if ``model_id`` is empty or either argument is not a str.
    """
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty str, got {model_id!r}")
    if not isinstance(cache_salt, str):
        raise ValueError(f'cache_salt must be a str ("" for none), got {cache_salt!r}')
    return hashlib.sha256(_ROOT_TAG + _encode_str(model_id) + _encode_str(cache_salt)).digest()


def hash_block_tokens(parent_block_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash h_i = sha256(h_{i-1} || tokens of block i) (DESIGN.md, "block hash").

    Encoding (little-endian)::

        sha256(parent_block_hash (32 bytes) || u32 num_tokens || num_tokens x u32 token id)

    Args:
        parent_block_hash: h_{i-1}; for the first block, ``root_block_hash(model_id, salt)``.
        token_ids: The block's token ids, each in [0, 2**32). Length is normally
            ``block_size``; it is part of the encoding, so any length hashes unambiguously.

    Returns:
        32-byte digest.

    Raises:
        ValueError: if ``parent_block_hash`` is not 32 bytes or a token id is not an int in
            [0, 2**32).
    """
    _check_block_hash(parent_block_hash, "parent_block_hash")
    num_tokens = len(token_ids)
    try:
        encoded = struct.pack(f"<I{num_tokens}I", num_tokens, *token_ids)
    except struct.error:
        for position, token_id in enumerate(token_ids):
            if not _is_token_id(token_id):
                raise ValueError(
                    f"token_ids[{position}] = {token_id!r} must be an int in [0, {_MAX_TOKEN_ID}]"
                ) from None
        raise
    return hashlib.sha256(parent_block_hash + encoded).digest()


def hash_prompt_blocks(
    token_ids: Sequence[int], block_size: int, model_id: str, cache_salt: str = ""
) -> list[BlockHash]:
    """Chained hashes of a prompt's full blocks; the trailing partial block is not hashed.

    Layout (block_size = 4, 10 tokens)::

        tokens  [t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9]
        hashes   h0            h1            (none: partial)
        h0 = hash_block_tokens(root_block_hash(model_id, cache_salt), t0..t3)
        h1 = hash_block_tokens(h0, t4..t7)

    Args:
        token_ids: The prompt's token ids.
        block_size: Tokens per block, > 0.
        model_id: Model name, seeds the chain (see ``root_block_hash``).
        cache_salt: Per-tenant salt, seeds the chain.

    Returns:
        ``len(token_ids) // block_size`` hashes, block order.

    Raises:
        ValueError: if ``block_size <= 0`` or a hashing argument is invalid.
    """
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
    parent = root_block_hash(model_id, cache_salt)
    block_hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        block_hashes.append(parent)
    return block_hashes


# --------------------------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Block pool
# --------------------------------------------------------------------------------------------


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
        # NOTE: counters move only in _incr_ref/_decr_ref/_evict, next to the ref count.
        self._num_pinned_blocks = 0
        self._num_evictable_blocks = 0
        self._events: list[KVEvent] = []

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
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block = self._free_queue.popleft()
            if block.block_hash is not None:
                evicted_hashes.append(self._evict(block))
            block.ref_cnt = 1
            self._num_pinned_blocks += 1
            block_ids.append(block.block_id)
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
            _check_block_hash(parent_block_hash, "parent_block_hash")
        blocks = [self._block_at(block_id, "block_ids") for block_id in block_ids]
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block_ids must be distinct, got {list(block_ids)}")
        for position, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            _check_block_hash(block_hash, f"block_hashes[{position}]")
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
        blocks = [self._block_at(block_id, "block_ids") for block_id in block_ids]
        for block_id, num_releases in Counter(block_ids).items():
            ref_cnt = self._blocks[block_id].ref_cnt
            if num_releases > ref_cnt:
                raise ValueError(
                    f"block_ids: block {block_id} released {num_releases} time(s) but its ref "
                    f"count is {ref_cnt}; free only blocks you pinned or allocated, once each"
                )
        for block in reversed(blocks):
            self._decr_ref(block)

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
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(
                f"{field}: block id {block_id!r} is not in [0, {self.num_blocks}) "
                "(this pool's capacity)"
            )
        return self._blocks[block_id]

    def _incr_ref(self, block: _Block) -> None:
        if block.ref_cnt == 0:
            self._free_queue.remove(block)
            self._num_pinned_blocks += 1
            if block.block_hash is not None:
                self._num_evictable_blocks -= 1
        block.ref_cnt += 1

    def _decr_ref(self, block: _Block) -> None:
        assert block.ref_cnt > 0, f"block {block.block_id}: release at ref count 0"
        block.ref_cnt -= 1
        if block.ref_cnt > 0:
            return
        self._num_pinned_blocks -= 1
        if block.block_hash is not None:
            self._num_evictable_blocks += 1
            self._free_queue.append(block)
        else:
            self._free_queue.appendleft(block)

    def _evict(self, block: _Block) -> BlockHash:
        """Drop a just-dequeued cached block's hash; returns it."""
        block_hash = block.block_hash
        assert block_hash is not None and block.ref_cnt == 0, "evicting a pinned/uncached block"
        del self._hash_to_block[block_hash]
        block.block_hash = None
        self._num_evictable_blocks -= 1
        return block_hash


# --------------------------------------------------------------------------------------------
# Per-stage manager
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PinReceipt:
    """What one request holds on one stage; ``StageKVManager.release`` accepts it.

    The defaults mean "held nothing": releasing a default (lost) receipt releases nothing and
    returns False, so a lost receipt leaks visibly instead of freeing another holder's pin.

    Attributes:
        request_id: The holder; "" for none.
        block_ids: Blocks held when the receipt was issued, block order (informational).
    """

    request_id: str = ""
    block_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class _HeldRequest:
    request_id: str
    hit_block_ids: list[int]  # pinned cached prefix from probe_pin (length = local hit)
    lease_expiry_s: float  # clock() time after which expire() releases the request
    seq: int  # admission order, breaks ties between equal expiries
    block_table: list[int] | None = None  # after commit: L* cached ids, then fresh ids
    num_agreed_blocks: int = 0  # L*, after commit
    num_hashed_blocks: int = 0  # leading table blocks already passed to cache_full_blocks


def _check_lease(lease_s: float) -> None:
    if not isinstance(lease_s, int | float) or not math.isfinite(lease_s) or lease_s <= 0:
        raise ValueError(f"lease_s must be a finite number of seconds > 0, got {lease_s!r}")


class StageKVManager:
    """Per-stage admission state: pins, reservations, leases, per-request block tables.

    A request moves probed -> committed -> released (or probed -> released). Block table of a
    committed request, L* = num_agreed_blocks::

        [ cached_0 ... cached_{L*-1} | fresh_{L*} ... fresh_{num_total_blocks-1} ]
          pinned by probe_pin          allocated by commit (the reservation)

    Every held request has a lease (``clock()`` seconds); ``expire`` releases any request
    whose lease passed, committed or not, so a dead controller leaks no pins.

    Args:
        pool: The stage's block pool; this manager is its only user.
        clock: Monotonic time in seconds (inject a fake in tests).
    """

    def __init__(self, pool: BlockPool, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self._clock = clock
        self._requests: dict[str, _HeldRequest] = {}
        self._num_admitted = 0

    @property
    def num_requests(self) -> int:
        """Requests holding blocks (probed or committed)."""
        return len(self._requests)

    def probe_pin(self, request_id: str, block_hashes: Sequence[BlockHash], lease_s: float) -> int:
        """Pin the longest cached prefix of ``block_hashes`` for ``request_id``.

        Idempotent by request id: for a request already held it pins nothing more and returns
        the held length (L* once committed); the lease is extended to at least
        ``clock() + lease_s``.

        Args:
            request_id: Non-empty id ("" is the receipt placeholder).
            block_hashes: The prompt's full-block hashes (``hash_prompt_blocks``).
            lease_s: Seconds until ``expire`` may release the request, > 0.

        Returns:
            The local hit in blocks: number of leading hashes this stage holds, now pinned.

        Raises:
            ValueError: on an empty ``request_id`` or a bad ``lease_s``.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        _check_lease(lease_s)
        held = self._requests.get(request_id)
        if held is not None:
            held.lease_expiry_s = max(held.lease_expiry_s, self._clock() + lease_s)
            return len(held.hit_block_ids)
        hit_block_ids = self.pool.find_longest_cache_hit(block_hashes)
        self.pool.pin(hit_block_ids)
        self._num_admitted += 1
        self._requests[request_id] = _HeldRequest(
            request_id, hit_block_ids, self._clock() + lease_s, self._num_admitted
        )
        return len(hit_block_ids)

    def commit(
        self, request_id: str, num_agreed_blocks: int, num_total_blocks: int, lease_s: float
    ) -> list[int] | None:
        """Keep the first L* pinned blocks, unpin the rest, reserve the blocks after L*.

        Args:
            request_id: A probed request.
            num_agreed_blocks: L*, the prefix agreed across stages; 0 <= L* <= local hit.
            num_total_blocks: Blocks the whole prompt needs (ceil(num_tokens / block_size)),
                >= L*. The controller keeps L* below it when the last token must be computed.
            lease_s: New lease, seconds from now, > 0.

        Returns:
            The block table (L* cached ids, then num_total_blocks - L* fresh ids), or None
            when the pool cannot reserve the fresh blocks: then all of this request's pins
            are released and it is forgotten (a refused reservation leaves no pins).
            Idempotent: a committed request returns the same table again.

        Raises:
            KeyError: if ``request_id`` is not held (never probed, released or expired).
            ValueError: if L* > local hit, L* < 0, num_total_blocks < L*, a bad ``lease_s``,
                or a repeated commit with different block counts.
        """
        _check_lease(lease_s)
        held = self._held(request_id)
        if held.block_table is not None:
            if (num_agreed_blocks, num_total_blocks) != (
                held.num_agreed_blocks,
                len(held.block_table),
            ):
                raise ValueError(
                    f"request {request_id!r} is already committed with num_agreed_blocks="
                    f"{held.num_agreed_blocks}, num_total_blocks={len(held.block_table)}; got "
                    f"{num_agreed_blocks}, {num_total_blocks}"
                )
            held.lease_expiry_s = max(held.lease_expiry_s, self._clock() + lease_s)
            return list(held.block_table)
        num_hit_blocks = len(held.hit_block_ids)
        if not isinstance(num_agreed_blocks, int) or not 0 <= num_agreed_blocks <= num_hit_blocks:
            raise ValueError(
                f"num_agreed_blocks = {num_agreed_blocks!r} must be in [0, {num_hit_blocks}] "
                f"(request {request_id!r}'s local hit on this stage); L* is the minimum over "
                "stages of their hits"
            )
        if not isinstance(num_total_blocks, int) or num_total_blocks < num_agreed_blocks:
            raise ValueError(
                f"num_total_blocks = {num_total_blocks!r} must be an int >= num_agreed_blocks "
                f"= {num_agreed_blocks}"
            )
        # Unpin past L* first: those blocks become evictable and may serve this reservation.
        self.pool.free(held.hit_block_ids[num_agreed_blocks:])
        del held.hit_block_ids[num_agreed_blocks:]
        fresh_block_ids = self.pool.allocate(num_total_blocks - num_agreed_blocks)
        if fresh_block_ids is None:
            self.pool.free(held.hit_block_ids)
            del self._requests[request_id]
            return None
        held.block_table = held.hit_block_ids + fresh_block_ids
        held.num_agreed_blocks = held.num_hashed_blocks = num_agreed_blocks
        held.lease_expiry_s = self._clock() + lease_s
        return list(held.block_table)

    def mark_computed(
        self, request_id: str, num_computed_tokens: int, block_hashes: Sequence[BlockHash]
    ) -> None:
        """After a chunk ran, give hashes to the request's blocks that are now full and computed.

        Block i (i >= L*) is full and computed when num_computed_tokens >= (i + 1) * block_size.
        Calls with a smaller or equal count than before change nothing.

        Args:
            request_id: A committed request.
            num_computed_tokens: Prompt tokens whose KV is now in this stage's blocks
                (cached prefix included), in [0, num_total_blocks * block_size].
            block_hashes: The prompt's full-block hashes (``hash_prompt_blocks``).

        Raises:
            KeyError: if ``request_id`` is not held.
            ValueError: if the request is not committed, ``num_computed_tokens`` is out of
                range, or ``block_hashes`` has fewer hashes than there are full computed blocks.
        """
        held = self._held(request_id)
        if held.block_table is None:
            raise ValueError(f"request {request_id!r} is not committed; commit before computing")
        block_size = self.pool.block_size
        num_table_tokens = len(held.block_table) * block_size
        if not isinstance(num_computed_tokens, int) or not (
            0 <= num_computed_tokens <= num_table_tokens
        ):
            raise ValueError(
                f"num_computed_tokens = {num_computed_tokens!r} must be in "
                f"[0, {num_table_tokens}] (request {request_id!r}'s block table, in tokens)"
            )
        num_full_blocks = num_computed_tokens // block_size
        if num_full_blocks <= held.num_hashed_blocks:
            return
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"block_hashes has {len(block_hashes)} hashes but {num_full_blocks} blocks are "
                f"full and computed ({num_computed_tokens} tokens); pass the prompt's "
                "full-block hashes"
            )
        first = held.num_hashed_blocks
        parent_block_hash = block_hashes[first - 1] if first > 0 else None
        self.pool.cache_full_blocks(
            held.block_table[first:num_full_blocks],
            block_hashes[first:num_full_blocks],
            parent_block_hash,
        )
        held.num_hashed_blocks = num_full_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The committed request's block table (a copy).

        Raises:
            KeyError: if ``request_id`` is not committed.
        """
        held = self._requests.get(request_id)
        if held is None or held.block_table is None:
            raise KeyError(f"request {request_id!r} is not committed on this stage")
        return list(held.block_table)

    def receipt(self, request_id: str) -> PinReceipt:
        """What ``request_id`` holds now; ``PinReceipt()`` (held nothing) if not held."""
        held = self._requests.get(request_id)
        if held is None:
            return PinReceipt()
        return PinReceipt(request_id, tuple(self._held_block_ids(held)))

    def release(self, request_id: str | PinReceipt) -> bool:
        """Drop everything the request holds, tail first; cached blocks stay cached for reuse.

        Args:
            request_id: The request's id, or a ``PinReceipt`` (the default receipt names no
                request and releases nothing).

        Returns:
            True if the request was held (now released), False otherwise (no effect).
        """
        if isinstance(request_id, PinReceipt):
            request_id = request_id.request_id
        held = self._requests.pop(request_id, None)
        if held is None:
            return False
        self.pool.free(self._held_block_ids(held))
        return True

    def renew(self, request_ids: Iterable[str], lease_s: float) -> None:
        """Set the lease of each held request to ``clock() + lease_s``; unknown ids are skipped.

        Raises:
            ValueError: on a bad ``lease_s``.
        """
        _check_lease(lease_s)
        lease_expiry_s = self._clock() + lease_s
        for request_id in request_ids:
            held = self._requests.get(request_id)
            if held is not None:
                held.lease_expiry_s = lease_expiry_s

    def expire(self) -> list[str]:
        """Release every request whose lease passed (expiry <= clock()), committed or not.

        Returns:
            Their ids, earliest expiry first.
        """
        now_s = self._clock()
        expired = sorted(
            (held for held in self._requests.values() if held.lease_expiry_s <= now_s),
            key=lambda held: (held.lease_expiry_s, held.seq),
        )
        for held in expired:
            self.release(held.request_id)
        return [held.request_id for held in expired]

    def take_events(self) -> list[KVEvent]:
        """Drain the pool's pending events (see ``BlockPool.take_events``)."""
        return self.pool.take_events()

    def _held(self, request_id: str) -> _HeldRequest:
        held = self._requests.get(request_id)
        if held is None:
            raise KeyError(
                f"request {request_id!r} holds nothing on this stage (never probed, released, "
                "or its lease expired); probe_pin first"
            )
        return held

    @staticmethod
    def _held_block_ids(held: _HeldRequest) -> list[int]:
        return held.block_table if held.block_table is not None else held.hit_block_ids
