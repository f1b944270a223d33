"""The one-round-trip agreement: probe-reserve on the wire, on a stage, in the controller, and a
stage whose own hit exceeds the agreed L* (its table, caching, L* from the plan).

The engines' side of that stage (logits against a cold run, cached blocks left unwritten) is
in ``tests/runtime/agreement/test_agreement_recompute.py``.
"""

from __future__ import annotations

import asyncio
import struct

import pytest
from agreement_support import local_stages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_wire_support import chain, reserve_batch, warm

from wavepp.api.kv_batch import (
    BatchOp,
    KVBatch,
    KVWireError,
    ReserveEntry,
    decode_batch,
    encode_batch,
)
from wavepp.api.kv_reply import EntryStatus, decode_reply
from wavepp.api.messages import PROTOCOL_VERSION, MicroBatchPlan, PlannedChunk
from wavepp.api.signing import BusKey
from wavepp.runtime.agreement import AgreementController, LocalStageClient
from wavepp.runtime.agreement.stage_handler import handle_kv_batch
from wavepp.runtime.kv import BlockPool, StageKVManager, hash_prompt_blocks
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.stage.core import StageCore

BLOCK = 4
MODEL_ID = "one-trip"


# --------------------------------------------------------------------------- wire format


def test_a_probe_reserve_batch_round_trips_in_the_protocol_version() -> None:
    prefix = chain(6)
    batch = reserve_batch(
        ReserveEntry("a", prefix, 7), ReserveEntry("b", prefix[:4] + chain(2, 9), 6)
    )
    payload = encode_batch(batch)
    assert payload[3] == PROTOCOL_VERSION  # the version byte
    decoded = decode_batch(payload)
    assert decoded == batch
    assert decoded.shares[1] == (0, 4)  # the shared prefix travels once
    release = encode_batch(KVBatch(BatchOp.RELEASE, ("a",)))
    assert release[3] == PROTOCOL_VERSION


@pytest.mark.parametrize("total", [0, 5, 8])
def test_a_reserve_count_that_does_not_fit_the_hashes_is_refused_naming_the_field(
    total: int,
) -> None:
    with pytest.raises(KVWireError, match="num_total_blocks"):
        encode_batch(reserve_batch(ReserveEntry("a", chain(6), total)))
    good = bytearray(encode_batch(reserve_batch(ReserveEntry("a", chain(6), 6))))
    at = good.index(struct.pack("<H", 1) + b"a") + 3 + 12  # rid; n, shared_from, shared_len
    good[at : at + 4] = struct.pack("<I", total)
    with pytest.raises(KVWireError, match="num_total_blocks"):
        decode_batch(bytes(good))


# --------------------------------------------------------------------------- the stage


def test_a_stage_pins_its_own_hit_and_reserves_after_it_in_one_message() -> None:
    manager = StageKVManager(BlockPool(16, BLOCK))
    prompt = chain(5)
    warm(manager, prompt)
    cached_ids = [manager.pool.find_longest_cache_hit(prompt)[i] for i in range(5)]
    reply = decode_reply(
        handle_kv_batch(manager, 0, encode_batch(reserve_batch(ReserveEntry("r", prompt, 6))))
    )
    assert [(r.status, r.value) for r in reply.results] == [(EntryStatus.OK, 5)]
    table = manager.block_table("r")
    # h_s = 5 cached ids, then one fresh block: no commit, and no L* needed for it
    assert table[:5] == cached_ids and len(table) == 6
    assert manager.pool.block_hash(table[5]) is None
    assert manager.num_hit_blocks("r") == 5 and manager.num_agreed_blocks("r") == -1
    manager.pool.check_invariants()


