"""Batched agreement: the wire format, the stage's one-pass handler, and rounds of many requests
(the same guarantees as one request at a time: L* = min over stages, refusals hold nothing)."""

from __future__ import annotations

import asyncio
import hashlib
import struct

import pytest
from agreement_support import local_stages, served_stages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_wire_support import chain as _chain

from wavepp.api import kv_batch
from wavepp.api.kv_batch import (
    BatchOp,
    KVBatch,
    KVWireError,
    ReserveEntry,
    decode_batch,
    encode_batch,
)
from wavepp.api.kv_reply import (
    EntryResult,
    EntryStatus,
    KVBatchReply,
    decode_reply,
    encode_reply,
    reply_rank,
)
from wavepp.api.messages import PROTOCOL_VERSION
from wavepp.api.signing import BusKey
from wavepp.runtime.agreement import AgreementController, AgreementRefused, LocalStageClient
from wavepp.runtime.agreement.rounds import StageProtocolError
from wavepp.runtime.agreement.stage_handler import handle_kv_batch
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.request import PromptRequest

BLOCK = 4
MODEL_ID = "tiny-llama:seed=0"
HASH = bytes(range(32))


def make_stages(
    capacities: list[int], *, max_batch: int = 512
) -> tuple[list[StageKVManager], AgreementController]:
    return local_stages(
        capacities, block_size=BLOCK, model_id=MODEL_ID, lease_s=30.0, max_batch=max_batch
    )


# --------------------------------------------------------------------------- wire format


def test_batches_round_trip_with_raw_hashes() -> None:
    probe = KVBatch(
        BatchOp.PROBE_RESERVE,
        (ReserveEntry("a", (HASH, HASH[::-1]), 3), ReserveEntry("b", (), 1)),
        5.0,
        owner="adm1",
        seq=7,
        releases=("z",),
    )
    payload = encode_batch(probe)
    assert decode_batch(payload) == probe
    # 32 bytes per hash on the wire, not 64 hex characters plus JSON quoting.
    assert len(payload) < 16 + 1 + 4 + 8 + 4 + 2 * (2 + 1 + 16) + 4 + 3 + 2 * 32 + 32
    release = KVBatch(BatchOp.RELEASE, ("a", "b"))
    assert decode_batch(encode_batch(release)) == release


@pytest.mark.parametrize("num_hashes", [0, 1, 63, 64, 65, 128, 200])
def test_probe_hashes_decode_in_runs_of_any_length(num_hashes: int) -> None:
    """Hashes are unpacked 64 at a time: every count, and a shared prefix before them, comes
    back in order."""
    own = tuple(hashlib.sha256(b"%d" % i).digest() for i in range(num_hashes))
    base = _chain(70, 3)
    probe = KVBatch(
        BatchOp.PROBE_RESERVE,
        (
            ReserveEntry("a", base, len(base)),
            ReserveEntry("b", base[:66] + own, 66 + num_hashes + 1),
            ReserveEntry("c", own, num_hashes + 1),
        ),
        5.0,
    )
    decoded = decode_batch(encode_batch(probe))
    assert decoded == probe
    assert all(type(h) is bytes for entry in decoded.entries for h in entry[1])


def _head(
    version: int = PROTOCOL_VERSION, op: int = 1, lease: float = 1.0, count: int = 0
) -> bytes:
    """A batch header (no owner, seq 0) of the given fields."""
    return (
        struct.pack("<3sBBd", b"WKB", version, op, lease) + b"\x00" + struct.pack("<QI", 0, count)
    )


MAC = bytes(32)
NO_RELEASES = struct.pack("<I", 0)


