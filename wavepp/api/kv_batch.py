"""The agreement wire format: one binary message per stage per round (``PROTOCOL_VERSION``).

A round carries the probe-reserves of every request ready in it, so a stage answers a whole
round with one message and one pass over its block table. A probe-reserve entry pins the
stage's local hit h_s and at once reserves the blocks after it (the stage's table does not
depend on L*: token p lives in block p // block_size either way); the controller takes L* from
the replies and sends it with the plan. Block hashes travel as raw 32-byte sha256 digests.

Layout (little-endian; ``rid`` = u16 length + UTF-8 request id, 1..256 bytes)::

    request  "WKB" | u8 version | u8 op | f64 lease_s | u8 owner length | owner (ASCII, <= 64)
             | u64 seq | u32 count | count x entry | [releases] | 32-byte mac
      op 1 probe-reserve  entry: rid | u32 n | u32 shared_from | u32 shared_len
                          | u32 num_total_blocks | [reference] | (n - shared_len) x 32-byte hash
                          num_total_blocks is n or n + 1 (the prompt's full blocks and a
                          partial last one); then the releases: u32 num_releases |
                          num_releases x rid, requests released before the round's entries
                          (the previous round's finished requests ride along)
      op 2 release        entry: rid                  (lease_s ignored, 0; no releases section)
    reply    ``wavepp.api.kv_reply``

``version`` is ``wavepp.api.messages.PROTOCOL_VERSION``; a stage refuses any other.

Sharing in a batch: a probe-reserve entry names its first ``shared_len`` hashes by reference
to the first ``shared_len`` hashes of entry ``shared_from - 1`` of the same batch (an earlier
one; 0 with ``shared_len`` 0: none), and only the rest travel. Requests of a round that share
a long prefix (agentic and chat: thousands of tokens in common, a short new suffix) so carry it
once, and a stage walks its block table once for it (``BlockPool.pin_cache_hit``).

Sharing across rounds: an entry whose ``shared_from`` is 0xFFFFFFFF (``RECENT_REFERENCE``)
names its first shared_len hashes (1 <= shared_len <= n) by reference to the prefix the stage
remembers for the batch's owner; ``[reference]`` is then the 32-byte root hash (index 0) and the
32-byte hash at index shared_len - 1. A stage remembers, per owner and root (first hash), the
hashes of the owner's latest probe-reserve entry with that root (``wavepp.runtime.kv.recent``);
the controller mirrors it and sets ``ReserveEntry.recent_len``, and ``encode_batch`` sends those
hashes as the root and the hash at index ``recent_len - 1`` unless an earlier entry of the batch
shares as much. Block hashes are a chain, so equal hashes at k - 1 mean equal first k hashes;
a reference the stage's memory does not end there (``decode_batch``'s ``resolve``) decodes as
``UnresolvedEntry``, as does a later entry sharing in-batch from it: nothing is probed for it.

``owner`` is the admission instance sending the round and ``seq`` its op number (a stage refuses a
repeated one); ``mac`` is HMAC-SHA256 under the replica's bus key (``wavepp.api.signing``) of
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
from wavepp.api.messages import PROTOCOL_VERSION
from wavepp.api.signing import BusKey

RECENT_REFERENCE = 0xFFFFFFFF
"""``shared_from`` of a probe-reserve entry that names its first ``shared_len`` hashes by
reference to the stage's remembered prefix (root hash and last hash on the wire)."""
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
_RESERVE = struct.Struct("<IIII")


class KVWireError(ValueError):
    """A batch or reply that does not decode; the message names the field and the limit."""


class BatchOp(IntEnum):
    PROBE_RESERVE = 1
    RELEASE = 2


class ReserveEntry(NamedTuple):
    """Pin the longest locally cached prefix of ``block_hashes`` (h_s blocks) and reserve the
    ``num_total_blocks - h_s`` blocks after it, in one step: the stage's block table is its
    h_s cached block ids, then fresh ones (or nothing held: refused).

    ``recent_len`` (encoding only, 0..len(block_hashes)): the first ``recent_len`` hashes are
    those of an entry with the same root the controller sent this stage before, so they may
    travel by reference; ``decode_batch`` always sets 0."""

    request_id: str
    block_hashes: tuple[bytes, ...]
    num_total_blocks: int
    recent_len: int = 0


class UnresolvedEntry(NamedTuple):
    """A decoded probe-reserve entry whose prefix reference the stage could not resolve (or
    that shares in-batch from such an entry): its hashes are unknown here, so nothing may be
    probed or held for it; the stage answers it unresolved."""

    request_id: str
    num_total_blocks: int


