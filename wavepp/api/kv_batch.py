"""The batched agreement wire format (version 1): one binary message per stage per admission round.

A round carries the probes (or the commits, or the releases) of every request ready in it, so a
stage answers a whole round with one message and one pass over its block table, instead of one
JSON request-reply per request per phase. Block hashes travel as raw 32-byte sha256 digests,
not as JSON lists of hex strings (64 characters each plus quoting).

Layout (little-endian; ``rid`` = u16 length + UTF-8 request id, 1..256 bytes)::

    request  "WKB" | u8 version | u8 op | f64 lease_s | u8 owner length | owner (ASCII, <= 64)
             | u64 seq | u32 count | count x entry | 32-byte mac
      op 1 probe   entry: rid | u32 n | n x 32-byte block hash
      op 2 commit  entry: rid | u32 num_agreed_blocks | u32 num_total_blocks
      op 3 release entry: rid                             (lease_s ignored, 0)
    reply    "WKR" | u8 version | u8 op | u16 rank | u32 num_free_blocks | u32 num_blocks
             | u16 error length | error (UTF-8; a whole-batch fault, else empty)
             | u32 count | count x (u8 status | u32 value | u16 length | UTF-8 error)
      status 0 ok (value: hit blocks for a probe, reserved blocks for a commit), 1 refused (a
      reservation that does not fit now; nothing held), 2 invalid (the entry names the fault)

``owner`` is the admission instance sending the round and ``seq`` its op number (a stage refuses a
replayed one); ``mac`` is HMAC-SHA256 under the replica's bus key (``wavepp.api.signing``) of
everything before it, or 32 zero bytes unsigned (insecure mode: a stage with a key refuses it).
A reply's entries are in the request's order. Decoding never trusts a length: every field is
bounds-checked and a fault raises ``KVWireError`` naming the field and the limit.
"""

from __future__ import annotations

import hmac
import math
import struct
from dataclasses import dataclass
from enum import IntEnum

from wavepp.api.signing import BusKey

__all__ = [
    "BLOCK_HASH_BYTES",
    "KV_BATCH_VERSION",
    "MAX_BATCH_ENTRIES",
    "MAX_BLOCKS_PER_ENTRY",
    "BatchOp",
    "CommitEntry",
    "EntryResult",
    "EntryStatus",
    "KVBatch",
    "KVBatchReply",
    "KVWireError",
    "ProbeEntry",
    "decode_batch",
    "decode_reply",
    "encode_batch",
    "encode_reply",
]

KV_BATCH_VERSION = 1
BLOCK_HASH_BYTES = 32
MAX_BATCH_ENTRIES = 4096
MAX_BLOCKS_PER_ENTRY = 1 << 20  # 64 Mi tokens at 64-token blocks
MAX_REQUEST_ID_BYTES = 256
MAX_LEASE_S = 3600.0

_REQUEST_MAGIC = b"WKB"
_REPLY_MAGIC = b"WKR"
_REQ_HEADER = struct.Struct("<3sBBd")
_OWNER_SEQ = struct.Struct("<Q")
MAC_BYTES = 32
_NO_MAC = bytes(MAC_BYTES)
MAX_OWNER_BYTES = 64
_REPLY_HEADER = struct.Struct("<3sBBHIIH")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_COMMIT = struct.Struct("<II")
_RESULT = struct.Struct("<BIH")


class KVWireError(ValueError):
    """A batch or reply that does not decode; the message names the field and the limit."""


class BatchOp(IntEnum):
    PROBE = 1
    COMMIT = 2
    RELEASE = 3


class EntryStatus(IntEnum):
    OK = 0
    REFUSED = 1
    INVALID = 2


@dataclass(frozen=True)
class ProbeEntry:
    """Pin the longest locally cached prefix of ``block_hashes`` (32-byte digests each)."""

    request_id: str
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class CommitEntry:
    """Unpin past ``num_agreed_blocks`` (L*) and reserve up to ``num_total_blocks``."""

    request_id: str
    num_agreed_blocks: int
    num_total_blocks: int


@dataclass(frozen=True)
class KVBatch:
    """One round's message to one stage: ``entries`` are ProbeEntry for PROBE, CommitEntry for
    COMMIT, request ids (str) for RELEASE."""

    op: BatchOp
    entries: tuple[ProbeEntry | CommitEntry | str, ...]
    lease_s: float = 0.0
    owner: str = ""  # the admission instance (only it may commit or release what it probed)
    seq: int = 0  # the owner's op number


@dataclass(frozen=True)
class EntryResult:
    status: EntryStatus
    value: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is EntryStatus.OK


