"""The stage core: everything one pipeline stage decides, with no I/O.

No NATS, no torch, no torch.distributed, no clock but the injected one. The stage process
(``worker.StageWorker``) and the simulator (``wavepp.sim.stage.SimStage``) drive the same
``StageCore``; they differ only in their I/O (NATS vs the simulated bus, torch.distributed
activations vs a virtual hop, an engine vs a sleep of the cost model's time).

One micro-batch through one stage, and who calls what::

    KV request -> handle_kv(payload) -> KVReply          pins and reservations, in the KV manager
    plan       -> receive_plan(plan) -> plans in id order, each once (PlanSequencer; the caller
                  fills holes from the scheduler's resend through ``sequencer``)
               -> accept(plan) -> StageWork: block tables from the KV manager, L* per chunk
                  (a request's first chunk tells the manager its L*), an error when a
                  request is not reserved here, prepare on arrival or later
               -> apply_transfers(work, engine.apply_transfers): the host tier's copies, or
                  the pool forgets what a failed log claims and the micro-batch fails
    [caller]      prepare, wait for the previous stage's activations, execute (or sleep)
               -> results(work, ...) -> one RequestResult per last chunk (last stage only)
               -> done_message(work, ...) -> MicroBatchDone
    after      -> complete(work, done): done kept for resend, computed blocks cached, counted
               -> take_kv_events() -> KVEventBatch of blocks stored/removed, to publish
    lease timer-> expire() -> ids of requests whose lease passed (released)

Trust: with the replica's bus key (``wavepp.api.signing``) a plan or resend reply whose tag is
missing or wrong is dropped and counted (``num_forged``), never sequenced, so a forged plan can
neither run nor make the real plan with its id a duplicate; done messages and KV events leave
signed. A plan without an epoch, or of an epoch this stage has left, is dropped too (a repeated
old plan cannot reset the sequence). KV requests are checked by ``handle_kv_batch`` and
``handle_kv_request``.

State: the KV manager (the one record of each request on this stage: pins, block table, prompt
block hashes, L*), the plan sequencer, the last ``retired_epochs_size`` epochs left, and the
last ``done_log_size`` done messages. In the stage
process, everything but ``results`` and ``done_message`` (pure functions of a ``StageWork``) runs
on the asyncio loop thread, the manager's single owner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from wavepp.api.messages import (
    KVEventBatch,
    KVReply,
    MicroBatchDone,
    MicroBatchPlan,
    PlanResendReply,
    RequestResult,
)
from wavepp.api.signing import BusKey
from wavepp.runtime.agreement.stage_handler import handle_kv_batch, handle_kv_request
from wavepp.runtime.kv import StageKVManager, Transfer
from wavepp.runtime.stage.chunk import ChunkSpec
from wavepp.runtime.stage.sequencing import PlanSequencer

M = TypeVar("M", MicroBatchDone, KVEventBatch)

PlanHeaders = Mapping[str, str] | None
"""The headers a plan arrived with (per-chunk trace context), passed through the sequencer."""


@dataclass
class StageWork:
    """One accepted plan on its way through this stage.

    Attributes:
        plan: the micro-batch plan.
        chunks: the engine's view, one ``ChunkSpec`` per plan chunk with this stage's block
            table (token ids on the first stage only); () when ``error`` is set.
        num_agreed_blocks: per plan chunk, L* its request committed on this stage (-1: none).
        prepare_on_arrival: local preparation runs when the plan arrives (wave mode), not once
            its activations have arrived.
        prepare_start_s, prepare_end_s: clock seconds of the preparation; the caller moves
            them when it prepares.
        error: "" or why the micro-batch cannot run on this stage; it then moves zeros of the
            right shape through the pipeline and its done message carries the error. The
            caller sets it when its engine fails.
        transfers: the host tier's copies logged up to this plan's acceptance (spills of
            evicted blocks, then this plan's loads; ``wavepp.runtime.kv.host``): the caller
            applies them in order while preparing, before the micro-batch runs.
    """

    plan: MicroBatchPlan
    chunks: tuple[ChunkSpec, ...]
    num_agreed_blocks: list[int]
    prepare_on_arrival: bool
    prepare_start_s: float
    prepare_end_s: float
    error: str = ""
    transfers: tuple[Transfer, ...] = ()

    @property
    def num_loads(self) -> int:
        """Blocks this micro-batch's preparation loads from the host tier."""
        return sum(transfer.kind == "load" for transfer in self.transfers)

    @property
    def num_tokens(self) -> int:
        """New tokens of the micro-batch: activation rows in and out of the stage."""
        return sum(len(c.token_ids) for c in self.plan.chunks)

    @property
    def chunk_shapes(self) -> list[tuple[int, int]]:
        """``(context_offset L, num_tokens x)`` per chunk: the cost model's input."""
        return [(c.context_offset, len(c.token_ids)) for c in self.plan.chunks]


class StageCore:
    """The decisions of one pipeline stage over its KV manager; see the module docstring.

    Args:
        manager: the stage's KV manager; this core is its only user.
        rank: this stage's rank r in [0, num_stages).
        num_stages: S, stages of the pipeline.
        local_prepare: prepare a micro-batch when its plan arrives (off the critical path).
        clock: seconds stamped on preparation (``time.time`` in the stage process: done
            messages cross processes; the virtual clock in the simulator).
        done_log_size: done messages kept for the scheduler's resend asks, > 0.
        bus_key: the replica's key (``BusKey.for_replica``); None: unsigned messages are
            accepted and nothing is signed (insecure mode).

    Raises:
        ValueError: rank outside [0, num_stages), or done_log_size < 1.
    """

    def __init__(
        self,
        manager: StageKVManager,
        *,
        rank: int,
        num_stages: int,
        local_prepare: bool,
        clock: Callable[[], float],
        done_log_size: int = 1024,
        bus_key: BusKey | None = None,
    ) -> None:
        if not 0 <= rank < num_stages:
            raise ValueError(f"rank={rank} must be in [0, num_stages={num_stages})")
        if done_log_size < 1:
            raise ValueError(f"done_log_size={done_log_size} must be >= 1")
        self.manager = manager
        self.rank = rank
        self.num_stages = num_stages
        self.is_first = rank == 0
        self.is_last = rank == num_stages - 1
        self.local_prepare = local_prepare
        self.clock = clock
        self.sequencer: PlanSequencer[tuple[MicroBatchPlan, PlanHeaders]] = PlanSequencer()
        self.num_microbatches = 0  # completed (complete() calls)
        self.execute_s = 0.0  # wall seconds of their execute phases (the stage's own metrics)
        # NOTE: what those micro-batches held: chunks, and the chunks over a cached context
        # (context_offset > 0: an earlier chunk of the prompt or a reused prefix, attended
        # through the paged cache); new tokens, and the context tokens those chunks attended.
        self.num_chunks = 0
        self.num_context_chunks = 0
        self.num_new_tokens = 0
        self.num_context_tokens = 0
        self._done_log_size = done_log_size
        self._done_log: OrderedDict[tuple[str, int], MicroBatchDone] = OrderedDict()
        self.bus_key = bus_key
        self.num_forged = 0  # plans and resend replies dropped: no epoch, a left epoch, bad mac
        self._retired_epochs: OrderedDict[str, None] = OrderedDict()

    # ---- KV requests ---------------------------------------------------------------------

    def handle_kv(self, payload: bytes) -> KVReply:
        """Answer one JSON KV request (renew, health); never raises."""
        return handle_kv_request(self.manager, self.rank, payload, bus_key=self.bus_key)

    def handle_kv_batch(self, payload: bytes, *, refuse: str = "") -> bytes:
        """Answer one agreement round (binary ``KVBatch``); never raises. ``refuse``: out of
        service for that reason (releases are still applied)."""
        return handle_kv_batch(
            self.manager, self.rank, payload, refuse=refuse, bus_key=self.bus_key
        )

    def reform(self) -> list[str]:
        """The stages re-form their group: release every request held here (the scheduler
        admits them again; computed blocks stay cached) and forget the plan order (the next
        plan, after the re-form, starts it again). Returns the released request ids."""
        released = self.manager.held_request_ids()
        for request_id in released:
            self.manager.release(request_id)
        self.sequencer = PlanSequencer()
        return released

    def expire(self) -> list[str]:
        """Release every request whose lease passed; their ids, earliest expiry first."""
        return self.manager.expire()

    def take_kv_events(self) -> KVEventBatch | None:
        """Drain the KV manager's events into one message; None when there were none."""
        # NOTE: the message speaks of the device tier; host-tier events are not published
        events = [e for e in self.manager.take_events() if e.tier == "device"]
        if not events:
            return None
        return self._signed(
            KVEventBatch(
                rank=self.rank,
                stored=[[h.hex() for h in e.block_hashes] for e in events if e.kind == "stored"],
                removed=[[h.hex() for h in e.block_hashes] for e in events if e.kind == "removed"],
            )
        )

    # ---- plans ---------------------------------------------------------------------------

    def receive_plan(
        self, plan: MicroBatchPlan, headers: PlanHeaders = None
    ) -> list[tuple[MicroBatchPlan, PlanHeaders]]:
        """Take a plan from the bus; return the plans now due, in id order, each once.

        A plan after a hole is held until the hole is settled through ``sequencer``. A plan that
        is not authentic (``is_authentic``) is dropped and counted in ``num_forged``.
        """
        if not self.is_authentic(plan):
            self.num_forged += 1
            return []
        previous = self.sequencer.epoch
        due = self.sequencer.offer(plan.epoch, plan.microbatch_id, (plan, headers))
        if previous and previous != plan.epoch:
            self._retired_epochs[previous] = None
            while len(self._retired_epochs) > self.retired_epochs_size:
                self._retired_epochs.popitem(last=False)
        return due

    retired_epochs_size = 64
    """Epochs left that a plan may not bring back (a repeated plan of an old scheduler)."""

    def is_authentic(self, plan: MicroBatchPlan) -> bool:
        """The plan has an epoch this stage has not left and, with a bus key, a valid tag."""
        if not plan.epoch or plan.epoch in self._retired_epochs:
            return False
        return self.bus_key is None or self.bus_key.verify(plan)

    def resend_items(
        self, reply: PlanResendReply
    ) -> list[tuple[int, tuple[MicroBatchPlan, PlanHeaders]]] | None:
        """The authentic plans of a resend reply, for ``sequencer.settle``; None when the reply
        itself is not authentic (bad tag, no epoch: ignore it and ask again)."""
        if (
            not reply.epoch
            or reply.epoch in self._retired_epochs
            or (self.bus_key is not None and not self.bus_key.verify(reply))
        ):
            self.num_forged += 1
            return None
        items: list[tuple[int, tuple[MicroBatchPlan, PlanHeaders]]] = []
        for plan in reply.plans:
            if plan.epoch == reply.epoch and self.is_authentic(plan):
                items.append((plan.microbatch_id, (plan, None)))
            else:
                self.num_forged += 1
        return items

    def accept(self, plan: MicroBatchPlan) -> StageWork:
        """Build the block tables of a due plan and decide where it is prepared.

        A plan naming a request this stage does not hold committed (never committed here, its
        lease expired, a bad plan) is accepted with ``error`` set, never raised: the
        micro-batch still travels the pipeline so that no stage waits for it forever.
        """
        start_s = self.clock()
        error = ""
        chunks: list[ChunkSpec] = []
        try:
            for c in plan.chunks:
                num_cached = self.manager.start_chunk(c.request_id, c.context_offset)
                chunks.append(
                    ChunkSpec(
                        request_id=c.request_id,
                        context_offset=c.context_offset,
                        num_tokens=len(c.token_ids),
                        block_ids=tuple(self.manager.block_table(c.request_id)),
                        token_ids=tuple(c.token_ids) if self.is_first else None,
                        is_last=c.is_last,
                        num_cached_tokens=num_cached,
                    )
                )
        except (KeyError, ValueError) as exc:
            error = f"stage {self.rank}: cannot build block tables: {exc!r}"
            chunks = []
        return StageWork(
            plan=plan,
            chunks=tuple(chunks),
            num_agreed_blocks=[self.manager.num_agreed_blocks(c.request_id) for c in plan.chunks],
            prepare_on_arrival=not error and self.local_prepare,
            prepare_start_s=start_s,
            prepare_end_s=start_s,
            error=error,
            transfers=tuple(self.manager.pool.take_transfers()),
        )

    def apply_transfers(self, work: StageWork, apply: Callable[[Sequence[Transfer]], None]) -> None:
        """Apply ``work``'s host-tier copies with ``apply`` (the engine's ``apply_transfers``).

        Whole or forgotten: when ``apply`` raises ValueError or RuntimeError (some copies may
        have run), the pool forgets what the log claims (``BlockPool.discard_transfers``: the
        host slots its spills wrote and the device blocks its loads filled lose their hashes),
        so no later hit reads those bytes, and the micro-batch fails with ``work.error``.
        Other exceptions propagate.
        """
        try:
            apply(work.transfers)
        except (ValueError, RuntimeError) as exc:
            self.manager.pool.discard_transfers(work.transfers)
            work.error = work.error or f"stage {self.rank}: host tier copies failed: {exc!r}"

    # ---- after execution -----------------------------------------------------------------

    def results(
        self,
        work: StageWork,
        first_token_id: Callable[[str], int],
        logits: Callable[[str], list[float]] | None = None,
    ) -> list[RequestResult]:
        """The answers of a micro-batch that ran: one per request whose last chunk it held.

        Only the last stage answers, and only when the micro-batch ran (no ``error``).

        Args:
            work: the micro-batch.
            first_token_id: request id -> the first output token (argmax of its logits).
            logits: request id -> its last token's logits, for chunks that ask for them
                (``return_logits``); None: never returned.
        """
        if not self.is_last or work.error:
            return []
        return [
            RequestResult(
                request_id=c.request_id,
                first_token_id=first_token_id(c.request_id),
                logits=logits(c.request_id) if c.return_logits and logits is not None else None,
            )
            for c in work.plan.chunks
            if c.is_last
        ]

    def done_message(
        self,
        work: StageWork,
        *,
        execute_start_s: float,
        execute_end_s: float,
        results: Iterable[RequestResult] = (),
    ) -> MicroBatchDone:
        """What this stage reports for a micro-batch (carries ``work.error``, if any), signed
        with the bus key when there is one."""
        done = MicroBatchDone(
            rank=self.rank,
            microbatch_id=work.plan.microbatch_id,
            num_tokens=work.num_tokens,
            prepare_start_s=work.prepare_start_s,
            prepare_end_s=work.prepare_end_s,
            execute_start_s=execute_start_s,
            execute_end_s=execute_end_s,
            results=list(results),
            error=work.error,
            num_agreed_blocks=work.num_agreed_blocks,
            epoch=work.plan.epoch,
        )
        return self._signed(done)

    def _signed(self, msg: M) -> M:
        return msg if self.bus_key is None else self.bus_key.sign(msg)

    def complete(self, work: StageWork, done: MicroBatchDone) -> None:
        """Record a finished micro-batch: keep its done message, cache the blocks it computed.

        Call it before the done message is published: a release of a request can only follow
        the last stage's result, so its computed blocks are cached by then.
        """
        self._done_log[(work.plan.epoch, done.microbatch_id)] = done
        while len(self._done_log) > self._done_log_size:
            self._done_log.popitem(last=False)
        if not done.error:
            for c in work.plan.chunks:
                try:
                    self.manager.mark_computed(c.request_id, c.context_offset + len(c.token_ids))
                except KeyError:
                    pass  # released meanwhile (lease expiry): nothing to cache
        self.num_microbatches += 1
        self.execute_s += max(0.0, done.execute_end_s - done.execute_start_s)
        for c in work.plan.chunks:
            self.num_chunks += 1
            self.num_new_tokens += len(c.token_ids)
            if c.context_offset > 0:
                self.num_context_chunks += 1
                self.num_context_tokens += c.context_offset

    def dones(self, epoch: str, microbatch_ids: Iterable[int]) -> list[MicroBatchDone]:
        """The kept done messages of ``epoch`` among ``microbatch_ids`` (a resend ask)."""
        return [
            self._done_log[(epoch, mb)] for mb in microbatch_ids if (epoch, mb) in self._done_log
        ]
