"""Stateful property tests (hypothesis) for BlockPool and StageKVManager.

What holds, and is asserted after every step:

- free + used == capacity; ref counts >= 0; the free queue is exactly the ref-0 blocks
  (``check_invariants``), and each block's ref count equals the number of holders in a model.
- BlockPool: the free queue order equals a plain-list model (LRU; tail first; uncached to the
  front), and every hash maps to exactly one block.
- A block held by a live request keeps its hash and its id in the request's block table (a
  pinned block is never evicted).
- Events replayed as set operations reproduce the pool's cached hash set (a shadow index), and
  each "stored" event is a hash chain following its parent_block_hash.
- ``find_longest_cache_hit`` returns exactly the leading run of hashes present, and so does
  ``pin_cache_hit`` when it starts from an earlier walk (still exact, or stale: a hash left
  or entered the pool since)
  for a sequence sharing some leading hashes with that walk's.
- A refused reservation leaves no pins for that request, and is refused only when the
  pool really lacks the blocks; after every request is released, nothing leaks.
- A reservation keeps the whole local hit: its table is the hit's
  ids, then fresh ones; a chunk starting at any L* <= the hit caches only the blocks past the
  hit, and a cached block never changes its hash.

What is NOT asserted: that the cached set is prefix-closed. Tail-first release makes a chain's
tail go before its prefix, but LRU across requests can evict block i of one chain while block
i + 1 (reached by a longer prompt, freed later) stays cached; such an orphan is unreachable by
``find_longest_cache_hit`` (it only follows leading runs) and is evicted in time.
"""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from wavepp.runtime.kv import (
    BlockPool,
    CacheHit,
    KVEvent,
    StageKVManager,
    hash_prompt_blocks,
)

_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# ---- BlockPool against a list-based model ---------------------------------------------------

