"""The batched agreement wire format (version 5): one binary message per stage per admission round.

A round carries the probe-reserves (or the releases) of every request ready in it, so a stage
answers a whole round with one message and one pass over its block table, instead of one JSON
request-reply per request per phase. Since version 3 the agreement takes one round trip: a
probe-reserve entry pins the stage's local hit h_s and at once reserves the blocks after it
(the stage's table does not depend on L*: token p lives in block p // block_size either way);
the controller takes L* from the replies and sends it with the plan. The two-phase ops (probe,
then commit with L*) are still decoded and applied, for a controller of an earlier release.
Block hashes travel as raw 32-byte sha256 digests, not JSON hex strings.

Layout (little-endian; ``rid`` = u16 length + UTF-8 request id, 1..256 bytes)::

    request  "WKB" | u8 version | u8 op | f64 lease_s | u8 owner length | owner (ASCII, <= 64)
             | u64 seq | u32 count | count x entry | 32-byte mac
      op 1 probe   entry: rid | u32 n | u32 shared_from | u32 shared_len
                          | (n - shared_len) x 32-byte block hash
      op 2 commit  entry: rid | u32 num_agreed_blocks | u32 num_total_blocks
      op 3 release entry: rid                             (lease_s ignored, 0)
      op 4 probe-reserve  entry: rid | u32 n | u32 shared_from | u32 shared_len
                          | u32 num_total_blocks | (n - shared_len) x 32-byte block hash
                          (version 3 on; num_total_blocks is n or n + 1: the prompt's full
                          blocks and a partial last one)
             version 4 (op 4 only), after the entries: u32 num_releases | num_releases x rid:
             requests to release before the round's probe-reserves (the previous round's
             finished requests ride along, one message per stage per round instead of two)
             version 5 (op 4 only): version 4, and an entry whose shared_from is 0xFFFFFFFF
             (``RECENT_REFERENCE``) names its first shared_len hashes by reference to the
             prefix the stage remembers for the batch's owner (below):
                          rid | u32 n | u32 0xFFFFFFFF | u32 shared_len | u32 num_total_blocks
                          | 32-byte root hash (index 0) | 32-byte hash at index shared_len - 1
                          | (n - shared_len) x 32-byte block hash      (1 <= shared_len <= n)
    reply    (``wavepp.api.kv_reply``) "WKR" | u8 version | u8 op | u16 rank
             | u32 num_free_blocks | u32 num_blocks | u16 error length | error (UTF-8; a whole-batch fault, else empty)
             | u32 count | count x (u8 status | u32 value | u16 length | UTF-8 error)
      status 0 ok (value: hit blocks for a probe or a probe-reserve, reserved blocks for a
      commit), 1 refused (a reservation that does not fit now; nothing held), 2 invalid (the
      entry names the fault; nothing held), 3 unresolved (a version 5 prefix reference the
      stage does not hold: send the hashes; nothing held)
    reply v2 the version 1 reply with version byte 2 | 32-byte tag: HMAC-SHA256 under the
             replica's key, domain "KVBatchReply", of the batch's u8 owner length | owner | u64 seq
             | u16 rank | the reply up to the tag

A probe (or probe-reserve) entry names its first ``shared_len`` hashes by reference: the first
``shared_len`` hashes of entry ``shared_from - 1`` of the same batch (an earlier one; 0 with
``shared_len`` 0: none), and only the rest travel. Requests of a round that share a long prefix
(agentic and chat: thousands of tokens in common, a short new suffix) so carry it once, and a
stage walks its block table once for it (``BlockPool.pin_cache_hit``).

Across rounds (version 5): a stage remembers, per owner and root (first hash), the hashes of
the owner's latest probe-reserve entry with that root (``wavepp.runtime.kv.recent``); the
controller mirrors it and sets ``ReserveEntry.recent_len``, and ``encode_batch`` sends those
hashes as the root and the hash at index ``recent_len - 1`` unless an earlier entry of the batch
shares as much. Block hashes are a chain, so equal hashes at k - 1 mean equal first k hashes;
a reference the stage's memory does not end there (``decode_batch``'s ``resolve``) decodes as
``UnresolvedEntry``, as does a later entry sharing in-batch from it: nothing is probed for it.

Versions: version 1 (no ``shared_from``/``shared_len``: every hash travels), version 2 (ops
1-3), 3 and 4 are still decoded; ``encode_batch`` writes version 5 only for a probe-reserve
batch with at least one reference written, else version 4 for one that carries releases,
version 3 for one without, and version 2 for ops 1-3 (a stage of an earlier release still reads
what it can apply; a controller turns references off for one that cannot decode version 5). A
batch's releases have no results (a release is idempotent and never refused). A reply is
version 1, or version 2 tagged by a keyed stage (``api.kv_reply_tag``).

``owner`` is the admission instance sending the round and ``seq`` its op number (a stage refuses a
replayed one); ``mac`` is HMAC-SHA256 under the replica's bus key (``wavepp.api.signing``) of
everything before it, or 32 zero bytes unsigned (insecure mode: a stage with a key refuses it).
Decoding never trusts a length: every field is bounds-checked and a fault raises
``KVWireError`` naming the field and the limit.
"""

