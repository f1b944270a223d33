"""One stage's modelled KV handoff: its layers' KV of each finished chunk queued on the stage's
network link to the decode instance, and the request's blocks held until the last byte landed.

Pure: no I/O, no clock of its own (the caller passes times: the simulator's virtual clock, the
emulated stage's wall clock); what it moves and how fast is ``planning.handoff_cost``'s model.
The caller runs the stage's compute as it would without the handoff: nothing here delays a
micro-batch. What it changes is memory: when the stage finishes a request's last chunk, the
handoff takes one reference on each block the request holds (``BlockPool.pin``: the handoff's
lease), so the scheduler's release after the first token leaves them pinned, unevictable and
counted against the stage's capacity, until ``finish_due`` at the request's ``landed_s`` frees
them. A link that cannot keep up therefore shows up as blocks held longer, so fewer requests
fit in the stage's pool and admission waits (backpressure), never as a slower micro-batch.

Chunk by chunk::

    micro-batch ends on the stage at t (microbatch_done(work, t))
      for each chunk (request q, context offset L, x tokens):
        tokens to send = L + x - tokens of q already queued here (its first chunk also sends
                         the agreed cached prefix [0, L): the decode instance needs it too)
        link.send(q, tokens * kv_token_r [+ state_r on q's last chunk], ready=t)
      q's last chunk: pin q's blocks (the lease) until q's last transfer landed

A chunk of a micro-batch that failed on this stage (``work.error``) sends nothing; its
request gets no handoff here.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wavepp.runtime.kv import StageKVManager
from wavepp.runtime.planning.handoff_cost import HandoffLink, StageHandoffBytes, Transfer
from wavepp.runtime.stage.core import StageWork


@dataclass
class HandoffRecord:
    """One request's handoff from one stage.

    Attributes:
        request_id: the request.
        transfers: its transfers on this stage's link, in order.
        done: its last chunk was queued (the record is complete).
        leased_blocks: the blocks the lease holds (empty before the last chunk and after
            the lease ended).
    """

    request_id: str
    transfers: list[Transfer] = field(default_factory=list)
    done: bool = False
    leased_blocks: tuple[int, ...] = ()

    @property
    def num_bytes(self) -> float:
        """Bytes this stage sent for the request."""
        return sum(t.num_bytes for t in self.transfers)

    @property
    def landed_s(self) -> float:
        """When its last byte from this stage reached the decode instance (needs ``done``)."""
        return self.transfers[-1].landed_s if self.transfers else float("-inf")


class ModelledHandoff:
    """A stage's handoff model over its KV manager (module docstring).

    Args:
        manager: the stage's KV manager (the same one its ``StageCore`` uses).
        link: the stage's link to the decode side.
        bytes_model: the stage's per-token and per-request bytes.
    """

    def __init__(
        self, manager: StageKVManager, link: HandoffLink, bytes_model: StageHandoffBytes
    ) -> None:
        self.manager = manager
        self.link = link
        self.bytes_model = bytes_model
        self.records: dict[str, HandoffRecord] = {}
        self._queued_tokens: dict[str, int] = {}
        self._leases: list[tuple[float, str]] = []  # (landed_s, request id), a heap
        self._lease_refs: Counter[int] = Counter()  # block id -> leases holding it
        self.peak_leased_blocks = 0  # the most distinct blocks leases held at once

    @property
    def num_leased_blocks(self) -> int:
        """Distinct blocks at least one lease holds now (a block several requests share, a
        common prefix, counts once: what the leases keep out of the pool)."""
        return len(self._lease_refs)

    @property
    def num_leased(self) -> int:
        """Requests whose blocks the handoff still holds."""
        return len(self._leases)

    def next_due_s(self) -> float | None:
        """When the earliest lease ends (its request's last transfer lands), or None."""
        return self._leases[0][0] if self._leases else None

    def microbatch_done(self, work: StageWork, now_s: float) -> list[Transfer]:
        """Queue the KV of ``work``'s chunks, ready at ``now_s`` (the micro-batch's end).

        Call once per micro-batch, after the stage marked its blocks computed and before the
        scheduler can hear of its end (so that a request's release cannot come first), in
        ``now_s`` order.

        Returns:
            The transfers queued, chunk order.
        """
        if work.error:
            return []
        bytes_model = self.bytes_model
        transfers = []
        for chunk in work.plan.chunks:
            request_id = chunk.request_id
            end_token = chunk.context_offset + len(chunk.token_ids)
            num_tokens = end_token - self._queued_tokens.get(request_id, 0)
            if num_tokens < 0:
                num_tokens = 0  # a chunk computed again (a resend): its KV went already
            self._queued_tokens[request_id] = max(end_token, self._queued_tokens.get(request_id, 0))
            num_bytes = num_tokens * bytes_model.kv_bytes_per_token
            if chunk.is_last:
                num_bytes += bytes_model.state_bytes_per_request
            record = self.records.setdefault(request_id, HandoffRecord(request_id))
            transfer = self.link.send(request_id, num_bytes, now_s)
            record.transfers.append(transfer)
            transfers.append(transfer)
            if chunk.is_last and not record.done:
                record.done = True
                del self._queued_tokens[request_id]
                blocks = self.manager.held_blocks(request_id)
                self.manager.pool.pin(blocks)
                record.leased_blocks = blocks
                self._lease_refs.update(blocks)
                self.peak_leased_blocks = max(self.peak_leased_blocks, len(self._lease_refs))
                heapq.heappush(self._leases, (transfer.landed_s, request_id))
        return transfers

    def finish_due(self, now_s: float) -> list[str]:
        """End the leases of the requests whose last transfer landed by ``now_s``: drop the
        handoff's reference on their blocks (they stay cached for reuse).

        Returns:
            Their request ids, landing order.
        """
        finished = []
        while self._leases and self._leases[0][0] <= now_s:
            _, request_id = heapq.heappop(self._leases)
            record = self.records[request_id]
            self.manager.pool.free(record.leased_blocks)
            self._lease_refs.subtract(record.leased_blocks)
            for block_id in record.leased_blocks:
                if self._lease_refs[block_id] <= 0:
                    del self._lease_refs[block_id]
            record.leased_blocks = ()
            finished.append(request_id)
        return finished


def summarize_handoffs(
    handoffs: Sequence[ModelledHandoff],
    first_token_s: Mapping[str, float],
    *,
    wall_s: float,
) -> dict[str, Any]:
    """The handoff's figures over the requests in ``first_token_s``, JSON-ready.

    Args:
        handoffs: every stage's handoff, stage order.
        first_token_s: request id -> when its first token came out of the last stage (its
            prefill ended), same clock as the transfers; requests outside it (warm-up) are
            not counted.
        wall_s: the measured window's length, seconds; it ends at the last first token.

    Returns:
        ``handoff_requests``: requests counted (a request every stage handed over);
        ``kv_bytes_transferred``: their bytes, all stages; ``handoff_s_p50``/``_p99``/``_max``:
        seconds from a request's first token to its last byte landed from every stage (what
        its decode waits for after the prefill); ``overlapped_fraction``: the fraction of
        those bytes landed by their request's first token (sent while the prefill ran);
        ``link_queued_s_max``: the longest a transfer waited for its link (0 when the links
        keep up); ``link_load``: per stage, the seconds its link needs for those requests /
        ``wall_s`` (above 1 the link, not the compute, bounds throughput: transfers end after
        the window and leases pile up); ``handoff_window_s``: ``wall_s`` plus how long after
        the last first token the last byte landed (prompt tokens / it: the rate at which KV
        reaches decode); ``peak_leased_blocks``: per stage, the most distinct blocks the
        handoff's leases held at once (warm-up included).
    """
    tails, total, overlapped, queued = [], 0.0, 0.0, 0.0
    stage_bytes = [0.0] * len(handoffs)
    last_landed_s = -math.inf
    for request_id, first_s in first_token_s.items():
        records = [h.records.get(request_id) for h in handoffs]
        if any(r is None or not r.done for r in records):
            continue
        landed_s = max(r.landed_s for r in records if r is not None)
        tails.append(landed_s - first_s)
        last_landed_s = max(last_landed_s, landed_s)
        for rank, record in enumerate(records):
            assert record is not None
            stage_bytes[rank] += record.num_bytes
            for transfer in record.transfers:
                total += transfer.num_bytes
                if transfer.landed_s <= first_s:
                    overlapped += transfer.num_bytes
                queued = max(queued, transfer.queued_s)
    tail = np.array(tails) if tails else np.array([0.0])
    window_s = wall_s
    if tails:
        window_s += max(0.0, last_landed_s - max(first_token_s.values()))
    return {
        "handoff_requests": len(tails),
        "kv_bytes_transferred": round(total),
        "handoff_s_p50": round(float(np.percentile(tail, 50)), 6),
        "handoff_s_p99": round(float(np.percentile(tail, 99)), 6),
        "handoff_s_max": round(float(tail.max()), 6),
        "overlapped_fraction": round(overlapped / total, 4) if total else 0.0,
        "link_queued_s_max": round(queued, 6),
        "link_load": [
            round(num_bytes / h.link.bytes_per_s / wall_s, 4) if wall_s > 0 else 0.0
            for h, num_bytes in zip(handoffs, stage_bytes, strict=True)
        ],
        "handoff_window_s": round(window_s, 6),
        "peak_leased_blocks": [h.peak_leased_blocks for h in handoffs],
    }
