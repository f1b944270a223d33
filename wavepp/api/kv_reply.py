"""A stage's reply to one agreement round (``wavepp.api.kv_batch``): the wire codec.

Layout (little-endian)::

    reply    "WKR" | u8 version | u8 op | u16 rank | u32 num_free_blocks | u32 num_blocks
             | u16 error length | error (UTF-8; a whole-batch fault, else empty)
             | u32 count | count x (u8 status | u32 value | u32 host | u16 length | UTF-8 error)
             | 32-byte tag (``wavepp.api.kv_reply_tag``; 32 zero bytes untagged)
      version ``wavepp.api.messages.PROTOCOL_VERSION``, the batch's
      host    the tier split of an ok value: the last ``host`` of the h_s hit blocks are in the
              stage's host tier (pinned there, loaded if L* needs them), the first
              ``value - host`` on its device; host <= value, and 0 for any other status
      status 0 ok (value: the stage's hit blocks h_s), 1 refused (a reservation that does not
      fit now; nothing held), 2 invalid (the entry names the fault; nothing held), 3 unresolved
      (the entry's prefix reference is not held here: send the hashes; nothing held)

A reply's results are in the batch's entry order (a batch's releases have none). Decoding never
trusts a length: a fault raises ``KVWireError`` naming the field and the limit. Pure: no I/O.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from wavepp.api.kv_batch import MAC_BYTES, BatchOp, KVWireError, _count, _Reader
from wavepp.api.messages import PROTOCOL_VERSION

_NO_TAG = bytes(MAC_BYTES)
_REPLY_MAGIC = b"WKR"
_REPLY_HEADER = struct.Struct("<3sBBHIIH")
_U32 = struct.Struct("<I")
_RESULT = struct.Struct("<BIIH")


class EntryStatus(IntEnum):
    OK = 0
    REFUSED = 1
    INVALID = 2
    UNRESOLVED = 3  # prefix reference not held here; send the hashes; nothing held


class EntryResult(NamedTuple):
    """One entry's answer: ``value`` is h_s for an ok probe-reserve, of which ``host`` blocks
    (the tail of the hit) are in the stage's host tier."""

    status: EntryStatus
    value: int = 0
    error: str = ""
    host: int = 0

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


def encode_reply(reply: KVBatchReply) -> bytes:
    """Serialise a stage's reply, untagged (errors truncated to 1,024 bytes each;
    ``kv_reply_tag.tag_reply`` tags it)."""
    error = reply.error.encode()[:1024]
    parts = [
        _REPLY_HEADER.pack(
            _REPLY_MAGIC,
            PROTOCOL_VERSION,
            int(reply.op),
            reply.rank,
            reply.num_free_blocks,
            reply.num_blocks,
            len(error),
        ),
        error,
        _U32.pack(len(reply.results)),
    ]
    pack = _RESULT.pack
    for status, value, text, host in reply.results:
        if text:
            raw = text.encode()[:1024]
            parts += [pack(status, value, host, len(raw)), raw]
        else:
            parts.append(pack(status, value, host, 0))
    parts.append(_NO_TAG)
    return b"".join(parts)


def reply_rank(payload: bytes) -> int | None:
    """The rank an encoded ``KVBatchReply`` names, read from its header alone (a round's replies
    from every stage share one reply subject, so the rank tells them apart); None for anything
    that does not begin as a reply does (the caller drops it)."""
    if len(payload) < _REPLY_HEADER.size or payload[:3] != _REPLY_MAGIC:
        return None
    return _REPLY_HEADER.unpack_from(payload)[3]


_STATUSES = tuple(EntryStatus)


class _PlainResults(dict):  # type: ignore[type-arg]
    """(status, value) -> its ``EntryResult`` without an error text, made once: a reply's
    entries are looked up in one C-level ``map``, not decoded entry by entry in Python (the
    controller decodes S replies per round)."""

    def __missing__(self, key: tuple[int, int, int]) -> EntryResult:
        status, value, host = key
        if host > value or (host and status):
            raise KVWireError(_bad_host(host, value, status))
        result = self[key] = EntryResult(_STATUSES[status], value, "", host)
        return result


def _bad_host(host: int, value: int, status: int) -> str:
    return (
        f"host: {host} with value {value} and status {status}; must be <= value, and 0 unless "
        "the status is ok"
    )


_PLAIN_RESULTS = _PlainResults()


@functools.lru_cache(maxsize=64)
def _values_of(count: int) -> struct.Struct:
    """The ``value`` and ``host`` fields of ``count`` text-less results (``u8 status | u32
    value | u32 host | u16 0``), interleaved."""
    return struct.Struct("<" + "xIIxx" * count)


_MAX_PLAIN_RESULTS = 4096  # distinct (status, value) pairs kept; cleared past it


def decode_reply(payload: bytes) -> KVBatchReply:
    """Parse a stage's reply. Raises ``KVWireError`` naming the field for anything malformed."""
    reader = _Reader(payload)
    magic, version, op, rank, free, blocks, error_len = reader.unpack(_REPLY_HEADER, "header")
    if magic != _REPLY_MAGIC:
        raise KVWireError("header: not a KV batch reply (bad magic)")
    if version != PROTOCOL_VERSION:
        raise KVWireError(
            f"version: {version}; this controller speaks agreement protocol version "
            f"{PROTOCOL_VERSION}"
        )
    if len(reader.view) < reader.at + MAC_BYTES:  # the tag: checked by a holder of the key
        raise KVWireError(f"tag: truncated at byte {reader.at} of {len(reader.view)}")
    reader.view = reader.view[:-MAC_BYTES]
    try:
        batch_op = BatchOp(op)
    except ValueError as exc:
        raise KVWireError(f"op: {op}; must be 1 (probe-reserve) or 2 (release)") from exc
    error = reader.text(error_len, "error")
    (count,) = reader.unpack(_U32, "count")
    rest = reader.view[reader.at :]
    if len(rest) == _RESULT.size * _count(count):  # no entry carries an error text
        raw = rest.tobytes()
        statuses = raw[0 :: _RESULT.size]
        # every text length 0 and every status known: the whole reply in C-level passes
        if not raw[9 :: _RESULT.size].strip(b"\0") and not raw[10 :: _RESULT.size].strip(b"\0"):
            if not statuses or max(statuses) < len(_STATUSES):
                fields = _values_of(count).unpack(raw)
                keys = zip(statuses, fields[0::2], fields[1::2], strict=True)
                results = tuple(map(_PLAIN_RESULTS.__getitem__, keys))
                if len(_PLAIN_RESULTS) > _MAX_PLAIN_RESULTS:
                    _PLAIN_RESULTS.clear()
                return KVBatchReply(batch_op, rank, free, blocks, results, error)
    results = []
    for _ in range(_count(count)):
        status, value, host, n = reader.unpack(_RESULT, "result")
        if host > value or (host and status):
            raise KVWireError(_bad_host(host, value, status))
        try:
            entry_status = EntryStatus(status)
        except ValueError as exc:
            raise KVWireError(
                f"status: {status}; must be 0, 1, 2 or 3 (ok, refused, invalid, unresolved)"
            ) from exc
        results.append(EntryResult(entry_status, value, reader.text(n, "result error"), host))
    reader.done()
    return KVBatchReply(batch_op, rank, free, blocks, tuple(results), error)
