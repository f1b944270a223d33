"""Attacks on prefix references (``wavepp.api.kv_batch``) and the stage's memory of them
(``RecentPrefixes``), signed with a bus key and unsigned: malformed references are refused
whole naming the field, unresolvable ones are answered UNRESOLVED holding nothing, another
owner's prefix never resolves, a refused batch (repeated, malformed) changes nothing a stage
remembers, and the controller's mirror stays within what a stage can remember.

The protocol's own tests are ``tests/runtime/agreement/test_kv_batch_refs.py`` and
``tests/runtime/agreement/test_agreement_prefix_refs.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import struct

import pytest
from kv_wire_support import CountingClient, chain, reserve_batch, warm

from wavepp.api.kv_batch import (
    MAX_BLOCKS_PER_BATCH,
    MAX_BLOCKS_PER_ENTRY,
    RECENT_REFERENCE,
    BatchOp,
    ReserveEntry,
    decode_batch,
    encode_batch,
)
from wavepp.api.kv_reply import EntryResult, EntryStatus, decode_reply, encode_reply
from wavepp.api.kv_reply_tag import reply_tag_prefix, verify_reply
from wavepp.api.messages import PROTOCOL_VERSION
from wavepp.api.signing import BusKey
from wavepp.runtime.agreement import AgreementController
from wavepp.runtime.agreement import rounds as rounds_module
from wavepp.runtime.agreement.stage_handler import handle_kv_batch
from wavepp.runtime.kv import BlockPool, RecentPrefixes, StageKVManager
from wavepp.runtime.request import PromptRequest

KEY = BusKey.generate().for_replica("attack")
BLOCK = 4
OWNER = "adm"
MODEL_ID = "prefix-refs-attacks"


PREFIX = chain(61)


def _signed(body: bytes, key: BusKey | None) -> bytes:
    return body + (key.mac_bytes(b"KVBatch", body) if key is not None else bytes(32))


def _body(*entries: bytes, count: int | None = None, owner: str = OWNER, seq: int = 1) -> bytes:
    head = (
        struct.pack("<3sBBd", b"WKB", PROTOCOL_VERSION, BatchOp.PROBE_RESERVE, 5.0)
        + bytes([len(owner)])
        + owner.encode()
    )
    return (
        head
        + struct.pack("<Q", seq)
        + struct.pack("<I", len(entries) if count is None else count)
        + b"".join(entries)
        + struct.pack("<I", 0)  # no releases
    )


def _entry(
    rid: bytes,
    n: int,
    shared_from: int,
    shared_len: int,
    *own: bytes,
    ref: tuple[bytes, ...] = (),
    total: int | None = None,
) -> bytes:
    counts = struct.pack("<IIII", n, shared_from, shared_len, n if total is None else total)
    return struct.pack("<H", len(rid)) + rid + counts + b"".join(ref) + b"".join(own)


def _ref(
    rid: bytes, n: int, shared_len: int, *own: bytes, last: bytes | None = None, root: bytes = b""
) -> bytes:
    """A reference entry to ``PREFIX`` (or ``root``) with the hash at shared_len - 1."""
    ref = (
        root or PREFIX[0],
        last if last is not None else PREFIX[min(max(shared_len, 1), len(PREFIX)) - 1],
    )
    return _entry(rid, n, RECENT_REFERENCE, shared_len, *own, ref=ref)


MALFORMED = {
    "reference of nothing": (_body(_ref(b"a", 4, 0, *chain(4, 9))), "shared_len"),
    "reference past its count": (_body(_ref(b"a", 4, 5)), "shared_len"),
    "reference huge": (_body(_ref(b"a", 4, 0xFFFFFFFE)), "shared_len"),
    "count past an entry's limit": (
        _body(_ref(b"a", MAX_BLOCKS_PER_ENTRY + 1, MAX_BLOCKS_PER_ENTRY + 1)),
        "block_hashes",
    ),
    # 400 bytes naming 5 Mi hashes by reference: refused before anything is resolved
    "references past the batch's limit": (
        _body(
            *(
                _ref(bytes([97 + i]), MAX_BLOCKS_PER_ENTRY, MAX_BLOCKS_PER_ENTRY)
                for i in range(MAX_BLOCKS_PER_BATCH // MAX_BLOCKS_PER_ENTRY + 1)
            )
        ),
        "per batch",
    ),
    "reference cut short": (_body(_ref(b"a", 4, 4))[:-20], "prefix reference"),
    "root only": (
        _body(_entry(b"a", 4, RECENT_REFERENCE, 4, ref=(PREFIX[0],))),
        "prefix reference",
    ),
    "in-batch share past the referencing entry": (
        _body(_ref(b"a", 8, 8), _entry(b"b", 12, 1, 9, *chain(3, 9))),
        "shared_len",
    ),
    "in-batch share from itself": (_body(_entry(b"a", 8, 1, 8)), "shared_from"),
    "count past the batch's entries": (_body(_ref(b"a", 8, 8), count=0xFFFFFFFF), "count"),
    "one entry more than sent": (_body(_ref(b"a", 8, 8), count=2), "request_id"),
}


def _stage() -> StageKVManager:
    manager = StageKVManager(BlockPool(256, BLOCK))
    warm(manager, PREFIX)
    manager.recent_prefixes.remember(OWNER, PREFIX)
    return manager


@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_reference_batch_is_refused_whole_naming_the_field(
    case: str, key: BusKey | None
) -> None:
    body, field = MALFORMED[case]
    manager = _stage()
    recent = manager.recent_prefixes
    before = list(recent._sequences.items())
    reply = decode_reply(handle_kv_batch(manager, 0, _signed(body, key), bus_key=key))
    assert field in reply.error and reply.results == ()
    assert manager.num_requests == 0 and manager.pool.num_pinned_blocks == 0
    assert list(recent._sequences.items()) == before  # nothing remembered, nothing reordered
    manager.pool.check_invariants()


@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_unresolvable_references_hold_nothing_and_never_reach_another_owners_prefix(
    key: BusKey | None,
) -> None:
    """Each way a reference can miss (another owner's prefix, a root never sent, the wrong last
    hash, one past what is remembered), and an entry sharing in-batch from such a one: UNRESOLVED,
    no pin, not remembered; the entries beside them are applied; another owner's memory is
    untouched."""
    manager = StageKVManager(BlockPool(256, BLOCK))
    warm(manager, PREFIX)
    manager.recent_prefixes.remember("other", PREFIX)
    other_root = chain(8, 5)
    manager.recent_prefixes.remember(OWNER, PREFIX[:20])
    entries = (
        _ref(b"u-root", 8, 8, root=other_root[0], last=other_root[7]),
        _ref(b"u-last", 10, 10, last=PREFIX[8]),  # index 9 is not PREFIX[8]
        _ref(b"u-long", 30, 30),  # remembered only 20 of it
        _entry(b"u-share", 31, 3, 30, PREFIX[30]),  # shares in-batch from u-long
        _ref(b"ok", 20, 20),
        _entry(b"own", 3, 0, 0, *chain(3, 6)),
    )
    payload = _signed(_body(*entries), key)
    data = handle_kv_batch(manager, 2, payload, bus_key=key)
    if key is not None:
        assert verify_reply(data, key, reply_tag_prefix(OWNER, 1), 2)
    reply = decode_reply(data)
    assert [r.status for r in reply.results] == [EntryStatus.UNRESOLVED] * 4 + [EntryStatus.OK] * 2
    assert reply.results[4].value == 20
    assert sorted(manager.request_ids()) == ["ok", "own"]
    for rid in ("ok", "own"):
        manager.release(rid, owner=OWNER)
    assert manager.pool.num_pinned_blocks == 0
    recent = manager.recent_prefixes
    assert recent.resolve("other", PREFIX[0], 61, PREFIX[60]) == PREFIX  # untouched
    assert recent.resolve(OWNER, PREFIX[0], 21, PREFIX[20]) is None  # u-long not remembered
    assert recent.resolve(OWNER, other_root[0], 1, other_root[0]) is None


def test_another_owners_batch_cannot_make_a_reference_resolve_elsewhere() -> None:
    """Owner "b" (signing with the same key under its own name) sends the same root with a
    different continuation: owner "a"'s references still resolve to its own sequence, or not at
    all; never to "b"'s."""
    manager = StageKVManager(BlockPool(256, BLOCK))
    mine = PREFIX[:10] + chain(6, 9)
    theirs = PREFIX[:10] + chain(6, 8)
    for owner, seq, hashes in (("a", 1, mine), ("b", 1, theirs)):
        batch = reserve_batch(ReserveEntry(f"{owner}1", hashes, 16), owner=owner, seq=seq)
        assert decode_reply(handle_kv_batch(manager, 0, encode_batch(batch, KEY), bus_key=KEY))
    recent = manager.recent_prefixes
    assert recent.resolve("a", PREFIX[0], 16, mine[15]) == mine
    assert recent.resolve("a", PREFIX[0], 16, theirs[15]) is None
    # "a" asking for b's continuation by reference: unresolved, nothing held
    ask = reserve_batch(
        ReserveEntry("a2", theirs + chain(1, 3), 17, recent_len=16), owner="a", seq=2
    )
    reply = decode_reply(handle_kv_batch(manager, 0, encode_batch(ask, KEY), bus_key=KEY))
    assert reply.results[0].status is EntryStatus.UNRESOLVED
    assert "a2" not in manager.request_ids()


