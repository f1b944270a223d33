"""The KV handoff's wire format, its token and the ``kv_transfer_params`` it travels in.

Standard library only: the vLLM connector (``wavepp.integrations.vllm``) imports this module in
vLLM's own environment, where WavePP's dependencies are not installed.

A handoff moves one prefilled request's KV from each pipeline stage to a decode engine. The
decode side *pulls*: it opens one TCP connection per stage and speaks frames::

    frame := length (4 bytes, big-endian, <= MAX_FRAME_BYTES) || payload
    client -> stage   JSON {"op": "pull", "request_id", "expires", "token", "traceparent"?}
    stage  -> client  JSON {"ok": true, "num_tokens", "block_size", "first_layer",
                            "last_layer", "parts", "num_kv_heads", "head_dim", "dtype"}
                      then one binary frame per layer of [first_layer, last_layer): that
                      layer's cache of the prompt's tokens, C order
                      [parts, num_tokens, num_kv_heads, head_dim], little-endian ``dtype``

``parts`` is 2 for grouped-query attention (K, then V) and 1 for multi-head latent attention
(MLA), whose one "head" of ``head_dim = kv_lora_rank + qk_rope_head_dim`` is the normed latent
followed by the roped key in the checkpoint's dimension order, as vLLM's MLA cache holds it.
    client -> stage   JSON {"op": "release", "request_id", "expires", "token"}
    stage  -> client  JSON {"ok": true}

``traceparent`` (optional, W3C): the span the pull belongs to (the gateway's ``decode``
span, carried in ``HandoffParams.traceparent``); a traced stage records its ``handoff.pull``
span under it.

Any refusal or failure is one JSON frame ``{"ok": false, "error": "..."}`` naming the cause,
and the stage closes the connection. ``{"op": "stats"}`` (no token) answers the stage's open
leases and transfer counters.

The token: ``HMAC-SHA256(replica key, "KVHandoff\\0" || request_id || "\\n" || expires)`` in hex
(``BusKey.mac_bytes``), ``expires`` the handoff lease's end in Unix seconds, written with 3
decimals. Only a holder of the token (the decode engine the prefill answer was handed to) can pull
or release the request's KV; it stops working at ``expires``.
"""

from __future__ import annotations

import hmac
import json
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HANDOFF_DOMAIN = b"KVHandoff"
"""The HMAC domain of a handoff token (``BusKey.mac_bytes(HANDOFF_DOMAIN, token_payload(...))``)."""

PARAMS_KEY = "wavepp_handoff"
"""The key of WavePP's handoff inside vLLM's ``kv_transfer_params``."""

MAX_FRAME_BYTES = 1 << 30
"""Largest frame either side accepts (one layer's K and V of one request)."""

_LEN = struct.Struct(">I")


class HandoffError(RuntimeError):
    """A handoff that cannot complete; the message names the cause (a stage's refusal, a
    broken connection, an expired lease, a malformed frame)."""


def expires_text(expires: float) -> str:
    """``expires`` as the token covers it: Unix seconds with 3 decimals."""
    return f"{expires:.3f}"


def token_payload(request_id: str, expires: float) -> bytes:
    """The bytes a handoff token authenticates (see the module docstring)."""
    return request_id.encode() + b"\n" + expires_text(expires).encode()


def tokens_equal(given: str, expected: str) -> bool:
    """Constant-time comparison of two hex tokens."""
    return hmac.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class StageEndpoint:
    """One stage's transfer server and the checkpoint layers ``[first_layer, last_layer)`` it
    serves."""

    addr: str  # "host:port"
    first_layer: int
    last_layer: int

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.addr.rpartition(":")
        return host, int(port)