_NUM_POOL_BLOCKS = 6
_MAX_HOLDERS = 3  # more holders pin the whole pool and most steps become refusals
_HASH_UNIVERSE = [hashlib.sha256(bytes([i])).digest() for i in range(5)]


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / hit+pin / free against an exact model of the free queue."""

    span_min_blocks: int | None = None  # None: the pool's default (spans off at this size)

    @initialize()
    def setup(self) -> None:
        self.pool = BlockPool(_NUM_POOL_BLOCKS, 2)
        if self.span_min_blocks is not None:
            self.pool.span_min_blocks = self.span_min_blocks
        self.model_free: list[int] = list(range(_NUM_POOL_BLOCKS))  # front first
        self.model_refs = [0] * _NUM_POOL_BLOCKS
        self.model_hash: list[bytes | None] = [None] * _NUM_POOL_BLOCKS
        self.model_events: list[KVEvent] = []
        self.holders: list[list[int]] = []
        self.walks: list[tuple[list[bytes], CacheHit]] = []  # earlier pin_cache_hit results

    def _model_map(self) -> dict[bytes, int]:
        return {h: b for b, h in enumerate(self.model_hash) if h is not None}

    def _model_pin(self, block_ids: list[int]) -> None:
        """The model's side of a pin: one reference more each, a new holder."""
        for block_id in block_ids:
            if self.model_refs[block_id] == 0:
                self.model_free.remove(block_id)
            self.model_refs[block_id] += 1
        if block_ids:
            self.holders.append(block_ids)

    def _model_hit(self, block_hashes: list[bytes]) -> list[int]:
        """The model's longest cache hit: the blocks of the leading hashes it holds."""
        model_map = self._model_map()
        expected = []
        for block_hash in block_hashes:
            if block_hash not in model_map:
                break
            expected.append(model_map[block_hash])
        return expected

    @rule()
    def allocate_more_than_free_changes_nothing(self) -> None:
        self.allocate(len(self.model_free) + 1)  # the invariant compares queue and events

    @precondition(lambda self: len(self.holders) < _MAX_HOLDERS)
    @rule(num_blocks=st.integers(0, 3))
    def allocate(self, num_blocks: int) -> None:
        block_ids = self.pool.allocate(num_blocks)
        if num_blocks > len(self.model_free):
            assert block_ids is None
            return
        taken, self.model_free = self.model_free[:num_blocks], self.model_free[num_blocks:]
        assert block_ids == taken
        evicted = []
        for block_id in taken:
            if self.model_hash[block_id] is not None:
                evicted.append(self.model_hash[block_id])
                self.model_hash[block_id] = None
            self.model_refs[block_id] = 1
        if evicted:
            self.model_events.append(KVEvent("removed", tuple(evicted), None))
        if taken:
            self.holders.append(taken)

    @precondition(lambda self: len(self.holders) < _MAX_HOLDERS)
    @rule(data=st.data(), num_blocks=st.integers(1, 3))
    def run_request(self, data: st.DataObject, num_blocks: int) -> None:
        """Allocate, cache (some of) the blocks, maybe free them: one step."""
        num_holders = len(self.holders)
        self.allocate(num_blocks)
        if len(self.holders) > num_holders:
            self._cache_full_blocks(data, self.holders[-1])

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def cache_full_blocks(self, data: st.DataObject) -> None:
        self._cache_full_blocks(data, data.draw(st.sampled_from(self.holders)))

    def _cache_full_blocks(self, data: st.DataObject, holder: list[int]) -> None:
        start = data.draw(st.integers(0, len(holder) - 1))
        end = data.draw(st.integers(start, len(holder)))
        block_ids = list(dict.fromkeys(holder[start:end]))  # a hit may name a block twice
        block_hashes = [
            self.model_hash[b] or data.draw(st.sampled_from(_HASH_UNIVERSE)) for b in block_ids
        ]
        parent = data.draw(st.none() | st.sampled_from(_HASH_UNIVERSE))
        self.pool.cache_full_blocks(block_ids, block_hashes, parent)
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            if self.model_hash[block_id] is None and block_hash not in self._model_map():
                self.model_hash[block_id] = block_hash
        if block_ids:
            self.model_events.append(KVEvent("stored", tuple(block_hashes), parent))
        if data.draw(st.booleans(), label="then free the holder"):
            self._free(self.holders.index(holder))

    @precondition(lambda self: len(self.holders) < _MAX_HOLDERS)
    @rule(block_hashes=st.lists(st.sampled_from(_HASH_UNIVERSE), max_size=4))
    def hit_and_pin(self, block_hashes: list[bytes]) -> None:
        expected = self._model_hit(block_hashes)
        hit = self.pool.find_longest_cache_hit(block_hashes)
        assert hit == expected
        self.pool.pin(hit)
        self._model_pin(hit)

    @precondition(lambda self: len(self.holders) < _MAX_HOLDERS)
    @rule(data=st.data(), extra=st.lists(st.sampled_from(_HASH_UNIVERSE), max_size=4))
    def pin_cache_hit_from_an_earlier_walk(self, data: st.DataObject, extra: list[bytes]) -> None:
        prior: CacheHit | None = None
        shared: list[bytes] = []
        if self.walks and data.draw(st.booleans(), label="from an earlier walk"):
            earlier, prior = data.draw(st.sampled_from(self.walks), label="walk")
            shared = earlier[: data.draw(st.integers(0, len(earlier)), label="num_shared")]
        block_hashes = shared + extra
        expected = self._model_hit(block_hashes)
        walk = self.pool.pin_cache_hit(block_hashes, prior, len(shared))
        assert list(walk.block_ids) == expected
        assert (walk.evictions, walk.stores) == (self.pool.num_evictions, self.pool.num_stores)
        self.walks = [*self.walks[-3:], (block_hashes, walk)]
        self._model_pin(expected)

    @precondition(lambda self: self.walks and len(self.holders) < _MAX_HOLDERS)
    @rule()
    def pin_the_latest_walk_again(self) -> None:
        """Another holder of the latest walk's whole sequence (a span's second holder)."""
        block_hashes, prior = self.walks[-1]
        expected = self._model_hit(block_hashes)
        walk = self.pool.pin_cache_hit(block_hashes, prior, len(block_hashes))
        assert list(walk.block_ids) == expected
        self._model_pin(expected)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self._free(data.draw(st.integers(0, len(self.holders) - 1)))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free_the_tail_of_a_holder(self, data: st.DataObject) -> None:
        """A release of a holder's tail: it keeps its first blocks (a span cut)."""
        holder_index = data.draw(st.integers(0, len(self.holders) - 1))
        holder = self.holders[holder_index]
        cut = data.draw(st.integers(0, len(holder)), label="cut")
        self.holders[holder_index : holder_index + 1] = [holder[cut:], holder[:cut]]
        self._free(holder_index)
        if not self.holders[holder_index]:
            del self.holders[holder_index]

    def _free(self, holder_index: int) -> None:
        holder = self.holders.pop(holder_index)
        self.pool.free(holder)
        for block_id in reversed(holder):
            self.model_refs[block_id] -= 1
            if self.model_refs[block_id] == 0:
                if self.model_hash[block_id] is None:
                    self.model_free.insert(0, block_id)
                else:
                    self.model_free.append(block_id)

    @precondition(lambda self: any(self.model_hash[b] is None for b in self.model_free))
    @rule()
    def pin_of_free_uncached_block_is_refused(self) -> None:
        block_id = next(b for b in self.model_free if self.model_hash[b] is None)
        try:
            self.pool.pin([block_id])
        except ValueError:
            return
        raise AssertionError(f"pin of free uncached block {block_id} was accepted")

    @invariant()
    def matches_model(self) -> None:
        pool = self.pool
        pool.check_invariants()
        assert pool.free_block_ids() == self.model_free
        assert [pool.ref_cnt(b) for b in range(_NUM_POOL_BLOCKS)] == self.model_refs
        assert [pool.block_hash(b) for b in range(_NUM_POOL_BLOCKS)] == self.model_hash
        assert all(ref_cnt >= 0 for ref_cnt in self.model_refs)
        num_used = sum(ref_cnt > 0 for ref_cnt in self.model_refs)
        assert pool.num_free_blocks + num_used == pool.num_blocks
        assert pool.num_pinned_blocks == num_used
        assert pool.num_cached_blocks == len(self._model_map())
        assert pool.take_events() == self.model_events
        self.model_events = []

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for holder in self.holders:
            self.pool.free(holder)
        self.pool.check_invariants()
        assert self.pool.num_free_blocks == _NUM_POOL_BLOCKS
        assert self.pool.num_pinned_blocks == 0


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = _SETTINGS