def test_a_stage_whose_hit_exceeds_l_star_caches_no_block_twice() -> None:
    """L* = 2 arrives with the first chunk; the stage computes from token 8 on but its blocks
    0..4 stay its own cached ones: nothing hashed again, no "stored" event for them."""
    manager = StageKVManager(BlockPool(16, BLOCK))
    prompt = chain(5)
    warm(manager, prompt)
    manager.take_events()
    hashes = prompt + chain(1, 7)  # 6 full blocks, 26 tokens: 7 blocks
    manager.probe_pin("r", hashes, 5.0)
    table = manager.reserve("r", 7, 5.0)
    assert table is not None
    assert manager.start_chunk("r", 2 * BLOCK) == 5 * BLOCK  # positions below are cached here
    assert manager.num_agreed_blocks("r") == 2
    manager.mark_computed("r", 13, hashes)  # a chunk ending inside the hit: nothing new
    assert manager.take_events() == []
    manager.mark_computed("r", 26, hashes)
    events = manager.take_events()
    assert [e.kind for e in events] == ["stored"]
    assert events[0].block_hashes == (hashes[5],) and events[0].parent_block_hash == hashes[4]
    for index, block_id in enumerate(table[:6]):
        assert manager.pool.block_hash(block_id) == hashes[index]
    assert len(manager.pool.cached_block_hashes()) == 6  # each hash once
    manager.pool.check_invariants()
    manager.release("r")
    assert manager.pool.num_pinned_blocks == 0


def test_a_first_chunk_past_the_stage_hit_is_refused() -> None:
    manager = StageKVManager(BlockPool(16, BLOCK))
    warm(manager, chain(2))
    manager.probe_pin("r", chain(4), 5.0)
    assert manager.reserve("r", 4, 5.0) is not None
    with pytest.raises(ValueError, match="hit of 8 tokens"):
        manager.start_chunk("r", 3 * BLOCK)  # this stage holds 2 blocks of the prefix
    with pytest.raises(ValueError, match="whole number"):
        manager.start_chunk("r", 5)
    assert manager.start_chunk("r", 2 * BLOCK) == 8
    assert manager.start_chunk("r", 3 * BLOCK + 1) == 8  # later chunks: L* stays 2
    assert manager.num_agreed_blocks("r") == 2


def test_reserve_is_idempotent_and_checks_its_total() -> None:
    manager = StageKVManager(BlockPool(16, BLOCK))
    manager.probe_pin("r", chain(3), 5.0)
    table = manager.reserve("r", 4, 5.0)
    assert manager.reserve("r", 4, 5.0) == table
    with pytest.raises(ValueError, match="already reserved"):
        manager.reserve("r", 3, 5.0)
    with pytest.raises(ValueError, match="num_total_blocks"):
        manager.probe_pin("short", chain(3, 6), 5.0)
        manager.reserve("short", 2, 5.0)


def test_a_refused_reservation_holds_nothing_and_the_round_still_pins_first() -> None:
    """Two passes: every entry pins its hit before any entry reserves, so the first entry's
    reservation cannot evict the block the second one hits; the entry that does not fit holds
    nothing."""
    manager = StageKVManager(BlockPool(6, BLOCK))
    warm(manager, chain(2, 3))  # 2 cached blocks, evictable; 4 free
    batch = reserve_batch(
        ReserveEntry("big", chain(5, 4), 5),  # needs 5 fresh: only 4 free
        ReserveEntry("hits", chain(2, 3) + chain(1, 8), 4),  # hits 2, needs 2 fresh
    )
    reply = decode_reply(handle_kv_batch(manager, 0, encode_batch(batch)))
    assert [r.status for r in reply.results] == [EntryStatus.REFUSED, EntryStatus.OK]
    assert reply.results[1].value == 2 and "needs 5 blocks" in reply.results[0].error
    assert manager.request_ids() == ["hits"]
    assert manager.pool.num_pinned_blocks == 4
    manager.pool.check_invariants()


def test_a_keyed_stage_takes_only_signed_fresh_probe_reserves_of_the_owner() -> None:
    key = BusKey.generate().for_replica("p")
    manager = StageKVManager(BlockPool(16, BLOCK))
    batch = reserve_batch(ReserveEntry("r", chain(2), 3), owner="adm1", seq=1)
    for payload in (encode_batch(batch), encode_batch(batch, BusKey.generate())):
        reply = decode_reply(handle_kv_batch(manager, 0, payload, bus_key=key))
        assert "mac" in reply.error and manager.num_requests == 0
    signed = encode_batch(batch, key)
    assert decode_reply(handle_kv_batch(manager, 0, signed, bus_key=key)).results[0].ok
    assert manager.pool.num_pinned_blocks == 3  # reserved at once
    assert "repeated" in decode_reply(handle_kv_batch(manager, 0, signed, bus_key=key)).error
    # Another owner naming the request (read from a plan) is refused and changes nothing.
    intruder = reserve_batch(ReserveEntry("r", chain(2), 3), owner="intruder", seq=1)
    reply = decode_reply(handle_kv_batch(manager, 0, encode_batch(intruder, key), bus_key=key))
    assert (
        reply.results[0].status is EntryStatus.INVALID and "another owner" in reply.results[0].error
    )
    release = KVBatch(BatchOp.RELEASE, ("r",), owner="intruder", seq=2)
    handle_kv_batch(manager, 0, encode_batch(release, key), bus_key=key)
    assert manager.request_ids() == ["r"] and manager.pool.num_pinned_blocks == 3