from __future__ import annotations

import hmac
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from functools import lru_cache
from typing import NamedTuple

from wavepp.api.hash_chain import common_prefix
from wavepp.api.signing import BusKey

__all__ = [
    "BLOCK_HASH_BYTES",
    "KV_BATCH_VERSION",
    "MAX_BATCH_ENTRIES",
    "MAX_BLOCKS_PER_BATCH",
    "MAX_BLOCKS_PER_ENTRY",
    "BatchOp",
    "CommitEntry",
    "KVBatch",
    "KVWireError",
    "ProbeEntry",
    "RECENT_REFERENCE",
    "REFERENCED",
    "ReserveEntry",
    "Resolver",
    "UnresolvedEntry",
    "decode_batch",
    "encode_batch",
]

KV_BATCH_VERSION = 5
_DECODED_VERSIONS = (1, 2, 3, 4, 5)
_FIRST_VERSION_OF_RESERVE = 3
_FIRST_VERSION_OF_RELEASES = 4
_FIRST_VERSION_OF_REFERENCES = 5
RECENT_REFERENCE = 0xFFFFFFFF
"""``shared_from`` of a version 5 probe-reserve entry that names its first ``shared_len``
hashes by reference to the stage's remembered prefix (root hash and last hash on the wire)."""
BLOCK_HASH_BYTES = 32
MAX_BATCH_ENTRIES = 4096
MAX_BLOCKS_PER_ENTRY = 1 << 20  # 64 Mi tokens at 64-token blocks
MAX_BLOCKS_PER_BATCH = 1 << 22  # hashes named in one batch, shared ones included (32 MiB of refs)
MAX_REQUEST_ID_BYTES = 256
MAX_LEASE_S = 3600.0

_REQUEST_MAGIC = b"WKB"
_REQ_HEADER = struct.Struct("<3sBBd")
_OWNER_SEQ = struct.Struct("<Q")
MAC_BYTES = 32
_NO_MAC = bytes(MAC_BYTES)
MAX_OWNER_BYTES = 64
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_COMMIT = struct.Struct("<II")
_PROBE_V2 = struct.Struct("<III")
_RESERVE = struct.Struct("<IIII")


class KVWireError(ValueError):
    """A batch or reply that does not decode; the message names the field and the limit."""


class BatchOp(IntEnum):
    PROBE = 1
    COMMIT = 2
    RELEASE = 3
    PROBE_RESERVE = 4


class ProbeEntry(NamedTuple):
    """Pin the longest locally cached prefix of ``block_hashes`` (32-byte digests each)."""

    request_id: str
    block_hashes: tuple[bytes, ...]


class CommitEntry(NamedTuple):
    """Unpin past ``num_agreed_blocks`` (L*) and reserve up to ``num_total_blocks``."""

    request_id: str
    num_agreed_blocks: int
    num_total_blocks: int


