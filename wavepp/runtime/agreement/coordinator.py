"""Cross-stage prefix agreement in one round trip: probe-reserve, L* = min over stages, release.

Protocol (docs/design.md 'Data flow', step 3), for one request with full-block hashes h_0..h_{n-1}::

    controller                          stage r (every r in [0, S), concurrently)
    ---- probe_reserve(hashes, total, lease) ->  pin the longest local hit hit_r, reserve
                                                 total - hit_r blocks after it (block table:
                                                 hit_r cached ids, then fresh ones)
                                          <---  hit_r, or refused (then the stage holds nothing)
    any refusal: release on every stage; the request waits and is retried (never half-admitted)
    L* = min(min_r hit_r, (num_tokens - 1) // block_size), rounded down to a multiple of k
    ---- plan (first chunk at L* * block_size) ->  a stage with hit_r > L* computes tokens
                                                 [L* B, hit_r B) again for its successors and
                                                 writes none of them (its cached blocks stay
                                                 as they are; caching starts at block hit_r)
    ...execution...
    ---- release([ids]) ---------------------->  drop pins and reservations; blocks stay cached

A stage's table does not depend on L* (token p lives in block p // block_size either way), so
the stage reserves before L* is known and the agreement costs one round trip. Every request
waiting when a round starts shares that round's one probe-reserve message per stage (``rounds.AgreementRounds``, binary ``wavepp.api.kv_batch``),
and rounds are pipelined.

L* is capped one token short of the prompt so that at least one token is computed (its logits
are the prefill's output). With ``state_interval_blocks`` = k > 1 (hybrid models whose
linear-attention layers keep their recurrent state after every k-th block only), L* is a
multiple of k: a prefix is reused up to the last block after which every stage holds both the
attention KV and the recurrent state (a stage holding a block's KV holds its state too: the
state is stored under that block's id and dropped when the block is rewritten). Pins and reservations carry a lease; the controller renews the leases
of live requests, so a vanished controller leaks nothing. Every op names the controller as its
``owner`` (a random id per instance) and, with a bus key, is signed: a stage lets only the
owner that pinned a request reserve, renew or release it.

Before any round, ``health`` asks every stage whether it is formed; its reply names the stage's
``PROTOCOL_VERSION``, and a stage of another version is refused at once
(``StageVersionError``), never discovered in a failed round.

The stage side (``stage_handler``) is a pure function over a ``StageKVManager``; the stage
process owns the NATS I/O around it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from wavepp.api.kv_batch import KVBatch, encode_batch
from wavepp.api.messages import PROTOCOL_VERSION, Health, KVReply, KVRequestMessage, Renew
from wavepp.api.signing import BusKey
from wavepp.runtime.agreement.clients import StageClient
from wavepp.runtime.agreement.rounds import AgreedBlocks, AgreementRounds, PendingAgreement
from wavepp.runtime.kv import PromptHasher
from wavepp.runtime.request import PromptRequest
from wavepp.telemetry import tracing

log = logging.getLogger(__name__)


class AgreementRefused(RuntimeError):
    """A request that can never be admitted (it needs more blocks than a stage holds)."""


@dataclass
class Ticket:
    """An admitted request: L* agreed and pinned on every stage, the rest reserved."""

    request: PromptRequest
    num_agreed_blocks: int
    block_size: int
    num_refusals: int = 0
    agreement_s: float = 0.0
    admitted_at_s: float = 0.0
    stage_hits: tuple[int, ...] = ()
    stage_host_hits: tuple[int, ...] = ()  # m_s per stage: the host-tier part of stage_hits

    @property
    def num_cached_tokens(self) -> int:
        return self.num_agreed_blocks * self.block_size


class StageVersionError(RuntimeError):
    """A stage speaks another ``PROTOCOL_VERSION`` than this controller: the message is one line
    naming the stage and both versions."""


def check_stage_versions(replies: Sequence[KVReply]) -> None:
    """Raise ``StageVersionError`` for the first health reply whose version ``v`` is not this
    build's ``PROTOCOL_VERSION`` (no round is ever sent to such a stage)."""
    for reply in replies:
        if reply.v != PROTOCOL_VERSION:
            raise StageVersionError(
                f"stage {reply.rank} speaks agreement protocol version {reply.v}, this "
                f"admission speaks version {PROTOCOL_VERSION}: refused (run the admission and "
                "its stages from one build)"
            )