def test_a_reserved_request_expires_with_its_lease() -> None:
    now = [0.0]
    manager = StageKVManager(BlockPool(8, BLOCK), clock=lambda: now[0])
    batch = KVBatch(BatchOp.PROBE_RESERVE, (ReserveEntry("r", chain(2), 3),), 2.0)
    assert decode_reply(handle_kv_batch(manager, 0, encode_batch(batch))).results[0].ok
    now[0] = 1.9
    assert manager.expire() == []
    now[0] = 2.0
    assert manager.expire() == ["r"] and manager.pool.num_pinned_blocks == 0


def test_the_stage_core_takes_l_star_from_the_first_chunk_and_reports_it() -> None:
    core = StageCore(
        StageKVManager(BlockPool(16, BLOCK)),
        rank=0,
        num_stages=1,
        local_prepare=True,
        clock=lambda: 0.0,
    )
    tokens = list(range(1, 27))
    hashes = tuple(hash_prompt_blocks(tokens, BLOCK, MODEL_ID))
    warm(core.manager, hashes[:5])
    batch = KVBatch(BatchOp.PROBE_RESERVE, (ReserveEntry("r", hashes, 7),), 5.0)
    assert decode_reply(core.handle_kv_batch(encode_batch(batch))).results[0].value == 5

    def chunk(offset: int, n: int, index: int) -> PlannedChunk:
        return PlannedChunk(
            request_id="r",
            chunk_index=index,
            context_offset=offset,
            token_ids=tokens[offset : offset + n],
            is_last=offset + n == len(tokens),
        )

    work = core.accept(MicroBatchPlan(microbatch_id=0, chunks=[chunk(8, 5, 0)], epoch="e"))
    assert not work.error and work.num_agreed_blocks == [2]
    [spec] = work.chunks
    assert spec.num_cached_tokens == 20 and spec.block_ids == tuple(core.manager.block_table("r"))
    work = core.accept(MicroBatchPlan(microbatch_id=1, chunks=[chunk(13, 13, 1)], epoch="e"))
    assert work.num_agreed_blocks == [2] and work.chunks[0].num_cached_tokens == 20


# --------------------------------------------------------------------------- the controller


async def test_a_stage_whose_hit_exceeds_l_star_keeps_it_in_its_table() -> None:
    managers, controller = local_stages([32] * 3, block_size=BLOCK, model_id=MODEL_ID)
    prompt = list(range(100, 126))  # 6 full blocks, 7 in all
    hashes = tuple(controller.block_hashes(PromptRequest("x", prompt)))
    warm(managers[0], hashes[:5])
    warm(managers[2], hashes[:2])
    before = [m.pool.find_longest_cache_hit(hashes) for m in managers]
    ticket = await controller.agree(PromptRequest("r", prompt))
    assert ticket is not None and ticket.stage_hits == (5, 0, 2)
    assert ticket.num_agreed_blocks == 0
    for manager, hit in zip(managers, before, strict=True):
        table = manager.block_table("r")
        assert table[: len(hit)] == list(hit) and len(table) == 7
        assert manager.pool.num_pinned_blocks == 7
    await controller.release(["r"])
    assert all(m.pool.num_pinned_blocks == 0 for m in managers)