Resolver = Callable[[str, bytes, int, bytes], tuple[bytes, ...] | None]
"""``(owner, root, num_shared, last_hash)`` -> the first ``num_shared`` hashes the stage
remembers for ``(owner, root)`` if their last is ``last_hash``, else None
(``wavepp.runtime.kv.recent.RecentPrefixes.resolve``)."""


REFERENCED = -2  # a decoded entry's ``shared_from`` when its prefix came by reference


@dataclass(frozen=True)
class KVBatch:
    """One round's message to one stage: ``entries`` are ReserveEntry (UnresolvedEntry once
    decoded) for PROBE_RESERVE, request ids (str) for RELEASE.

    ``shares``, set by ``decode_batch`` for a probe-reserve batch (``encode_batch`` finds the
    sharing itself and ignores it): per entry ``(shared_from, shared_len)``,
    ``block_hashes[:shared_len]`` being the first ``shared_len`` hashes of entry ``shared_from``
    (-1: none; ``REFERENCED`` (-2): named by reference to the stage's remembered prefix).

    ``releases`` (PROBE_RESERVE only): request ids the stage releases before the entries."""

    op: BatchOp
    entries: tuple[ReserveEntry | UnresolvedEntry | str, ...]
    lease_s: float = 0.0
    owner: str = ""  # the admission instance (only it may reserve or release what it probed)
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
    reserve = batch.op is BatchOp.PROBE_RESERVE
    lease_s = float(batch.lease_s)
    if reserve and not (0 < lease_s <= MAX_LEASE_S):
        raise KVWireError(f"lease_s: {lease_s}; must be in (0, {MAX_LEASE_S}]")
    owner = batch.owner.encode()
    if len(owner) > MAX_OWNER_BYTES or not batch.owner.isascii():
        raise KVWireError(f"owner: {len(owner)} bytes; at most {MAX_OWNER_BYTES} ASCII")
    if not 0 <= batch.seq < 2**64:
        raise KVWireError(f"seq: {batch.seq}; must be in [0, 2**64)")
    if batch.releases and not reserve:
        raise KVWireError(f"releases: only in a probe-reserve batch (op 1), not op {batch.op}")
    if len(batch.releases) > MAX_BATCH_ENTRIES:
        raise KVWireError(f"releases: {len(batch.releases)}; at most {MAX_BATCH_ENTRIES}")
    parts: list[bytes] = [
        _REQ_HEADER.pack(_REQUEST_MAGIC, PROTOCOL_VERSION, int(batch.op), lease_s),
        bytes([len(owner)]),
        owner,
        _OWNER_SEQ.pack(batch.seq),
        _U32.pack(len(batch.entries)),
    ]
    if reserve:
        parts += _reserve_entries(batch.entries)  # type: ignore[arg-type]
        parts.append(_U32.pack(len(batch.releases)))
        parts += [_rid(request_id) for request_id in batch.releases]
    else:
        parts += [_rid(request_id) for request_id in batch.entries]  # type: ignore[arg-type]
    body = b"".join(parts)
    return body + (bus_key.mac_bytes(b"KVBatch", body) if bus_key is not None else _NO_MAC)