class BlockPoolSpansMachine(BlockPoolMachine):
    """The same, with every prefix taken from an earlier walk pinned as a span (shared-prefix
    pin: one holder count, not one ref count per block), cut by tail frees."""

    span_min_blocks = 1


TestBlockPoolSpansMachine = BlockPoolSpansMachine.TestCase
TestBlockPoolSpansMachine.settings = _SETTINGS


# ---- StageKVManager -------------------------------------------------------------------------

_NUM_STAGE_BLOCKS = 10
_BLOCK_SIZE = 2
_MODEL_ID = "prop-model"

# a prompt: up to 5 block choices (0 or 1, so prefixes are often shared) plus 0..1 tail tokens
_prompts = st.tuples(
    st.lists(st.integers(0, 1), min_size=0, max_size=5),
    st.integers(0, 1),
    st.sampled_from(["", "tenant"]),
).filter(lambda prompt: prompt[0] or prompt[1])
_leases_s = st.sampled_from([1.0, 2.5, 5.0, 10.0])


class _ModelRequest:
    def __init__(self, token_ids: list[int], cache_salt: str, expiry_s: float, seq: int) -> None:
        self.token_ids = token_ids
        self.block_hashes = hash_prompt_blocks(token_ids, _BLOCK_SIZE, _MODEL_ID, cache_salt)
        self.num_total_blocks = -(-len(token_ids) // _BLOCK_SIZE)
        self.held_block_ids: list[int] = []
        self.is_reserved = False
        self.num_agreed_blocks = 0
        self.num_computed_tokens = 0
        self.expiry_s = expiry_s
        self.seq = seq
        self.hash_snapshot: dict[int, bytes | None] = {}  # held block id -> its hash


class StageKVManagerMachine(RuleBasedStateMachine):
    """Random probes, reservations, chunks, releases, renewals and expiries with a fake clock."""

    span_min_blocks: int | None = None  # None: the pool's default

    @initialize()
    def setup(self) -> None:
        self.now_s = 0.0
        self.manager = StageKVManager(
            BlockPool(_NUM_STAGE_BLOCKS, _BLOCK_SIZE), clock=lambda: self.now_s
        )
        self.pool = self.manager.pool
        if self.span_min_blocks is not None:
            self.pool.span_min_blocks = self.span_min_blocks
        self.requests: dict[str, _ModelRequest] = {}
        self.shadow_hashes: set[bytes] = set()
        self.parent_of: dict[bytes, bytes | None] = {}  # block hash -> previous block's hash
        self.num_ids = 0

    # ---- helpers --------------------------------------------------------------------------

    def _model_refs(self) -> list[int]:
        refs = [0] * _NUM_STAGE_BLOCKS
        for request in self.requests.values():
            for block_id in request.held_block_ids:
                refs[block_id] += 1
        return refs

    def _pick(self, data: st.DataObject, reserved: bool | None) -> str:
        ids = sorted(
            rid for rid, r in self.requests.items() if reserved is None or r.is_reserved == reserved
        )
        return data.draw(st.sampled_from(ids))

    def _has(self, reserved: bool | None) -> bool:
        return any(reserved is None or r.is_reserved == reserved for r in self.requests.values())

    # ---- rules ----------------------------------------------------------------------------

    @rule(prompt=_prompts, lease_s=_leases_s)
    def probe(self, prompt: tuple[list[int], int, str], lease_s: float) -> None:
        self._probe(prompt, lease_s)

    @rule(data=st.data(), prompt=_prompts, lease_s=_leases_s)
    def serve_prompt(self, data: st.DataObject, prompt: tuple, lease_s: float) -> None:
        """A whole request in one step (probe, reserve, compute all, maybe release)."""
        request_id = self._probe(prompt, lease_s)
        if not self._reserve(data, request_id, lease_s):
            return
        self._mark_computed(request_id, len(self.requests[request_id].token_ids))
        if data.draw(st.booleans(), label="release"):
            del self.requests[request_id]
            assert self.manager.release(request_id) is True

    def _probe(self, prompt: tuple[list[int], int, str], lease_s: float) -> str:
        choices, num_tail_tokens, cache_salt = prompt
        token_ids = [t for c in choices for t in (c, 7)] + [3] * num_tail_tokens
        self.num_ids += 1
        request_id = f"r{self.num_ids}"
        request = _ModelRequest(token_ids, cache_salt, self.now_s + lease_s, self.num_ids)
        for index, block_hash in enumerate(request.block_hashes):
            self.parent_of[block_hash] = request.block_hashes[index - 1] if index else None
        cached = self.pool.cached_block_hashes()
        expected_hit = 0
        while (
            expected_hit < len(request.block_hashes)
            and request.block_hashes[expected_hit] in cached
        ):
            expected_hit += 1
        assert self.manager.probe_pin(request_id, request.block_hashes, lease_s) == expected_hit
        held = self.manager.held_blocks(request_id)
        assert len(held) == expected_hit
        request.held_block_ids = list(held)
        for block_id, block_hash in zip(request.held_block_ids, request.block_hashes, strict=False):
            assert self.pool.block_hash(block_id) == block_hash
            request.hash_snapshot[block_id] = block_hash
        self.requests[request_id] = request
        return request_id

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), lease_s=_leases_s)
    def probe_again_is_idempotent(self, data: st.DataObject, lease_s: float) -> None:
        request_id = self._pick(data, None)
        request = self.requests[request_id]
        num_held = request.num_agreed_blocks if request.is_reserved else len(request.held_block_ids)
        assert self.manager.probe_pin(request_id, request.block_hashes, lease_s) == num_held
        request.expiry_s = max(request.expiry_s, self.now_s + lease_s)

    @precondition(lambda self: self._has(reserved=False))
    @rule(data=st.data(), lease_s=_leases_s)
    def reserve(self, data: st.DataObject, lease_s: float) -> None:
        self._reserve(data, self._pick(data, reserved=False), lease_s)

    def _reserve(self, data: st.DataObject, request_id: str, lease_s: float) -> bool:
        """Reserve after the whole hit; the first chunk then starts at some L* <= the hit."""
        request = self.requests[request_id]
        hit = request.held_block_ids
        num_fresh = request.num_total_blocks - len(hit)
        refs = self._model_refs()
        should_refuse = self.pool.num_free_blocks < num_fresh
        num_pinned_before = self.pool.num_pinned_blocks

        table = self.manager.reserve(request_id, request.num_total_blocks, lease_s)

        if table is None:
            assert should_refuse, "refused although enough blocks were free"
            del self.requests[request_id]
            assert self.manager.held_blocks(request_id) == ()
            assert self.pool.num_pinned_blocks == num_pinned_before - sum(
                refs[block_id] == 1 for block_id in hit
            )
            return False
        assert not should_refuse, "accepted although too few blocks were free"
        assert table[: len(hit)] == hit and len(table) == request.num_total_blocks
        fresh = table[len(hit) :]
        assert len(set(fresh)) == len(fresh)
        for block_id in fresh:
            assert refs[block_id] == 0
            assert self.pool.block_hash(block_id) is None and self.pool.ref_cnt(block_id) == 1
        num_agreed = data.draw(st.integers(0, len(hit)), label="L*")
        assert self.manager.start_chunk(request_id, num_agreed * _BLOCK_SIZE) == len(hit) * (
            _BLOCK_SIZE
        )
        assert self.manager.num_agreed_blocks(request_id) == num_agreed
        request.held_block_ids = table
        request.hash_snapshot.update(dict.fromkeys(fresh))
        request.is_reserved = True
        request.num_agreed_blocks = len(hit)  # what probing it again answers: the hit
        # computing starts at L*, but the blocks before the hit are cached: none hashed again
        request.num_computed_tokens = len(hit) * _BLOCK_SIZE
        request.expiry_s = self.now_s + lease_s
        return True

    @precondition(lambda self: self._has(reserved=True))
    @rule(data=st.data(), lease_s=_leases_s)
    def reserve_again_is_idempotent(self, data: st.DataObject, lease_s: float) -> None:
        request_id = self._pick(data, reserved=True)
        request = self.requests[request_id]
        table = self.manager.reserve(request_id, request.num_total_blocks, lease_s)
        assert table == request.held_block_ids
        request.expiry_s = max(request.expiry_s, self.now_s + lease_s)

    @precondition(lambda self: self._has(reserved=True))
    @rule(data=st.data(), num_chunk_tokens=st.integers(1, 5))
    def mark_computed(self, data: st.DataObject, num_chunk_tokens: int) -> None:
        request_id = self._pick(data, reserved=True)
        request = self.requests[request_id]
        self._mark_computed(request_id, request.num_computed_tokens + num_chunk_tokens)

    def _mark_computed(self, request_id: str, num_computed_tokens: int) -> None:
        request = self.requests[request_id]
        num_before = request.num_computed_tokens // _BLOCK_SIZE
        request.num_computed_tokens = min(len(request.token_ids), num_computed_tokens)
        self.manager.mark_computed(request_id, request.num_computed_tokens, request.block_hashes)
        cached = self.pool.cached_block_hashes()
        for index in range(num_before, request.num_computed_tokens // _BLOCK_SIZE):
            block_id = request.held_block_ids[index]
            block_hash = self.pool.block_hash(block_id)
            # either this block now holds the hash, or another block held it already
            assert block_hash == request.block_hashes[index] or (
                block_hash is None and request.block_hashes[index] in cached
            )
            request.hash_snapshot[block_id] = block_hash

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.requests and data.draw(st.booleans()):
            request_id = self._pick(data, None)
            del self.requests[request_id]
            assert self.manager.release(request_id) is True
        else:
            assert self.manager.release("unknown") is False

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), lease_s=_leases_s)
    def renew(self, data: st.DataObject, lease_s: float) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.requests)), max_size=3))
        self.manager.renew([*ids, "unknown"], lease_s)
        for request_id in ids:
            self.requests[request_id].expiry_s = self.now_s + lease_s

    @rule(elapsed_s=st.sampled_from([0.0, 0.5, 1.0, 2.5, 6.0]))
    def advance_clock_and_expire(self, elapsed_s: float) -> None:
        self.now_s += elapsed_s
        expected = sorted(
            (r.expiry_s, r.seq, rid) for rid, r in self.requests.items() if r.expiry_s <= self.now_s
        )
        assert self.manager.expire() == [rid for _, _, rid in expected]
        for _, _, request_id in expected:
            del self.requests[request_id]

    @rule()
    def release_all_leaks_nothing(self) -> None:
        for request_id in list(self.requests):
            assert self.manager.release(request_id)
        self.requests.clear()
        assert self.pool.num_free_blocks == _NUM_STAGE_BLOCKS
        assert self.pool.num_pinned_blocks == 0 and self.manager.num_requests == 0

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def pool_is_consistent_with_holders(self) -> None:
        self.pool.check_invariants()
        refs = self._model_refs()
        assert [self.pool.ref_cnt(b) for b in range(_NUM_STAGE_BLOCKS)] == refs
        assert self.pool.num_free_blocks + sum(r > 0 for r in refs) == _NUM_STAGE_BLOCKS
        assert self.manager.num_requests == len(self.requests)
        # the owner cap's count, kept as requests change (every request here is owner "")
        held = sum(len(r.held_block_ids) for r in self.requests.values())
        assert self.manager.num_owner_blocks("") == held

    @invariant()
    def held_blocks_keep_their_ids_and_hashes(self) -> None:
        for request_id, request in self.requests.items():
            assert list(self.manager.held_blocks(request_id)) == request.held_block_ids
            if request.is_reserved:
                assert self.manager.block_table(request_id) == request.held_block_ids
            for block_id, block_hash in request.hash_snapshot.items():
                assert self.pool.block_hash(block_id) == block_hash, (
                    f"block {block_id} held by {request_id} changed its hash"
                )

    @invariant()
    def events_rebuild_the_cached_hash_set(self) -> None:
        for event in self.manager.take_events():
            if event.kind == "stored":
                # a chain: each hash's parent is the one before it, the first's is the parent
                parents = [event.parent_block_hash, *event.block_hashes[:-1]]
                assert [self.parent_of[h] for h in event.block_hashes] == parents
                self.shadow_hashes.update(event.block_hashes)
            else:
                self.shadow_hashes.difference_update(event.block_hashes)
        assert self.shadow_hashes == self.pool.cached_block_hashes()

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        for request_id in list(self.requests):
            assert self.manager.release(request_id)
        self.pool.check_invariants()
        assert self.pool.num_free_blocks == _NUM_STAGE_BLOCKS
        assert self.pool.num_pinned_blocks == 0


TestStageKVManagerMachine = StageKVManagerMachine.TestCase
TestStageKVManagerMachine.settings = _SETTINGS


class StageKVManagerSpansMachine(StageKVManagerMachine):
    """The same, with every probe's prefix from an earlier walk pinned as a span."""

    span_min_blocks = 1


TestStageKVManagerSpansMachine = StageKVManagerSpansMachine.TestCase
TestStageKVManagerSpansMachine.settings = _SETTINGS
