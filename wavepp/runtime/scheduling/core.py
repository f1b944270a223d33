"""The wave scheduler's decisions, without I/O: one owner of every request's state.

``SchedulerCore`` is what the driver (``WaveScheduler``: asyncio, the transport, the admission
controller) and the simulator share. It never awaits, publishes or sleeps; it takes the facts
(an agreement's ticket, a stage's done message, the clock) and answers with decisions::

    driver                                   SchedulerCore
    ------                                   -------------
    submit(request)                   -----> add_request          -> RequestRecord (WAITING)
    admission strategy agreed         -----> admitted(record, ticket)            (ADMITTED)
    scheduling loop, a slot free      -----> schedule(...)        -> ScheduledMicroBatch
      telemetry gives a traceparent   -----> encoded_plan_of      -> MicroBatchPlan (ledger)
    a stage's MicroBatchDone          -----> update_from_done     -> DoneUpdate
    deadline tick                     -----> overdue / expire     -> ids to release
    the caller gave up on a request   -----> withdraw             -> take_releasable
    the replica re-forms              -----> reform               -> records to re-admit
    after each call                   -----> take_finished        -> records answered

A request's state lives in its ``RequestRecord`` (status, ticket, progress, outcome, chunks in
flight); the core indexes the admitted, unreleased ones by id (``live``). Every way a request
ends (a result, a stage error, a deadline, no result from the last stage, a refusal before
admission, a withdrawal) goes through ``_finish``, which queues the record for ``take_finished``.

Done messages and deadlines are ``DoneAccounting`` (outputs.py), mixed in: a result is answered
once every stage reported the micro-batch that carried it. The micro-batch size (the closed-loop
target) is ``MicroBatchSizing`` (sizing.py), mixed in too. The records the core and the driver
hand each other are in records.py.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from wavepp.api.messages import MicroBatchPlan, PlannedChunk, RequestResult
from wavepp.api.signing import BusKey
from wavepp.runtime.agreement import Ticket
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv.inflight import InflightPrefixIndex
from wavepp.runtime.planning import Chunk, ChunkPlanner, RequestProgress
from wavepp.runtime.request import PromptRequest, RequestOutcome, RequestStatus
from wavepp.runtime.scheduling.ledger import PlanLedger
from wavepp.runtime.scheduling.outputs import DoneAccounting
from wavepp.runtime.scheduling.records import RequestRecord, ScheduledMicroBatch
from wavepp.runtime.scheduling.sizing import MicroBatchSizing
from wavepp.runtime.scheduling.speculation import AgreedPrefixIndex
from wavepp.runtime.scheduling.stats import WaveStats

log = logging.getLogger(__name__)

_RECENT_OUTCOMES = 4096  # stages report in any order: outcomes kept a while after release
# The error a withdrawn request is answered with (``SchedulerCore.withdraw``).
WITHDRAWN_ERROR = "withdrawn: the caller gave up on this request"


class SchedulerCore(DoneAccounting, MicroBatchSizing):
    """Request records, micro-batches in flight, the plan ledger, the stats. No I/O.

    Args:
        config: the replica's RuntimeConfig (S, deadlines, prefix wait, max in flight).
        planner: the chunk planner.
        block_hashes: a prompt's full-block hashes (the agreement controller's memo).
        first_microbatch_id: the first plan's id.
        clock: wall-clock seconds (outcome times, plan publish times).
        monotonic: seconds for deadlines.
        stats: where micro-batch statistics accumulate (default: a new WaveStats).
        bus_key: the replica's key: plans leave signed, done messages must carry its tag;
            None: unsigned (insecure mode).
        state_interval_blocks: the agreement rounds L* down to a multiple of this (hybrid
            models); a predicted L* does too.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        planner: ChunkPlanner,
        *,
        block_hashes: Callable[[PromptRequest], list[bytes]],
        first_microbatch_id: int = 0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        stats: WaveStats | None = None,
        bus_key: BusKey | None = None,
        state_interval_blocks: int = 1,
    ) -> None:
        self.config = config
        self.state_interval_blocks = state_interval_blocks
        self.bus_key = bus_key
        self.num_forged_dones = 0  # done messages or results dropped (outputs.py)
        self.planner = planner
        self.num_stages = config.num_stages
        self.block_hashes = block_hashes
        self.clock = clock
        self.monotonic = monotonic
        self.stats = stats if stats is not None else WaveStats()
        self.epoch = uuid.uuid4().hex[:16]
        self.ledger: PlanLedger[MicroBatchPlan] = PlanLedger(config.num_stages)
        self.next_microbatch_id = first_microbatch_id
        self.inflight_prefixes = InflightPrefixIndex()
        # Admitted and not yet released, by request id; `active`: those the planner may cut
        # (admitted, not fully planned), in admission order.
        self.live: dict[str, RequestRecord] = {}
        self.active: list[RequestRecord] = []
        # Micro-batches published and not reported by the last stage: chunk owners (each
        # request once, plan order) and monotonic publish time (deadlines).
        self.inflight: dict[int, list[str]] = {}
        # NOTE: kept past the last stage's report while results are held (the deadline bounds
        # the wait for a late done).
        self._published_at_s: dict[int, float] = {}
        # Results the last stage reported for a micro-batch some stage has not reported yet,
        # answered when the ledger completes it (every stage reported) or it expires.
        self._held_results: dict[int, list[tuple[RequestRecord, RequestResult]]] = {}
        self._recent: OrderedDict[str, RequestOutcome] = OrderedDict()
        self._finished: list[RequestRecord] = []
        # Requests added and not yet finished (queued, agreeing, admitted, in flight): the
        # closed loop's population, whose work sizes each micro-batch.
        self.num_open = 0
        self._init_sizing()
        # Baseline, budget accounting "estimated": the block hashes of every live request whose
        # first chunk was planned (it holds references on them), each hash counted once per
        # holder; a new request's estimate is how many of its leading blocks they hold.
        self._started_blocks: Counter[bytes] = Counter()
        self._started_hashes: dict[str, list[bytes]] = {}
        # The agreed prefix (L* blocks) of every live request, each hash counted once per
        # holder. Those blocks are pinned on every stage until the request is released, so a
        # new request's leading blocks found here are cached, not computed (prefix wait, the
        # admission lookahead).
        self._pinned_blocks: Counter[bytes] = Counter()
        self._pinned_hashes: dict[str, list[bytes]] = {}
        # Speculative planning (speculation.py): the prefixes agreed lately predict L*.
        self.agreed_prefixes = AgreedPrefixIndex()
        # Requests added and not admitted (queued, agreeing), by id (the first of an id): what
        # ``withdraw`` finds before admission.
        self._unadmitted: dict[str, RequestRecord] = {}
        # Withdrawn requests with nothing in flight, left live: released by the driver
        # (``take_releasable``).
        self._releasable: list[str] = []
        self.num_withdrawn = 0  # requests withdrawn (``withdraw`` returned True)

    # ---- intake and admission ------------------------------------------------------------

    def add_request(self, request: PromptRequest, waiter: Any) -> RequestRecord:
        """A new request (WAITING); indexed as unadmitted (``withdraw`` finds it) until it is
        admitted or finished."""
        self.num_open += 1
        record = RequestRecord(request=request, waiter=waiter)
        self._unadmitted.setdefault(request.request_id, record)
        return record

    def reject_if_live(self, record: RequestRecord) -> bool:
        """Fail a request whose id is admitted and unreleased already; True if it was."""
        if record.request_id not in self.live:
            return False
        self._finish(record, error=f"request_id {record.request_id!r} is already in flight")
        return True

    def fail(self, record: RequestRecord, error: str, *, is_retryable: bool = False) -> None:
        """A request that ends before admission (its prompt can never fit, an agreement
        error); ``is_retryable``: a transient cause (``RequestOutcome.is_retryable``)."""
        self._finish(record, error=error)
        assert record.outcome is not None
        if is_retryable and record.outcome.error == error:
            record.outcome.is_retryable = True

    def admitted(self, record: RequestRecord, ticket: Ticket) -> None:
        """The agreement succeeded: index the record (ADMITTED); the planner sees it once the
        driver ``activate``s it."""
        request = record.request
        self._forget_unadmitted(record)
        record.ticket = ticket
        record.work_s = self.planner.request_work_s(ticket.num_cached_tokens, request.num_tokens)
        self._record_work(request.request_id, record.work_s)
        record.status = RequestStatus.ADMITTED
        record.num_inflight_microbatches = 0
        record.outcome = RequestOutcome(
            request_id=request.request_id,
            num_prompt_tokens=request.num_tokens,
            num_cached_tokens=ticket.num_cached_tokens,
            arrival_s=request.arrival_s,
            admitted_s=ticket.admitted_at_s,
            agreement_s=ticket.agreement_s,
            num_refusals=ticket.num_refusals,
            stage_hits=ticket.stage_hits,
            stage_host_hits=ticket.stage_host_hits,
        )
        accounting = self.planner.budget_accounting
        record.progress = RequestProgress(
            request_id=request.request_id,
            num_prompt_tokens=request.num_tokens,
            num_computed_tokens=ticket.num_cached_tokens,
            arrival_s=request.arrival_s,
            num_credited_tokens=None if accounting == "exact" else 0,
        )
        if accounting == "estimated":
            self._estimate_credit(record)
        self.live[request.request_id] = record
        if self.config.resolved_prefix_wait:
            # Narrow the claim made before agreeing to the blocks it really computes.
            hashes = self.block_hashes(request)
            self.inflight_prefixes.remove(request.request_id)
            self.inflight_prefixes.add(request.request_id, hashes[ticket.num_agreed_blocks :])
        self._forget_pinned([request.request_id])
        if self.config.resolved_speculative_planning:
            self.agreed_prefixes.record(self.block_hashes(request), ticket.num_agreed_blocks)
        pinned = self.block_hashes(request)[: ticket.num_agreed_blocks]
        self._pinned_hashes[request.request_id] = pinned
        self._pinned_blocks.update(pinned)
        self._recent[request.request_id] = record.outcome
        while len(self._recent) > _RECENT_OUTCOMES:
            self._recent.popitem(last=False)

    def activate(self, records: Sequence[RequestRecord]) -> None:
        """Admitted records join the planning set, in order; a finished one (withdrawn while
        it waited to join) does not."""
        self.active.extend(record for record in records if not record.status.is_finished)

    # ---- withdrawal (the caller gave up on a request) ---------------------------------------

    def withdraw(self, request_id: str) -> bool:
        """Stop serving ``request_id``: nobody waits for its answer any more.

        - Not admitted yet (queued or agreeing): answered at once with ``WITHDRAWN_ERROR``;
          the admission strategy skips it (a reservation its agreement made meanwhile is
          released by the strategy, never admitted).
        - Admitted and not fully planned: answered at once with ``WITHDRAWN_ERROR`` and left
          out of the planning set, so no further chunk of it is planned. Its micro-batches in
          flight run to their end, untouched, with the other requests they carry; its pins and
          reservations are released as for a failed request: by the last stage's report of
          its last micro-batch in flight (``DoneUpdate.to_release``), or their deadline
          (``expire``); with none in flight it leaves ``live`` at once and its id is handed to
          the driver by ``take_releasable``. Released once either way.
        - Fully planned (its last chunk is in flight), finished or unknown: nothing happens
          (the last chunk's answer ends it as usual).

        Returns:
            True if the request was withdrawn (answered now, counted in ``num_withdrawn``).
        """
        record = self.live.get(request_id)
        if record is None:
            record = self._unadmitted.get(request_id)
            if record is None or record.status.is_finished:
                return False
            self._finish(record, error=WITHDRAWN_ERROR)
            self.num_withdrawn += 1
            return True
        if record.status.is_fully_planned:
            return False
        self._finish(record, error=WITHDRAWN_ERROR)
        self.num_withdrawn += 1
        self._prune_active()
        if record.num_inflight_microbatches == 0:
            del self.live[request_id]
            self._releasable.append(request_id)
        return True

    def take_releasable(self) -> list[str]:
        """Ids of withdrawn requests that had nothing in flight, not yet released, in order
        (the driver releases them on every stage, then calls ``released``); each once."""
        releasable, self._releasable = self._releasable, []
        return releasable

    def _forget_unadmitted(self, record: RequestRecord) -> None:
        if self._unadmitted.get(record.request_id) is record:
            del self._unadmitted[record.request_id]

    # ---- queries the admission strategies ask ---------------------------------------------

    def is_live(self, request_id: str) -> bool:
        return request_id in self.live

    @property
    def num_inflight(self) -> int:
        """Micro-batches published and not reported by the last stage."""
        return len(self.inflight)

    def has_free_slot(self) -> bool:
        return len(self.inflight) < self.config.resolved_max_inflight

    def is_plannable(self, record: RequestRecord) -> bool:
        """The planner may cut ``record`` now: admitted, and not held back by a chunk in flight
        (``ChunkPlanner.may_cut``: the baseline's one chunk in flight)."""
        return record.progress is not None and self.planner.may_cut(
            record.num_inflight_microbatches
        )

    def plannable_budget_tokens(self) -> int:
        """Tokens the static budget would charge to plan every plannable request of the
        planning set whole (the sync admission fills up to ``chunk_tokens`` of it); equals their
        unplanned new tokens when the planner's budget accounting is exact."""
        return sum(
            record.progress.num_charged_tokens
            for record in self.active
            if record.progress is not None and self.is_plannable(record)
        )

    def _estimate_credits(self) -> None:
        """Budget accounting "estimated": credit each unstarted request with the leading
        blocks of its prompt that started live requests hold, capped by its agreed prefix
        (PR 11637's estimate as MAX_UTILIZATION computed it before PR 15066: blocks with live
        references only; docs/bench/baseline.md)."""
        if self.planner.budget_accounting != "estimated":
            return
        for record in self.active:
            self._estimate_credit(record)

    def _estimate_credit(self, record: RequestRecord) -> None:
        progress, ticket = record.progress, record.ticket
        if progress is None or ticket is None or progress.num_planned_chunks:
            return
        num_held = 0
        for block_hash in self.block_hashes(record.request)[: ticket.num_agreed_blocks]:
            if not self._started_blocks[block_hash]:
                break
            num_held += 1
        progress.num_credited_tokens = num_held * self.config.block_size

    def _started(self, record: RequestRecord) -> None:
        if self.planner.budget_accounting != "estimated":
            return
        if record.request_id in self._started_hashes:
            return
        hashes = self.block_hashes(record.request)
        self._started_hashes[record.request_id] = hashes
        self._started_blocks.update(hashes)

    def _forget_started(self, request_ids: Sequence[str]) -> None:
        _forget_blocks(request_ids, self._started_hashes, self._started_blocks)

    def num_pinned_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` (a prompt's chained full-block hashes)
        some live request holds pinned as its agreed prefix: cached on every stage until that
        request is released. Hashes are chained, so the count stops at the first block no live
        request pins."""
        num_blocks = 0
        for block_hash in block_hashes:
            if not self._pinned_blocks[block_hash]:
                break
            num_blocks += 1
        return num_blocks

    def _forget_pinned(self, request_ids: Sequence[str]) -> None:
        _forget_blocks(request_ids, self._pinned_hashes, self._pinned_blocks)

    def unplanned_tokens(self) -> int:
        """New tokens of every admitted request not yet planned (the lookahead's measure)."""
        return sum(
            record.num_unplanned_tokens
            for record in self.live.values()
            if not record.status.is_fully_planned
        )

    # ---- planning ------------------------------------------------------------------------

    def schedule(
        self, *, more_work_queued: bool, planning_started_s: float
    ) -> ScheduledMicroBatch | None:
        """Cut the next micro-batch from the planning set; None when the planner made none.

        Marks each chunk's request RUNNING (PLANNED with its last chunk), counts it in flight,
        and takes the micro-batch's id. The plan itself comes from ``encoded_plan_of``.
        """
        self._estimate_credits()
        chunks = self.planner.plan_microbatch(
            [record.progress for record in self.active if self.is_plannable(record)],
            num_stages=self.num_stages,
            num_inflight=len(self.inflight),
            more_work_queued=more_work_queued,
            target_cost_s=self.closed_loop_target_s(),
        )
        if not chunks:
            self._prune_active()
            return None
        return self.take_planned(chunks, planning_started_s)

    def take_planned(self, chunks: list[Chunk], planning_started_s: float) -> ScheduledMicroBatch:
        """The bookkeeping of a planned micro-batch (``schedule``'s, or a speculation's whose
        chunks already advanced the records' progress): ids, statuses, in-flight counts."""
        microbatch_id = self.next_microbatch_id
        self.next_microbatch_id += 1
        now = self.clock()
        scheduled = ScheduledMicroBatch(microbatch_id, chunks, planning_started_s or now, now)
        request_ids: list[str] = []
        for chunk in chunks:
            record = self.live[chunk.request_id]
            request = record.request
            # NOTE: built without validation (the hot path: validating a chunk's token ids
            # costs time linear in their number): every field is already checked, the request id by
            # the agreement's messages, the token ids by the API (``list[int]``), the offsets
            # and flags by the planner; the stages validate the plan they receive.
            scheduled.planned.append(
                PlannedChunk.model_construct(
                    request_id=chunk.request_id,
                    chunk_index=chunk.chunk_index,
                    context_offset=chunk.context_offset,
                    token_ids=request.token_ids[
                        chunk.context_offset : chunk.context_offset + chunk.num_tokens
                    ],
                    is_last=chunk.is_last,
                    return_logits=request.return_logits and chunk.is_last,
                    handoff_expires=self._handoff_expires(record) if chunk.is_last else 0.0,
                )
            )
            if chunk.request_id not in request_ids:
                request_ids.append(chunk.request_id)
                record.num_inflight_microbatches += 1
            assert record.outcome is not None, f"{chunk.request_id}: planned before admission"
            if not record.outcome.first_scheduled_s:
                record.outcome.first_scheduled_s = now
                self._started(record)
            if chunk.is_last:
                record.status = RequestStatus.PLANNED
            elif record.status == RequestStatus.ADMITTED:
                record.status = RequestStatus.RUNNING
        self.inflight[microbatch_id] = request_ids
        self._published_at_s[microbatch_id] = self.monotonic()
        self.stats.record_microbatch(sum(c.num_tokens for c in chunks))
        self._prune_active()
        return scheduled

    def _handoff_expires(self, record: RequestRecord) -> float:
        """0.0, or for a request handed to a decode engine (``PromptRequest.handoff``) the end
        of its KV's handoff lease on the stages: clock seconds + ``handoff_lease_s``, to the
        millisecond (what a handoff token covers), recorded on its outcome."""
        if not record.request.handoff:
            return 0.0
        expires = round(self.clock() + self.config.handoff_lease_s, 3)
        assert record.outcome is not None, f"{record.request.request_id}: planned before admission"
        record.outcome.handoff_expires = expires
        return expires

    def encoded_plan_of(
        self, scheduled: ScheduledMicroBatch, traceparent: str = ""
    ) -> tuple[MicroBatchPlan, bytes]:
        """The plan every stage runs for ``scheduled`` (kept in the ledger until all S report it)
        and its wire JSON, serialised once: signing serialises the plan
        anyway, and serialising a plan costs time linear in its token ids (on the critical
        path: the stages wait for it)."""
        plan = MicroBatchPlan(
            microbatch_id=scheduled.microbatch_id,
            chunks=scheduled.planned,
            published_at_s=scheduled.published_s,
            traceparent=traceparent,
            epoch=self.epoch,
        )
        if self.bus_key is not None:
            plan, data = self.bus_key.sign_json(plan)
        else:
            data = plan.model_dump_json().encode()
        self.ledger.published(
            scheduled.microbatch_id, plan, [c.request_id for c in scheduled.chunks]
        )
        return plan, data

    def _prune_active(self) -> None:
        self.active = [r for r in self.active if not r.status.is_fully_planned]

    def released(self, request_ids: Sequence[str]) -> None:
        """The requests' pins are gone: drop their claims on in-flight prefixes."""
        self._forget_started(request_ids)
        self._forget_pinned(request_ids)
        if self.config.resolved_prefix_wait:
            for request_id in request_ids:
                self.inflight_prefixes.remove(request_id)

    def reform(self, queued: Sequence[RequestRecord]) -> list[RequestRecord]:
        """The replica re-forms (new stages hold no KV state): every admitted, unanswered
        request goes back to WAITING, its micro-batches in flight forgotten, not failed; an
        answered one still live (its micro-batches in flight) leaves ``live``.

        Args:
            queued: admitted records not yet in the planning set (the driver's queue).

        Returns:
            The records to admit again, each once, in order.
        """
        readmit: list[RequestRecord] = []
        seen: set[str] = set()
        for record in [*self.live.values(), *queued]:
            if record.status.is_finished and self.live.get(record.request_id) is record:
                # answered (failed or withdrawn) with micro-batches in flight: those are
                # forgotten, and the new stages hold nothing of it to release
                del self.live[record.request_id]
                self._forget_pinned([record.request_id])
                if self.config.resolved_prefix_wait:
                    self.inflight_prefixes.remove(record.request_id)
            if record.status.is_finished or record.request_id in seen:
                continue
            seen.add(record.request_id)
            self.live.pop(record.request_id, None)
            if self.config.resolved_prefix_wait:
                self.inflight_prefixes.remove(record.request_id)
            self._forget_pinned([record.request_id])
            record.status = RequestStatus.WAITING
            record.ticket = None
            record.progress = None
            record.outcome = None
            record.num_inflight_microbatches = 0
            self._unadmitted.setdefault(record.request_id, record)
            readmit.append(record)
        self.active = []
        self.inflight.clear()
        self._forget_started(list(self._started_hashes))
        for microbatch_id in list(self._held_results):  # computed: the results stand
            self._answer_held(microbatch_id)
        self._published_at_s.clear()
        return readmit

    # ---- the one way a request ends --------------------------------------------------------

    def _finish(
        self,
        record: RequestRecord,
        *,
        error: str = "",
        first_token_id: int | None = None,
        logits: list[float] | None = None,
    ) -> None:
        request = record.request
        self._forget_unadmitted(record)
        if record.outcome is None:  # never admitted
            record.outcome = RequestOutcome(
                request_id=request.request_id,
                num_prompt_tokens=request.num_tokens,
                arrival_s=request.arrival_s,
            )
        outcome = record.outcome
        if error:
            outcome.error = outcome.error or error
        else:
            outcome.first_token_id = first_token_id
            outcome.logits = logits
            if self.config.resolved_speculative_planning and record.ticket is not None:
                # Computed: every full block of the prompt is cached on every stage now.
                hashes = self.block_hashes(request)
                self.agreed_prefixes.record(hashes, len(hashes))
        outcome.finished_s = self.clock()
        if not record.status.is_finished:
            self.num_open -= 1
        record.status = RequestStatus.FINISHED_ERROR if outcome.error else RequestStatus.FINISHED_OK
        self._finished.append(record)

    def take_finished(self) -> list[RequestRecord]:
        """The records answered since the last call, in order (the driver tells their callers)."""
        finished, self._finished = self._finished, []
        return finished


def _forget_blocks(
    request_ids: Sequence[str], hashes_of: dict[str, list[bytes]], counts: Counter[bytes]
) -> None:
    """Drop each request's block hashes from ``hashes_of`` and their counts from ``counts``
    (a hash whose count reaches 0 leaves it)."""
    for request_id in request_ids:
        hashes = hashes_of.pop(request_id, None)
        if hashes is not None:
            counts.subtract(hashes)
            for block_hash in hashes:
                if counts[block_hash] <= 0:
                    del counts[block_hash]
