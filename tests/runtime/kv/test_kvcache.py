"""Unit tests for wavepp.runtime.kv: hashing, BlockPool on tiny pools, StageKVManager."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wavepp.runtime.kv import (
    BlockPool,
    KVEvent,
    PromptHasher,
    StageKVManager,
    hash_block_tokens,
    hash_prompt_blocks,
    root_block_hash,
)

MODEL_ID = "tiny-llama"


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _hashes(num_blocks: int, tag: str = "a") -> list[bytes]:
    """Distinct block hashes for pool-level tests (content is irrelevant to the pool)."""
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(num_blocks)]


# ---- hashing --------------------------------------------------------------------------------


def test_root_hash_matches_documented_encoding() -> None:
    def encode(text: str) -> bytes:
        data = text.encode()
        return struct.pack("<I", len(data)) + data

    expected = hashlib.sha256(
        b"wavepp.root_block_hash.v1\x00" + encode("m\u00e9") + encode("tenant")
    ).digest()
    assert root_block_hash("m\u00e9", "tenant") == expected


def test_block_hash_matches_documented_encoding() -> None:
    parent = root_block_hash(MODEL_ID, "")
    expected = hashlib.sha256(parent + struct.pack("<4I", 3, 7, 0, 2**32 - 1)).digest()
    assert hash_block_tokens(parent, [7, 0, 2**32 - 1]) == expected


def test_prompt_hashes_are_a_chain_of_full_blocks_only() -> None:
    token_ids = list(range(100, 111))  # 11 tokens, block_size 4: 2 full blocks, 3 left over
    block_hashes = hash_prompt_blocks(token_ids, 4, MODEL_ID, "s")
    root = root_block_hash(MODEL_ID, "s")
    h0 = hash_block_tokens(root, token_ids[0:4])
    h1 = hash_block_tokens(h0, token_ids[4:8])
    assert block_hashes == [h0, h1]
    assert all(len(block_hash) == 32 for block_hash in block_hashes)
    # the partial block does not count: changing it changes nothing, extending it adds a hash
    assert hash_prompt_blocks(token_ids[:8] + [1, 2, 3], 4, MODEL_ID, "s") == block_hashes
    longer = hash_prompt_blocks(token_ids + [5], 4, MODEL_ID, "s")
    assert longer[:2] == block_hashes and len(longer) == 3
    assert hash_prompt_blocks(token_ids[:3], 4, MODEL_ID, "s") == []


def test_changing_an_early_token_changes_every_later_hash() -> None:
    token_ids = list(range(12))
    changed = [99] + token_ids[1:]
    a = hash_prompt_blocks(token_ids, 4, MODEL_ID)
    b = hash_prompt_blocks(changed, 4, MODEL_ID)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_cache_salt_and_model_separate_hashes() -> None:
    token_ids = list(range(8))
    plain = hash_prompt_blocks(token_ids, 4, MODEL_ID)
    assert plain == hash_prompt_blocks(token_ids, 4, MODEL_ID, "")
    salted = hash_prompt_blocks(token_ids, 4, MODEL_ID, "tenant-a")
    other_salt = hash_prompt_blocks(token_ids, 4, MODEL_ID, "tenant-b")
    other_model = hash_prompt_blocks(token_ids, 4, "other-model")
    for block_hashes in (salted, other_salt, other_model):
        assert not set(block_hashes) & set(plain)
    assert not set(salted) & set(other_salt)
    # the length prefixes keep ("ab", "c") and ("a", "bc") apart
    assert root_block_hash("ab", "c") != root_block_hash("a", "bc")


_SUBPROCESS_SNIPPET = (
    "from wavepp.runtime.kv import hash_prompt_blocks;"
    "print(','.join(h.hex() for h in hash_prompt_blocks(list(range(40)), 16, 'm', 'salt')))"
)


def test_hashes_are_equal_across_processes_and_hash_seeds() -> None:
    outputs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_SNIPPET],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outputs.append(result.stdout.strip())
    here = ",".join(h.hex() for h in hash_prompt_blocks(list(range(40)), 16, "m", "salt"))
    assert outputs[0] == outputs[1] == here
    assert len(here.split(",")) == 2


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: hash_prompt_blocks([1, 2], 0, MODEL_ID), "block_size must be an int > 0, got 0"),
        (lambda: hash_prompt_blocks([1, 2], -4, MODEL_ID), "block_size"),
        (lambda: root_block_hash("", "s"), "model_id must be a non-empty str"),
        (lambda: hash_block_tokens(b"short", [1]), "parent_block_hash must be a 32-byte"),
        (lambda: hash_block_tokens(b"\0" * 32, [1, -1]), r"token_ids\[1\] = -1"),
        (lambda: hash_block_tokens(b"\0" * 32, [2**32]), r"token_ids\[0\]"),
        (lambda: hash_block_tokens(b"\0" * 32, [1.5]), r"token_ids\[0\] = 1.5"),
    ],
)
def test_hashing_rejects_bad_arguments(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ---- BlockPool ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "match"),
    [(0, 16, "num_blocks must be an int > 0, got 0"), (-1, 16, "num_blocks"), (4, 0, "block_size")],
)
def test_pool_rejects_bad_sizes(num_blocks: int, block_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BlockPool(num_blocks, block_size)


def test_new_pool_is_all_free_in_id_order() -> None:
    pool = BlockPool(4, 16)
    assert pool.free_block_ids() == [0, 1, 2, 3]
    assert (pool.num_free_blocks, pool.num_cached_blocks, pool.num_pinned_blocks) == (4, 0, 0)
    assert pool.allocate(2) == [0, 1]
    assert pool.free_block_ids() == [2, 3]
    assert (pool.num_free_blocks, pool.num_pinned_blocks) == (2, 2)
    assert pool.ref_cnt(0) == 1 and pool.ref_cnt(2) == 0
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_free_releases_tail_first_so_chain_tail_is_evicted_first() -> None:
    pool = BlockPool(6, 2)
    h = _hashes(3)
    assert pool.allocate(3) == [0, 1, 2]
    pool.cache_full_blocks([0, 1, 2], h, None)
    pool.free([0, 1, 2])
    assert pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert pool.num_evictable_blocks == 3
    pool.take_events()
    # 3 uncached blocks go first, then the chain's tail (block 2), its prefix stays
    assert pool.allocate(4) == [3, 4, 5, 2]
    assert pool.take_events() == [KVEvent("removed", (h[2],), None)]
    assert pool.find_longest_cache_hit(h) == [0, 1]
    assert pool.block_hash(2) is None and pool.block_hash(1) == h[1]
    pool.check_invariants()


def test_uncached_blocks_go_to_the_front_cached_to_the_back() -> None:
    pool = BlockPool(6, 2)
    h = _hashes(1)
    assert pool.allocate(3) == [0, 1, 2]
    pool.cache_full_blocks([0], h, None)  # blocks 1, 2 never became full/computed
    pool.free([0, 1, 2])
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 0]
    assert pool.allocate(5) == [1, 2, 3, 4, 5]
    assert pool.find_longest_cache_hit(h) == [0]
    pool.check_invariants()


def test_least_recently_freed_cached_blocks_are_evicted_first() -> None:
    pool = BlockPool(4, 2)
    ha, hb = _hashes(2, "a"), _hashes(2, "b")
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) == [2, 3]
    pool.cache_full_blocks([0, 1], ha, None)
    pool.cache_full_blocks([2, 3], hb, None)
    pool.free([2, 3])  # b freed first: older
    pool.free([0, 1])
    assert pool.free_block_ids() == [3, 2, 1, 0]
    # a hit moves a's blocks out of the queue; freeing them again makes them newest
    hit = pool.find_longest_cache_hit(ha)
    assert hit == [0, 1]
    pool.pin(hit)
    assert pool.free_block_ids() == [3, 2]
    pool.free(hit)
    assert pool.free_block_ids() == [3, 2, 1, 0]
    pool.pin(pool.find_longest_cache_hit(hb))
    pool.free([2, 3])
    assert pool.free_block_ids() == [1, 0, 3, 2]  # now a is least recently used
    assert pool.allocate(1) == [1]
    pool.check_invariants()


def test_find_longest_cache_hit_returns_only_the_leading_run_and_has_no_side_effects() -> None:
    pool = BlockPool(4, 2)
    h = _hashes(3)
    pool.allocate(3)
    pool.cache_full_blocks([0, 2], [h[0], h[2]], None)
    pool.free([0, 1, 2])
    before = (pool.free_block_ids(), pool.num_pinned_blocks, pool.take_events())
    assert pool.find_longest_cache_hit(h) == [0]  # h[1] missing stops the run at 1
    assert pool.find_longest_cache_hit(h[1:]) == []
    assert pool.find_longest_cache_hit([h[2]]) == [2]
    assert (pool.free_block_ids(), pool.num_pinned_blocks, pool.take_events()) == (
        before[0],
        before[1],
        [],
    )


def test_pinned_blocks_are_never_evicted_and_ref_counts_add_up() -> None:
    pool = BlockPool(3, 2)
    h = _hashes(2)
    pool.allocate(2)
    pool.cache_full_blocks([0, 1], h, None)
    pool.pin([0, 1])  # a second holder
    assert (pool.ref_cnt(0), pool.ref_cnt(1)) == (2, 2)
    pool.free([0, 1])
    assert pool.num_pinned_blocks == 2 and pool.free_block_ids() == [2]
    assert pool.allocate(2) is None
    assert pool.allocate(1) == [2]
    assert pool.find_longest_cache_hit(h) == [0, 1]
    pool.check_invariants()


def test_allocate_returns_none_without_side_effects() -> None:
    pool = BlockPool(3, 2)
    h = _hashes(2)
    pool.allocate(2)
    pool.cache_full_blocks([0, 1], h, None)
    pool.free([0, 1])
    pool.take_events()
    before = (pool.free_block_ids(), pool.cached_block_hashes(), pool.num_pinned_blocks)
    assert pool.allocate(4) is None
    after = (pool.free_block_ids(), pool.cached_block_hashes(), pool.num_pinned_blocks)
    assert after == before
    assert pool.take_events() == []
    with pytest.raises(ValueError, match="num_blocks must be an int >= 0, got -1"):
        pool.allocate(-1)


def test_duplicate_hash_leaves_the_second_block_unhashed() -> None:
    pool = BlockPool(4, 2)
    (h,) = _hashes(1)
    assert pool.allocate(1) == [0]
    assert pool.allocate(1) == [1]
    pool.cache_full_blocks([0], [h], None)
    pool.cache_full_blocks([1], [h], None)
    assert pool.block_hash(0) == h and pool.block_hash(1) is None
    assert pool.num_cached_blocks == 1
    assert pool.find_longest_cache_hit([h]) == [0]
    # both calls announce h: after each, the stage holds h
    assert pool.take_events() == [KVEvent("stored", (h,), None)] * 2
    pool.free([1])  # the duplicate is uncached: front of the queue
    assert pool.free_block_ids() == [1, 2, 3]
    pool.check_invariants()


def test_cache_full_blocks_is_idempotent_for_the_same_hash() -> None:
    pool = BlockPool(2, 2)
    h = _hashes(2)
    pool.allocate(2)
    pool.cache_full_blocks([0, 1], h, None)
    pool.cache_full_blocks([1], h[1:], h[0])
    assert [pool.block_hash(0), pool.block_hash(1)] == h
    assert pool.take_events() == [
        KVEvent("stored", tuple(h), None),
        KVEvent("stored", (h[1],), h[0]),
    ]
    assert pool.take_events() == []


def test_events_for_store_and_eviction_in_order() -> None:
    pool = BlockPool(2, 2)
    ha, hb = _hashes(2, "a"), _hashes(2, "b")
    pool.allocate(2)
    pool.cache_full_blocks([0, 1], ha, None)
    pool.free([0, 1])
    pool.allocate(2)
    pool.cache_full_blocks([1, 0], hb, ha[1])
    assert pool.take_events() == [
        KVEvent("stored", tuple(ha), None),
        KVEvent("removed", (ha[1], ha[0]), None),
        KVEvent("stored", tuple(hb), ha[1]),
    ]


@pytest.mark.parametrize(
    ("action", "match"),
    [
        (lambda pool, h: pool.pin([3]), "block 3 is free and uncached"),
        (lambda pool, h: pool.pin([7]), r"block id 7 is not in \[0, 4\)"),
        (lambda pool, h: pool.free([0, 0]), "block 0 released 2 time"),
        (lambda pool, h: pool.free([3]), "block 3 released 1 time"),
        (lambda pool, h: pool.cache_full_blocks([0], h, None), "block_ids has 1 ids but"),
        (lambda pool, h: pool.cache_full_blocks([0], [h[1]], None), "already holds hash"),
        (lambda pool, h: pool.cache_full_blocks([3], [h[1]], None), "block 3 is not pinned"),
        (lambda pool, h: pool.cache_full_blocks([1, 1], h, None), "must be distinct"),
        (lambda pool, h: pool.cache_full_blocks([1], [b"x"], None), r"block_hashes\[0\]"),
        (lambda pool, h: pool.cache_full_blocks([1], [h[1]], b"x"), "parent_block_hash"),
    ],
)
def test_pool_caller_mistakes_raise_and_change_nothing(action, match: str) -> None:
    pool = BlockPool(4, 2)
    h = _hashes(2)
    pool.allocate(2)
    pool.cache_full_blocks([0], h[:1], None)
    pool.take_events()
    before = [(pool.ref_cnt(i), pool.block_hash(i)) for i in range(4)], pool.free_block_ids()
    with pytest.raises(ValueError, match=match):
        action(pool, h)
    after = [(pool.ref_cnt(i), pool.block_hash(i)) for i in range(4)], pool.free_block_ids()
    assert after == before
    assert pool.take_events() == []
    pool.check_invariants()


def _cached_pool(num_blocks: int, hashes: list[bytes]) -> BlockPool:
    """A pool holding ``hashes`` on blocks 0..len - 1, all released (LRU: tail first)."""
    pool = BlockPool(num_blocks, 2)
    block_ids = pool.allocate(len(hashes))
    assert block_ids is not None
    pool.cache_full_blocks(block_ids, hashes, None)
    pool.free(block_ids)
    pool.take_events()
    return pool


@pytest.mark.parametrize("span_min_blocks", [1, 8, 100])
def test_a_shared_prefix_pinned_from_an_earlier_walk_counts_each_holder(
    span_min_blocks: int,
) -> None:
    """Holders pinning a prefix from an earlier walk (a span, when long enough) see the same
    ref counts, free queue order and refusals as with one ref count per block per holder."""
    h = _hashes(10)
    pool = _cached_pool(14, h)
    pool.span_min_blocks = span_min_blocks
    walk = pool.pin_cache_hit(h[:9])  # a full walk: plain per-block refs
    assert list(walk.block_ids) == list(range(9))
    a = pool.pin_cache_hit(h[:8] + _hashes(1, "x"), walk, 8)
    b = pool.pin_cache_hit(h[:10], walk, 8)  # goes on past the prior's 8 blocks
    assert list(a.block_ids) == list(range(8))
    assert list(b.block_ids) == list(range(10))
    assert [pool.ref_cnt(i) for i in range(10)] == [3] * 8 + [2, 1]
    pool.check_invariants()
    with pytest.raises(ValueError, match="block 9 released 2 time"):
        pool.free([*b.block_ids, 9])
    assert [pool.ref_cnt(i) for i in range(10)] == [3] * 8 + [2, 1]
    pool.free(list(b.block_ids[6:]))  # a release of the blocks past 6: cuts the prefix
    assert [pool.ref_cnt(i) for i in range(10)] == [3] * 6 + [2, 2, 1, 0]
    pool.check_invariants()
    pool.free(list(a.block_ids))  # one holder less; nothing freed
    assert [pool.ref_cnt(i) for i in range(10)] == [2] * 6 + [1, 1, 1, 0]
    assert pool.free_block_ids() == [10, 11, 12, 13, 9]
    pool.check_invariants()
    pool.free(list(b.block_ids[:6]))
    pool.free(list(walk.block_ids))
    assert pool.num_pinned_blocks == 0
    # released tail first: the walk's chain reversed after block 9 (freed before it)
    assert pool.free_block_ids() == [10, 11, 12, 13, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    pool.check_invariants()


def test_the_last_holder_of_a_span_releases_its_blocks_tail_first() -> None:
    h = _hashes(8)
    pool = _cached_pool(10, h)
    pool.span_min_blocks = 2
    walk = pool.pin_cache_hit(h)
    holders = [pool.pin_cache_hit(h, walk, 8) for _ in range(3)]
    pool.free(list(walk.block_ids))
    fresh = pool.allocate(2)
    assert fresh == [8, 9]
    for index, hit in enumerate(holders):
        pool.free([*hit.block_ids, *fresh] if index == 2 else list(hit.block_ids))
        if index < 2:
            assert [pool.ref_cnt(i) for i in range(8)] == [2 - index] * 8
            pool.check_invariants()
    assert pool.free_block_ids() == [8, 9, 7, 6, 5, 4, 3, 2, 1, 0]
    pool.check_invariants()


def test_a_release_that_cuts_a_span_of_several_holders_keeps_the_others_pins() -> None:
    h = _hashes(6)
    pool = _cached_pool(8, h)
    pool.span_min_blocks = 2
    walk = pool.pin_cache_hit(h)
    a, b = (pool.pin_cache_hit(h, walk, 6) for _ in range(2))
    pool.free(list(walk.block_ids[3:]))  # (not from the span's head: per-block refs go)
    pool.free(list(walk.block_ids[:3]))  # now the two hold the blocks through the span only
    assert [pool.ref_cnt(i) for i in range(6)] == [2] * 6
    pool.free(list(b.block_ids[3:]))  # L* = 3 on this stage
    assert [pool.ref_cnt(i) for i in range(6)] == [2, 2, 2, 1, 1, 1]
    pool.check_invariants()
    pool.free(list(a.block_ids))
    assert pool.free_block_ids() == [6, 7, 5, 4, 3]
    pool.free(list(b.block_ids[:3]))
    assert pool.free_block_ids() == [6, 7, 5, 4, 3, 2, 1, 0]
    pool.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    pool = BlockPool(2, 2)
    pool.allocate(1)
    pool._ref[0] = 0  # corrupt on purpose: ref 0 but not queued
    with pytest.raises(AssertionError, match="block 0"):
        pool.check_invariants()


# ---- StageKVManager -------------------------------------------------------------------------

BLOCK_SIZE = 2
PROMPT = [11, 12, 13, 14, 15, 16, 17]  # 3 full blocks + 1 token: 4 blocks in all
PROMPT_HASHES = hash_prompt_blocks(PROMPT, BLOCK_SIZE, MODEL_ID)


def _manager(num_blocks: int) -> tuple[StageKVManager, FakeClock]:
    clock = FakeClock()
    return StageKVManager(BlockPool(num_blocks, BLOCK_SIZE), clock=clock), clock


def _run_prompt(manager: StageKVManager, request_id: str) -> list[int]:
    """Probe (miss or hit), reserve after the hit, compute the prompt, release."""
    manager.probe_pin(request_id, PROMPT_HASHES, lease_s=10)
    table = manager.reserve(request_id, 4, lease_s=10)
    assert table is not None
    manager.mark_computed(request_id, len(PROMPT), PROMPT_HASHES)
    assert manager.release(request_id)
    return table


def test_miss_then_hit_reuses_the_cached_prefix() -> None:
    manager, _ = _manager(8)
    pool = manager.pool
    assert manager.probe_pin("r1", PROMPT_HASHES, lease_s=10) == 0
    assert manager.reserve("r1", 4, lease_s=10) == [0, 1, 2, 3]
    assert manager.block_table("r1") == [0, 1, 2, 3]
    manager.mark_computed("r1", len(PROMPT), PROMPT_HASHES)
    assert [pool.block_hash(i) for i in range(4)] == [*PROMPT_HASHES, None]  # partial: no hash
    assert manager.take_events() == [KVEvent("stored", tuple(PROMPT_HASHES), None)]
    assert manager.release("r1") is True
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert pool.num_cached_blocks == 3 and manager.num_requests == 0

    assert manager.probe_pin("r2", PROMPT_HASHES, lease_s=10) == 3
    assert [pool.ref_cnt(i) for i in range(3)] == [1, 1, 1]
    assert manager.reserve("r2", 4, lease_s=10) == [0, 1, 2, 3]
    manager.mark_computed("r2", len(PROMPT), PROMPT_HASHES)
    assert manager.take_events() == []  # nothing new became full
    pool.check_invariants()


def test_chunked_mark_computed_hashes_blocks_as_they_fill() -> None:
    manager, _ = _manager(8)
    pool = manager.pool
    manager.probe_pin("r1", PROMPT_HASHES, lease_s=10)
    manager.reserve("r1", 4, lease_s=10)
    manager.mark_computed("r1", 1, PROMPT_HASHES)
    assert manager.take_events() == [] and pool.num_cached_blocks == 0
    manager.mark_computed("r1", 3, PROMPT_HASHES)
    assert pool.block_hash(0) == PROMPT_HASHES[0] and pool.block_hash(1) is None
    manager.mark_computed("r1", 6, PROMPT_HASHES)
    manager.mark_computed("r1", 5, PROMPT_HASHES)  # smaller count: no effect
    assert [pool.block_hash(i) for i in range(3)] == PROMPT_HASHES
    assert manager.take_events() == [
        KVEvent("stored", (PROMPT_HASHES[0],), None),
        KVEvent("stored", (PROMPT_HASHES[1], PROMPT_HASHES[2]), PROMPT_HASHES[0]),
    ]


def test_concurrent_identical_prompts_leave_duplicates_uncached() -> None:
    manager, _ = _manager(8)
    pool = manager.pool
    for request_id in ("r1", "r2"):
        assert manager.probe_pin(request_id, PROMPT_HASHES, lease_s=10) == 0
    assert manager.reserve("r1", 4, lease_s=10) == [0, 1, 2, 3]
    assert manager.reserve("r2", 4, lease_s=10) == [4, 5, 6, 7]
    manager.mark_computed("r1", 7, PROMPT_HASHES)
    manager.mark_computed("r2", 7, PROMPT_HASHES)
    assert [pool.block_hash(i) for i in range(4, 8)] == [None] * 4
    manager.release("r2")
    assert pool.free_block_ids() == [4, 5, 6, 7]  # all uncached: front, released tail first
    manager.release("r1")
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    pool.check_invariants()


def test_a_refused_reservation_releases_all_pins_and_forgets_the_request() -> None:
    clock = FakeClock()
    manager = StageKVManager(BlockPool(5, BLOCK_SIZE), clock=clock)
    pool = manager.pool
    prompt_hashes = PROMPT_HASHES[:3]
    manager.probe_pin("r1", prompt_hashes, lease_s=10)
    assert manager.reserve("r1", 3, lease_s=10) == [0, 1, 2]
    manager.mark_computed("r1", 6, prompt_hashes)
    manager.release("r1")
    assert pool.free_block_ids() == [3, 4, 2, 1, 0]

    assert manager.probe_pin("r2", prompt_hashes, lease_s=10) == 3
    assert manager.probe_pin("r3", _hashes(2, "x"), lease_s=10) == 0
    assert manager.reserve("r3", 2, lease_s=10) == [3, 4]
    assert pool.num_free_blocks == 0
    # r2 holds its 3-block hit and needs 1 fresh block: none is free
    assert manager.reserve("r2", 4, lease_s=10) is None
    assert manager.num_requests == 1
    assert [pool.ref_cnt(i) for i in range(5)] == [0, 0, 0, 1, 1]
    assert pool.free_block_ids() == [2, 1, 0]
    assert pool.find_longest_cache_hit(prompt_hashes) == [0, 1, 2]  # refusal evicted nothing
    with pytest.raises(KeyError, match="r2"):
        manager.block_table("r2")
    with pytest.raises(KeyError, match="probe_pin first"):
        manager.reserve("r2", 4, lease_s=10)
    assert manager.release("r2") is False
    pool.check_invariants()


def test_probe_and_reserve_are_idempotent_by_request_id() -> None:
    manager, clock = _manager(8)
    pool = manager.pool
    _run_prompt(manager, "r0")
    assert manager.probe_pin("r1", PROMPT_HASHES, lease_s=10) == 3
    assert manager.probe_pin("r1", PROMPT_HASHES, lease_s=10) == 3
    assert manager.probe_pin("r1", [], lease_s=10) == 3
    assert [pool.ref_cnt(i) for i in range(3)] == [1, 1, 1]
    table = manager.reserve("r1", 4, lease_s=10)
    assert table == [0, 1, 2, 3]
    num_free_blocks = pool.num_free_blocks
    assert manager.reserve("r1", 4, lease_s=10) == table
    assert manager.probe_pin("r1", PROMPT_HASHES, lease_s=10) == 3  # the held hit
    assert pool.num_free_blocks == num_free_blocks
    with pytest.raises(ValueError, match="already reserved with num_total_blocks=4"):
        manager.reserve("r1", 3, lease_s=10)
    assert manager.release("r1") is True
    assert manager.release("r1") is False
    assert pool.num_pinned_blocks == 0
    pool.check_invariants()


def test_release_keeps_cached_blocks() -> None:
    manager, _ = _manager(8)
    pool = manager.pool
    _run_prompt(manager, "r0")
    manager.probe_pin("r1", PROMPT_HASHES, lease_s=10)
    assert manager.held_blocks("r1") == (0, 1, 2)
    assert manager.release("nobody") is False  # an unknown id frees nobody's pin
    assert pool.num_pinned_blocks == 3
    assert manager.release("r1") is True
    assert pool.num_pinned_blocks == 0 and pool.num_cached_blocks == 3
    assert manager.release("never-seen") is False


def test_leases_expire_probed_and_reserved_requests() -> None:
    manager, clock = _manager(8)
    pool = manager.pool
    manager.probe_pin("r1", PROMPT_HASHES, lease_s=5)
    manager.probe_pin("r2", PROMPT_HASHES, lease_s=10)
    assert manager.reserve("r2", 4, lease_s=10) is not None
    clock.now_s = 4.9
    assert manager.expire() == []
    clock.now_s = 5.0
    assert manager.expire() == ["r1"]
    clock.now_s = 9.0
    manager.renew(["r2", "unknown"], lease_s=10)  # r2 now expires at 19
    clock.now_s = 15.0
    assert manager.expire() == []
    assert manager.num_requests == 1 and pool.num_pinned_blocks == 4
    manager.renew(["r2"], lease_s=2)  # a renewal sets the lease, also to an earlier time: 17
    clock.now_s = 17.0
    assert manager.expire() == ["r2"]
    assert manager.num_requests == 0
    assert pool.num_free_blocks == pool.num_blocks and pool.num_pinned_blocks == 0
    pool.check_invariants()


def test_expire_orders_by_expiry_and_repeated_probe_extends_lease() -> None:
    manager, clock = _manager(8)
    manager.probe_pin("late", PROMPT_HASHES, lease_s=3)
    manager.probe_pin("early", PROMPT_HASHES, lease_s=2)
    clock.now_s = 1.0
    manager.probe_pin("late", PROMPT_HASHES, lease_s=4)  # extended to 5
    clock.now_s = 4.0
    assert manager.expire() == ["early"]
    clock.now_s = 10.0
    manager.probe_pin("a", [], lease_s=1)
    manager.probe_pin("b", [], lease_s=1)
    clock.now_s = 11.0
    assert manager.expire() == ["late", "a", "b"]


def test_manager_caller_mistakes_raise_clear_errors() -> None:
    manager, _ = _manager(8)
    _run_prompt(manager, "r0")
    assert manager.probe_pin("r1", PROMPT_HASHES, lease_s=10) == 3
    with pytest.raises(ValueError, match="num_total_blocks = 2 must be an int >= 1 and >= the 3"):
        manager.reserve("r1", 2, lease_s=10)
    with pytest.raises(ValueError, match="another owner"):
        manager.reserve("r1", 4, lease_s=10, owner="intruder")
    for bad_lease_s in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="lease_s must be a finite number"):
            manager.probe_pin("r9", PROMPT_HASHES, lease_s=bad_lease_s)
    with pytest.raises(ValueError, match="request_id must be a non-empty str"):
        manager.probe_pin("", PROMPT_HASHES, lease_s=10)
    with pytest.raises(ValueError, match="is not reserved; reserve before computing"):
        manager.mark_computed("r1", 2, PROMPT_HASHES)
    with pytest.raises(KeyError, match="nope"):
        manager.mark_computed("nope", 2, PROMPT_HASHES)
    with pytest.raises(KeyError, match="not reserved"):
        manager.block_table("r1")
    assert manager.reserve("r1", 4, lease_s=10) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"num_computed_tokens = 9 must be in \[0, 8\]"):
        manager.mark_computed("r1", 9, PROMPT_HASHES)
    with pytest.raises(ValueError, match="block_hashes has 2 hashes but 4 blocks"):
        manager.mark_computed("r1", 8, PROMPT_HASHES[:2])
    # nothing above changed the request's state
    assert manager.block_table("r1") == [0, 1, 2, 3]
    assert manager.num_requests == 1
    manager.pool.check_invariants()


def _cache(manager: StageKVManager, request_id: str, hashes: list[bytes]) -> list[int]:
    """Probe, reserve and compute ``hashes`` as one request, then release it: cached blocks."""
    manager.probe_pin(request_id, hashes, 5.0)
    table = manager.reserve(request_id, len(hashes), 5.0)
    assert table is not None
    manager.mark_computed(request_id, len(hashes) * manager.pool.block_size, hashes)
    manager.release(request_id)
    return table


def test_a_probe_starts_from_the_latest_walk_of_its_prefix_and_pins_what_a_full_walk_pins() -> None:
    manager = StageKVManager(BlockPool(32, 4))
    chain = _hashes(5, "a")
    _cache(manager, "warm", chain)
    # a probe of the same prefix starts from the walk before it: same blocks as a full walk
    assert manager.probe_pin("p1", chain[:3] + _hashes(2, "x"), 5.0) == 3
    assert manager.probe_pin("p2", chain + _hashes(1, "y"), 5.0) == 5
    assert manager.held_blocks("p2") == tuple(manager.pool.find_longest_cache_hit(chain))
    # blocks stored since the walk that stopped early: the next probe goes on past it
    _cache(manager, "more", chain[:3] + _hashes(2, "x"))
    assert manager.probe_pin("p3", chain[:3] + _hashes(2, "x"), 5.0) == 5
    # evicted since: the earlier walk is not used
    for request_id in ("p1", "p2", "p3"):
        manager.release(request_id)
    assert manager.probe_pin("big", _hashes(1, "z"), 5.0) == 0
    assert manager.reserve("big", 32, 5.0) is not None  # takes every block: evicts all
    manager.release("big")
    assert manager.probe_pin("p4", chain[:3] + _hashes(2, "x"), 5.0) == 0
    manager.pool.check_invariants()


def test_a_probe_sharing_first_and_last_hashes_with_a_forged_one_does_not_inherit_its_blocks() -> (
    None
):
    """A forged probe whose hashes match a real chain's at the ends but name another cached
    block in the middle: a later real probe must not take that block (the common prefix is
    compared, not guessed from a binary search over the chain)."""
    manager = StageKVManager(BlockPool(32, 4))
    chain, other = _hashes(5, "a"), _hashes(2, "b")
    _cache(manager, "warm-a", chain)
    _cache(manager, "warm-b", other)
    forged = [chain[0], other[1], *chain[2:]]
    assert manager.probe_pin("forged", forged, 5.0) == 5
    assert manager.probe_pin("real", chain, 5.0) == 5
    assert manager.held_blocks("real") == tuple(manager.pool.find_longest_cache_hit(chain))


_SHARED_TOKENS = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(2)]


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(
            st.integers(0, 1),  # which shared prefix
            st.integers(0, 40),  # how much of it
            st.lists(st.integers(0, 3), max_size=12),  # then new tokens
            st.sampled_from(["", "tenant"]),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_a_prompt_hasher_hashes_as_hash_prompt_blocks(prompts: list) -> None:
    """Prompts sharing prefixes of every length (also mid-block, and with other salts): the
    hasher that reuses a recent prompt's blocks answers exactly as hashing from scratch."""
    hasher = PromptHasher(4, MODEL_ID, max_prompts=2)
    for which, length, tail, salt in prompts:
        token_ids = _SHARED_TOKENS[which][:length] + tail
        assert hasher(token_ids, salt) == hash_prompt_blocks(token_ids, 4, MODEL_ID, salt)