class ReserveEntry(NamedTuple):
    """Pin the longest locally cached prefix of ``block_hashes`` (h_s blocks) and reserve the
    ``num_total_blocks - h_s`` blocks after it, in one step: the stage's block table is its
    h_s cached block ids, then fresh ones (or nothing held: refused).

    ``recent_len`` (encoding only, 0..len(block_hashes)): the first ``recent_len`` hashes are
    those of an entry with the same root the controller sent this stage before, so they may
    travel by reference (version 5); ``decode_batch`` always sets 0."""

    request_id: str
    block_hashes: tuple[bytes, ...]
    num_total_blocks: int
    recent_len: int = 0


class UnresolvedEntry(NamedTuple):
    """A decoded probe-reserve entry whose prefix reference (version 5) the stage could not
    resolve (or that shares in-batch from such an entry): its hashes are unknown here, so
    nothing may be probed or held for it; the stage answers it unresolved."""

    request_id: str
    num_total_blocks: int


Resolver = Callable[[str, bytes, int, bytes], tuple[bytes, ...] | None]
"""``(owner, root, num_shared, last_hash)`` -> the first ``num_shared`` hashes the stage
remembers for ``(owner, root)`` if their last is ``last_hash``, else None
(``wavepp.runtime.kv.recent.RecentPrefixes.resolve``)."""


_HASHED_OPS = (BatchOp.PROBE, BatchOp.PROBE_RESERVE)
REFERENCED = -2  # a decoded entry's ``shared_from`` when its prefix came by reference


@dataclass(frozen=True)
class KVBatch:
    """One round's message to one stage: ``entries`` are ReserveEntry for PROBE_RESERVE,
    ProbeEntry for PROBE, CommitEntry for COMMIT, request ids (str) for RELEASE.

    ``shares``, set by ``decode_batch`` for a probe or probe-reserve batch (``encode_batch``
    finds the sharing itself and ignores it): per entry ``(shared_from, shared_len)``,
    ``block_hashes[:shared_len]`` being the first ``shared_len`` hashes of entry ``shared_from``
    (-1: none; ``REFERENCED`` (-2): named by reference to the stage's remembered prefix).

    ``releases`` (PROBE_RESERVE only): request ids the stage releases before the entries."""

    op: BatchOp
    entries: tuple[ReserveEntry | UnresolvedEntry | ProbeEntry | CommitEntry | str, ...]
    lease_s: float = 0.0
    owner: str = ""  # the admission instance (only it may commit or release what it probed)
    seq: int = 0  # the owner's op number
    shares: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    releases: tuple[str, ...] = ()


# ---- encoding ------------------------------------------------------------------------------


def _rid(request_id: str) -> bytes:
    raw = request_id.encode()
    if not 1 <= len(raw) <= MAX_REQUEST_ID_BYTES:
        raise KVWireError(
            f"request_id: {len(raw)} bytes; must be 1..{MAX_REQUEST_ID_BYTES} bytes of UTF-8"
        )
    return _U16.pack(len(raw)) + raw


