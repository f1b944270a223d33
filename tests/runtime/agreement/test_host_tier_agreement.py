"""The agreement across tiers: a stage's hit is its device run plus the host run after it, the
reply carries the split (and a forged split is refused), the plan loads only pinned host
copies, and the L* policy loads or recomputes by cost."""

from __future__ import annotations

import pytest

from wavepp.api.kv_batch import BatchOp, KVBatch, KVWireError, ReserveEntry, encode_batch
from wavepp.api.kv_reply import EntryResult, EntryStatus, KVBatchReply, decode_reply, encode_reply
from wavepp.api.messages import MicroBatchPlan, PlannedChunk
from wavepp.runtime.agreement.stage_handler import handle_kv_batch
from wavepp.runtime.kv import BlockPool, HostTier, StageKVManager, hash_prompt_blocks
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.host_load import HostLoadPolicy
from wavepp.runtime.stage.core import StageCore

BLOCK = 4


def _tokens(prefix: int, num_blocks: int) -> list[int]:
    return [prefix * 1000 + i for i in range(num_blocks * BLOCK)]


def _stage(num_blocks: int = 12, num_slots: int = 16) -> StageKVManager:
    now = [0.0]
    return StageKVManager(
        BlockPool(num_blocks, BLOCK, host=HostTier(num_slots)), clock=lambda: now[0]
    )