@dataclass(frozen=True)
class KVBatchReply:
    """A stage's answer to one ``KVBatch``: one result per entry, in order, or ``error`` (and no
    results) when the batch as a whole was refused."""

    op: BatchOp
    rank: int
    num_free_blocks: int
    num_blocks: int
    results: tuple[EntryResult, ...] = ()
    error: str = ""


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
    parts = [
        _REQ_HEADER.pack(_REQUEST_MAGIC, KV_BATCH_VERSION, int(batch.op), lease_s),
        bytes([len(owner)]),
        owner,
        _OWNER_SEQ.pack(batch.seq),
        _U32.pack(len(batch.entries)),
    ]
    for entry in batch.entries:
        if batch.op is BatchOp.PROBE:
            assert isinstance(entry, ProbeEntry)
            hashes = entry.block_hashes
            if len(hashes) > MAX_BLOCKS_PER_ENTRY:
                raise KVWireError(
                    f"block_hashes: {len(hashes)}; at most {MAX_BLOCKS_PER_ENTRY} per request"
                )
            joined = b"".join(hashes)
            if len(joined) != BLOCK_HASH_BYTES * len(hashes):
                raise KVWireError(f"block_hashes: each must be {BLOCK_HASH_BYTES} bytes")
            parts += [_rid(entry.request_id), _U32.pack(len(hashes)), joined]
        elif batch.op is BatchOp.COMMIT:
            assert isinstance(entry, CommitEntry)
            parts += [
                _rid(entry.request_id),
                _COMMIT.pack(entry.num_agreed_blocks, entry.num_total_blocks),
            ]
        else:
            assert isinstance(entry, str)
            parts.append(_rid(entry))
    body = b"".join(parts)
    return body + (bus_key.mac_bytes(b"KVBatch", body) if bus_key is not None else _NO_MAC)


def encode_reply(reply: KVBatchReply) -> bytes:
    """Serialise a stage's reply (errors truncated to 1,024 bytes each)."""
    error = reply.error.encode()[:1024]
    parts = [
        _REPLY_HEADER.pack(
            _REPLY_MAGIC,
            KV_BATCH_VERSION,
            int(reply.op),
            reply.rank,
            reply.num_free_blocks,
            reply.num_blocks,
            len(error),
        ),
        error,
        _U32.pack(len(reply.results)),
    ]
    for result in reply.results:
        text = result.error.encode()[:1024]
        parts += [_RESULT.pack(int(result.status), result.value, len(text)), text]
    return b"".join(parts)


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


def decode_batch(payload: bytes, bus_key: BusKey | None = None) -> KVBatch:
    """Parse a batch; with ``bus_key``, only one it signed. Raises ``KVWireError`` naming the
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
    if version != KV_BATCH_VERSION:
        raise KVWireError(f"version: {version}; this stage speaks {KV_BATCH_VERSION}")
    try:
        batch_op = BatchOp(op)
    except ValueError as exc:
        raise KVWireError(f"op: {op}; must be 1 (probe), 2 (commit) or 3 (release)") from exc
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
    entries: list[ProbeEntry | CommitEntry | str] = []
    for _ in range(_count(count)):
        rid = reader.rid()
        if batch_op is BatchOp.PROBE:
            (n,) = reader.unpack(_U32, "block_hashes count")
            if n > MAX_BLOCKS_PER_ENTRY:
                raise KVWireError(f"block_hashes: {n}; at most {MAX_BLOCKS_PER_ENTRY} per request")
            raw = bytes(reader.take(n * BLOCK_HASH_BYTES, "block_hashes"))
            hashes = tuple(
                raw[i : i + BLOCK_HASH_BYTES] for i in range(0, len(raw), BLOCK_HASH_BYTES)
            )
            entries.append(ProbeEntry(rid, hashes))
        elif batch_op is BatchOp.COMMIT:
            agreed, total = reader.unpack(_COMMIT, "commit counts")
            if total < 1 or agreed > total:
                raise KVWireError(
                    f"num_total_blocks={total}, num_agreed_blocks={agreed}: need "
                    "1 <= total and agreed <= total"
                )
            entries.append(CommitEntry(rid, agreed, total))
        else:
            entries.append(rid)
    reader.done()
    return KVBatch(
        batch_op,
        tuple(entries),
        lease_s if batch_op is not BatchOp.RELEASE else 0.0,
        owner,
        seq,
    )


def decode_reply(payload: bytes) -> KVBatchReply:
    """Parse a stage's reply. Raises ``KVWireError`` naming the field for anything malformed."""
    reader = _Reader(payload)
    magic, version, op, rank, free, blocks, error_len = reader.unpack(_REPLY_HEADER, "header")
    if magic != _REPLY_MAGIC:
        raise KVWireError("header: not a KV batch reply (bad magic)")
    if version != KV_BATCH_VERSION:
        raise KVWireError(f"version: {version}; this controller speaks {KV_BATCH_VERSION}")
    try:
        batch_op = BatchOp(op)
    except ValueError as exc:
        raise KVWireError(f"op: {op}; must be 1, 2 or 3") from exc
    error = reader.text(error_len, "error")
    (count,) = reader.unpack(_U32, "count")
    results = []
    for _ in range(_count(count)):
        status, value, n = reader.unpack(_RESULT, "result")
        try:
            entry_status = EntryStatus(status)
        except ValueError as exc:
            raise KVWireError(f"status: {status}; must be 0, 1 or 2") from exc
        results.append(EntryResult(entry_status, value, reader.text(n, "result error")))
    reader.done()
    return KVBatchReply(batch_op, rank, free, blocks, tuple(results), error)