def test_a_round_sends_a_shared_prefix_once_and_the_stage_walks_it_once() -> None:
    prefix_a, prefix_b = _chain(40, 1), _chain(40, 2)
    entries = tuple(
        ReserveEntry(f"r{i}", (prefix_a if i % 2 else prefix_b) + _chain(2, 10 + i), 42)
        for i in range(8)
    )
    probe = KVBatch(BatchOp.PROBE_RESERVE, entries, 5.0)
    payload = encode_batch(probe)
    decoded = decode_batch(payload)
    assert decoded == probe  # every entry's full hashes, shared ones included
    # entries 2.. name their 40 shared hashes by reference: each sends its own 2
    assert decoded.shares[:4] == ((-1, 0), (-1, 0), (0, 40), (1, 40))
    assert len(payload) < 2 * 42 * 32 + 6 * 2 * 32 + 8 * 32
    # the stage pins what a stage without sharing pins
    shared, plain = (StageKVManager(BlockPool(128, BLOCK)) for _ in range(2))
    for manager in (shared, plain):
        for index, prefix in enumerate((prefix_a, prefix_b[:30])):
            manager.probe_pin(f"w{index}", prefix, 5.0)
            manager.reserve(f"w{index}", len(prefix), 5.0)
            manager.mark_computed(f"w{index}", len(prefix) * BLOCK, prefix)
            manager.release(f"w{index}")
    reply = decode_reply(handle_kv_batch(shared, 0, payload))
    assert [r.value for r in reply.results] == [30, 40] * 4
    for entry in entries:  # the handler's two passes: every pin, then every reservation
        plain.probe_pin(entry.request_id, entry.block_hashes, 5.0)
    for entry in entries:
        plain.reserve(entry.request_id, entry.num_total_blocks, 5.0)
    for block_id in range(128):
        assert shared.pool.ref_cnt(block_id) == plain.pool.ref_cnt(block_id)
    shared.pool.check_invariants()


def _shared_entry(rid: bytes, n: int, shared_from: int, shared_len: int, own: int) -> bytes:
    return (
        struct.pack("<H", len(rid))
        + rid
        + struct.pack("<IIII", n, shared_from, shared_len, n)
        + bytes(32) * own
    )


@pytest.mark.parametrize(
    ("entries", "field"),
    [
        # names itself or a later entry
        ([_shared_entry(b"a", 2, 1, 1, 1)], "shared_from"),
        ([_shared_entry(b"a", 2, 0, 0, 2), _shared_entry(b"b", 2, 3, 1, 1)], "shared_from"),
        # more shared than the earlier entry has, or than its own count
        ([_shared_entry(b"a", 2, 0, 0, 2), _shared_entry(b"b", 5, 1, 3, 2)], "shared_len"),
        ([_shared_entry(b"a", 2, 0, 0, 2), _shared_entry(b"b", 1, 1, 2, 0)], "shared_len"),
        ([_shared_entry(b"a", 2, 0, 0, 2), _shared_entry(b"b", 2, 1, 0, 2)], "shared_len"),
        ([_shared_entry(b"a", 2, 0, 1, 1)], "shared_len"),
    ],
)
def test_malformed_shares_name_the_field(entries: list[bytes], field: str) -> None:
    payload = _head(count=len(entries)) + b"".join(entries) + NO_RELEASES + MAC
    with pytest.raises(KVWireError, match=field):
        decode_batch(payload)


