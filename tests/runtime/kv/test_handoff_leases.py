"""Handoff leases pin a request's blocks past the request's own release, and every way a lease
ends (release, expiry, release_all) returns the pool to its free and pinned counts."""

from __future__ import annotations

import pytest

from wavepp.runtime.kv import BlockPool
from wavepp.runtime.kv.handoff import HandoffLeases


def test_lease_outlives_the_request_and_release_frees_every_block() -> None:
    pool = BlockPool(16, 4)
    leases = HandoffLeases(pool)
    free0 = pool.num_free_blocks
    blocks = pool.allocate(3)  # the request's table: 10 tokens in 3 blocks
    assert blocks is not None
    lease = leases.hold("r", tuple(blocks), 10, expires=100.0)
    assert lease.block_ids == tuple(blocks)
    pool.free(blocks)  # the scheduler releases the request: the lease keeps the blocks
    assert pool.num_pinned_blocks == 3 and pool.num_free_blocks == free0 - 3
    assert leases.num_pinned_blocks() == 3
    assert leases.release("r") and not leases.release("r")
    assert pool.num_free_blocks == free0 and pool.num_pinned_blocks == 0
    pool.check_invariants()


def test_expiry_and_release_all_end_leases() -> None:
    pool = BlockPool(16, 4)
    leases = HandoffLeases(pool)
    free0 = pool.num_free_blocks
    for rid, expires in (("a", 5.0), ("b", 9.0), ("c", 50.0)):
        blocks = pool.allocate(2)
        assert blocks is not None
        leases.hold(rid, tuple(blocks), 8, expires=expires)
        pool.free(blocks)
    assert leases.expire(4.9) == []
    assert leases.expire(9.0) == ["a", "b"]
    assert leases.num_expired == 2 and len(leases) == 1
    assert leases.release_all() == ["c"]
    assert pool.num_free_blocks == free0 and pool.num_pinned_blocks == 0
    pool.check_invariants()


def test_hold_refuses_bad_input_and_changes_nothing() -> None:
    pool = BlockPool(8, 4)
    leases = HandoffLeases(pool, max_leases=1)
    blocks = pool.allocate(2)
    assert blocks is not None
    with pytest.raises(ValueError, match="cannot hold num_tokens=9"):
        leases.hold("r", tuple(blocks), 9, expires=1.0)
    with pytest.raises(ValueError, match="free and uncached"):
        leases.hold("r", (7,), 4, expires=1.0)  # not the request's block
    leases.hold("r", tuple(blocks), 8, expires=1.0)
    with pytest.raises(ValueError, match="already has a handoff lease"):
        leases.hold("r", tuple(blocks), 8, expires=1.0)
    with pytest.raises(ValueError, match="max_leases"):
        leases.hold("s", tuple(blocks), 8, expires=1.0)
    assert pool.num_pinned_blocks == 2
