"""Message authentication on the bus: an HMAC-SHA256 tag in each message's ``mac`` field.

Every process of a deployment holds one secret, the *bus key* (``WAVEPP_BUS_KEY``, hex, or the
file named by ``WAVEPP_BUS_KEY_FILE``; ``wavepp up`` generates one at start). Each replica signs
with its own key derived from it (``BusKey.for_replica``), so a message of one replica never
passes as another's::

    replica key = HMAC-SHA256(bus key, "wavepp replica " + pipeline)
    mac         = HMAC-SHA256(replica key, message type + NUL + JSON of the message without mac)
                  as 32 hex digits (128 bits)

Signed messages: ``MicroBatchPlan`` and ``PlanResendReply`` (scheduler -> stages), the KV ops
(admission -> stage), ``MicroBatchDone`` (stage -> scheduler), ``KVEventBatch`` (stage ->
gateway), ``Heartbeat`` and ``PrefillResult`` (admission -> gateway and the results bucket);
binary, through ``mac_bytes``: the batched KV rounds (admission -> stages) and their replies
(stage -> admission, ``wavepp.api.kv_reply_tag``).
The JSON is pydantic's own serialisation of the frozen field values, the same on both sides.
Pure: no I/O, standard library ``hmac`` only. A receiver without a key (``None``) accepts
unsigned messages (an insecure deployment, logged loudly at process start); a receiver with a
key refuses a message whose tag is missing or wrong.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Protocol, TypeVar

_MAC_HEX = 32  # 128-bit tags
_KEY_BYTES = 32


class Signable(Protocol):
    """A pydantic message with a ``mac: str`` field."""

    mac: str

    def model_dump_json(self, *, exclude: set[str]) -> str: ...  # pragma: no cover

    def model_copy(self, *, update: dict[str, object]) -> Signable: ...  # pragma: no cover


S = TypeVar("S")


class BusKey:
    """A secret that signs and checks messages; see the module docstring.

    Args:
        secret: at least 16 bytes.

    Raises:
        ValueError: a secret shorter than 16 bytes.
    """

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError(f"bus key: {len(secret)} bytes, need at least 16")
        self._secret = bytes(secret)

    def __repr__(self) -> str:  # never print the secret
        return "BusKey(<secret>)"

    @classmethod
    def generate(cls) -> BusKey:
        """A fresh random key (``secrets.token_bytes``)."""
        return cls(secrets.token_bytes(_KEY_BYTES))

    @classmethod
    def from_hex(cls, text: str) -> BusKey:
        """The key from its hex form (surrounding whitespace ignored).

        Raises:
            ValueError: not hex, or shorter than 32 hex digits.
        """
        try:
            secret = bytes.fromhex(text.strip())
        except ValueError as exc:
            raise ValueError("bus key: not a hex string") from exc
        return cls(secret)

    def hex(self) -> str:
        """The key as hex (what ``WAVEPP_BUS_KEY`` holds)."""
        return self._secret.hex()

    def for_replica(self, pipeline: str) -> BusKey:
        """The key replica ``pipeline`` signs with (derived: one bus key serves a pool)."""
        return BusKey(
            hmac.new(self._secret, b"wavepp replica " + pipeline.encode(), hashlib.sha256).digest()
        )

    def mac(self, msg: Signable) -> str:
        """The tag of ``msg`` (its ``mac`` field excluded)."""
        return self._tag(msg, msg.model_dump_json(exclude={"mac"}).encode())

    def _tag(self, msg: Signable, body: bytes) -> str:
        tag = hmac.new(self._secret, type(msg).__name__.encode() + b"\0", hashlib.sha256)
        tag.update(body)
        return tag.hexdigest()[:_MAC_HEX]

    def mac_bytes(self, domain: bytes, payload: bytes) -> bytes:
        """The raw 32-byte tag of a binary message of kind ``domain`` (e.g. ``b"KVBatch"``)."""
        tag = hmac.new(self._secret, domain + b"\0", hashlib.sha256)
        tag.update(payload)
        return tag.digest()

    def sign(self, msg: S) -> S:
        """``msg`` with its ``mac`` set (a copy; messages are frozen)."""
        return msg.model_copy(update={"mac": self.mac(msg)})  # type: ignore[attr-defined]

    def sign_json(self, msg: S) -> tuple[S, bytes]:
        """``sign(msg)`` and its wire JSON, serialised once (a plan with thousands of token ids
        costs more to serialise than to tag): the JSON the tag covers (without ``mac``) with
        the ``mac`` field appended. It parses to the signed copy (JSON fields are named, not
        ordered); where ``mac`` is the last field it is byte for byte ``model_dump_json``."""
        body = msg.model_dump_json(exclude={"mac"}).encode()  # type: ignore[attr-defined]
        mac = self._tag(msg, body)  # type: ignore[arg-type]
        signed = msg.model_copy(update={"mac": mac})  # type: ignore[attr-defined]
        separator = b"" if body == b"{}" else b","
        return signed, body[:-1] + separator + b'"mac":"' + mac.encode() + b'"}'

    def verify(self, msg: Signable) -> bool:
        """True when ``msg.mac`` is this key's tag of ``msg`` (constant-time compare)."""
        return bool(msg.mac) and hmac.compare_digest(msg.mac, self.mac(msg))