@pytest.mark.parametrize("how", ["repeated", "malformed after the reference", "another key"])
def test_a_refused_batch_does_not_change_which_prefixes_a_stage_keeps(how: str) -> None:
    """A batch the stage refuses (a repeat of a signed one, one malformed after its reference,
    one signed with another key) leaves the memory's eviction order as it was: the prefix it
    referenced is still the oldest, and goes first."""
    key = None if how == "malformed after the reference" else KEY
    manager = StageKVManager(BlockPool(256, BLOCK))
    manager.recent_prefixes = RecentPrefixes(max_entries=2)
    old, new = PREFIX[:8], chain(8, 3)
    first = reserve_batch(ReserveEntry("r1", old, 8), ReserveEntry("r2", new, 8), seq=1)
    assert not decode_reply(
        handle_kv_batch(manager, 0, encode_batch(first, key), bus_key=key)
    ).error
    manager.release("r1", owner=OWNER)
    manager.release("r2", owner=OWNER)
    referencing = reserve_batch(ReserveEntry("r3", old + chain(1, 4), 9, recent_len=8), seq=2)
    payload = encode_batch(referencing, key)
    if how == "repeated":
        assert not decode_reply(handle_kv_batch(manager, 0, payload, bus_key=key)).error
        manager.release("r3", owner=OWNER)
        manager.recent_prefixes.remember(OWNER, new)  # "new" back to most recent
        manager.recent_prefixes.remember(OWNER, old)
        manager.recent_prefixes.remember(OWNER, new)  # now "old" is the oldest again
    elif how == "malformed after the reference":
        payload = payload[:-32] + b"\x00" + bytes(32)  # one byte after the last entry
    else:
        payload = encode_batch(referencing, BusKey.generate().for_replica("attack"))
    reply = decode_reply(handle_kv_batch(manager, 0, payload, bus_key=key))
    assert reply.error  # refused whole
    manager.recent_prefixes.remember(OWNER, chain(8, 6))  # a third root: the oldest goes
    assert manager.recent_prefixes.resolve(OWNER, old[0], 8, old[7]) is None
    assert manager.recent_prefixes.resolve(OWNER, new[0], 8, new[7]) == new
    assert manager.num_requests == 0


