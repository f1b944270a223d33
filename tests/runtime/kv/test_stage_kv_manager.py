"""StageKVManager (wavepp.runtime.kv.manager): probe, reserve, compute and release of one
request; reuse of a cached prefix, refusals that hold nothing, idempotence by request id, leases
and their expiry, and caller mistakes."""

from __future__ import annotations

import hashlib

import pytest

from wavepp.runtime.kv import (
    BlockPool,
    KVEvent,
    StageKVManager,
    hash_prompt_blocks,
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


def test_on_release_hears_each_request_released_once() -> None:
    """``on_release`` is told the id of each request ``release`` releases (a bus message, a
    lease's expiry), after its blocks are freed; never for an unknown id or another owner's."""
    manager, clock = _manager(16)
    heard: list[tuple[str, int]] = []
    manager.on_release = lambda rid: heard.append((rid, manager.num_requests))
    manager.probe_pin("a", PROMPT_HASHES, lease_s=10, owner="o1")
    manager.probe_pin("b", PROMPT_HASHES, lease_s=1)
    assert not manager.release("a", owner="o2")  # another owner's: not released, not told
    assert not manager.release("unknown")
    assert heard == []
    assert manager.release("a", owner="o1")
    assert not manager.release("a", owner="o1")  # released already
    clock.now_s = 2.0
    assert manager.expire() == ["b"]
    assert heard == [("a", 1), ("b", 0)]  # each once, after it left the held requests
