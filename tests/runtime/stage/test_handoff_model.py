"""One stage's modelled KV handoff (wavepp.runtime.stage.handoff_model) over a real StageCore
and StageKVManager: what each finished chunk sends, and the lease on the request's blocks."""

from __future__ import annotations

import pytest

from wavepp.api.kv_batch import BatchOp, KVBatch, ReserveEntry, encode_batch
from wavepp.api.kv_reply import decode_reply
from wavepp.api.messages import MicroBatchPlan, PlannedChunk
from wavepp.runtime.kv import BlockPool, StageKVManager, hash_prompt_blocks
from wavepp.runtime.planning.handoff_cost import HandoffLink, StageHandoffBytes
from wavepp.runtime.stage.core import StageCore, StageWork
from wavepp.runtime.stage.handoff_model import ModelledHandoff, summarize_handoffs

BLOCK = 4
MODEL_ID = "handoff-test"
PROMPT = list(range(1, 13))  # 12 tokens: 3 full blocks
PER_TOKEN = 10.0  # bytes per token of this stage's layers
STATE = 7.0  # bytes per request


class Clock:
    now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make(num_blocks: int = 8, bytes_per_s: float = 100.0, latency_s: float = 0.5):  # noqa: ANN201
    clock = Clock()
    core = StageCore(
        StageKVManager(BlockPool(num_blocks, BLOCK), clock=clock),
        rank=0,
        num_stages=1,
        local_prepare=True,
        clock=clock,
    )
    handoff = ModelledHandoff(
        core.manager,
        HandoffLink(bytes_per_s, latency_s),
        StageHandoffBytes(rank=0, layers=(0, 1), kv_bytes_per_token=PER_TOKEN,
                          state_bytes_per_request=STATE),
    )  # fmt: skip
    return core, handoff


def kv(core: StageCore, op: BatchOp, *items: object) -> list:
    reply = decode_reply(core.handle_kv_batch(encode_batch(KVBatch(op, tuple(items), 30.0))))
    assert all(r.ok for r in reply.results)
    return [r.value for r in reply.results]


