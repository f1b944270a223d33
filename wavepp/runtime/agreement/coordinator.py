"""Cross-stage prefix agreement: probe-and-pin, L* = min over stages, commit, release.

Protocol (DESIGN.md 'Data flow', step 2), for one request with full-block hashes h_0..h_{n-1}::

    controller                          stage r (every r in [0, S), concurrently)
    ---------- probe_pin(hashes, lease) ----->  pin the longest local hit; reply hit_r
    L* = min(min_r hit_r, (num_tokens - 1) // block_size)
    ---------- commit(L*, total, lease) ----->  unpin past L*, reserve total - L* blocks
                                          <---  ok, or refused (then the stage holds nothing)
    any refusal: release on every stage; the request waits and is retried (never half-admitted)
    ...execution...
    ---------- release([ids]) --------------->  drop pins and reservations; blocks stay cached

L* is capped one token short of the prompt so that at least one token is computed (its logits
are the prefill's output). Pins and reservations carry a lease; the controller renews the leases
of live requests, so a vanished controller leaks nothing. Every op names the controller as its
``owner`` (a random id per instance) and, with a bus key, is signed: a stage lets only the
owner that pinned a request commit, renew or release it.

The stage side (``handle_kv_request``) is a pure function over a ``StageKVManager``; the stage
process owns the NATS I/O around it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from wavepp.api.messages import (
    Commit,
    Health,
    KVReply,
    KVRequestMessage,
    ProbePin,
    Release,
    Renew,
)
from wavepp.api.signing import BusKey
from wavepp.runtime.agreement.clients import StageClient
from wavepp.runtime.kv import hash_prompt_blocks
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

    @property
    def num_cached_tokens(self) -> int:
        return self.num_agreed_blocks * self.block_size


class AdmissionController:
    """The controller side of the agreement protocol over S stage clients.

    ``agree`` returns a ``Ticket`` or ``None`` when some stage refused the reservation (then no
    stage holds anything for the request). Leases of admitted requests are renewed by
    ``renew_leases`` (call it periodically) until ``release``.

    ``bus_key`` (the replica's, ``wavepp.api.signing``) signs every op; None sends them unsigned.
    """

    def __init__(
        self,
        stages: Sequence[StageClient],
        *,
        block_size: int,
        model_id: str,
        lease_s: float = 30.0,
        stage_capacities: Sequence[int] | None = None,
        bus_key: BusKey | None = None,
    ) -> None:
        if not stages:
            raise ValueError("stages: need at least one stage client")
        self.stages = list(stages)
        self.block_size = block_size
        self.model_id = model_id
        self.lease_s = lease_s
        self.stage_capacities = list(stage_capacities) if stage_capacities else None
        self.bus_key = bus_key
        self.owner = uuid.uuid4().hex[:16]  # this instance, as the stages know it
        self._seq = 0  # numbers this owner's ops: a stage refuses a replayed (signed) one
        self._live: set[str] = set()  # admitted, not released: their leases are renewed
        self.num_agreements = 0
        self.num_refusals = 0

    def block_hashes(self, request: PromptRequest) -> list[bytes]:
        """The prompt's full-block hashes (computed once, memoised on the request)."""
        if request.block_hashes is None:
            request.block_hashes = hash_prompt_blocks(
                request.token_ids, self.block_size, self.model_id, request.cache_salt
            )
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
                    f"{need} blocks of {self.block_size}; stage {rank} holds {capacity}"
                )

    async def _all(self, msg: KVRequestMessage) -> list[KVReply]:
        if not isinstance(msg, Health):  # a health probe changes nothing: never signed
            self._seq += 1
            msg = msg.model_copy(update={"owner": self.owner, "seq": self._seq})
            if self.bus_key is not None:
                msg = self.bus_key.sign(msg)
        return list(await asyncio.gather(*(stage.call(msg) for stage in self.stages)))

    async def agree(self, request: PromptRequest) -> Ticket | None:
        """Probe-and-pin on every stage, agree on L*, commit. See the module docstring.

        Traced as an ``agreement`` span (children ``agreement.probe``, ``agreement.commit``)
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
        """Probe-and-pin on every stage, agree on L*, commit (untraced).

        Returns:
            The ticket, or None when a stage refused the reservation (nothing is held then).

        Raises:
            AgreementRefused: the prompt can never fit.
            StageUnavailableError: a stage did not answer (its pins expire with the lease).
        """
        self.check_fits(request)
        started = time.monotonic()
        hashes = self.block_hashes(request)
        rid = request.request_id
        probe = ProbePin(
            request_id=rid, block_hashes=[h.hex() for h in hashes], lease_s=self.lease_s
        )
        try:
            with tracing.span("agreement.probe", **{"prefix.num_blocks": len(hashes)}):
                replies = await self._all(probe)
            for reply in replies:
                if not reply.ok:
                    raise AgreementRefused(f"request {rid}: stage {reply.rank}: {reply.error}")
            hits = tuple(reply.num_hit_blocks for reply in replies)
            num_agreed = min(min(hits), (request.num_tokens - 1) // self.block_size)
            commit = Commit(
                request_id=rid,
                num_agreed_blocks=num_agreed,
                num_total_blocks=self.num_total_blocks(request),
                lease_s=self.lease_s,
            )
            with tracing.span(
                "agreement.commit",
                **{
                    "prefix.agreed_blocks": num_agreed,
                    "reservation.num_blocks": commit.num_total_blocks - num_agreed,
                },
            ):
                replies = await self._all(commit)
        except BaseException:
            await self._release_quietly([rid])
            raise
        self.num_agreements += 1
        if not all(reply.ok for reply in replies):
            self.num_refusals += 1
            await self._release_quietly([rid])
            return None
        self._live.add(rid)
        return Ticket(
            request=request,
            num_agreed_blocks=num_agreed,
            block_size=self.block_size,
            agreement_s=time.monotonic() - started,
            admitted_at_s=time.time(),
            stage_hits=hits,
        )

    async def release(self, request_ids: Sequence[str]) -> None:
        """Drop pins and reservations on every stage; the blocks stay cached for reuse."""
        if not request_ids:
            return
        self._live.difference_update(request_ids)
        await self._all(Release(request_ids=list(request_ids)))

    async def _release_quietly(self, request_ids: list[str]) -> None:
        try:
            await asyncio.shield(self._all(Release(request_ids=request_ids)))
        except Exception as exc:  # the lease frees what we could not
            log.warning("release of %s failed (%s); leases will expire", request_ids, exc)

    @property
    def num_live(self) -> int:
        """Admitted requests not yet released (their leases are renewed)."""
        return len(self._live)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Stop renewing the leases of requests without releasing them: the stages that held
        their pins are gone (a re-form); nothing is sent."""
        self._live.difference_update(request_ids)

    async def renew_leases(self) -> None:
        if self._live:
            await self._all(Renew(request_ids=sorted(self._live), lease_s=self.lease_s))

    async def health(self) -> list[KVReply]:
        return await self._all(Health())
