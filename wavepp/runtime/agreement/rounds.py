"""Batched, pipelined agreement rounds: the controller's side of ``wavepp.api.kv_batch``.

Every ``agree`` call joins the next round. A round is one round trip: it sends one probe-reserve
batch to each stage, carrying the block hashes and block count of every request waiting when it
starts; each stage pins its local hit h_s and at once reserves the blocks after it (its block
table: h_s cached ids, then fresh ones; it does not depend on L*). From the replies the round
takes each request's L* = min(min over stages of h_s, (num_tokens - 1) // block_size), rounded
down to ``state_interval_blocks``; with host tiers (a reply's ``host`` part of h_s) an
``agreed_blocks`` policy may agree less, recomputing what loading would cost more
(``planning.host_load.HostLoadPolicy``); L* reaches the stages with the plan (the request's first chunk
starts at L* * block_size). A stage whose hit exceeds L* computes tokens [L* B, h_s B) again
for its successors, writing none of them (``StageKVManager.start_chunk``). Requests that a
stage refused (or that do not fit now, or whose entry was invalid) are released on every stage
in one release batch before their callers hear None (or the error), so nothing stays pinned.

Releases ride along: while agreements wait for a round that can start now, ``release`` queues
the ids for it, and the probe-reserve round carries them (``KVBatch.releases``: each stage
releases them before the round's reservations), so the finished requests and the new ones cost
each stage one message, not two; otherwise the ids go out at once in a release batch of their
own (a release never waits for a round). An agreement of an id whose release is under way
waits for it (a stage still holding the id would answer from its old table, and the late
release would free the new one's). A round starts one pass of the event loop after its first
request arrived: what else arrives in that pass (the callers a finished round woke, the
releases of a finished micro-batch) joins it.

Prefix references (``prefix_refs``, on by default): every stage
remembers, for this controller's owner id, the hashes of the latest probe-reserve entry per
root (first hash; ``wavepp.runtime.kv.recent``), and the controller keeps a mirror of it, a
``RecentPrefixes`` of its own (the latest entry sent per root, in send order, 1,024 roots and
2^20 hashes). An entry whose root the mirror holds with a common prefix of at least 3 blocks
names that prefix by its root and last hash (64 bytes) when no earlier entry of its round
shares as much: a chat or agentic round re-sending
the same long cached prefixes (8 prefixes of 61 blocks: 15.6 KB of an 18.7 KB round) then
sends a few hundred bytes of them. A stage that does not hold the prefix (restarted, or it
dropped it) answers the entry UNRESOLVED and holds nothing; the controller drops that root from
the mirror, releases the request on every stage (as a refusal) and puts it back at the front
of the queue to go again in full, its caller none the wiser (``num_unresolved``); an entry
sent in full that a stage still calls UNRESOLVED fails (``AgreementRefused``), once. A round that
failed clears the mirror (what the stages applied is not known).

A round holds at most ``max_batch`` requests and ``max_round_bytes`` of entries and releases
(``MAX_ROUND_BYTES``, below NATS's 1 MiB ``max_payload``: the server refuses a larger message,
which would fail every request of the round); the rest wait for the next round.

Rounds in flight: a request that arrives while fewer than ``max_rounds_in_flight`` rounds are
under way starts a round at once; past that, arrivals wait for a round to finish and then share
the next one, so the batch grows with the load: one request per round when they come one at a
time, hundreds when they come faster than a round trip. The default is one round at a time:
every round costs each stage a message and the controller S replies whatever its size, so
overlapping rounds split the same arrivals into more, smaller rounds (latency by rounds in
flight: docs/bench/cadence.md, "One round in flight").

A stage handles its messages in order, each round's entries atomically per request (pin, then
reserve or hold nothing); a reservation that does not fit is refused (the request retries),
never half-admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wavepp.api.hash_chain import common_prefix
from wavepp.api.kv_batch import (
    MAX_BATCH_ENTRIES,
    BatchOp,
    KVBatch,
    ReserveEntry,
    encode_batch,
)
from wavepp.api.kv_reply import EntryStatus, KVBatchReply, decode_reply
from wavepp.api.signing import BusKey
from wavepp.runtime.kv.recent import RecentPrefixes
from wavepp.runtime.request import PromptRequest
from wavepp.telemetry import tracing

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from wavepp.runtime.agreement.clients import StageClient

MAX_ROUND_BYTES = 1024 * 1024 - 64 * 1024
"""Most bytes of entries (and riding releases) in one round's message: below NATS's default
``max_payload`` of 1 MiB, with room for the batch's header, owner and tag."""
_ENTRY_BYTES = 2 + 16  # a probe-reserve entry's id length and counts (kv_batch op 1)
_ID_BYTES = 2  # a release's id length
_HASH_BYTES = 32
_SENT_ROOTS_KEPT = 1024  # roots whose latest entry the controller mirrors (oldest dropped)
_MIRROR = ""  # the mirror's one owner: this controller (a RecentPrefixes keyed by owner)
_SENT_HASHES_KEPT = 1 << 20
"""Hashes the mirror keeps over all roots (oldest root dropped first; an entry longer than
this alone is not kept): a stage's ``RecentPrefixes`` default ``max_hashes``, so the mirror
drops what a stage remembering this owner alone drops, in the same order, and never names a
long prefix the stage let go (which would cost the request a resend); and the controller's
memory is bounded by hashes (~73 MB), not by 1,024 roots times the longest prompt."""
_MIN_REFERENCE_BLOCKS = 3  # a reference costs 2 hashes on the wire: shorter ones save nothing