def _reference_chain(token_ids: list[int], block_size: int, salt: str) -> list[bytes]:
    """The chain by its definition: ``hash_block_tokens`` (one ``struct.pack`` per block)."""
    parent, chain = root_block_hash(MODEL_ID, salt), []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        chain.append(parent)
    return chain


@settings(max_examples=150, deadline=None)
@given(
    base=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=70),
    edits=st.lists(
        st.tuples(st.integers(0, 69), st.sampled_from([0, 1, 2**31, 2**32 - 1])), max_size=3
    ),
    cut=st.integers(0, 70),
    block_size=st.sampled_from([1, 3, 8]),
)
def test_hashes_are_byte_identical_to_the_per_block_definition(
    base: list[int], edits: list, cut: int, block_size: int
) -> None:
    """``hash_prompt_blocks`` (one vectorised encoding of the prompt) and ``PromptHasher``
    (the first differing token found by a vectorised compare against the latest prompt) give
    exactly the hashes of the per-block definition, over the whole u32 range, for prompts that
    differ from the one before at any position (or not at all, or are cut short)."""
    hasher = PromptHasher(block_size, MODEL_ID)
    edited = list(base)
    for position, value in edits:
        if position < len(edited):
            edited[position] = value
    for token_ids in (base, edited, edited[:cut], base, base + [7] * block_size):
        assert hash_prompt_blocks(token_ids, block_size, MODEL_ID) == _reference_chain(
            token_ids, block_size, ""
        )
        assert hasher(token_ids) == _reference_chain(token_ids, block_size, "")