def encode_batch(batch: KVBatch, bus_key: BusKey | None = None) -> bytes:
    """Serialise a batch, signed with ``bus_key`` (None: unsigned). Raises ``KVWireError`` for
    a field out of its limit."""
    if len(batch.entries) > MAX_BATCH_ENTRIES:
        raise KVWireError(f"entries: {len(batch.entries)}; at most {MAX_BATCH_ENTRIES} per batch")
    lease_s = float(batch.lease_s)
    if batch.op is not BatchOp.RELEASE and not (0 < lease_s <= MAX_LEASE_S):
        raise KVWireError(f"lease_s: {lease_s}; must be in (0, {MAX_LEASE_S}]")
    owner = batch.owner.encode()
    if len(owner) > MAX_OWNER_BYTES or not batch.owner.isascii():
        raise KVWireError(f"owner: {len(owner)} bytes; at most {MAX_OWNER_BYTES} ASCII")
    if not 0 <= batch.seq < 2**64:
        raise KVWireError(f"seq: {batch.seq}; must be in [0, 2**64)")
    if batch.releases and batch.op is not BatchOp.PROBE_RESERVE:
        raise KVWireError(f"releases: only in a probe-reserve batch (op 4), not op {batch.op}")
    if len(batch.releases) > MAX_BATCH_ENTRIES:
        raise KVWireError(f"releases: {len(batch.releases)}; at most {MAX_BATCH_ENTRIES}")
    parts: list[bytes] = []
    num_references = 0
    # first hash -> the latest probe entry (index, hashes) that starts with it
    latest_with_root: dict[bytes, tuple[int, tuple[bytes, ...]]] = {}
    for index, entry in enumerate(batch.entries):
        if batch.op in _HASHED_OPS:
            assert isinstance(entry, ProbeEntry | ReserveEntry)
            hashes = tuple(entry.block_hashes)
            if len(hashes) > MAX_BLOCKS_PER_ENTRY:
                raise KVWireError(
                    f"block_hashes: {len(hashes)}; at most {MAX_BLOCKS_PER_ENTRY} per request"
                )
            shared_from, shared_len = 0, 0
            if hashes:
                earlier = latest_with_root.get(hashes[0])
                if earlier is not None:
                    shared_from, shared_len = earlier[0] + 1, common_prefix(earlier[1], hashes)
                latest_with_root[hashes[0]] = (index, hashes)
            reference = b""
            if isinstance(entry, ReserveEntry) and entry.recent_len:
                if not 0 <= entry.recent_len <= len(hashes):
                    raise KVWireError(
                        f"recent_len: {entry.recent_len}; must be in [0, {len(hashes)}] (the "
                        "entry's block hashes)"
                    )
                if entry.recent_len > shared_len:  # else the in-batch share is as long
                    shared_from, shared_len = RECENT_REFERENCE, entry.recent_len
                    reference = hashes[0] + hashes[shared_len - 1]
                    num_references += 1
            rest = hashes[shared_len:]
            joined = reference + b"".join(rest)
            if len(joined) != BLOCK_HASH_BYTES * (len(rest) + 2 * bool(reference)):
                raise KVWireError(f"block_hashes: each must be {BLOCK_HASH_BYTES} bytes")
            if isinstance(entry, ReserveEntry):
                if entry.num_total_blocks not in (len(hashes), len(hashes) + 1) or (
                    entry.num_total_blocks < 1
                ):
                    raise KVWireError(_bad_total(entry.num_total_blocks, len(hashes)))
                counts = _RESERVE.pack(len(hashes), shared_from, shared_len, entry.num_total_blocks)
            else:
                counts = _PROBE_V2.pack(len(hashes), shared_from, shared_len)
            parts += [_rid(entry.request_id), counts, joined]
        elif batch.op is BatchOp.COMMIT:
            assert isinstance(entry, CommitEntry)
            parts += [
                _rid(entry.request_id),
                _COMMIT.pack(entry.num_agreed_blocks, entry.num_total_blocks),
            ]
        else:
            assert isinstance(entry, str)
            parts.append(_rid(entry))
    if batch.op is not BatchOp.PROBE_RESERVE:
        version = 2
    elif num_references:
        version = _FIRST_VERSION_OF_REFERENCES
    else:
        version = _FIRST_VERSION_OF_RELEASES if batch.releases else _FIRST_VERSION_OF_RESERVE
    header = [
        _REQ_HEADER.pack(_REQUEST_MAGIC, version, int(batch.op), lease_s),
        bytes([len(owner)]),
        owner,
        _OWNER_SEQ.pack(batch.seq),
        _U32.pack(len(batch.entries)),
    ]
    parts = header + parts
    if version >= _FIRST_VERSION_OF_RELEASES:
        parts.append(_U32.pack(len(batch.releases)))
        parts += [_rid(request_id) for request_id in batch.releases]
    body = b"".join(parts)
    return body + (bus_key.mac_bytes(b"KVBatch", body) if bus_key is not None else _NO_MAC)


def _bad_total(total: int, num_hashes: int) -> str:
    return (
        f"num_total_blocks: {total} with {num_hashes} block hashes; must be {num_hashes} or "
        f"{num_hashes + 1} (the prompt's full blocks, and a partial last one), and >= 1"
    )


# ---- decoding ------------------------------------------------------------------------------