class StageProtocolError(RuntimeError):
    """A stage answered a batch with a batch-level error or the wrong number of results."""


@dataclass(eq=False)
class PendingAgreement:
    """One ``agree`` call waiting for its round."""

    request: PromptRequest
    block_hashes: Sequence[bytes]
    future: asyncio.Future[Any]
    started_s: float
    trace_context: Context | None = None
    abandoned: bool = False  # the caller was cancelled: release whatever the round admits
    stage_hits: tuple[int, ...] = field(default=())
    stage_host_hits: tuple[int, ...] = field(default=())  # m_s, the host part of each h_s
    num_agreed_blocks: int = 0
    send_full: bool = False  # a stage did not resolve its prefix reference: no reference now

    @property
    def request_id(self) -> str:
        return self.request.request_id


OnAdmitted = Callable[[PendingAgreement], Any]
OnRefused = Callable[[PendingAgreement, str], BaseException]
AgreedBlocks = Callable[[Sequence[int], Sequence[int], int], int]
"""L* from (h_s per stage, the host part of each, the cap): ``HostLoadPolicy.agreed_blocks``."""


class AgreementRounds:
    """The round engine behind ``AgreementController.agree`` (one per controller, one event
    loop). ``submit`` queues a request; ``admitted`` and ``refusal`` are the controller's
    callbacks that build the caller's result (a ``Ticket``) and its error."""

    def __init__(
        self,
        stages: Sequence[StageClient],
        *,
        block_size: int,
        lease_s: float,
        admitted: OnAdmitted,
        refusal: OnRefused,
        max_batch: int = 512,
        max_round_bytes: int = MAX_ROUND_BYTES,
        max_rounds_in_flight: int = 1,
        state_interval_blocks: int = 1,
        encode: Callable[[KVBatch], bytes] = encode_batch,
        reply_key: BusKey | None = None,
        prefix_refs: bool = True,
        agreed_blocks: AgreedBlocks | None = None,
    ) -> None:
        if not 1 <= max_batch <= MAX_BATCH_ENTRIES:
            raise ValueError(f"max_batch: {max_batch}; must be in [1, {MAX_BATCH_ENTRIES}]")
        if max_rounds_in_flight < 1:
            raise ValueError(f"max_rounds_in_flight: {max_rounds_in_flight}; must be >= 1")
        if max_round_bytes < 1:
            raise ValueError(f"max_round_bytes: {max_round_bytes}; must be >= 1")
        self.stages = list(stages)
        self.block_size = block_size
        self.lease_s = lease_s
        self.max_batch = max_batch
        self.max_round_bytes = max_round_bytes
        self.max_rounds_in_flight = max_rounds_in_flight
        # hybrid models: a prefix is reusable only up to a stored recurrent state, every k blocks
        self.state_interval_blocks = state_interval_blocks
        # host tiers: L* from each stage's device and host hit (load or recompute); None: min h_s
        self.agreed_blocks = agreed_blocks
        self._encode = encode  # the controller's: stamps its owner and op number, signs
        self._reply_key = reply_key  # the key it signs with: over NATS, only tagged replies
        self._admitted = admitted
        self._refusal = refusal
        self._pending: deque[PendingAgreement] = deque()
        # ids to release with the next round (at most max_batch each), and who waits for them
        self._releases: deque[tuple[list[str], asyncio.Future[None]]] = deque()
        # id -> its release under way (``release`` called, not yet applied on every stage): an
        # agreement of the id waits for it, since a stage still holding the id answers a
        # probe-reserve from the old table (idempotent by id) and the late release would then
        # free the new agreement's blocks
        self._releasing: dict[str, asyncio.Future[None]] = {}
        self._runner: asyncio.Task[None] | None = None
        self._rounds: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Future[None]] = set()
        # prefix references: root -> hashes of the latest entry sent with that
        # root, in send order: what every stage remembers for this owner (RecentPrefixes)
        self.prefix_refs = prefix_refs
        self._sent = RecentPrefixes(_SENT_ROOTS_KEPT, _SENT_HASHES_KEPT)  # this owner's only
        self.num_rounds = 0
        self.num_agreements = 0  # requests whose probe-reserve every stage answered
        self.num_refusals = 0  # of those, refused by some stage (released everywhere)
        self.num_unresolved = 0  # entries a stage did not resolve (sent again in full)
        self.num_probe_reserve_bytes = 0  # encoded probe-reserve batches (one copy per round)

    # ---- the caller's side -------------------------------------------------------------------

    async def submit(self, request: PromptRequest, block_hashes: Sequence[bytes]) -> Any:
        """Join the next round; the controller's ``admitted`` result, or None when a stage
        refused the reservation (nothing held then). Raises what the round raised for it
        (``StageUnavailableError``, ``StageProtocolError``, the controller's refusal error).
        An id whose release is under way waits for it first."""
        while (releasing := self._releasing.get(request.request_id)) is not None:
            await asyncio.shield(releasing)  # never raises: set when the release ends
        loop = asyncio.get_running_loop()
        pending = PendingAgreement(
            request, block_hashes, loop.create_future(), time.monotonic(), tracing.current_context()
        )
        self._pending.append(pending)
        self._start_runner(loop)
        try:
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            pending.abandoned = True
            if pending.future.done() and not pending.future.cancelled():
                if pending.future.exception() is None and pending.future.result() is not None:
                    self._in_background(self.release([pending.request_id]))
            raise

    async def release(self, request_ids: Sequence[str]) -> None:
        """Release on every stage: with the next round's probe-reserve batch when agreements
        wait for a round that can start now, else at once in release batches of their own (at
        most ``max_batch`` ids per message either way). Returns once every stage applied them;
        raises what that round raised (``StageUnavailableError``, ``StageProtocolError``).
        Cancelling the caller does not withdraw a release queued for a round."""
        ids = list(request_ids)
        if not ids:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        for request_id in ids:
            self._releasing[request_id] = done
        try:
            if not self._pending or len(self._rounds) >= self.max_rounds_in_flight:
                # nothing to ride with, or no round can start now: never later than on its own
                for chunk in self._chunks(ids):
                    await self._call_all(KVBatch(BatchOp.RELEASE, tuple(chunk)))
                return
            futures = []
            for chunk in self._chunks(ids):
                future: asyncio.Future[None] = loop.create_future()
                future.add_done_callback(_retrieve)
                self._releases.append((chunk, future))
                futures.append(future)
            self._start_runner(loop)
            await asyncio.shield(asyncio.gather(*futures))
        finally:
            for request_id in ids:
                if self._releasing.get(request_id) is done:
                    del self._releasing[request_id]
            done.set_result(None)

    async def release_quietly(self, request_ids: Sequence[str]) -> None:
        """Release batches sent at once (not with the next round: a round waits for this
        before it settles its callers), shielded from the caller's cancellation; a failure is
        left to the leases (logged by the caller's logger)."""
        with contextlib.suppress(Exception):
            for chunk in self._chunks(list(request_ids)):
                await asyncio.shield(self._call_all(KVBatch(BatchOp.RELEASE, tuple(chunk))))

    def _chunks(self, ids: list[str]) -> list[list[str]]:
        """``ids`` in pieces of at most ``max_batch`` (one release message each)."""
        return [ids[at : at + self.max_batch] for at in range(0, len(ids), self.max_batch)]

    # ---- rounds ------------------------------------------------------------------------------

    def _start_runner(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run(), name="agreement-rounds")

    async def _run(self) -> None:
        await asyncio.sleep(0)  # what arrives in this pass of the loop joins the first round
        while self._pending or self._releases:
            while len(self._rounds) >= self.max_rounds_in_flight:
                await asyncio.wait(self._rounds, return_when=asyncio.FIRST_COMPLETED)
            releases: list[tuple[list[str], asyncio.Future[None]]] = []
            num_ids = size = 0
            while self._releases and num_ids + len(self._releases[0][0]) <= self.max_batch:
                releases.append(self._releases.popleft())
                num_ids += len(releases[-1][0])
                size += sum(_ID_BYTES + len(rid) for rid in releases[-1][0])
            batch: list[PendingAgreement] = []
            while self._pending and len(batch) < self.max_batch:
                pending = self._pending[0]
                if pending.abandoned:
                    self._pending.popleft().future.cancel()
                    continue
                # at most max_round_bytes on the wire (NATS refuses a message past its
                # max_payload, failing every request of the round): the entry's bytes counted
                # as if it shared nothing; one entry alone goes out whatever its size
                entry_bytes = (
                    _ENTRY_BYTES + len(pending.request_id) + _HASH_BYTES * len(pending.block_hashes)
                )
                if batch and size + entry_bytes > self.max_round_bytes:
                    break
                batch.append(self._pending.popleft())
                size += entry_bytes
            if batch:
                self.num_rounds += 1
                task = asyncio.create_task(self._round(batch, releases))
            elif releases:
                task = asyncio.create_task(self._release_round(releases))
            else:
                continue
            self._rounds.add(task)
            task.add_done_callback(self._rounds.discard)

    async def _release_round(
        self, releases: Sequence[tuple[list[str], asyncio.Future[None]]]
    ) -> None:
        """A release batch of its own (no agreement waited for a round)."""
        try:
            await self._call_all(KVBatch(BatchOp.RELEASE, _ids_of(releases)))
        except BaseException as exc:
            _settle_releases(releases, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        _settle_releases(releases, None)

    async def _round(
        self,
        batch: list[PendingAgreement],
        releases: Sequence[tuple[list[str], asyncio.Future[None]]] = (),
    ) -> None:
        """One round, one round trip: release what finished (``releases``), probe-reserve on
        every stage, agree on each L*, release what some stage refused (or that failed, or
        whose caller left), settle every caller."""
        started = time.time()
        probe_reserve = KVBatch(
            BatchOp.PROBE_RESERVE,
            self._entries(batch),
            self.lease_s,
            releases=_ids_of(releases),
        )
        try:
            payload = self._encode(probe_reserve)
            self.num_probe_reserve_bytes += len(payload)
            replies = await self._send(payload, len(probe_reserve.entries))
        except BaseException as exc:
            self._sent.clear()  # what a stage applied (and remembers) is not known now
            _settle_releases(releases, exc)
            await self.release_quietly([p.request_id for p in batch])
            for p in batch:
                _settle(p, exc=exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        _settle_releases(releases, None)
        admitted: list[PendingAgreement] = []
        refused: list[PendingAgreement] = []
        failed: list[tuple[PendingAgreement, BaseException]] = []
        unresolved: list[PendingAgreement] = []
        for index, pending in enumerate(batch):
            results = [reply.results[index] for reply in replies]
            invalid = [
                (reply.rank, result.error)
                for reply, result in zip(replies, results, strict=True)
                if result.status is EntryStatus.INVALID
            ]
            if invalid:
                rank, error = invalid[0]
                failed.append((pending, self._refusal(pending, f"stage {rank}: {error}")))
                continue
            unresolved_by = [
                reply.rank
                for reply, result in zip(replies, results, strict=True)
                if result.status is EntryStatus.UNRESOLVED
            ]
            if unresolved_by and pending.send_full:
                # sent in full already: no reference to resolve, so a stage that says so is
                # faulty (or a forger, without a bus key); resending would never end
                error = (
                    f"stage {unresolved_by[0]}: answered UNRESOLVED to an entry sent in full "
                    "(no prefix reference); not sent again"
                )
                failed.append((pending, self._refusal(pending, error)))
                continue
            if unresolved_by:
                # a stage does not hold the prefix it references: that root is sent in full
                # next time, and this request again, in full, once released everywhere
                self.num_unresolved += 1
                if pending.block_hashes:
                    self._sent.forget(_MIRROR, pending.block_hashes[0])
                unresolved.append(pending)
                continue
            self.num_agreements += 1
            if not all(result.ok for result in results):
                self.num_refusals += 1
                refused.append(pending)
                continue
            hits = tuple(result.value for result in results)
            pending.stage_hits = hits
            hosts = tuple(result.host for result in results)
            pending.stage_host_hits = hosts
            cap = (pending.request.num_tokens - 1) // self.block_size
            if self.agreed_blocks is not None and any(hosts):
                num_agreed = min(self.agreed_blocks(hits, hosts, cap), min(hits), cap)
            else:
                num_agreed = min(min(hits), cap)
            pending.num_agreed_blocks = num_agreed - num_agreed % self.state_interval_blocks
            (refused if pending.abandoned else admitted).append(pending)
        self._trace(batch, "agreement.probe_reserve", started)
        for pending in admitted:  # held on every stage: nothing to wait for
            _settle(pending, result=self._admitted(pending))
        # a refusal on one stage leaves the others holding: released before its caller hears
        await self.release_quietly(
            [p.request_id for p in refused]
            + [p.request_id for p, _ in failed]
            + [p.request_id for p in unresolved]
        )
        for pending in refused:
            _settle(pending, result=None)
        for pending, error in failed:
            _settle(pending, exc=error)
        self._resend_in_full(unresolved)

    def _entries(self, batch: Sequence[PendingAgreement]) -> tuple[ReserveEntry, ...]:
        """A round's probe-reserve entries; with prefix references on, each whose root the
        stages remember (``_sent``, as it was before this round) with a common prefix of at
        least ``_MIN_REFERENCE_BLOCKS`` may send that prefix by reference (``recent_len``).
        Then every entry is mirrored, in order, as the stages will remember it."""
        entries = []
        for pending in batch:
            hashes = tuple(pending.block_hashes)
            recent_len = 0
            if self.prefix_refs and hashes and not pending.send_full:
                known = self._sent.latest(_MIRROR, hashes[0])
                if known is not None:
                    recent_len = common_prefix(known, hashes)
                    if recent_len < _MIN_REFERENCE_BLOCKS:
                        recent_len = 0
            entries.append(
                ReserveEntry(
                    pending.request_id,
                    hashes,
                    -(-pending.request.num_tokens // self.block_size),
                    recent_len,
                )
            )
        if self.prefix_refs:
            for entry in entries:  # as every stage will remember them, in order
                self._sent.remember(_MIRROR, entry.block_hashes)
        return tuple(entries)

    def _resend_in_full(self, unresolved: Sequence[PendingAgreement]) -> None:
        """Requests a stage could not resolve (released everywhere by now) back at the front
        of the queue, flagged to send every hash: their callers see no refusal (one whose caller
        left meanwhile is dropped there, as any abandoned one)."""
        for pending in reversed(unresolved):
            pending.send_full = True
            self._pending.appendleft(pending)
        if self._pending:
            self._start_runner(asyncio.get_running_loop())

    async def _call_all(self, batch: KVBatch) -> list[KVBatchReply]:
        return await self._send(self._encode(batch), len(batch.entries))

    async def _send(self, payload: bytes, num_entries: int) -> list[KVBatchReply]:
        """An encoded batch of ``num_entries`` entries to every stage; their replies, in the
        stages' order. Raises ``StageProtocolError`` for a batch-level error or a reply of the
        wrong length, and what the transport raises."""
        call_all = getattr(self.stages[0], "call_batch_all", None)
        if call_all is not None and all(type(s) is type(self.stages[0]) for s in self.stages):
            # one fan-out (NatsStageClient); with a key, replies not tagged for it are dropped
            raw = await call_all(self.stages, payload, reply_key=self._reply_key)
        else:
            raw = await asyncio.gather(*(stage.call_batch(payload) for stage in self.stages))
        replies = []
        for stage, data in zip(self.stages, raw, strict=True):
            reply = decode_reply(data)
            if reply.error or len(reply.results) != num_entries:
                raise StageProtocolError(
                    f"stage {stage.rank}: {reply.error or 'wrong number of results'} "
                    f"({len(reply.results)} for {num_entries} entries)"
                )
            replies.append(reply)
        return replies

    def _trace(self, batch: list[PendingAgreement], name: str, start_s: float) -> None:
        """One span per request under its ``agreement`` span, covering the round's phase."""
        if not tracing.is_enabled():
            return
        end_s = time.time()
        for pending in batch:
            attributes: dict[str, Any] = {
                "agreement.batch_size": len(batch),
                "prefix.num_blocks": len(pending.block_hashes),
            }
            if pending.stage_hits:
                total = -(-pending.request.num_tokens // self.block_size)
                attributes["prefix.agreed_blocks"] = pending.num_agreed_blocks
                attributes["reservation.num_blocks"] = total - min(pending.stage_hits)
            tracing.record_span(
                name, start_s, end_s, parent=pending.trace_context, attributes=attributes
            )

    def _in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)  # kept referenced until done
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _ids_of(releases: Sequence[tuple[list[str], asyncio.Future[None]]]) -> tuple[str, ...]:
    return tuple(request_id for group, _ in releases for request_id in group)


def _retrieve(future: asyncio.Future[None]) -> None:
    """Mark a release's outcome seen: its caller may have left (a cancelled scheduler)."""
    if not future.cancelled():
        future.exception()


def _settle_releases(
    releases: Sequence[tuple[list[str], asyncio.Future[None]]], exc: BaseException | None
) -> None:
    for _, future in releases:
        if future.done():
            continue
        if exc is None:
            future.set_result(None)
        elif isinstance(exc, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(exc)


def _settle(
    pending: PendingAgreement, *, result: Any = None, exc: BaseException | None = None
) -> None:
    if pending.future.done():
        return
    if pending.abandoned and exc is not None:
        pending.future.cancel()  # nobody awaits it: no "exception never retrieved"
    elif exc is not None:
        if isinstance(exc, asyncio.CancelledError):
            pending.future.cancel()
        else:
            pending.future.set_exception(exc)
    else:
        pending.future.set_result(result)