def admit(core: StageCore, request_id: str, tokens: list[int]) -> int:
    hashes = tuple(hash_prompt_blocks(tokens, BLOCK, model_id=MODEL_ID))
    (hit,) = kv(
        core, BatchOp.PROBE_RESERVE, ReserveEntry(request_id, hashes, -(-len(tokens) // BLOCK))
    )
    return hit


def run_chunk(
    core: StageCore, mb: int, request_id: str, tokens: list[int], offset: int, *, last: bool
) -> StageWork:
    plan = MicroBatchPlan(
        microbatch_id=mb,
        chunks=[PlannedChunk(request_id=request_id, chunk_index=mb, context_offset=offset,
                             token_ids=tokens, is_last=last)],
        epoch="e1",
    )  # fmt: skip
    (ready, _), *_ = core.receive_plan(plan)
    work = core.accept(ready)
    results = core.results(work, lambda rid: 0)
    core.complete(
        work, core.done_message(work, execute_start_s=0, execute_end_s=1, results=results)
    )
    return work


def test_each_chunk_sends_its_tokens_and_the_last_adds_the_state() -> None:
    core, handoff = make()
    admit(core, "a", PROMPT)
    first = handoff.microbatch_done(run_chunk(core, 0, "a", PROMPT[:8], 0, last=False), 1.0)
    assert [(t.num_bytes, t.start_s, t.end_s, t.landed_s) for t in first] == [(80.0, 1.0, 1.8, 2.3)]
    assert handoff.num_leased == 0  # the request holds its own blocks until its last chunk
    (last,) = handoff.microbatch_done(run_chunk(core, 1, "a", PROMPT[8:], 8, last=True), 1.5)
    # ready at 1.5 while the link still sends the first chunk: starts at 1.8
    assert (last.num_bytes, last.start_s, last.end_s) == (4 * PER_TOKEN + STATE, 1.8, 2.27)
    assert last.landed_s == pytest.approx(2.77)
    assert handoff.records["a"].num_bytes == 12 * PER_TOKEN + STATE


def test_a_first_chunk_after_a_cached_prefix_also_sends_the_prefix() -> None:
    core, handoff = make()
    admit(core, "warm", PROMPT)
    run_chunk(core, 0, "warm", PROMPT, 0, last=True)
    kv(core, BatchOp.RELEASE, "warm")
    assert admit(core, "b", PROMPT) == 3  # all 3 blocks cached here
    # the plan computes only the last 4 tokens; the decode instance needs all 12
    (transfer,) = handoff.microbatch_done(run_chunk(core, 1, "b", PROMPT[8:], 8, last=True), 5.0)
    assert transfer.num_bytes == 12 * PER_TOKEN + STATE


def test_the_lease_holds_the_blocks_after_release_until_the_last_byte_lands() -> None:
    core, handoff = make(num_blocks=3)
    pool = core.manager.pool
    admit(core, "a", PROMPT)
    (transfer,) = handoff.microbatch_done(run_chunk(core, 0, "a", PROMPT, 0, last=True), 1.0)
    blocks = core.manager.held_blocks("a")
    assert handoff.records["a"].leased_blocks == blocks and handoff.num_leased_blocks == 3
    kv(core, BatchOp.RELEASE, "a")  # the scheduler releases after the first token
    assert core.manager.held_blocks("a") == ()
    assert [pool.ref_cnt(b) for b in blocks] == [1, 1, 1]  # still pinned: the handoff's lease
    assert pool.num_evictable_blocks == 0
    # a new request cannot take them: the pool is full until the transfer lands
    other = [100 + t for t in PROMPT]
    entry = ReserveEntry("c", tuple(hash_prompt_blocks(other, BLOCK, model_id=MODEL_ID)), 3)
    reply = decode_reply(
        core.handle_kv_batch(encode_batch(KVBatch(BatchOp.PROBE_RESERVE, (entry,), 30.0)))
    )
    assert not reply.results[0].ok
    assert handoff.next_due_s() == transfer.landed_s
    assert handoff.finish_due(transfer.landed_s - 1e-9) == []
    assert handoff.finish_due(transfer.landed_s) == ["a"]
    assert [pool.ref_cnt(b) for b in blocks] == [0, 0, 0]
    assert pool.num_cached_blocks == 3 and handoff.num_leased == 0 == handoff.num_leased_blocks
    assert handoff.peak_leased_blocks == 3
    pool.check_invariants()
    kv(core, BatchOp.RELEASE, "c")
    assert admit(core, "c", other) == 0  # room again (the cached blocks are evicted)


def test_a_lease_ending_before_the_release_leaves_the_request_its_own_pins() -> None:
    core, handoff = make()
    pool = core.manager.pool
    admit(core, "a", PROMPT)
    (transfer,) = handoff.microbatch_done(run_chunk(core, 0, "a", PROMPT, 0, last=True), 1.0)
    assert handoff.finish_due(transfer.landed_s) == ["a"]
    blocks = core.manager.held_blocks("a")
    assert [pool.ref_cnt(b) for b in blocks] == [1, 1, 1]  # the request's own pins
    kv(core, BatchOp.RELEASE, "a")
    assert [pool.ref_cnt(b) for b in blocks] == [0, 0, 0]
    pool.check_invariants()


def test_a_failed_microbatch_sends_nothing_and_leases_nothing() -> None:
    core, handoff = make()
    work = run_chunk(core, 0, "ghost", PROMPT[:4], 0, last=True)  # never admitted here
    assert work.error
    assert handoff.microbatch_done(work, 1.0) == []
    assert handoff.num_leased == 0 and handoff.records == {}


def test_summary_counts_tails_overlap_and_only_the_requests_it_is_given() -> None:
    core, handoff = make(bytes_per_s=100.0, latency_s=0.0)
    admit(core, "a", PROMPT)
    admit(core, "warm", [50 + t for t in PROMPT])
    handoff.microbatch_done(run_chunk(core, 0, "a", PROMPT[:8], 0, last=False), 1.0)  # lands 1.8
    handoff.microbatch_done(run_chunk(core, 1, "a", PROMPT[8:], 8, last=True), 2.0)  # lands 2.47
    handoff.microbatch_done(run_chunk(core, 2, "warm", [50 + t for t in PROMPT], 0, last=True), 3.0)
    summary = summarize_handoffs([handoff], {"a": 2.0}, wall_s=10.0)
    assert summary["handoff_requests"] == 1
    assert summary["kv_bytes_transferred"] == round(12 * PER_TOKEN + STATE)
    assert summary["handoff_s_p50"] == pytest.approx(0.47)
    assert summary["overlapped_fraction"] == pytest.approx(80 / 127, abs=1e-4)
    assert summary["link_queued_s_max"] == 0.0
    assert summary["link_load"] == [pytest.approx(1.27 / 10.0, abs=1e-4)]
    # the window (10 s, ending at the last first token, 2.0) plus a's last byte 0.47 s later
    assert summary["handoff_window_s"] == pytest.approx(10.47)


def test_leases_count_a_shared_block_once() -> None:
    core, handoff = make()
    pool = core.manager.pool
    admit(core, "warm", PROMPT)
    run_chunk(core, 0, "warm", PROMPT, 0, last=True)
    kv(core, BatchOp.RELEASE, "warm")
    # a and b share the 3 cached blocks; each adds one fresh block for its 13th token
    for index, request_id in enumerate(("a", "b")):
        assert admit(core, request_id, [*PROMPT, 90 + index]) == 3
        work = run_chunk(core, 1 + index, request_id, [90 + index], 12, last=True)
        handoff.microbatch_done(work, 1.0 + index)
    assert handoff.num_leased_blocks == 5 == handoff.peak_leased_blocks  # 3 shared + 2 own
    kv(core, BatchOp.RELEASE, "a", "b")
    shared = core.manager.pool.find_longest_cache_hit(
        hash_prompt_blocks(PROMPT, BLOCK, model_id=MODEL_ID)
    )
    assert [pool.ref_cnt(b) for b in shared] == [2, 2, 2]  # one reference per lease
    handoff.finish_due(10.0)
    assert handoff.num_leased_blocks == 0 and [pool.ref_cnt(b) for b in shared] == [0, 0, 0]
    pool.check_invariants()