def test_shared_hashes_count_against_the_batch_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shares cost a few bytes on the wire but a reference per hash once decoded: a batch
    naming more hashes than the bound is refused before they are built."""
    monkeypatch.setattr(kv_batch, "MAX_BLOCKS_PER_BATCH", 10)
    entries = [_shared_entry(b"a", 4, 0, 0, 4)] + [
        _shared_entry(bytes([98 + i]), 4, 1, 4, 0) for i in range(2)
    ]
    payload = _head(count=3) + b"".join(entries) + NO_RELEASES + MAC
    with pytest.raises(KVWireError, match="per batch"):
        decode_batch(payload)
    two = _head(count=2) + b"".join(entries[:2]) + NO_RELEASES + MAC
    assert len(decode_batch(two).entries) == 2


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (b"", "header"),
        (b"XYZ" + bytes(50), "bad magic"),
        (_head(version=9) + MAC, "version"),
        (_head(version=PROTOCOL_VERSION + 1) + MAC, "version"),
        (_head(op=7) + MAC, "op"),
        (_head(lease=float("inf")) + MAC, "lease_s"),
        (_head(count=10**6) + MAC, "count"),
        (_head(count=1) + struct.pack("<H", 0) + MAC, "request_id"),
        # claims a million hashes, sends none: rejected before any allocation
        (
            _head(count=1) + b"\x01\x00a" + struct.pack("<IIII", 10**6, 0, 0, 10**6) + MAC,
            "block_hashes",
        ),
        (
            _head(count=1) + b"\x01\x00a" + struct.pack("<IIII", 2, 0, 0, 5) + MAC,
            "num_total_blocks",
        ),
        (_head(count=0) + MAC, "num_releases"),
        (_head(op=2, count=1) + b"\x01\x00a" + NO_RELEASES + MAC, "after the last entry"),
        (
            encode_batch(KVBatch(BatchOp.RELEASE, ("a",)))[:-32] + b"x" + MAC,
            "after the last entry",
        ),
    ],
)
def test_malformed_batches_name_the_field(payload: bytes, field: str) -> None:
    with pytest.raises(KVWireError, match=field):
        decode_batch(payload)


def test_a_keyed_stage_takes_only_signed_fresh_batches_of_the_owner() -> None:
    key = BusKey.generate().for_replica("p")
    manager = StageKVManager(BlockPool(16, BLOCK))
    probe = KVBatch(BatchOp.PROBE_RESERVE, (ReserveEntry("r", (), 1),), 5.0, owner="adm1", seq=1)
    # Unsigned, or signed with another key: refused whole, nothing held.
    for payload in (encode_batch(probe), encode_batch(probe, BusKey.generate())):
        reply = decode_reply(handle_kv_batch(manager, 0, payload, bus_key=key))
        assert "mac" in reply.error and manager.num_requests == 0
    signed = encode_batch(probe, key)
    assert decode_reply(handle_kv_batch(manager, 0, signed, bus_key=key)).results[0].ok
    # The same signed batch again (a repeat): refused by its op number.
    repeat = decode_reply(handle_kv_batch(manager, 0, signed, bus_key=key))
    assert "repeated" in repeat.error
    # A release by another owner (a forger who read the id in a plan) frees nothing.
    forged = KVBatch(BatchOp.RELEASE, ("r",), owner="intruder", seq=1)
    decode_reply(handle_kv_batch(manager, 0, encode_batch(forged, key), bus_key=key))
    assert manager.request_ids() == ["r"] and manager.pool.num_pinned_blocks == 1
    release = KVBatch(BatchOp.RELEASE, ("r",), owner="adm1", seq=2)
    decode_reply(handle_kv_batch(manager, 0, encode_batch(release, key), bus_key=key))
    assert manager.num_requests == 0 and manager.pool.num_pinned_blocks == 0


async def test_a_keyed_controller_and_keyed_stages_agree_in_signed_rounds() -> None:
    key = BusKey.generate().for_replica("p")
    managers = [StageKVManager(BlockPool(64, BLOCK)) for _ in range(3)]
    controller = AgreementController(
        [LocalStageClient(m, r, bus_key=key) for r, m in enumerate(managers)],
        block_size=BLOCK,
        model_id=MODEL_ID,
        bus_key=key,
    )
    requests = [PromptRequest(f"s{i}", list(range(i, i + 9))) for i in range(6)]
    tickets = await asyncio.gather(*(controller.agree(r) for r in requests))
    assert all(t is not None for t in tickets)
    await controller.release([r.request_id for r in requests])
    assert all(m.num_requests == 0 for m in managers)
    # A controller without the key is refused by the same stages: nothing held.
    stranger = AgreementController(
        [LocalStageClient(m, r, bus_key=key) for r, m in enumerate(managers)],
        block_size=BLOCK,
        model_id=MODEL_ID,
    )
    with pytest.raises(StageProtocolError, match="mac"):
        await stranger.agree(PromptRequest("x", list(range(9))))
    assert all(m.num_requests == 0 for m in managers)


@settings(max_examples=200, deadline=None)
@given(
    garbage=st.binary(max_size=200),
    prefix=st.sampled_from([b"", b"WKB\x01\x01", b"WKB\x01\x02", b"WKB\x02\x01"]),
)
def test_the_stage_handler_never_raises_and_changes_nothing_on_garbage(
    garbage: bytes, prefix: bytes
) -> None:
    manager = StageKVManager(BlockPool(8, BLOCK))
    reply = decode_reply(handle_kv_batch(manager, 2, prefix + garbage))
    assert reply.rank == 2
    if reply.error:
        assert not reply.results
    assert manager.num_requests == 0 and manager.pool.num_free_blocks == 8


def test_a_bad_entry_is_answered_alone_and_the_others_apply() -> None:
    manager = StageKVManager(BlockPool(8, BLOCK))
    batch = KVBatch(
        BatchOp.PROBE_RESERVE,
        (
            ReserveEntry("a", (), 1),
            ReserveEntry("a", (HASH,), 2),  # the same id with another total
            ReserveEntry("b", _chain(99), 100),
        ),
        5.0,
    )
    reply = decode_reply(handle_kv_batch(manager, 0, encode_batch(batch)))
    assert [r.status for r in reply.results] == [
        EntryStatus.OK,
        EntryStatus.INVALID,  # named, and the first "a" keeps its table
        EntryStatus.REFUSED,  # does not fit: nothing held
    ]
    assert "already reserved" in reply.results[1].error
    assert "needs 100 blocks" in reply.results[2].error
    assert manager.request_ids() == ["a"] and manager.pool.num_pinned_blocks == 1


# --------------------------------------------------------------------------- rounds


class CountingClient(LocalStageClient):
    """An in-process client that yields to the loop and records the batches it carried."""

    def __init__(self, manager: StageKVManager, rank: int, log: list[tuple[int, str, int]]):
        super().__init__(manager, rank)
        self.log = log

    async def call_batch(self, payload: bytes) -> bytes:
        batch = decode_batch(payload)
        self.log.append((self.rank, batch.op.name, len(batch.entries)))
        await asyncio.sleep(0.001)
        return await super().call_batch(payload)


class GatedClient(LocalStageClient):
    """An in-process client whose calls wait for ``gate``; records each batch it carried."""

    def __init__(self, manager: StageKVManager, rank: int, log: list[tuple[int, str, int]]) -> None:
        super().__init__(manager, rank)
        self.log = log
        self.gate = asyncio.Event()

    async def call_batch(self, payload: bytes) -> bytes:
        batch = decode_batch(payload)
        self.log.append((self.rank, batch.op.name, len(batch.entries)))
        await self.gate.wait()
        return await super().call_batch(payload)


async def test_a_round_is_one_round_trip_and_rounds_overlap_when_allowed() -> None:
    """One probe-reserve message per stage per round and nothing more; with two rounds allowed
    in flight (the default is one), a second round goes out while the first is on the wire."""
    managers = [StageKVManager(BlockPool(256, BLOCK)) for _ in range(3)]
    log: list[tuple[int, str, int]] = []
    clients = [GatedClient(m, r, log) for r, m in enumerate(managers)]
    controller = AgreementController(
        clients, block_size=BLOCK, model_id=MODEL_ID, max_rounds_in_flight=2
    )
    requests = [PromptRequest(f"r{i}", list(range(i, i + 9))) for i in range(40)]
    first = asyncio.gather(*(controller.agree(r) for r in requests[:20]))
    for _ in range(1000):  # the first round is on the wire, unanswered
        if len(log) >= 3:
            break
        await asyncio.sleep(0)
    second = asyncio.gather(*(controller.agree(r) for r in requests[20:]))
    for _ in range(1000):  # the second round went out before the first came back
        if len(log) >= 6:
            break
        await asyncio.sleep(0)
    assert len(log) == 6
    assert not first.done()
    for client in clients:
        client.gate.set()
    tickets = [*await first, *await second]
    assert all(t is not None for t in tickets)
    assert controller.num_rounds == 2
    stage0 = [(op, n) for rank, op, n in log if rank == 0]
    assert stage0 == [("PROBE_RESERVE", 20), ("PROBE_RESERVE", 20)]
    for manager in managers:  # reserved at once: every table is complete, nothing to commit
        assert all(len(manager.block_table(r.request_id)) == 3 for r in requests)
    await controller.release([r.request_id for r in requests])
    for manager in managers:
        assert manager.num_requests == 0 and manager.pool.num_pinned_blocks == 0


async def test_one_stage_of_eight_refuses_mid_batch_and_nothing_leaks_elsewhere() -> None:
    capacities = [64] * 8
    capacities[5] = 10  # stage 5 holds 10 blocks: three 3-block prompts fit, the rest do not
    managers, controller = make_stages(capacities)
    requests = [PromptRequest(f"r{i}", list(range(100 * i, 100 * i + 12))) for i in range(6)]
    tickets = await asyncio.gather(*(controller.agree(r) for r in requests))
    assert controller.num_rounds == 1
    admitted = [r.request_id for r, t in zip(requests, tickets, strict=True) if t is not None]
    refused = [r.request_id for r, t in zip(requests, tickets, strict=True) if t is None]
    assert len(admitted) == 3 and len(refused) == 3
    for manager in managers:
        assert sorted(manager.request_ids()) == sorted(admitted)
        assert manager.pool.num_pinned_blocks == 9
        manager.pool.check_invariants()
    await controller.release(admitted)
    for manager in managers:
        assert manager.num_requests == 0 and manager.pool.num_free_blocks == manager.pool.num_blocks


async def test_a_probe_error_fails_only_its_request() -> None:
    managers, controller = make_stages([32, 32])
    good = PromptRequest("good", list(range(9)))
    empty = PromptRequest("empty", [])
    results = await asyncio.gather(
        controller.agree(good), controller.agree(empty), return_exceptions=True
    )
    assert results[0] is not None and not isinstance(results[0], BaseException)
    assert isinstance(results[1], AgreementRefused)
    assert all(m.request_ids() == ["good"] for m in managers)


async def test_a_cancelled_caller_leaves_nothing_held() -> None:
    managers, controller = make_stages([32, 32])
    waiter = asyncio.ensure_future(controller.agree(PromptRequest("gone", list(range(9)))))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    ticket = await controller.agree(PromptRequest("next", list(range(50, 59))))
    assert ticket is not None
    for _ in range(5):
        await asyncio.sleep(0)  # the background release of "gone", if it was admitted
    assert all(m.request_ids() == ["next"] for m in managers)


prompts = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 24)),  # (which shared prefix, suffix length)
    min_size=1,
    max_size=16,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacities=st.lists(st.integers(8, 40), min_size=2, max_size=4),
    workload=prompts,
    group=st.integers(1, 6),
    max_batch=st.integers(1, 4),
)
def test_batched_agreement_properties(
    capacities: list[int], workload: list[tuple[int, int]], group: int, max_batch: int
) -> None:
    """Requests agreed ``group`` at a time, rounds of at most ``max_batch``: L* never exceeds a
    stage's hit, a refusal leaves no pins, nothing leaks after release."""

    async def scenario() -> None:
        managers, controller = make_stages(capacities, max_batch=max_batch)
        for start in range(0, len(workload), group):
            requests = [
                PromptRequest(
                    f"r{i}",
                    [prefix_id * 1000 + t for t in range(12)] + [i * 100 + t for t in range(n)],
                )
                for i, (prefix_id, n) in enumerate(workload[start : start + group], start)
            ]
            results = await asyncio.gather(
                *(controller.agree(r) for r in requests), return_exceptions=True
            )
            live = []
            for request, ticket in zip(requests, results, strict=True):
                if isinstance(ticket, AgreementRefused):
                    continue
                assert not isinstance(ticket, BaseException), ticket
                if ticket is None:
                    for manager in managers:
                        assert request.request_id not in manager.request_ids()
                    continue
                assert ticket.num_agreed_blocks <= min(ticket.stage_hits)
                assert ticket.num_agreed_blocks * BLOCK < request.num_tokens
                hashes = controller.block_hashes(request)
                for manager, hit in zip(managers, ticket.stage_hits, strict=True):
                    table = manager.block_table(request.request_id)
                    assert len(table) * BLOCK >= request.num_tokens
                    # one round trip: each stage's table starts with its own whole hit
                    assert [manager.pool.block_hash(b) for b in table[:hit]] == hashes[:hit]
                    start = manager.start_chunk(request.request_id, ticket.num_cached_tokens)
                    assert start == hit * BLOCK
                    manager.mark_computed(request.request_id, request.num_tokens, hashes)
                live.append(request.request_id)
            for manager in managers:
                manager.pool.check_invariants()
            await controller.release(live)
        for manager in managers:
            assert manager.num_requests == 0
            assert manager.pool.num_pinned_blocks == 0
            assert manager.pool.num_free_blocks == manager.pool.num_blocks

    asyncio.run(scenario())