async def test_a_refusal_on_one_stage_is_released_on_the_others_before_the_caller_hears() -> None:
    managers = [StageKVManager(BlockPool(c, BLOCK)) for c in (16, 2, 16)]
    heard: list[list[list[str]]] = []

    class Watching(LocalStageClient):
        async def call_batch(self, payload: bytes) -> bytes:
            await asyncio.sleep(0)
            return await super().call_batch(payload)

    controller = AgreementController(
        [Watching(m, r) for r, m in enumerate(managers)], block_size=BLOCK, model_id=MODEL_ID
    )

    async def agree() -> None:
        assert await controller.agree(PromptRequest("big", list(range(12)))) is None
        heard.append([m.request_ids() for m in managers])

    await agree()
    assert heard == [[[], [], []]]
    assert controller.num_refusals == 1 and controller.num_agreements == 1
    assert all(m.pool.num_pinned_blocks == 0 for m in managers)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(2, 24),
    cached=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6)), max_size=3),
    entries=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=8,
    ),
)
def test_probe_reserve_batches_hold_whole_tables_or_nothing(
    num_blocks: int,
    cached: list[tuple[int, int]],
    entries: list[tuple[int, int, int, bool]],
) -> None:
    """Any round on any pool: an OK entry holds its whole table (its hit's cached ids, then
    fresh blocks) and answered its hit; a refused or invalid one holds nothing; every hit was
    pinned before any reservation of the round; releasing everything frees everything."""
    manager = StageKVManager(BlockPool(num_blocks, BLOCK))
    for index, (root, n) in enumerate(cached):
        hashes = chain(min(n, num_blocks), root)
        manager.probe_pin(f"w{index}", hashes, 5.0)
        if manager.reserve(f"w{index}", len(hashes), 5.0) is not None:
            manager.mark_computed(f"w{index}", len(hashes) * BLOCK, hashes)
            manager.release(f"w{index}")
    reserve_entries = []
    for index, (root, shared, own, partial) in enumerate(entries):
        hashes = chain(shared, root) + chain(own, 10 + index)
        rid = f"r{index % 5}"  # some ids repeat within the round
        reserve_entries.append(ReserveEntry(rid, hashes, len(hashes) + int(partial or not hashes)))
    hits_before = [
        len(manager.pool.find_longest_cache_hit(e.block_hashes)) for e in reserve_entries
    ]
    reply = decode_reply(handle_kv_batch(manager, 0, encode_batch(reserve_batch(*reserve_entries))))
    assert len(reply.results) == len(reserve_entries)
    held = set(manager.request_ids())
    first_of: dict[str, int] = {}
    for index, (entry, result) in enumerate(zip(reserve_entries, reply.results, strict=True)):
        first = first_of.setdefault(entry.request_id, index)
        if result.ok:
            assert entry.request_id in held
            table = manager.block_table(entry.request_id)
            if first == index:  # the first entry of an id decides its table
                assert result.value == hits_before[index]  # hits pinned before reserving
                assert len(table) == entry.num_total_blocks
                assert [manager.pool.block_hash(b) for b in table[: result.value]] == list(
                    entry.block_hashes[: result.value]
                )
        elif first == index:
            assert entry.request_id not in held
    manager.pool.check_invariants()
    for request_id in held:
        assert manager.release(request_id)
    assert manager.pool.num_pinned_blocks == 0


async def test_admitted_callers_do_not_wait_for_the_release_of_a_refused_one() -> None:
    """In a round where one request is refused, the others are answered before the refused
    one's release round trip (which still completes before its own caller hears None)."""
    managers = [StageKVManager(BlockPool(c, BLOCK)) for c in (16, 4)]
    events: list[str] = []

    class Slow(LocalStageClient):
        async def call_batch(self, payload: bytes) -> bytes:
            op = decode_batch(payload).op
            if op is BatchOp.RELEASE:
                events.append("release sent")
                await asyncio.sleep(0.01)
            reply = await super().call_batch(payload)
            if op is BatchOp.RELEASE:
                events.append("released")
            return reply

    controller = AgreementController(
        [Slow(m, r) for r, m in enumerate(managers)], block_size=BLOCK, model_id=MODEL_ID
    )

    async def agree(rid: str, n: int) -> None:
        ticket = await controller.agree(PromptRequest(rid, list(range(100 * n, 100 * n + n))))
        events.append(f"{rid} {'admitted' if ticket else 'refused'}")

    await asyncio.gather(agree("small", 8), agree("big", 20))
    assert controller.num_rounds == 1
    assert events.index("small admitted") < events.index("released")
    assert events.index("released") < events.index("big refused")
    assert managers[0].request_ids() == ["small"] and managers[1].request_ids() == ["small"]
