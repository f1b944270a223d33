"""A host-tier transfer log whose copies fail (the engine's ``apply_transfers`` raises) leaves
no bookkeeping that claims those bytes: the device blocks its loads filled and the host slots its
spills wrote lose their hashes, so no later probe counts them and no later plan loads them; the
micro-batch carries an error. The engine's failure is the one stand-in here (a callable that
raises): a copy that fails cannot be provoked in a real engine on demand."""

from __future__ import annotations

from collections.abc import Sequence

from wavepp.api.messages import MicroBatchPlan, PlannedChunk
from wavepp.runtime.kv import BlockPool, HostTier, StageKVManager, Transfer, hash_prompt_blocks
from wavepp.runtime.stage.core import StageCore

BLOCK = 4


def _tokens(prefix: int, num_blocks: int) -> list[int]:
    return [prefix * 1000 + i for i in range(num_blocks * BLOCK)]


def _hashes(tokens: list[int]) -> list[bytes]:
    return hash_prompt_blocks(tokens, BLOCK, "m", "")


def _reserve(manager: StageKVManager, request_id: str, tokens: list[int]) -> int:
    hit = manager.probe_pin(request_id, _hashes(tokens), 5.0)
    assert manager.reserve(request_id, -(-len(tokens) // BLOCK), 5.0) is not None
    return hit


def _plan(request_id: str, context_offset: int, num_tokens: int = 1) -> MicroBatchPlan:
    chunk = PlannedChunk(
        request_id=request_id,
        chunk_index=0,
        context_offset=context_offset,
        token_ids=list(range(num_tokens)),
        is_last=True,
    )
    return MicroBatchPlan(epoch="e", microbatch_id=0, chunks=[chunk])


def _failing(transfers: Sequence[Transfer]) -> None:
    raise RuntimeError(f"copy of {len(transfers)} blocks failed")


def _stage_with_spilled_prefix() -> tuple[StageKVManager, StageCore, list[int]]:
    """A 12-block stage whose device evicted prompt A's 6 blocks to its host tier (spills
    logged, not yet applied)."""
    manager = StageKVManager(BlockPool(12, BLOCK, host=HostTier(16)), clock=lambda: 0.0)
    core = StageCore(manager, rank=1, num_stages=2, local_prepare=True, clock=lambda: 0.0)
    prompt_a = _tokens(1, 6) + [7]
    for request_id, tokens in (("a", prompt_a), ("b", _tokens(2, 12))):
        hit = _reserve(manager, request_id, tokens)
        manager.start_chunk(request_id, min(hit, (len(tokens) - 1) // BLOCK) * BLOCK)
        manager.mark_computed(request_id, len(tokens))
        manager.release(request_id)
    assert manager.pool.host.num_cached == 6
    return manager, core, prompt_a


def _check(manager: StageKVManager) -> None:
    manager.pool.check_invariants()
    manager.pool.host.check_invariants()


def test_failed_loads_leave_no_device_hash_behind() -> None:
    """The plan loads A's 6 blocks (after the 6 spills that put them on the host); the copies
    fail: neither tier holds A any more, so the next probe of A hits nothing."""
    manager, core, prompt_a = _stage_with_spilled_prefix()
    assert _reserve(manager, "a2", prompt_a) == 6
    work = core.accept(_plan("a2", 6 * BLOCK))
    kinds = [t.kind for t in work.transfers]  # A's 6 spills, B's as a2 took its blocks
    assert kinds[-6:] == ["load"] * 6 and set(kinds[:-6]) == {"spill"}
    core.apply_transfers(work, _failing)
    assert "host tier copies failed" in work.error
    held = set(_hashes(prompt_a))
    assert not held & manager.pool.cached_block_hashes()
    assert not held & manager.pool.host.cached_block_hashes()
    _check(manager)
    assert manager.probe_pin("a3", _hashes(prompt_a), 5.0) == 0
    events = manager.pool.take_events()
    removed = {
        h for e in events if e.kind == "removed" and e.tier == "device" for h in e.block_hashes
    }
    assert held <= removed  # the gateway's index hears the device hashes leave
    manager.release("a2")
    manager.release("a3")
    _check(manager)


def test_failed_spills_cannot_be_loaded_by_a_probe_that_pinned_them() -> None:
    """A probe pins A's host copies; the log carrying their spills fails with another
    micro-batch: the plan that would load them is refused, reading no KV."""
    manager, core, prompt_a = _stage_with_spilled_prefix()
    assert _reserve(manager, "a2", prompt_a) == 6  # pins the 6 host slots
    assert _reserve(manager, "c", _tokens(3, 1) + [7]) == 0
    work = core.accept(_plan("c", 0, 5))
    assert work.num_loads == 0 and len(work.transfers) > 6  # A's spills among them
    core.apply_transfers(work, _failing)
    assert work.error
    assert not set(_hashes(prompt_a)) & manager.pool.host.cached_block_hashes()
    _check(manager)
    later = core.accept(_plan("a2", 6 * BLOCK))
    assert later.error and not later.chunks and later.num_loads == 0
    manager.release("a2")
    manager.release("c")
    _check(manager)
    assert manager.pool.host.num_pinned == 0 and manager.pool.host.num_cached == 0


def test_applied_transfers_keep_the_bookkeeping() -> None:
    manager, core, prompt_a = _stage_with_spilled_prefix()
    _reserve(manager, "a2", prompt_a)
    work = core.accept(_plan("a2", 6 * BLOCK))
    applied: list[Transfer] = []
    core.apply_transfers(work, applied.extend)
    assert not work.error and applied == list(work.transfers)
    assert set(_hashes(prompt_a)) <= manager.pool.cached_block_hashes()