def test_prompt_hashes_keep_their_values() -> None:
    """The encoding is a wire contract between processes and versions: the first two hashes of
    a fixed prompt (values from before the vectorised encoder; a change here changes every
    stored block's name)."""
    token_ids = [0, 1, 2**32 - 1, 70000, *range(12)]
    assert [h.hex()[:16] for h in hash_prompt_blocks(token_ids, 8, "m", "salt")] == [
        "63161e300df79f77",
        "ec41e21a33e8b2fc",
    ]


def test_a_prompt_hasher_refuses_what_hash_prompt_blocks_refuses() -> None:
    hasher = PromptHasher(4, MODEL_ID)
    with pytest.raises(ValueError, match="token_ids"):
        hasher([1, 2, -3, 4])
    with pytest.raises(ValueError, match="model_id"):
        PromptHasher(4, "")([1, 2, 3, 4])


def test_a_lease_accepted_before_is_checked_again_against_a_lowered_bound() -> None:
    """The manager skips re-checking the lease it accepted last (a round's entries share one),
    but not once ``max_lease_s`` changed, and never for a value of another type."""
    manager = StageKVManager(BlockPool(8, BLOCK_SIZE), max_lease_s=10.0)
    manager.probe_pin("a", PROMPT_HASHES, 10.0)
    manager.max_lease_s = 5.0
    with pytest.raises(ValueError, match="max_lease_s=5.0"):
        manager.probe_pin("b", PROMPT_HASHES, 10.0)
    manager.max_lease_s = None
    manager.probe_pin("c", PROMPT_HASHES, 10.0)
    with pytest.raises(ValueError, match="lease_s must be a finite number"):
        manager.probe_pin("d", PROMPT_HASHES, float("inf"))
    with pytest.raises(ValueError, match="lease_s must be a finite number"):
        manager.probe_pin("d", PROMPT_HASHES, "10.0")  # type: ignore[arg-type]
    assert manager.request_ids() == ["a", "c"]
