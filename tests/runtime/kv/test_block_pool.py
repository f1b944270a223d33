"""BlockPool on tiny pools (wavepp.runtime.kv.pool): free order and eviction order, the longest
cache hit, pins and reference counts across shared spans, store and eviction events, and caller
mistakes that raise and change nothing."""

from __future__ import annotations

import hashlib

import pytest

from wavepp.runtime.kv import (
    BlockPool,
    KVEvent,
)


def _hashes(num_blocks: int, tag: str = "a") -> list[bytes]:
    """Distinct block hashes for pool-level tests (content is irrelevant to the pool)."""
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(num_blocks)]


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