class _Reader:
    def __init__(self, payload: bytes) -> None:
        self.view = memoryview(payload)
        self.at = 0

    def take(self, n: int, field: str) -> memoryview:
        end = self.at + n
        if end > len(self.view):
            raise KVWireError(f"{field}: truncated at byte {self.at} of {len(self.view)}")
        out = self.view[self.at : end]
        self.at = end
        return out

    def unpack(self, fmt: struct.Struct, field: str) -> tuple:
        return fmt.unpack(self.take(fmt.size, field))

    def rid(self) -> str:
        (n,) = self.unpack(_U16, "request_id length")
        if not 1 <= n <= MAX_REQUEST_ID_BYTES:
            raise KVWireError(f"request_id: {n} bytes; must be 1..{MAX_REQUEST_ID_BYTES}")
        try:
            return bytes(self.take(n, "request_id")).decode()
        except UnicodeDecodeError as exc:
            raise KVWireError("request_id: not UTF-8") from exc

    def text(self, n: int, field: str) -> str:
        return bytes(self.take(n, field)).decode(errors="replace")

    def done(self) -> None:
        if self.at != len(self.view):
            raise KVWireError(f"payload: {len(self.view) - self.at} bytes after the last entry")


def _count(n: int) -> int:
    if n > MAX_BATCH_ENTRIES:
        raise KVWireError(f"count: {n}; at most {MAX_BATCH_ENTRIES} per batch")
    return n


def decode_batch(
    payload: bytes, bus_key: BusKey | None = None, *, resolve: Resolver | None = None
) -> KVBatch:
    """Parse a batch; with ``bus_key``, only one it signed (checked before anything is
    resolved). ``resolve``: the stage's remembered prefixes, for a version 5 entry's reference
    (``Resolver``); None, or a reference it does not resolve: that entry, and any later one
    sharing in-batch from it, decodes as ``UnresolvedEntry``. Raises ``KVWireError`` naming the
    field for anything malformed, unsigned or signed with another key."""
    if len(payload) < MAC_BYTES:
        raise KVWireError(f"header: truncated at byte 0 of {len(payload)}")
    body, mac = payload[:-MAC_BYTES], payload[-MAC_BYTES:]
    if bus_key is not None and not hmac.compare_digest(mac, bus_key.mac_bytes(b"KVBatch", body)):
        raise KVWireError("mac: missing or wrong (not signed with this replica's bus key)")
    reader = _Reader(body)
    magic, version, op, lease_s = reader.unpack(_REQ_HEADER, "header")
    if magic != _REQUEST_MAGIC:
        raise KVWireError("header: not a KV batch (bad magic)")
    if version not in _DECODED_VERSIONS:
        raise KVWireError(
            f"version: {version}; this stage speaks {', '.join(map(str, _DECODED_VERSIONS))}"
        )
    try:
        batch_op = BatchOp(op)
    except ValueError as exc:
        raise KVWireError(
            f"op: {op}; must be 1 (probe), 2 (commit), 3 (release) or 4 (probe-reserve)"
        ) from exc
    if batch_op is BatchOp.PROBE_RESERVE and version < _FIRST_VERSION_OF_RESERVE:
        raise KVWireError(f"op: 4 (probe-reserve) in a version {version} batch; needs version 3")
    if batch_op is not BatchOp.RELEASE and not (
        math.isfinite(lease_s) and 0 < lease_s <= MAX_LEASE_S
    ):
        raise KVWireError(f"lease_s: {lease_s}; must be in (0, {MAX_LEASE_S}]")
    owner_len = reader.take(1, "owner length")[0]
    if owner_len > MAX_OWNER_BYTES:
        raise KVWireError(f"owner: {owner_len} bytes; at most {MAX_OWNER_BYTES}")
    try:
        owner = bytes(reader.take(owner_len, "owner")).decode("ascii")
    except UnicodeDecodeError as exc:
        raise KVWireError("owner: not ASCII") from exc
    (seq,) = reader.unpack(_OWNER_SEQ, "seq")
    (count,) = reader.unpack(_U32, "count")
    if version >= _FIRST_VERSION_OF_RELEASES and batch_op is not BatchOp.PROBE_RESERVE:
        raise KVWireError(
            f"version: {version} with op {op}; versions 4 and 5 are for probe-reserve (op 4) only"
        )
    entries, shares, releases = _decode_entries(
        bytes(body), reader.at, _count(count), batch_op, version, owner, resolve
    )
    return KVBatch(
        batch_op,
        entries,
        lease_s if batch_op is not BatchOp.RELEASE else 0.0,
        owner,
        seq,
        shares,
        releases,
    )


