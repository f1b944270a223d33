"""Prefix references on the wire and on a stage: an entry names a long
prefix the stage remembers for its owner (``RecentPrefixes``) by its root and last hash, not 32
bytes per block; a stage that does not hold it answers UNRESOLVED and holds nothing for it.

The controller's side (mirror, resend in full) is in ``tests/runtime/agreement/test_agreement_prefix_refs.py``."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_wire_support import chain, reserve_batch, warm

from wavepp.api.kv_batch import (
    RECENT_REFERENCE,
    REFERENCED,
    KVWireError,
    ReserveEntry,
    UnresolvedEntry,
    decode_batch,
    encode_batch,
)
from wavepp.api.kv_reply import EntryStatus, decode_reply
from wavepp.api.messages import PROTOCOL_VERSION
from wavepp.api.signing import BusKey
from wavepp.runtime.agreement.stage_handler import handle_kv_batch
from wavepp.runtime.kv import BlockPool, RecentPrefixes, StageKVManager

BLOCK = 4
OWNER = "adm"


PREFIX = chain(61)


def remembered(owner: str, *sequences: tuple[bytes, ...]) -> RecentPrefixes:
    recent = RecentPrefixes()
    for hashes in sequences:
        recent.remember(owner, hashes)
    return recent


# --------------------------------------------------------------------------- wire format


def test_a_reference_entry_is_smaller_and_decodes_to_the_same_hashes() -> None:
    hashes = PREFIX + chain(3, 9)
    full = encode_batch(reserve_batch(ReserveEntry("a", hashes, 64)))
    ref = encode_batch(reserve_batch(ReserveEntry("a", hashes, 64, recent_len=61)))
    assert full[3] == ref[3] == PROTOCOL_VERSION
    # root and last hash instead of 61 hashes
    assert len(full) - len(ref) == (61 - 2) * 32
    recent = remembered(OWNER, PREFIX + chain(5, 7))  # the same prefix, another suffix
    decoded = decode_batch(ref, resolve=recent.resolve)
    assert decoded.entries == (ReserveEntry("a", hashes, 64),)
    assert decoded.shares == ((REFERENCED, 61),)
    assert all(type(h) is bytes for h in decoded.entries[0].block_hashes)


@pytest.mark.parametrize(
    "recent",
    [
        None,  # no resolver: a stage of this release without memory
        remembered(OWNER),  # nothing remembered (a restarted stage)
        remembered("other", PREFIX),  # another owner's sequence never resolves for this one
        remembered(OWNER, PREFIX[:60]),  # too short
        remembered(OWNER, PREFIX[:40] + chain(21, 3)),  # same root, parts before index 60
    ],
)
def test_a_reference_the_stage_cannot_resolve_decodes_unresolved(
    recent: RecentPrefixes | None,
) -> None:
    """An unresolved entry, and a later one sharing in-batch from it, carry no hashes; an
    entry of its own in the same batch decodes as usual."""
    batch = reserve_batch(
        ReserveEntry("a", PREFIX + chain(2, 9), 63, recent_len=61),
        ReserveEntry("b", PREFIX + chain(2, 8), 63),  # shares 61 in-batch from "a"
        ReserveEntry("c", chain(4, 5), 4),
    )
    decoded = decode_batch(encode_batch(batch), resolve=recent.resolve if recent else None)
    assert decoded.entries == (
        UnresolvedEntry("a", 63),
        UnresolvedEntry("b", 63),
        ReserveEntry("c", chain(4, 5), 4),
    )


def test_the_layout_written_out_by_hand() -> None:
    """The probe-reserve layout, written out by hand: an in-batch share at least as long as
    the reference asked writes no reference; a reference writes the root and the last hash;
    the releases follow the entries."""
    a, b = chain(3), chain(2) + chain(1, 4)

    def entry(
        rid: bytes, n: int, shared_from: int, shared_len: int, total: int, own: tuple[bytes, ...]
    ) -> bytes:
        return (
            struct.pack("<H", len(rid))
            + rid
            + struct.pack("<IIII", n, shared_from, shared_len, total)
            + b"".join(own)
        )

    def head(count: int) -> bytes:
        return (
            struct.pack("<3sBBd", b"WKB", PROTOCOL_VERSION, 1, 5.0)
            + bytes([3])
            + OWNER.encode()
            + struct.pack("<QI", 1, count)
        )

    body = entry(b"a", 3, 0, 0, 4, a) + entry(b"b", 3, 1, 2, 3, b[2:])
    batch = reserve_batch(ReserveEntry("a", a, 4), ReserveEntry("b", b, 3, recent_len=2))
    no_releases = struct.pack("<I", 0)
    assert encode_batch(batch) == head(2) + body + no_releases + bytes(32)
    with_releases = reserve_batch(*batch.entries, releases=("z",))
    released = head(2) + body + struct.pack("<IH", 1, 1) + b"z"
    assert encode_batch(with_releases) == released + bytes(32)
    referenced = reserve_batch(ReserveEntry("a", a, 4, recent_len=3))
    by_reference = entry(b"a", 3, RECENT_REFERENCE, 3, 4, (a[0], a[2]))
    assert encode_batch(referenced) == head(1) + by_reference + no_releases + bytes(32)


def _batch(
    *entries: bytes, count: int | None = None, version: int = PROTOCOL_VERSION, op: int = 1
) -> bytes:
    head = struct.pack("<3sBBd", b"WKB", version, op, 5.0) + b"\x00" + struct.pack("<Q", 0)
    tail = struct.pack("<I", 0) if op == 1 else b""
    return (
        head
        + struct.pack("<I", len(entries) if count is None else count)
        + b"".join(entries)
        + tail
        + bytes(32)
    )


def _ref_entry(
    n: int, shared_len: int, own: int, *, ref: int = 2, total: int | None = None
) -> bytes:
    return (
        struct.pack("<H", 1)
        + b"a"
        + struct.pack("<IIII", n, RECENT_REFERENCE, shared_len, n if total is None else total)
        + bytes(32) * ref
        + bytes(32) * own
    )


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (_batch(_ref_entry(4, 0, 4)), "shared_len"),  # a reference of nothing
        (_batch(_ref_entry(4, 5, 0)), "shared_len"),  # more than its own count
        (_batch(_ref_entry(4, 2, 2, ref=1)), "block_hashes"),  # the reference cut short
        (_batch(_ref_entry(4, 2, 2, ref=1))[:-40], "prefix reference"),
        (_batch(_ref_entry(4, 2, 1)), "block_hashes"),  # one of the rest missing
        (_batch(_ref_entry(4, 2, 2), version=PROTOCOL_VERSION + 1), "version"),
        (_batch(_ref_entry(4, 2, 2), op=2), "after the last entry"),  # a release has no hashes
        (_batch(_ref_entry(4, 2, 2, total=9)), "num_total_blocks"),
    ],
)
def test_malformed_reference_batches_name_the_field(payload: bytes, field: str) -> None:
    with pytest.raises(KVWireError, match=field):
        decode_batch(payload, resolve=remembered("", chain(8)).resolve)


def test_an_entry_asking_for_more_than_its_hashes_is_refused_naming_the_field() -> None:
    with pytest.raises(KVWireError, match="recent_len"):
        encode_batch(reserve_batch(ReserveEntry("a", chain(3), 3, recent_len=4)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    at=st.integers(0, 600),
    value=st.integers(0, 255),
    cut=st.integers(0, 700),
    resolvable=st.booleans(),
)
def test_a_mangled_reference_batch_decodes_or_names_its_fault(
    at: int, value: int, cut: int, resolvable: bool
) -> None:
    """Any byte of a batch with references changed, or the batch cut short: decoded (references
    resolved or not) or refused with ``KVWireError``, never another exception, and the stage
    handler answers it without raising and holds nothing for an unresolved entry."""
    payload = bytearray(
        encode_batch(
            reserve_batch(
                ReserveEntry("a", PREFIX[:8] + chain(2, 9), 10, recent_len=8),
                ReserveEntry("b", PREFIX[:8] + chain(1, 8), 10),
                releases=("r",),
            )
        )
    )
    payload[at % len(payload)] = value
    data = bytes(payload[: len(payload) - cut % 40])
    recent = remembered(OWNER, PREFIX[:8]) if resolvable else RecentPrefixes()
    try:
        batch = decode_batch(data, resolve=recent.resolve)
    except KVWireError:
        pass
    else:
        assert len(batch.entries) == len(batch.shares)
    manager = StageKVManager(BlockPool(32, BLOCK))
    manager.recent_prefixes = recent
    reply = decode_reply(handle_kv_batch(manager, 0, data))
    for result, request_id in zip(reply.results, ("a", "b"), strict=False):
        if result.status is not EntryStatus.OK:
            assert request_id not in manager.request_ids()


# --------------------------------------------------------------------------- the stage's memory


def test_recent_prefixes_are_bounded_least_recently_used_first() -> None:
    recent = RecentPrefixes(max_entries=2)
    a, b, c = chain(4, 1), chain(4, 2), chain(4, 3)
    recent.remember("o", a)
    recent.remember("o", b)
    assert recent.resolve("o", a[0], 4, a[3]) == a  # resolving alone reorders nothing
    recent.remember("o", a)  # an accepted batch remembers what it resolved: b is the oldest
    recent.remember("o", c)
    assert len(recent) == 2
    assert recent.resolve("o", b[0], 4, b[3]) is None
    assert recent.resolve("o", a[0], 2, a[1]) == a[:2]
    assert recent.resolve("o", c[0], 4, c[3]) == c
    # the latest entry with a root replaces the one before
    recent.remember("o", a[:2] + chain(2, 7))
    assert recent.resolve("o", a[0], 3, a[2]) is None
    assert recent.resolve("o", a[0], 2, a[1]) == a[:2]


def test_recent_prefixes_bound_their_hashes_and_keep_owners_apart() -> None:
    recent = RecentPrefixes(max_hashes=10)
    a, b = chain(6, 1), chain(6, 2)
    recent.remember("o", a)
    recent.remember("p", a)  # the same hashes under another owner: 12 > 10, the oldest goes
    assert recent.num_hashes == 6
    assert recent.resolve("o", a[0], 6, a[5]) is None
    assert recent.resolve("p", a[0], 6, a[5]) == a
    recent.remember("o", chain(11, 3))  # longer than the whole bound: not kept
    assert recent.resolve("o", chain(11, 3)[0], 1, chain(11, 3)[0]) is None
    assert recent.resolve("o", b[0], 1, b[0]) is None  # never remembered
    for bad in (0, 7):  # nothing shared, or more than it holds
        assert recent.resolve("p", a[0], bad, a[min(bad, 6) - 1]) is None
    assert recent.resolve("p", a[0], 3, a[3]) is None  # the wrong last hash
    recent.clear()
    assert len(recent) == 0 and recent.num_hashes == 0
    with pytest.raises(ValueError, match="max_entries"):
        RecentPrefixes(max_entries=0)


# --------------------------------------------------------------------------- the stage handler


def test_an_unresolved_entry_is_answered_alone_and_holds_nothing() -> None:
    manager = StageKVManager(BlockPool(256, BLOCK))
    warm(manager, PREFIX)
    first = reserve_batch(ReserveEntry("r1", PREFIX + chain(2, 9), 63))
    reply = decode_reply(handle_kv_batch(manager, 0, encode_batch(first)))
    assert [(r.status, r.value) for r in reply.results] == [(EntryStatus.OK, 61)]
    other_root = chain(30, 4)
    second = reserve_batch(
        ReserveEntry("r2", PREFIX + chain(2, 8), 63, recent_len=61),  # remembered: resolves
        ReserveEntry("r3", other_root + chain(1, 8), 31, recent_len=30),  # never sent here
        ReserveEntry("r4", other_root + chain(1, 7), 31),  # shares in-batch from r3
        ReserveEntry("r5", chain(3, 6), 3),
        seq=2,
    )
    payload = encode_batch(second)
    assert len(payload) < 20 * 32  # 11 hashes travel (98 named): references, shares
    reply = decode_reply(handle_kv_batch(manager, 0, payload))
    assert [(r.status, r.value) for r in reply.results] == [
        (EntryStatus.OK, 61),  # the same hit as the hashes in full
        (EntryStatus.UNRESOLVED, 0),
        (EntryStatus.UNRESOLVED, 0),
        (EntryStatus.OK, 0),
    ]
    assert sorted(manager.request_ids()) == ["r1", "r2", "r5"]
    assert len(manager.block_table("r2")) == 63
    for rid in ("r1", "r2", "r5"):
        manager.release(rid, owner=OWNER)
    assert manager.pool.num_pinned_blocks == 0
    manager.pool.check_invariants()
    # what it resolved it remembers in full (the latest entry per root); not what it did not
    recent = manager.recent_prefixes
    assert recent.resolve(OWNER, PREFIX[0], 63, (PREFIX + chain(2, 8))[62]) is not None
    assert recent.resolve(OWNER, other_root[0], 1, other_root[0]) is None


def test_a_keyed_stage_remembers_only_batches_it_accepted() -> None:
    key = BusKey.generate().for_replica("p")
    manager = StageKVManager(BlockPool(64, BLOCK))
    batch = reserve_batch(ReserveEntry("r", PREFIX[:8], 8))
    for payload in (encode_batch(batch), encode_batch(batch, BusKey.generate())):
        assert "mac" in decode_reply(handle_kv_batch(manager, 0, payload, bus_key=key)).error
    assert len(manager.recent_prefixes) == 0
    signed = encode_batch(batch, key)
    assert decode_reply(handle_kv_batch(manager, 0, signed, bus_key=key)).results[0].ok
    assert len(manager.recent_prefixes) == 1
    manager.recent_prefixes.clear()
    assert "repeated" in decode_reply(handle_kv_batch(manager, 0, signed, bus_key=key)).error
    assert len(manager.recent_prefixes) == 0