async def test_rounds_over_a_real_nats_server(nc) -> None:  # noqa: ANN001
    managers, controller = await served_stages(
        nc, "wavepp.tb", [1024] * 4, block_size=BLOCK, model_id=MODEL_ID, timeout_s=5.0,
        fanout=False,
    )  # fmt: skip
    shared = list(range(40))
    requests = [PromptRequest(f"n{i}", shared + [1000 + i] * 5) for i in range(64)]
    tickets = await asyncio.gather(*(controller.agree(r) for r in requests))
    assert all(t is not None for t in tickets)
    assert controller.num_rounds < 64
    assert all(m.num_requests == 64 for m in managers)
    await controller.release([r.request_id for r in requests])
    assert all(m.num_requests == 0 and m.pool.num_pinned_blocks == 0 for m in managers)


_RESULTS = st.lists(
    st.tuples(
        st.sampled_from(list(EntryStatus)),
        st.integers(0, 2**32 - 1),
        st.sampled_from(["", "", "", "refused: x", "é"]),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(results=_RESULTS, error=st.sampled_from(["", "invalid batch: x"]), rank=st.integers(0, 9))
def test_replies_round_trip(results: list, error: str, rank: int) -> None:
    """A reply decodes to what was encoded: text-less entries through the C-level path (one
    unpack, shared result objects), any with an error text entry by entry; the rank is read from
    the header alone as well (``reply_rank``, what a fan-out round sorts replies by)."""
    reply = KVBatchReply(
        BatchOp.PROBE_RESERVE,
        rank,
        5,
        9,
        tuple(EntryResult(s, v, t) for s, v, t in results),
        error,
    )
    payload = encode_reply(reply)
    assert decode_reply(payload) == reply
    assert decode_reply(payload) == reply  # shared result objects are not mutated
    assert reply_rank(payload) == rank


def _reply_head(count: int) -> bytes:
    return struct.pack("<3sBBHIIH", b"WKR", PROTOCOL_VERSION, 1, 0, 0, 0, 0) + struct.pack(
        "<I", count
    )


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (
            _reply_head(2)
            + struct.pack("<BIIH", 0, 1, 0, 0)
            + struct.pack("<BIIH", 4, 1, 0, 0)
            + MAC,
            "status",
        ),
        (_reply_head(1) + struct.pack("<BIIH", 9, 1, 0, 0) + MAC, "status"),
        (_reply_head(2) + struct.pack("<BIIH", 0, 1, 0, 0) + MAC, "result"),
        (_reply_head(1) + struct.pack("<BIIH", 0, 1, 0, 4) + b"ab" + MAC, "result error"),
        (_reply_head(0), "tag"),
        (_reply_head(1)[:5], "header"),
        (b"XYZ" + _reply_head(0)[3:], "magic"),
    ],
)
def test_malformed_replies_name_the_field(payload: bytes, field: str) -> None:
    with pytest.raises(KVWireError, match=field):
        decode_reply(payload)
    if field in ("header", "magic"):
        assert reply_rank(payload) is None