def _truncated(field: str, at: int, size: int) -> KVWireError:
    return KVWireError(f"{field}: truncated at byte {at} of {size}")


def _decode_entries(
    data: bytes,
    at: int,
    count: int,
    op: BatchOp,
    version: int,
    owner: str,
    resolve: Resolver | None,
) -> tuple[
    tuple[ReserveEntry | UnresolvedEntry | ProbeEntry | CommitEntry | str, ...],
    tuple[tuple[int, int], ...],
    tuple[str, ...],
]:
    """The ``count`` entries from byte ``at`` of ``data`` (a batch's body, up to the mac), the
    probe entries' shares, and (version 4 on) the releases; version 5 references resolved for
    ``owner`` with ``resolve``. One pass with plain offsets: this runs once per entry per stage
    per round, the hot path of a stage's agreement work."""
    size = len(data)
    u16, u32 = _U16.unpack_from, _U32.unpack_from
    entries: list[ReserveEntry | UnresolvedEntry | ProbeEntry | CommitEntry | str] = []
    counts: list[int] = []  # each probe entry's n (an unresolved one's hashes are unknown)
    shares: list[tuple[int, int]] = []
    num_named = 0
    for index in range(count):
        if at + 2 > size:
            raise _truncated("request_id length", at, size)
        (n,) = u16(data, at)
        at += 2
        if not 1 <= n <= MAX_REQUEST_ID_BYTES:
            raise KVWireError(f"request_id: {n} bytes; must be 1..{MAX_REQUEST_ID_BYTES}")
        if at + n > size:
            raise _truncated("request_id", at, size)
        try:
            rid = data[at : at + n].decode()
        except UnicodeDecodeError as exc:
            raise KVWireError("request_id: not UTF-8") from exc
        at += n
        if op is BatchOp.PROBE or op is BatchOp.PROBE_RESERVE:
            total = -1
            if op is BatchOp.PROBE_RESERVE:
                if at + 16 > size:
                    raise _truncated("block_hashes counts", at, size)
                n, shared_from, shared_len, total = _RESERVE.unpack_from(data, at)
                at += 16
                if total not in (n, n + 1) or total < 1:
                    raise KVWireError(_bad_total(total, n))
            elif version == 1:
                if at + 4 > size:
                    raise _truncated("block_hashes count", at, size)
                (n,) = u32(data, at)
                at += 4
                shared_from = shared_len = 0
            else:
                if at + 12 > size:
                    raise _truncated("block_hashes counts", at, size)
                n, shared_from, shared_len = _PROBE_V2.unpack_from(data, at)
                at += 12
            if n > MAX_BLOCKS_PER_ENTRY:
                raise KVWireError(f"block_hashes: {n}; at most {MAX_BLOCKS_PER_ENTRY} per request")
            num_named += n
            if num_named > MAX_BLOCKS_PER_BATCH:
                raise KVWireError(
                    f"block_hashes: {num_named} named by entries 0..{index}; at most "
                    f"{MAX_BLOCKS_PER_BATCH} per batch (shared ones included)"
                )
            shared: tuple[bytes, ...] | None = ()  # None: unknown here (unresolved)
            if shared_from == RECENT_REFERENCE and version >= _FIRST_VERSION_OF_REFERENCES:
                if not 0 < shared_len <= n:
                    raise KVWireError(
                        f"shared_len: {shared_len} in entry {index}; must be in [1, {n}] (its "
                        "count) for a prefix reference"
                    )
                if at + 2 * BLOCK_HASH_BYTES > size:
                    raise _truncated("prefix reference", at, size)
                root = data[at : at + BLOCK_HASH_BYTES]
                last = data[at + BLOCK_HASH_BYTES : at + 2 * BLOCK_HASH_BYTES]
                at += 2 * BLOCK_HASH_BYTES
                shared = resolve(owner, root, shared_len, last) if resolve is not None else None
                if shared is not None and len(shared) != shared_len:
                    shared = None
                shared_from = REFERENCED + 1  # shares records shared_from - 1
            elif shared_from:
                if shared_from > index:
                    raise KVWireError(
                        f"shared_from: {shared_from} in entry {index}; must name an earlier "
                        f"entry (1..{index}) or be 0 (or {RECENT_REFERENCE:#x}, a prefix "
                        "reference, in a version 5 batch)"
                    )
                earlier = entries[shared_from - 1]
                if not 0 < shared_len <= min(n, counts[shared_from - 1]):
                    raise KVWireError(
                        f"shared_len: {shared_len} in entry {index}; must be in [1, "
                        f"{min(n, counts[shared_from - 1])}] (its count and entry "
                        f"{shared_from - 1}'s)"
                    )
                if isinstance(earlier, UnresolvedEntry):
                    shared = None
                else:
                    shared = earlier[1][:shared_len]  # type: ignore[index]
            elif shared_len:
                raise KVWireError(
                    f"shared_len: {shared_len} in entry {index}; 0 without shared_from"
                )
            end = at + (n - shared_len) * BLOCK_HASH_BYTES
            if end > size:
                raise _truncated("block_hashes", at, size)
            counts.append(n)
            if shared is None:
                entries.append(UnresolvedEntry(rid, total))
            else:
                hashes = shared + _unpack_hashes(data, at, n - shared_len)
                entries.append(
                    ProbeEntry(rid, hashes) if total < 0 else ReserveEntry(rid, hashes, total)
                )
            at = end
            shares.append((shared_from - 1, shared_len))
        elif op is BatchOp.COMMIT:
            if at + 8 > size:
                raise _truncated("commit counts", at, size)
            agreed, total = _COMMIT.unpack_from(data, at)
            at += 8
            if total < 1 or agreed > total:
                raise KVWireError(
                    f"num_total_blocks={total}, num_agreed_blocks={agreed}: need "
                    "1 <= total and agreed <= total"
                )
            entries.append(CommitEntry(rid, agreed, total))
        else:
            entries.append(rid)
    releases: tuple[str, ...] = ()
    if version >= _FIRST_VERSION_OF_RELEASES:
        releases, at = _decode_releases(data, at)
    if at != size:
        raise KVWireError(f"payload: {size - at} bytes after the last entry")
    return tuple(entries), tuple(shares), releases


