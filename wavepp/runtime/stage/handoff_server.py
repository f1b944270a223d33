"""A stage's KV transfer server: the decode engine pulls a prefilled request's KV of this stage's
layers, over the framed, authenticated TCP protocol of ``wavepp.api.kv_handoff``.

It runs on the stage's asyncio loop (the owner of the KV manager and of the ``HandoffLeases``);
reading the cache (a gather of the request's slots per layer) runs in a worker thread, so the
loop keeps serving and the compute thread never waits on the network. The blocks read are
pinned by the request's handoff lease, so no micro-batch writes them meanwhile.

Failure cases, each ending with every pin of the request released on this stage:

- the client's token is wrong or expired: refused (``{"ok": false, "error": ...}``), nothing read,
  the lease untouched (a stranger cannot cancel someone's handoff);
- the connection breaks or times out after an authenticated pull began, or closes after it
  without a release (decode gone): the lease is released at once;
- nobody pulls or releases before the lease ends: ``HandoffLeases.expire`` (the worker's timer).

A refused ask for a handoff that ended here names how it ended (released, released after its
pull, its pull broke off, or the lease's end): what the gateway tells a client whose decode
failed (``wavepp.runtime.serving.handoff.release_handoff_report``).

Tracing: a pull whose ask carries a ``traceparent`` (the gateway's ``decode`` span) is recorded,
when this process traces, as a ``handoff.pull`` span under it (``request.id``,
``handoff.first_layer``, ``handoff.last_layer``, ``handoff.bytes``; ``handoff.error`` when it
broke off), from the token check to the last layer sent.

Overlap: each transfer's wall interval is kept with the stage's execute intervals
(``record_execute``); ``stats`` answers the seconds of transfer that overlapped the stage's
compute (``overlap_seconds``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from wavepp.api.kv_handoff import (
    HANDOFF_DOMAIN,
    LENGTH_BYTES,
    HandoffError,
    encode_json,
    frame_header,
    parse_json_frame,
    token_payload,
    tokens_equal,
)
from wavepp.api.signing import BusKey
from wavepp.runtime.kv.handoff import HandoffLeases
from wavepp.telemetry import tracing

log = logging.getLogger(__name__)

_JSON_LIMIT = 1 << 16
_IO_TIMEOUT_S = 30.0
_KEPT_INTERVALS = 16384
_KEPT_ENDINGS = 4096  # how many ended handoffs' causes a refusal can still name


def read_layer_kv(
    cache: torch.Tensor, block_ids: Sequence[int], block_size: int, num_tokens: int
) -> torch.Tensor:
    """One layer's cache of a request's first ``num_tokens`` tokens.

    Args:
        cache: the layer's paged cache [parts, num_slots, num_kv_heads, head_dim] (K/V: parts
            2; an MLA latent: parts 1, one head) (slot of token t:
            ``block_ids[t // block_size] * block_size + t % block_size``).
        block_ids: the request's blocks in block order.
        block_size: tokens per block.
        num_tokens: tokens to read.

    Returns:
        A contiguous copy [parts, num_tokens, num_kv_heads, head_dim].

    Raises:
        ValueError: ``block_ids`` cannot hold ``num_tokens``.
    """
    if num_tokens > len(block_ids) * block_size:
        raise ValueError(
            f"num_tokens={num_tokens} exceeds {len(block_ids)} blocks of {block_size} tokens"
        )
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    t = torch.arange(num_tokens, dtype=torch.long)
    slots = blocks[t // block_size] * block_size + t % block_size
    return cache.index_select(1, slots).contiguous()


def overlap_seconds(
    spans: Sequence[tuple[float, float]], busy: Sequence[tuple[float, float]]
) -> float:
    """Seconds of the ``spans`` (transfer intervals) covered by the union of ``busy``
    (execute intervals); each a (start, end) pair in one clock's seconds."""
    merged: list[list[float]] = []
    for start, end in sorted(busy):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = 0.0
    for s0, s1 in spans:
        for b0, b1 in merged:
            if b0 >= s1:
                break
            total += max(0.0, min(s1, b1) - max(s0, b0))
    return total


class HandoffServer:
    """Serves pulls of this stage's layers' KV (see the module docstring).

    Args:
        leases: the stage's handoff leases (loop-thread owned, like its KV manager).
        layer_caches: local layer i's cache [parts, num_slots, num_kv_heads, head_dim] (the
            engine's ``handoff_caches``), for checkpoint layers ``[first_layer, last_layer)``
            in order.
        first_layer, last_layer: the checkpoint layers this stage owns.
        block_size: tokens per block.
        key: the replica's key; tokens are its ``mac_bytes(HANDOFF_DOMAIN, ...)``. None: every
            pull is refused (an unsigned deployment cannot authenticate a decode engine).
        clock: wall seconds (``time.time``: tokens carry Unix seconds).
    """

    def __init__(
        self,
        leases: HandoffLeases,
        layer_caches: Callable[[], Sequence[torch.Tensor]],
        *,
        first_layer: int,
        last_layer: int,
        block_size: int,
        key: BusKey | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.leases = leases
        self.layer_caches = layer_caches
        self.first_layer = first_layer
        self.last_layer = last_layer
        self.block_size = block_size
        self.key = key
        self.clock = clock
        self.server: asyncio.Server | None = None
        self.addr = ""
        self.num_transfers = 0
        self.num_refused = 0
        self.num_broken = 0
        self.bytes_sent = 0
        self._spans: deque[tuple[float, float]] = deque(maxlen=_KEPT_INTERVALS)
        self._busy: deque[tuple[float, float]] = deque(maxlen=_KEPT_INTERVALS)
        self._ended: OrderedDict[str, str] = OrderedDict()  # request id -> how its lease ended

    async def start(self, host: str, port: int, advertise_host: str = "") -> str:
        """Listen on ``host:port`` (0: any free port); returns the address clients use."""
        self.server = await asyncio.start_server(self._serve, host, port)
        bound = self.server.sockets[0].getsockname()[1]
        self.addr = f"{advertise_host or host}:{bound}"
        return self.addr

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()
            self.server = None

    def record_execute(self, start_s: float, end_s: float) -> None:
        """One execute interval of the stage's compute (wall seconds)."""
        self._busy.append((start_s, end_s))

    def stats(self) -> dict[str, Any]:
        """Open leases, pinned blocks, transfer counters and their overlap with compute."""
        spans = list(self._spans)
        return {
            "ok": True,
            "first_layer": self.first_layer,
            "last_layer": self.last_layer,
            "leases": len(self.leases),
            "lease_pinned_blocks": self.leases.num_pinned_blocks(),
            "free_blocks": self.leases.pool.num_free_blocks,
            "pinned_blocks": self.leases.pool.num_pinned_blocks,
            "transfers": self.num_transfers,
            "refused": self.num_refused,
            "broken": self.num_broken,
            "expired": self.leases.num_expired,
            "bytes_sent": self.bytes_sent,
            "transfer_s": sum(e - s for s, e in spans),
            "overlapped_s": overlap_seconds(spans, list(self._busy)),
        }

    # ---- one connection ------------------------------------------------------------------

    def _check_token(self, ask: dict[str, Any]) -> str:
        """ "" when ``ask`` names a held lease with a valid, unexpired token; else the cause."""
        try:
            request_id = str(ask["request_id"])
            expires = float(ask["expires"])
            token = str(ask["token"])
        except (KeyError, TypeError, ValueError):
            return "request_id, expires and token are required"
        if self.key is None:
            return "this stage has no bus key: handoffs cannot be authenticated"
        expected = self.key.mac_bytes(HANDOFF_DOMAIN, token_payload(request_id, expires)).hex()
        if not tokens_equal(token, expected):
            return f"token: not valid for request {request_id!r}"
        if self.clock() >= expires:
            return f"expires: the handoff lease of {request_id!r} ended at {expires:.3f}"
        if self.leases.get(request_id) is None:
            ended = self._ended.get(request_id)
            return f"request_id: {request_id!r} holds no handoff lease on layers " + (
                f"[{self.first_layer}, {self.last_layer})" + (f": {ended}" if ended else "")
            )
        return ""

    def _ended_by(self, request_id: str, cause: str) -> None:
        """Remember how ``request_id``'s lease ended (the last ``_KEPT_ENDINGS``), so that a
        later ask for it is refused with the cause."""
        self._ended[request_id] = cause
        self._ended.move_to_end(request_id)
        while len(self._ended) > _KEPT_ENDINGS:
            self._ended.popitem(last=False)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request_id = ""
        try:
            while True:
                try:
                    ask = await _read_json(reader)
                except (asyncio.IncompleteReadError, ConnectionError) as exc:
                    if request_id:  # pulled, then left without releasing: decode gone
                        raise HandoffError("the client left before releasing") from exc
                    return  # the client left between asks
                op = ask.get("op")
                if op == "stats":
                    await _send(writer, encode_json(self.stats()))
                    continue
                if op not in ("pull", "release"):
                    await _send(writer, encode_json({"ok": False, "error": f"op: {op!r} unknown"}))
                    return
                cause = self._check_token(ask)
                if cause:
                    self.num_refused += 1
                    await _send(writer, encode_json({"ok": False, "error": cause}))
                    return
                pulled = request_id == str(ask["request_id"])  # by this connection
                request_id = str(ask["request_id"])
                if op == "release":
                    self.leases.release(request_id)
                    self._ended_by(request_id, "released after its pull" if pulled else "released")
                    request_id = ""
                    await _send(writer, encode_json({"ok": True}))
                    continue
                await self._traced_pull(request_id, writer, str(ask.get("traceparent") or ""))
        except (HandoffError, ConnectionError, TimeoutError, asyncio.IncompleteReadError) as exc:
            if request_id and self.leases.release(request_id):
                self.num_broken += 1
                self._ended_by(request_id, f"its pull broke off ({exc!r})")
                log.warning("handoff of %s broke (%r); lease released", request_id, exc)
            if isinstance(exc, HandoffError):
                with contextlib.suppress(Exception):
                    await _send(writer, encode_json({"ok": False, "error": str(exc)}))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _traced_pull(
        self, request_id: str, writer: asyncio.StreamWriter, traceparent: str
    ) -> None:
        """``_pull``, recorded as a ``handoff.pull`` span under ``traceparent`` (module doc)."""
        parent = tracing.context_from_traceparent(traceparent) if tracing.is_enabled() else None
        if parent is None:
            await self._pull(request_id, writer)
            return
        began = self.clock()
        attributes: dict[str, Any] = {
            "request.id": request_id,
            "handoff.first_layer": self.first_layer,
            "handoff.last_layer": self.last_layer,
        }
        try:
            attributes["handoff.bytes"] = await self._pull(request_id, writer)
        except BaseException as exc:
            attributes["handoff.error"] = repr(exc)[:200]
            raise
        finally:
            tracing.record_span(
                "handoff.pull", began, self.clock(), parent=parent, attributes=attributes
            )

    async def _pull(self, request_id: str, writer: asyncio.StreamWriter) -> int:
        """Send the request's layers (the protocol's ``pull`` answer); returns the bytes sent."""
        lease = self.leases.get(request_id)
        assert lease is not None, "checked by _check_token"
        began = self.clock()
        try:
            caches = list(self.layer_caches())
        except (AttributeError, ValueError) as exc:  # an engine without a handed-over cache
            self.leases.release(request_id)
            raise HandoffError(f"this stage cannot serve its KV: {exc}") from exc
        first = caches[0]
        await _send(
            writer,
            encode_json(
                {
                    "ok": True,
                    "num_tokens": lease.num_tokens,
                    "block_size": self.block_size,
                    "first_layer": self.first_layer,
                    "last_layer": self.last_layer,
                    "parts": int(first.shape[0]),
                    "num_kv_heads": int(first.shape[2]),
                    "head_dim": int(first.shape[3]),
                    "dtype": str(first.dtype).removeprefix("torch."),
                }
            ),
        )
        sent = 0
        for cache in caches:
            kv = await asyncio.to_thread(
                read_layer_kv, cache, lease.block_ids, self.block_size, lease.num_tokens
            )
            data = memoryview(kv.view(torch.uint8).numpy()).cast("B")
            writer.write(frame_header(len(data)))
            await _send(writer, data)
            self.bytes_sent += len(data)
            sent += len(data)
        self.num_transfers += 1
        self._spans.append((began, self.clock()))
        return sent


async def _read_json(reader: asyncio.StreamReader) -> dict[str, Any]:
    head = await asyncio.wait_for(reader.readexactly(LENGTH_BYTES), _IO_TIMEOUT_S * 10)
    size = int.from_bytes(head, "big")
    if size > _JSON_LIMIT:
        raise HandoffError(f"ask of {size} bytes exceeds {_JSON_LIMIT}")
    return parse_json_frame(await asyncio.wait_for(reader.readexactly(size), _IO_TIMEOUT_S))


async def _send(writer: asyncio.StreamWriter, data: bytes | memoryview) -> None:
    writer.write(data)
    await asyncio.wait_for(writer.drain(), _IO_TIMEOUT_S)