def _reserve_entries(entries: tuple[ReserveEntry, ...]) -> list[bytes]:
    """The probe-reserve entries' bytes: each shares its leading hashes with the latest earlier
    entry of the same root, or (``recent_len`` longer) names them by reference."""
    parts: list[bytes] = []
    # first hash -> the latest entry (index, hashes) that starts with it
    latest_with_root: dict[bytes, tuple[int, tuple[bytes, ...]]] = {}
    for index, entry in enumerate(entries):
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
        if entry.recent_len:
            if not 0 <= entry.recent_len <= len(hashes):
                raise KVWireError(
                    f"recent_len: {entry.recent_len}; must be in [0, {len(hashes)}] (the "
                    "entry's block hashes)"
                )
            if entry.recent_len > shared_len:  # else the in-batch share is as long
                shared_from, shared_len = RECENT_REFERENCE, entry.recent_len
                reference = hashes[0] + hashes[shared_len - 1]
        rest = hashes[shared_len:]
        joined = reference + b"".join(rest)
        if len(joined) != BLOCK_HASH_BYTES * (len(rest) + 2 * bool(reference)):
            raise KVWireError(f"block_hashes: each must be {BLOCK_HASH_BYTES} bytes")
        total = entry.num_total_blocks
        if total not in (len(hashes), len(hashes) + 1) or total < 1:
            raise KVWireError(_bad_total(total, len(hashes)))
        counts = _RESERVE.pack(len(hashes), shared_from, shared_len, total)
        parts += [_rid(entry.request_id), counts, joined]
    return parts


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
    resolved). ``resolve``: the stage's remembered prefixes, for an entry's prefix reference
    (``Resolver``); None, or a reference it does not resolve: that entry, and any later one
    sharing in-batch from it, decodes as ``UnresolvedEntry``. Raises ``KVWireError`` naming the
    field for anything malformed, of another version, unsigned or signed with another key."""
    if len(payload) < MAC_BYTES:
        raise KVWireError(f"header: truncated at byte 0 of {len(payload)}")
    body, mac = payload[:-MAC_BYTES], payload[-MAC_BYTES:]
    if bus_key is not None and not hmac.compare_digest(mac, bus_key.mac_bytes(b"KVBatch", body)):
        raise KVWireError("mac: missing or wrong (not signed with this replica's bus key)")
    reader = _Reader(body)
    magic, version, op, lease_s = reader.unpack(_REQ_HEADER, "header")
    if magic != _REQUEST_MAGIC:
        raise KVWireError("header: not a KV batch (bad magic)")
    if version != PROTOCOL_VERSION:
        raise KVWireError(
            f"version: {version}; this stage speaks agreement protocol version {PROTOCOL_VERSION}"
        )
    try:
        batch_op = BatchOp(op)
    except ValueError as exc:
        raise KVWireError(f"op: {op}; must be 1 (probe-reserve) or 2 (release)") from exc
    reserve = batch_op is BatchOp.PROBE_RESERVE
    if reserve and not (math.isfinite(lease_s) and 0 < lease_s <= MAX_LEASE_S):
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
    if not reserve:
        releases = tuple(reader.rid() for _ in range(_count(count)))
        reader.done()
        return KVBatch(batch_op, releases, 0.0, owner, seq)
    entries, shares, releases = _decode_entries(
        bytes(body), reader.at, _count(count), owner, resolve
    )
    return KVBatch(batch_op, entries, lease_s, owner, seq, shares, releases)


def _truncated(field: str, at: int, size: int) -> KVWireError:
    return KVWireError(f"{field}: truncated at byte {at} of {size}")


def _decode_entries(
    data: bytes, at: int, count: int, owner: str, resolve: Resolver | None
) -> tuple[
    tuple[ReserveEntry | UnresolvedEntry, ...],
    tuple[tuple[int, int], ...],
    tuple[str, ...],
]:
    """The ``count`` probe-reserve entries from byte ``at`` of ``data`` (a batch's body, up to
    the mac), their shares, and the releases after them; prefix references resolved for
    ``owner`` with ``resolve``. One pass with plain offsets: this runs once per entry per stage
    per round, the hot path of a stage's agreement work."""
    size = len(data)
    u16 = _U16.unpack_from
    entries: list[ReserveEntry | UnresolvedEntry] = []
    counts: list[int] = []  # each entry's n (an unresolved one's hashes are unknown)
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
        if at + 16 > size:
            raise _truncated("block_hashes counts", at, size)
        n, shared_from, shared_len, total = _RESERVE.unpack_from(data, at)
        at += 16
        if total not in (n, n + 1) or total < 1:
            raise KVWireError(_bad_total(total, n))
        if n > MAX_BLOCKS_PER_ENTRY:
            raise KVWireError(f"block_hashes: {n}; at most {MAX_BLOCKS_PER_ENTRY} per request")
        num_named += n
        if num_named > MAX_BLOCKS_PER_BATCH:
            raise KVWireError(
                f"block_hashes: {num_named} named by entries 0..{index}; at most "
                f"{MAX_BLOCKS_PER_BATCH} per batch (shared ones included)"
            )
        shared: tuple[bytes, ...] | None = ()  # None: unknown here (unresolved)
        if shared_from == RECENT_REFERENCE:
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
                    f"entry (1..{index}), be 0, or {RECENT_REFERENCE:#x} (a prefix reference)"
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
                shared = earlier.block_hashes[:shared_len]
        elif shared_len:
            raise KVWireError(f"shared_len: {shared_len} in entry {index}; 0 without shared_from")
        end = at + (n - shared_len) * BLOCK_HASH_BYTES
        if end > size:
            raise _truncated("block_hashes", at, size)
        counts.append(n)
        if shared is None:
            entries.append(UnresolvedEntry(rid, total))
        else:
            entries.append(
                ReserveEntry(rid, shared + _unpack_hashes(data, at, n - shared_len), total)
            )
        at = end
        shares.append((shared_from - 1, shared_len))
    releases, at = _decode_releases(data, at)
    if at != size:
        raise KVWireError(f"payload: {size - at} bytes after the last entry")
    return tuple(entries), tuple(shares), releases


def _decode_releases(data: bytes, at: int) -> tuple[tuple[str, ...], int]:
    """A probe-reserve batch's release section from byte ``at``: the ids and the offset after."""
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
