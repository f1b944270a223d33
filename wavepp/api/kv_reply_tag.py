"""The tag of an agreement round's reply (``wavepp.api.kv_reply``'s last 32 bytes).

The stages of a replica answer one fan-out round (``{p}.stages.kvb``) on one reply subject,
and anyone who hears the round learns it: without NATS auth (``wavepp up --insecure-nats`` keeps
the bus key) any client could answer first for any rank, with a made-up hit or refusal. So a
stage with the replica's bus key tags its reply to a batch whose mac it verified::

    tag = HMAC-SHA256(replica key, "KVBatchReply" NUL
                      | u8 owner length | owner | u64 seq   (the batch's header bytes)
                      | u16 rank | the reply up to the tag)       32 bytes

The owner and op number (seq) bind the reply to its round (a reply of an earlier round, or of
another controller, does not pass), the rank to its stage. A controller with the key takes only
replies that verify for its batch and the rank they name and drops any other
(``agreement.nats_client``); without a key nothing is tagged (32 zero bytes) or checked. A stage
does not tag its refusal of a batch that did not verify: a forger could otherwise ask it, under
the owner and the next op number, for a tagged refusal to answer a round to come with. A stage's
refusal of a repeated (verified) batch is tagged: only a batch already applied is refused that
way. Cost: one HMAC-SHA256 of the reply on either side for up to 128
entries. Pure: no I/O.
"""

from __future__ import annotations

import hmac
import struct

from wavepp.api.kv_batch import MAC_BYTES
from wavepp.api.messages import PROTOCOL_VERSION
from wavepp.api.signing import BusKey

_DOMAIN = b"KVBatchReply"
_REPLY_MAGIC = b"WKR"
_RANK = slice(5, 7)  # a reply's u16 rank: after "WKR" | u8 version | u8 op
_OWNER_AT = struct.calcsize("<3sBBd")  # a batch's owner length: after "WKB" | u8 | u8 | f64
_SEQ = struct.Struct("<Q")
_U16 = struct.Struct("<H")


def reply_tag_prefix(owner: str, seq: int) -> bytes:
    """What a reply's tag covers before the rank: the batch's owner length, owner and seq, as
    its header holds them (``batch_reply_tag_prefix`` reads them from an encoded batch)."""
    raw = owner.encode()
    return bytes([len(raw)]) + raw + _SEQ.pack(seq)


def batch_reply_tag_prefix(payload: bytes) -> bytes | None:
    """``reply_tag_prefix`` of an encoded batch, read from its header (no mac check: the
    controller reads its own batch); None for a payload too short to be a batch."""
    if len(payload) <= _OWNER_AT:
        return None
    end = _OWNER_AT + 1 + payload[_OWNER_AT] + _SEQ.size
    return payload[_OWNER_AT:end] if end <= len(payload) - MAC_BYTES else None


def tag_reply(payload: bytes, bus_key: BusKey, prefix: bytes) -> bytes:
    """``payload`` (an ``encode_reply`` reply, untagged) tagged for the batch whose
    ``reply_tag_prefix`` is ``prefix`` and for the rank in its header."""
    body = payload[:-MAC_BYTES]
    return body + bus_key.mac_bytes(_DOMAIN, prefix + payload[_RANK] + body)


def verify_reply(payload: bytes, bus_key: BusKey, prefix: bytes, rank: int) -> bool:
    """Whether ``payload`` is stage ``rank``'s tagged reply to the batch whose
    ``reply_tag_prefix`` is ``prefix`` (constant-time compare). False for an untagged reply, a
    tag under another key, for another owner, seq or rank, or a reply changed after tagging."""
    if (
        len(payload) < _RANK.stop + MAC_BYTES
        or payload[:3] != _REPLY_MAGIC
        or payload[3] != PROTOCOL_VERSION
    ):
        return False
    body = payload[:-MAC_BYTES]
    expected = bus_key.mac_bytes(_DOMAIN, prefix + _U16.pack(rank) + body)
    return hmac.compare_digest(payload[-MAC_BYTES:], expected)