def _serve(manager: StageKVManager, request_id: str, token_ids: list[int]) -> None:
    """One whole request on the stage at L* = its own hit: probe, reserve, run, release."""
    hashes = hash_prompt_blocks(token_ids, BLOCK, "m", "")
    hit = manager.probe_pin(request_id, hashes, 5.0)
    assert manager.reserve(request_id, -(-len(token_ids) // BLOCK), 5.0) is not None
    manager.start_chunk(request_id, min(hit, (len(token_ids) - 1) // BLOCK) * BLOCK)
    manager.mark_computed(request_id, len(token_ids))
    manager.release(request_id)


def _probe(manager: StageKVManager, request_id: str, token_ids: list[int]) -> EntryResult:
    hashes = tuple(hash_prompt_blocks(token_ids, BLOCK, "m", ""))
    entry = ReserveEntry(request_id, hashes, -(-len(token_ids) // BLOCK))
    batch = KVBatch(BatchOp.PROBE_RESERVE, (entry,), lease_s=5.0)
    reply = decode_reply(handle_kv_batch(manager, 0, encode_batch(batch)))
    assert not reply.error
    return reply.results[0]


def _spilled_prefix_stage() -> tuple[StageKVManager, list[int]]:
    """A stage whose device pool evicted prompt A's 6 blocks to its host tier."""
    manager = _stage()
    prompt_a = _tokens(1, 6) + [7]
    _serve(manager, "a", prompt_a)
    _serve(manager, "b", _tokens(2, 12))  # needs the whole pool: A's blocks spill
    assert manager.pool.num_cached_blocks == 12 and manager.pool.host.num_cached == 6
    return manager, prompt_a


def test_reply_carries_the_host_part_of_the_hit() -> None:
    manager, prompt_a = _spilled_prefix_stage()
    result = _probe(manager, "a2", prompt_a)
    assert result.status is EntryStatus.OK
    assert (result.value, result.host) == (6, 6)  # no device hit; the whole run on the host
    assert manager.num_host_hit_blocks("a2") == 6
    assert manager.pool.host.num_pinned == 6


def test_device_hit_then_host_run() -> None:
    manager, prompt_a = _spilled_prefix_stage()
    _serve(manager, "a-head", _tokens(1, 2) + [9])  # loads A's first 2 blocks to the device
    head = hash_prompt_blocks(prompt_a, BLOCK, "m", "")[:2]
    assert set(head) <= manager.pool.cached_block_hashes()
    assert not set(head) & manager.pool.host.cached_block_hashes()  # exclusive tiers
    result = _probe(manager, "a3", prompt_a)
    assert (result.value, result.host) == (6, 4)


@pytest.mark.parametrize(
    ("status", "value", "host"),
    [(EntryStatus.OK, 3, 4), (EntryStatus.REFUSED, 0, 1), (EntryStatus.INVALID, 0, 2)],
)
def test_a_forged_tier_split_is_refused(status: EntryStatus, value: int, host: int) -> None:
    for error in ("", "why"):  # the fast path (no texts) and the per-entry path
        reply = KVBatchReply(
            BatchOp.PROBE_RESERVE, 0, 1, 8, (EntryResult(status, value, error, host),)
        )
        with pytest.raises(KVWireError, match="host"):
            decode_reply(encode_reply(reply))


def test_a_valid_tier_split_round_trips() -> None:
    results = (
        EntryResult(EntryStatus.OK, 9, "", 4),
        EntryResult(EntryStatus.OK, 2),
        EntryResult(EntryStatus.REFUSED, 0, "full"),
    )
    reply = KVBatchReply(BatchOp.PROBE_RESERVE, 1, 3, 8, results)
    assert decode_reply(encode_reply(reply)) == reply


def _plan(request_id: str, context_offset: int, num_tokens: int) -> MicroBatchPlan:
    chunk = PlannedChunk(
        request_id=request_id,
        chunk_index=0,
        context_offset=context_offset,
        token_ids=list(range(num_tokens)),
        is_last=True,
    )
    return MicroBatchPlan(epoch="e", microbatch_id=0, chunks=[chunk])


def test_a_plan_loads_the_pinned_copy_despite_host_pressure() -> None:
    manager, prompt_a = _spilled_prefix_stage()
    _probe(manager, "a2", prompt_a)
    slots = [manager.pool.host.slot_of(h) for h in hash_prompt_blocks(prompt_a, BLOCK, "m", "")]
    for index in range(3, 15):  # fill the host tier past its capacity: LRU spills and evicts
        _serve(manager, f"x{index}", _tokens(index, 1) + [7])
    assert manager.pool.host.num_evictions > 0
    for slot, block_hash in zip(slots, hash_prompt_blocks(prompt_a, BLOCK, "m", ""), strict=True):
        assert manager.pool.host.slot_hash(slot) == block_hash  # pinned: never evicted
    core = StageCore(manager, rank=1, num_stages=2, local_prepare=True, clock=lambda: 0.0)
    work = core.accept(_plan("a2", 6 * BLOCK, 1))
    assert not work.error
    loads = [t for t in work.transfers if t.kind == "load"]
    assert [t.slot for t in loads] == slots
    assert [t.block_id for t in loads] == list(manager.block_table("a2")[:6])
    assert work.chunks[0].num_cached_tokens == 6 * BLOCK


def test_a_stage_that_lost_its_host_copy_cannot_read_wrong_kv() -> None:
    """Host eviction between probe and plan: the probe's pins expire with its lease; the plan
    finds nothing held and the micro-batch carries an error, reading no KV; a plan asking
    more than the stage's hit is refused the same way."""
    manager, prompt_a = _spilled_prefix_stage()
    _probe(manager, "a2", prompt_a)
    manager._clock = lambda: 100.0  # the lease passes
    assert manager.expire() == ["a2"]
    assert manager.pool.host.num_pinned == 0
    for index in range(3, 40):  # A's released slots went to the LRU's back: push them out
        _serve(manager, f"x{index}", _tokens(index, 1) + [7])
    assert manager.pool.host.slot_of(hash_prompt_blocks(prompt_a, BLOCK, "m", "")[0]) is None
    core = StageCore(manager, rank=1, num_stages=2, local_prepare=True, clock=lambda: 0.0)
    work = core.accept(_plan("a2", 6 * BLOCK, 1))
    assert work.error and not work.chunks
    assert not [t for t in work.transfers if t.kind == "load"]

    manager2, prompt_a = _spilled_prefix_stage()
    _probe(manager2, "a3", prompt_a[: 4 * BLOCK] + [1])  # the stage holds 4 of them for it
    work = StageCore(manager2, rank=1, num_stages=2, local_prepare=True, clock=lambda: 0.0).accept(
        _plan("a3", 6 * BLOCK, 1)
    )
    assert "hit of 16 tokens" in work.error and work.num_loads == 0


def test_policy_loads_when_loading_is_cheaper() -> None:
    model = CostModel(c=0.0, g=0.0, b=1e-3, a=0.0)  # 1 ms per token
    policy = HostLoadPolicy([model, model], [1e-4, 1e-4], block_size=BLOCK)
    # stage 0: 2 device + 6 host; stage 1: 5 device + 3 host; cap 10
    assert policy.agreed_blocks([8, 8], [6, 3], 10) == 8


def test_policy_recomputes_when_loading_costs_more() -> None:
    model = CostModel(c=0.0, g=0.0, b=1e-3, a=0.0)  # 4 ms per block
    slow = HostLoadPolicy([model, model], [1.0, 1e-4], block_size=BLOCK)
    assert slow.agreed_blocks([8, 8], [6, 3], 10) == 2  # stage 0's device hit
    # a slow link on the stage that holds the run on device costs nothing there
    mixed = HostLoadPolicy([model, model], [1e-4, 1.0], block_size=BLOCK)
    assert mixed.agreed_blocks([8, 5], [6, 0], 10) == 5
    # between the two: loading stage 0's 3 blocks past 2 costs 3 x 3 ms < computing 12 ms
    medium = HostLoadPolicy([model, model], [3e-3, 3e-3], block_size=BLOCK)
    assert medium.agreed_blocks([5, 8], [3, 0], 10) == 5


def test_policy_without_host_hits_is_the_least_hit() -> None:
    model = CostModel(c=0.0, g=0.0, b=1e-3, a=0.0)
    policy = HostLoadPolicy([model], [1.0], block_size=BLOCK)
    assert policy.agreed_blocks([7], [0], 3) == 3
    with pytest.raises(ValueError, match="load_s"):
        HostLoadPolicy([model], [-1.0], block_size=BLOCK)