def _decode_releases(data: bytes, at: int) -> tuple[tuple[str, ...], int]:
    """A version 4 batch's release section from byte ``at``: the ids and the offset after."""
    reader = _Reader(data)
    reader.at = at
    (count,) = reader.unpack(_U32, "num_releases")
    if count > MAX_BATCH_ENTRIES:
        raise KVWireError(f"num_releases: {count}; at most {MAX_BATCH_ENTRIES} per batch")
    releases = tuple(reader.rid() for _ in range(count))
    return releases, reader.at


_HASHES_PER_STRUCT = 64


@lru_cache(maxsize=_HASHES_PER_STRUCT + 1)
def _hashes_struct(num_hashes: int) -> struct.Struct:
    return struct.Struct(f"{BLOCK_HASH_BYTES}s" * num_hashes)


def _unpack_hashes(data: bytes, at: int, num_hashes: int) -> tuple[bytes, ...]:
    """``num_hashes`` 32-byte hashes from byte ``at`` of ``data`` (bounds checked by the
    caller): one ``struct`` call per 64, a C loop, not a slice per hash in Python."""
    if num_hashes <= _HASHES_PER_STRUCT:
        return _hashes_struct(num_hashes).unpack_from(data, at)
    run = _hashes_struct(_HASHES_PER_STRUCT)
    step = _HASHES_PER_STRUCT * BLOCK_HASH_BYTES
    num_runs, num_rest = divmod(num_hashes, _HASHES_PER_STRUCT)
    hashes: list[bytes] = []
    for index in range(num_runs):
        hashes += run.unpack_from(data, at + index * step)
    hashes += _hashes_struct(num_rest).unpack_from(data, at + num_runs * step)
    return tuple(hashes)