# --------------------------------------------------------------------------- the controller


def _requests(tag: str, roots: range, blocks: int) -> list[PromptRequest]:
    return [
        PromptRequest(
            f"{tag}-{root}",
            [root * 100_000 + t for t in range(blocks * BLOCK)] + [7, 8],
        )
        for root in roots
    ]


async def test_the_mirror_holds_no_more_hashes_than_a_stage_remembers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Long prefixes, more of them than a stage keeps (its ``max_hashes``): the controller's
    mirror keeps at most as many hashes as the stage, dropping the oldest first as the stage
    does, so it never names a prefix the stage dropped (no UNRESOLVED, no resend), and its
    memory is bounded by hashes, not only by roots."""
    bound = 64
    monkeypatch.setattr(rounds_module, "_SENT_HASHES_KEPT", bound, raising=False)
    managers = [StageKVManager(BlockPool(1024, BLOCK)) for _ in range(2)]
    for manager in managers:
        manager.recent_prefixes = RecentPrefixes(max_hashes=bound)
    clients = [CountingClient(m, r) for r, m in enumerate(managers)]
    controller = AgreementController(clients, block_size=BLOCK, model_id=MODEL_ID, lease_s=30.0)
    # roots of 20 blocks: 0, 1, 2 fit (60 hashes); 3 pushes 0 and 1 out; then 0 (dropped: in
    # full) and 2 (kept: by reference)
    for index, root in enumerate((0, 1, 2, 3, 0, 2)):
        request = _requests(f"w{index}", range(root, root + 1), 20)[0]
        ticket = await asyncio.wait_for(controller.agree(request), 10)
        assert ticket is not None
        await controller.release([request.request_id])
    assert controller.num_unresolved == 0  # root 0 goes in full: the stage dropped it
    sent = controller._rounds._sent._sequences  # the mirror's kept sequences
    assert sum(map(len, sent.values())) <= bound
    assert any(referenced for _, referenced in clients[0].payloads)  # references were used
    for manager in managers:
        assert manager.num_requests == 0 and manager.pool.num_pinned_blocks == 0


def test_the_mirror_bound_is_at_most_a_stages_default() -> None:
    assert rounds_module._SENT_HASHES_KEPT <= RecentPrefixes().max_hashes


class FaultyStage(CountingClient):
    """Answers after ``delay`` passes of the event loop (rounds overlap); the probe-reserve
    round numbered ``fault_at`` (0-based, as it reaches this stage) it applies, then answers
    with ``fault``: "count" (one result short), "error" (a batch-level refusal), "unresolved" (every entry UNRESOLVED: a forger without a key, or a
    faulty stage; it holds nothing for them)."""

    def __init__(self, manager: StageKVManager, rank: int, delay: int, fault: str, fault_at: int):
        super().__init__(manager, rank)
        self.delay, self.fault, self.fault_at = delay, fault, fault_at

    async def call_batch(self, payload: bytes) -> bytes:
        index = len(self.payloads)
        data = await super().call_batch(payload)
        for _ in range(self.delay):
            await asyncio.sleep(0)
        if payload[4] != BatchOp.PROBE_RESERVE or index != self.fault_at:
            return data
        reply = decode_reply(data)
        if self.fault == "count":
            reply = dataclasses.replace(reply, results=reply.results[:-1])
        elif self.fault == "error":
            reply = dataclasses.replace(reply, results=(), error="invalid batch: a fault")
        else:
            for result, rid in zip(reply.results, _entry_ids(payload), strict=True):
                if result.ok:
                    self.manager.release(rid)
            unresolved = EntryResult(EntryStatus.UNRESOLVED)
            reply = dataclasses.replace(reply, results=(unresolved,) * len(reply.results))
        return encode_reply(reply)


def _entry_ids(payload: bytes) -> list[str]:
    return [e.request_id for e in decode_batch(payload).entries]  # type: ignore[union-attr]


@pytest.mark.parametrize("rounds_in_flight", [1, 2, 3])
@pytest.mark.parametrize("fault", ["count", "error", "unresolved"])
@pytest.mark.parametrize("fault_at", [1, 2])
async def test_a_stage_faulting_mid_stream_leaves_no_request_half_admitted(
    rounds_in_flight: int, fault: str, fault_at: int
) -> None:
    """Waves of requests with shared prefixes (references in use), rounds overlapping, one
    caller cancelled while its round is out, and one stage answering one round wrongly: every
    caller returns (a ticket, None or an error; none hangs), each admitted request is held on
    every stage and every other one on none, nothing is left once the admitted ones are
    released; after a failed round the mirror is empty."""
    managers = [StageKVManager(BlockPool(1024, BLOCK)) for _ in range(3)]
    clients: list[CountingClient] = [
        FaultyStage(m, r, d, fault, fault_at if r == 2 else -1)
        for r, (m, d) in enumerate(zip(managers, (0, 2, 1), strict=True))
    ]
    controller = AgreementController(
        clients,
        block_size=BLOCK,
        model_id=MODEL_ID,
        max_batch=3,
        max_rounds_in_flight=rounds_in_flight,
    )
    admitted: list[str] = []
    outcomes: dict[str, str] = {}
    for wave in range(3):
        requests = [
            PromptRequest(
                f"w{wave}-{i}", [root * 1000 + t for t in range(40)] + [wave * 10 + i, 5, 6]
            )
            for i, root in enumerate((0, 1, 0, 1, 0))
        ]
        tasks = [asyncio.ensure_future(controller.agree(r)) for r in requests]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        tasks[-1].cancel()  # a caller gone while its round is out
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        for request, result in zip(requests, results, strict=True):
            kind = type(result).__name__
            outcomes[request.request_id] = kind
            if result is not None and not isinstance(result, BaseException):
                admitted.append(request.request_id)
    for manager in managers:
        assert sorted(manager.request_ids()) == sorted(admitted), outcomes
    assert controller.num_unresolved <= 3 * 5
    if fault in ("count", "error"):
        assert any(kind == "StageProtocolError" for kind in outcomes.values()), outcomes
    await controller.release(admitted)
    for manager in managers:
        assert manager.num_requests == 0 and manager.pool.num_pinned_blocks == 0
        manager.pool.check_invariants()