@dataclass(frozen=True)
class HandoffParams:
    """What the decode engine needs to pull one request's KV: ``kv_transfer_params[PARAMS_KEY]``.

    ``num_tokens``: prompt tokens whose KV the stages hold; ``expires``: Unix seconds when the
    stages drop the lease; ``token``: see the module docstring; ``stages``: one endpoint per
    pipeline stage, rank order, their layer ranges tiling ``[0, num_layers)``;
    ``traceparent``: W3C, the trace the pull joins ("" none; the token does not cover it: it
    names a span, it grants nothing).
    """

    request_id: str
    num_tokens: int
    expires: float
    token: str
    stages: tuple[StageEndpoint, ...]
    traceparent: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "num_tokens": self.num_tokens,
            "expires": float(expires_text(self.expires)),
            "token": self.token,
            "stages": [[s.addr, s.first_layer, s.last_layer] for s in self.stages],
        }
        if self.traceparent:
            out["traceparent"] = self.traceparent
        return out

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> HandoffParams:
        """Parse ``kv_transfer_params[PARAMS_KEY]``.

        Raises:
            HandoffError: a missing or mistyped field (named), or stages whose layer ranges do
                not tile ``[0, num_layers)`` in order.
        """
        try:
            stages = tuple(
                StageEndpoint(str(addr), int(first), int(last))
                for addr, first, last in value["stages"]
            )
            params = cls(
                request_id=str(value["request_id"]),
                num_tokens=int(value["num_tokens"]),
                expires=float(value["expires"]),
                token=str(value["token"]),
                stages=stages,
                traceparent=str(value.get("traceparent") or ""),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise HandoffError(f"kv_transfer_params.{PARAMS_KEY}: malformed ({exc!r})") from exc
        if params.num_tokens < 1:
            raise HandoffError(
                f"kv_transfer_params.{PARAMS_KEY}.num_tokens={params.num_tokens} must be >= 1"
            )
        edge = 0
        for s in stages:
            if s.first_layer != edge or s.last_layer <= s.first_layer:
                raise HandoffError(
                    f"kv_transfer_params.{PARAMS_KEY}.stages: layer ranges must tile [0, L) "
                    f"in order; got {[(x.first_layer, x.last_layer) for x in stages]}"
                )
            edge = s.last_layer
        if not stages:
            raise HandoffError(f"kv_transfer_params.{PARAMS_KEY}.stages: empty")
        return params


# ---- frames ------------------------------------------------------------------------------


def write_frame(sock: socket.socket, payload: bytes | memoryview) -> None:
    """Send one frame (length prefix, then the payload)."""
    if len(payload) > MAX_FRAME_BYTES:
        raise HandoffError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    sock.sendall(_LEN.pack(len(payload)))
    sock.sendall(payload)


def write_json(sock: socket.socket, obj: Mapping[str, Any]) -> None:
    write_frame(sock, json.dumps(obj, separators=(",", ":")).encode())


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise HandoffError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def read_frame(sock: socket.socket, *, limit: int = MAX_FRAME_BYTES) -> bytearray:
    """Receive one frame's payload.

    Raises:
        HandoffError: the peer closed mid-frame, or the frame is longer than ``limit``.
    """
    (n,) = _LEN.unpack(bytes(_recv_exact(sock, _LEN.size)))
    if n > limit:
        raise HandoffError(f"frame of {n} bytes exceeds the limit of {limit}")
    return _recv_exact(sock, n)


def read_json(sock: socket.socket, *, limit: int = 1 << 16) -> dict[str, Any]:
    """Receive one JSON-object frame. Raises HandoffError when it is not one."""
    return parse_json_frame(read_frame(sock, limit=limit))


def parse_json_frame(raw: bytes) -> dict[str, Any]:
    """One JSON-object frame's payload, parsed. Raises HandoffError when it is not one."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise HandoffError(f"frame is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise HandoffError("frame is not a JSON object")
    return obj


def encode_json(obj: Mapping[str, Any]) -> bytes:
    """A JSON frame, length prefix included (for stream writers)."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


def frame_header(num_bytes: int) -> bytes:
    """The length prefix of a frame of ``num_bytes``."""
    if num_bytes > MAX_FRAME_BYTES:
        raise HandoffError(f"frame of {num_bytes} bytes exceeds {MAX_FRAME_BYTES}")
    return _LEN.pack(num_bytes)


LENGTH_BYTES = _LEN.size
"""Bytes of a frame's length prefix."""