class AgreementController:
    """The controller side of the agreement protocol over S stage clients.

    ``agree`` returns a ``Ticket`` or ``None`` when some stage refused the reservation (then no
    stage holds anything for the request). Leases of admitted requests are renewed by
    ``renew_leases`` (call it periodically) until ``release``.

    ``bus_key`` (the replica's, ``wavepp.api.signing``) signs every op; None sends them unsigned.
    ``max_batch`` and ``max_rounds_in_flight``: the round engine's limits
    (``wavepp.runtime.agreement.rounds.AgreementRounds``; ValueError outside them).
    ``prefix_refs``: let a round name a prefix the stages remember from an earlier round by
    reference (``wavepp.api.kv_batch``); False sends every hash.
    ``agreed_blocks``: L* from each stage's device and host hit (``AgreementRounds``; None:
    the least h_s).
    """

    def __init__(
        self,
        stages: Sequence[StageClient],
        *,
        block_size: int,
        model_id: str,
        lease_s: float = 30.0,
        stage_capacities: Sequence[int] | None = None,
        max_batch: int = 512,
        max_rounds_in_flight: int = 1,
        state_interval_blocks: int = 1,
        bus_key: BusKey | None = None,
        prefix_refs: bool = True,
        agreed_blocks: AgreedBlocks | None = None,
    ) -> None:
        if not stages:
            raise ValueError("stages: need at least one stage client")
        if state_interval_blocks < 1:
            raise ValueError(f"state_interval_blocks={state_interval_blocks} must be >= 1")
        self.state_interval_blocks = state_interval_blocks
        self.stages = list(stages)
        self.block_size = block_size
        self.model_id = model_id
        self.lease_s = lease_s
        self.stage_capacities = list(stage_capacities) if stage_capacities else None
        self.bus_key = bus_key
        self._hasher = PromptHasher(block_size, model_id)  # recent prompts' shared blocks
        self.owner = uuid.uuid4().hex[:16]  # this instance, as the stages know it
        self._seq = 0  # numbers this owner's ops: a stage refuses a repeated (signed) one
        self._live: set[str] = set()  # admitted, not released: their leases are renewed
        self._agreeing: set[str] = set()  # in a round now: a second agreement is refused
        self._rounds = AgreementRounds(
            self.stages,
            block_size=block_size,
            lease_s=lease_s,
            admitted=self._on_admitted,
            refusal=self._on_refused,
            max_batch=max_batch,
            max_rounds_in_flight=max_rounds_in_flight,
            state_interval_blocks=state_interval_blocks,
            encode=self._encode_batch,
            reply_key=bus_key,
            prefix_refs=prefix_refs,
            agreed_blocks=agreed_blocks,
        )

    def block_hashes(self, request: PromptRequest) -> list[bytes]:
        """The prompt's full-block hashes (computed once, memoised on the request)."""
        if request.block_hashes is None:
            request.block_hashes = self._hasher(request.token_ids, request.cache_salt)
        return request.block_hashes

    def num_total_blocks(self, request: PromptRequest) -> int:
        return math.ceil(request.num_tokens / self.block_size)

    def check_fits(self, request: PromptRequest) -> None:
        """Raise AgreementRefused if the prompt can never fit on some stage."""
        if request.num_tokens < 1:
            raise AgreementRefused(f"request {request.request_id}: prompt has no tokens")
        need = self.num_total_blocks(request)
        for rank, capacity in enumerate(self.stage_capacities or []):
            if need > capacity:
                raise AgreementRefused(
                    f"request {request.request_id}: prompt of {request.num_tokens} tokens needs "
                    f"{need} blocks of {self.block_size}; stage {rank} holds {capacity} blocks "
                    "for one owner (its pool, or max_blocks_per_owner when lower)"
                )

    def _encode_batch(self, batch: KVBatch) -> bytes:
        """A round's batch as this owner's next op, signed with the bus key (if any)."""
        self._seq += 1
        return encode_batch(replace(batch, owner=self.owner, seq=self._seq), self.bus_key)

    async def _all(self, msg: KVRequestMessage) -> list[KVReply]:
        if not isinstance(msg, Health):  # a health probe changes nothing: never signed
            self._seq += 1
            msg = msg.model_copy(update={"owner": self.owner, "seq": self._seq})
            if self.bus_key is not None:
                msg = self.bus_key.sign(msg)
        return list(await asyncio.gather(*(stage.call(msg) for stage in self.stages)))

    async def agree(self, request: PromptRequest) -> Ticket | None:
        """Probe-and-reserve on every stage, agree on L*. See the module docstring.

        Traced as an ``agreement`` span (child ``agreement.probe_reserve``)
        under the current span, when tracing is on. Returns and raises as ``_agree``.
        """
        if not tracing.is_enabled():
            return await self._agree(request)
        with tracing.span("agreement", **{"request.id": request.request_id}) as span:
            ticket = await self._agree(request)
            if span is not None:
                span.set_attribute("agreement.refused", ticket is None)
                if ticket is not None:
                    span.set_attribute("prefix.agreed_blocks", ticket.num_agreed_blocks)
                    span.set_attribute("tokens.cached", ticket.num_cached_tokens)
                    span.set_attribute("prefix.stage_hits", list(ticket.stage_hits))
            return ticket

    async def _agree(self, request: PromptRequest) -> Ticket | None:
        """Probe-and-reserve on every stage, agree on L* (untraced), in the next batched
        round (``rounds.AgreementRounds``; an id whose release is under way waits for it).

        Returns:
            The ticket, or None when a stage refused the reservation (nothing is held then).

        Raises:
            AgreementRefused: the prompt can never fit, a stage found its entry invalid, or
                the request id is agreeing or admitted already on this controller (a stage
                holds one table per id: a second agreement would share or, on a refusal,
                release the first's).
            StageUnavailableError: a stage did not answer (its pins expire with the lease).
        """
        request_id = request.request_id
        if request_id in self._agreeing or request_id in self._live:
            raise AgreementRefused(
                f"request {request_id}: request_id is already "
                f"{'agreeing' if request_id in self._agreeing else 'admitted'} on this "
                "controller; one agreement per id until it is released"
            )
        self.check_fits(request)
        self._agreeing.add(request_id)
        try:
            return await self._rounds.submit(request, self.block_hashes(request))
        finally:
            self._agreeing.discard(request_id)

    def _on_admitted(self, pending: PendingAgreement) -> Ticket:
        self._live.add(pending.request_id)
        return Ticket(
            request=pending.request,
            num_agreed_blocks=pending.num_agreed_blocks,
            block_size=self.block_size,
            agreement_s=time.monotonic() - pending.started_s,
            admitted_at_s=time.time(),
            stage_hits=pending.stage_hits,
            stage_host_hits=pending.stage_host_hits,
        )

    @staticmethod
    def _on_refused(pending: PendingAgreement, error: str) -> BaseException:
        return AgreementRefused(f"request {pending.request_id}: {error}")

    @property
    def num_agreements(self) -> int:
        """Requests whose probe-reserve every stage answered (refused or not)."""
        return self._rounds.num_agreements

    @property
    def num_refusals(self) -> int:
        """Reservations that some stage refused (the request waited and retried)."""
        return self._rounds.num_refusals

    @property
    def num_unresolved(self) -> int:
        """Entries whose prefix reference some stage did not hold (sent again in full)."""
        return self._rounds.num_unresolved

    @property
    def num_probe_reserve_bytes(self) -> int:
        """Bytes of the probe-reserve batches sent (one stage's copy of each round's message)."""
        return self._rounds.num_probe_reserve_bytes

    @property
    def num_rounds(self) -> int:
        """Batched admission rounds sent (one probe-reserve message per stage each)."""
        return self._rounds.num_rounds

    async def release(self, request_ids: Sequence[str]) -> None:
        """Drop pins and reservations on every stage; the blocks stay cached for reuse."""
        if not request_ids:
            return
        self._live.difference_update(request_ids)
        await self._rounds.release(request_ids)

    @property
    def live_request_ids(self) -> frozenset[str]:
        """Requests whose leases this controller renews (agreed, not released)."""
        return frozenset(self._live)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Stop renewing the leases of requests without releasing them: the stages that held
        their pins are gone (a re-form); nothing is sent."""
        self._live.difference_update(request_ids)

    async def renew_leases(self) -> None:
        if self._live:
            await self._all(Renew(request_ids=sorted(self._live), lease_s=self.lease_s))

    async def health(self) -> list[KVReply]:
        """Every stage's answer to a health probe, in rank order. Raises
        ``StageVersionError`` for a stage of another ``PROTOCOL_VERSION``, and what the
        transport raises (``StageUnavailableError``)."""
        replies = await self._all(Health())
        check_stage_versions(replies)
        return replies
