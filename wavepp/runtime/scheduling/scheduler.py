"""The wave scheduler: admitted requests -> micro-batches -> every stage at once.

Two modes share this executor; only the three mechanisms of ``RuntimeConfig`` differ:

wave (WavePP)::

    intake --> admission tasks (<= max_agreements_in_flight, concurrent with execution)
                 probe/pin/commit over NATS --> prepared queue (bounded, max_prepared)
    scheduling loop: prepared tickets --> dynamic planner (equal cost per micro-batch)
                 --> publish plan to {p}.plan (stages prepare on arrival)

sync (baseline, mirrors TensorRT-LLM's ``_executor_loop_pp``)::

    scheduling loop: for each new request, on the critical path: probe/pin/commit over NATS,
                 retrying until the reservation fits (head of line waits)
                 --> static planner (``chunk_tokens`` per micro-batch)
                 --> publish plan (stages prepare after their activations arrive)

Both keep at most ``max_inflight`` (default S) micro-batches in the pipeline. The last stage's
``MicroBatchDone`` frees a slot and carries the first tokens of finished requests; a request's
pins and reservations are released once no micro-batch holding one of its chunks is in flight.

Delivery across NATS reconnects: plans carry this scheduler's ``epoch`` and consecutive ids and
stay in a ``PlanLedger`` until every stage reported them done. Stages ask for plans they missed
(``{p}.plan.replay``); after a reconnect the scheduler republishes the outstanding plans and
asks each stage for the done messages it has not seen (``{p}.stage.{r}.dones``), also when a
stage says it reconnected (``{p}.resync``) or reports a later micro-batch first. Done messages
count once per (micro-batch, stage). An agreement a stage did not answer is retried for
``agreement_retry_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from wavepp.api.messages import (
    DoneReplay,
    DoneReplayReply,
    MicroBatchDone,
    MicroBatchPlan,
    PlannedChunk,
    PlanReplay,
    PlanReplayReply,
    StageResync,
)
from wavepp.runtime.agreement import (
    AdmissionController,
    AgreementRefused,
    StageUnavailableError,
    Ticket,
)
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv.inflight import InflightPrefixIndex
from wavepp.runtime.planning import ChunkPlanner, RequestProgress
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.scheduling.ledger import PlanLedger, Report
from wavepp.runtime.transport.natsio import on_reconnect
from wavepp.telemetry import tracing
from wavepp.telemetry.pipeline import ChunkInfo, PipelineTelemetry, tenant_of

log = logging.getLogger(__name__)

_RECENT_OUTCOMES = 4096
# Wave mode: an under-full micro-batch waits at most this fraction of the planner's target
# micro-batch cost for requests still before their agreement (see _gather_work_async).
UNDERFULL_WAIT_FRACTION = 0.05


@dataclass
class RequestOutcome:
    """What a caller gets back for one request. Times are ``time.time()`` seconds."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    first_token_id: int | None = None
    logits: list[float] | None = None
    error: str = ""
    arrival_s: float = 0.0
    admitted_s: float = 0.0
    first_scheduled_s: float = 0.0
    finished_s: float = 0.0
    agreement_s: float = 0.0
    num_refusals: int = 0
    stage_hits: tuple[int, ...] = ()
    # (rank, L*) as each stage reported it for each of the request's chunks
    stage_agreed_blocks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft_s(self) -> float:
        return self.finished_s - self.arrival_s


@dataclass
class _Live:
    ticket: Ticket
    progress: RequestProgress
    future: asyncio.Future[RequestOutcome]
    outcome: RequestOutcome
    num_inflight_microbatches: int = 0
    planned_all: bool = False
    finished: bool = False


@dataclass
class StageSpan:
    """One stage's work on one micro-batch (for wave-fill accounting and timelines)."""

    rank: int
    microbatch_id: int
    num_tokens: int
    prepare_start_s: float
    prepare_end_s: float
    execute_start_s: float
    execute_end_s: float


@dataclass
class WaveStats:
    spans: list[StageSpan] = field(default_factory=list)
    num_microbatches: int = 0
    microbatch_tokens: list[int] = field(default_factory=list)

    def wave_fill(self, num_stages: int) -> float:
        """Busy time of all stages / (S x wall time) over the spans' window (DESIGN.md terms)."""
        if not self.spans:
            return 0.0
        start = min(s.execute_start_s for s in self.spans)
        end = max(s.execute_end_s for s in self.spans)
        busy = sum(s.execute_end_s - s.execute_start_s for s in self.spans)
        return busy / (num_stages * (end - start)) if end > start else 0.0

    def busy_s_by_stage(self, num_stages: int) -> list[float]:
        busy = [0.0] * num_stages
        for s in self.spans:
            busy[s.rank] += s.execute_end_s - s.execute_start_s
        return busy


class WaveScheduler:
    """Drives one pipeline: intake, admission, planning, publishing plans, collecting results."""

    def __init__(
        self,
        config: RuntimeConfig,
        nc: NATS,
        controller: AdmissionController,
        planner: ChunkPlanner,
        *,
        on_outcome: Callable[[RequestOutcome], None] | None = None,
        on_stage_done: Callable[[MicroBatchDone, list[str]], None] | None = None,
        first_microbatch_id: int = 0,
    ) -> None:
        self.config = config
        self.nc = nc
        self.controller = controller
        self.planner = planner
        self.on_outcome = on_outcome
        self.on_stage_done = on_stage_done  # each (micro-batch, stage) once, with chunk owners
        self.num_stages = config.num_stages
        self.prefix = config.subject_prefix
        self.subjects = config.subjects
        self.intake: asyncio.Queue[tuple[PromptRequest, asyncio.Future[RequestOutcome]]] = (
            asyncio.Queue()
        )
        self.prepared: asyncio.Queue[_Live] = asyncio.Queue(maxsize=config.max_prepared)
        self.active: list[_Live] = []
        self.by_id: dict[str, _Live] = {}
        self.inflight: dict[int, list[str]] = {}
        self._published_at_s: dict[int, float] = {}  # micro-batch id -> time.monotonic()
        self.epoch = uuid.uuid4().hex[:16]
        self.ledger: PlanLedger[MicroBatchPlan] = PlanLedger(config.num_stages)
        self._pulls: set[asyncio.Task[None]] = set()
        # Recovery counters (a NATS reconnect): plans replayed or republished to stages, done
        # messages recovered from stages, agreements retried after a stage did not answer.
        self.num_plans_resent = 0
        self.num_dones_recovered = 0
        self.num_agreement_retries = 0
        self.num_readmitted = 0  # admitted requests sent back to admission by a re-form
        # Stages report in any order: keep recent outcomes a while after release.
        self._recent: OrderedDict[str, RequestOutcome] = OrderedDict()
        self.stats = WaveStats()
        self._next_microbatch_id = first_microbatch_id
        self._slot_freed = asyncio.Event()
        self._capacity_generation = 0
        self._capacity_changed = asyncio.Condition()
        self._agreements = asyncio.Semaphore(config.max_agreements_in_flight)
        self._retry_lock = asyncio.Lock()
        self._admission_open = asyncio.Event()
        self._admission_open.set()
        self._plans_open = asyncio.Event()  # cleared while the replica re-forms
        self._plans_open.set()
        self.inflight_prefixes = InflightPrefixIndex()
        self._prefixes_changed = asyncio.Condition()
        self._lookahead_changed = asyncio.Condition()
        self._agreeing_tokens = 0
        # Agreements whose RPC is under way or that succeeded and are not in `prepared` yet;
        # an under-full micro-batch waits for them (see _gather_work_async).
        self._num_agreeing = 0
        self._agreeing_changed = asyncio.Event()
        self._target_cost_s = planner.target_cost_s()
        self.num_prefix_waits = 0
        self._sync_head: tuple[PromptRequest, asyncio.Future[RequestOutcome], int] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._admissions: set[asyncio.Task[None]] = set()
        self._sub = None
        self._subs: list[object] = []
        self._planning_started_s = 0.0
        self.telemetry = PipelineTelemetry(
            config.pipeline,
            self.num_stages,
            self.stats,
            lambda: {"intake": self.intake.qsize(), "prepared": self.prepared.qsize()},
        )

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subjects.done, cb=self._on_done)
        self._subs = [
            await self.nc.subscribe(self.subjects.plan_replay, cb=self._on_plan_replay),
            await self.nc.subscribe(self.subjects.resync, cb=self._on_resync),
        ]
        on_reconnect(self.nc, self._on_reconnected)
        await self.telemetry.start(self.nc, self.prefix)
        await self.nc.flush()
        if self.config.resolved_async_agreement:
            self._tasks.append(asyncio.create_task(self._admission_loop(), name="admission"))
        self._tasks.append(asyncio.create_task(self._scheduling_loop(), name="scheduling"))
        self._tasks.append(asyncio.create_task(self._renew_loop(), name="renew"))
        self._tasks.append(asyncio.create_task(self._deadline_loop(), name="deadline"))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._admissions, *self._pulls]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sub in [self._sub, *self._subs]:
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()  # type: ignore[attr-defined]
        await self.telemetry.close()

    def pause_plans(self) -> None:
        """Publish no micro-batch plan until :meth:`resume_plans` (the stages re-form).

        Plans are core NATS: one published while only some restarted stages have subscribed
        reaches a subset of them, and their activation streams desynchronise for good.
        Admission, deadlines and results go on meanwhile.
        """
        self._plans_open.clear()

    def resume_plans(self, *, readmit: bool = True) -> None:
        """Publish plans again (every stage subscribed); see :meth:`pause_plans`.

        The outstanding plans are forgotten (no replay to the new stages: the stages that held
        their requests are gone). With ``readmit`` (after a re-form: the new stages hold no
        KV state of anything admitted before), every admitted request not yet answered goes
        back to admission and is agreed and computed again on the new stages; its
        micro-batches in flight are forgotten, not failed. Requests already failed by the
        deadline stay failed (they were answered).
        """
        if readmit:
            self._readmit_live()
        self.ledger.clear()
        self._plans_open.set()

    def _readmit_live(self) -> None:
        lives = [*self.by_id.values(), *self._take_prepared()]
        seen: set[str] = set()
        for live in lives:
            request = live.ticket.request
            if live.finished or request.request_id in seen:
                continue
            seen.add(request.request_id)
            self.by_id.pop(request.request_id, None)
            self.controller.live.discard(request.request_id)
            if self.config.resolved_prefix_wait:
                self.inflight_prefixes.remove(request.request_id)
            self.intake.put_nowait((request, live.future))
        self.num_readmitted += len(seen)
        if seen:
            log.warning("re-form: %d admitted requests go back to admission", len(seen))
        self.active = []
        self.inflight.clear()
        self._published_at_s.clear()
        self._slot_freed.set()
        self._admission_open.set()

    async def submit(self, request: PromptRequest) -> RequestOutcome:
        """Queue a request and wait for its outcome (never raises for request errors)."""
        future: asyncio.Future[RequestOutcome] = asyncio.get_running_loop().create_future()
        self.telemetry.request_arrived(
            request.request_id,
            request.arrival_s,
            request.num_tokens,
            tenant_of(getattr(request, "tenant", ""), request.cache_salt),
        )
        self.intake.put_nowait((request, future))
        return await future

    # ---- admission -----------------------------------------------------------------------

    def _fail(
        self, request: PromptRequest, future: asyncio.Future[RequestOutcome], error: str
    ) -> None:
        outcome = RequestOutcome(
            request_id=request.request_id,
            num_prompt_tokens=request.num_tokens,
            error=error,
            arrival_s=request.arrival_s,
            finished_s=time.time(),
        )
        self._complete(future, outcome)

    def _complete(self, future: asyncio.Future[RequestOutcome], outcome: RequestOutcome) -> None:
        self.telemetry.completed(
            outcome.request_id,
            ttft_s=outcome.ttft_s,
            finished_s=outcome.finished_s,
            error=outcome.error,
        )
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        if not future.done():
            future.set_result(outcome)

    async def _agree_until_admitted(self, request: PromptRequest) -> Ticket:
        """Agree; on refusal wait until some request releases blocks, then retry.

        Refused requests retry one at a time, in order (a FIFO lock), and no new agreement
        starts while one waits: backpressure instead of rounds of probe/commit/release that
        cannot fit.
        """
        ticket = await self._agree_through_outages(request)
        if ticket is not None:
            return ticket
        num_refusals = 1
        async with self._retry_lock:
            while True:
                self._admission_open.clear()
                generation = self._capacity_generation
                with tracing.span("reservation.wait", **{"reservation.refusals": num_refusals}):
                    await self._wait_for_capacity(generation)
                ticket = await self._agree_through_outages(request)
                if ticket is not None:
                    ticket.num_refusals = num_refusals
                    self._admission_open.set()
                    return ticket
                num_refusals += 1

    async def _agree_through_outages(self, request: PromptRequest) -> Ticket | None:
        """``controller.agree``, retried while a stage does not answer (NATS reconnecting, a
        stage restarting), for ``agreement_retry_s``; each retry first releases what the failed
        attempt may have left (probe and commit are idempotent per request id).

        Raises:
            StageUnavailableError: a stage still did not answer when the retry time ran out.
        """
        deadline = time.monotonic() + self.config.agreement_retry_s
        delay_s = 0.1
        while True:
            self._num_agreeing += 1
            try:
                ticket = await self.controller.agree(request)
            except BaseException as exc:
                self._agreement_ended()
                if not isinstance(exc, StageUnavailableError):
                    raise
                if time.monotonic() + delay_s > deadline:
                    raise
                log.warning("agreement for %s: %s; retrying", request.request_id, exc)
                self.num_agreement_retries += 1
            else:
                if ticket is None:  # refused: the caller waits for capacity, not counted
                    self._agreement_ended()
                return ticket  # counted until it is in `prepared` (_admit_async)
            await asyncio.sleep(delay_s)
            delay_s = min(1.0, 2 * delay_s)
            with contextlib.suppress(Exception):
                await self.controller.release([request.request_id])

    def _agreement_ended(self) -> None:
        self._num_agreeing -= 1
        self._agreeing_changed.set()

    def _admitted(
        self, request: PromptRequest, future: asyncio.Future[RequestOutcome], ticket: Ticket
    ) -> _Live:
        outcome = RequestOutcome(
            request_id=request.request_id,
            num_prompt_tokens=request.num_tokens,
            num_cached_tokens=ticket.num_cached_tokens,
            arrival_s=request.arrival_s,
            admitted_s=ticket.admitted_at_s,
            agreement_s=ticket.agreement_s,
            num_refusals=ticket.num_refusals,
            stage_hits=ticket.stage_hits,
        )
        self.telemetry.admitted(
            request.request_id,
            num_prompt_tokens=request.num_tokens,
            num_cached_tokens=ticket.num_cached_tokens,
            agreement_s=ticket.agreement_s,
            num_refusals=ticket.num_refusals,
        )
        live = _Live(
            ticket=ticket,
            progress=RequestProgress(
                request_id=request.request_id,
                num_prompt_tokens=request.num_tokens,
                num_computed_tokens=ticket.num_cached_tokens,
                arrival_s=request.arrival_s,
            ),
            future=future,
            outcome=outcome,
        )
        self.by_id[request.request_id] = live
        if self.config.resolved_prefix_wait:
            # Narrow the claim made before agreeing to the blocks it really computes.
            hashes = self.controller.block_hashes(request)
            self.inflight_prefixes.remove(request.request_id)
            self.inflight_prefixes.add(request.request_id, hashes[ticket.num_agreed_blocks :])
        self._recent[request.request_id] = outcome
        while len(self._recent) > _RECENT_OUTCOMES:
            self._recent.popitem(last=False)
        return live

    async def _admit_one(
        self, request: PromptRequest, future: asyncio.Future[RequestOutcome]
    ) -> _Live | None:
        if request.request_id in self.by_id:
            self._fail(request, future, f"request_id {request.request_id!r} is already in flight")
            return None
        try:
            with self.telemetry.request_context(request.request_id):
                ticket = await self._agree_until_admitted(request)
        except AgreementRefused as exc:
            self._fail(request, future, str(exc))
            return None
        except Exception as exc:
            log.exception("agreement for %s failed", request.request_id)
            self._fail(request, future, f"agreement failed: {exc}")
            return None
        return self._admitted(request, future, ticket)

    async def _admission_loop(self) -> None:
        while True:
            request, future = await self.intake.get()
            await self._admission_open.wait()
            await self._wait_for_lookahead_room()
            self._agreeing_tokens += request.num_tokens
            task = asyncio.create_task(self._admit_async(request, future))
            self._admissions.add(task)
            task.add_done_callback(self._admissions.discard)

    async def _admit_async(
        self, request: PromptRequest, future: asyncio.Future[RequestOutcome]
    ) -> None:
        if self.config.resolved_prefix_wait:
            await self._wait_for_prefix_owner(request)
        live = None
        await self._agreements.acquire()
        try:
            live = await self._admit_one(request, future)
            if live is not None:
                try:
                    await self.prepared.put(live)
                finally:
                    self._agreement_ended()
        finally:
            self._agreements.release()
            self._agreeing_tokens -= request.num_tokens
            await self._notify(self._lookahead_changed)
            if self.config.resolved_prefix_wait:
                if live is None:
                    self.inflight_prefixes.remove(request.request_id)
                async with self._prefixes_changed:
                    self._prefixes_changed.notify_all()

    def _lookahead_tokens(self) -> int:
        """New tokens admitted (or being agreed) but not yet planned into a micro-batch."""
        planned_pending = sum(
            live.progress.num_prompt_tokens - live.progress.num_computed_tokens
            for live in self.by_id.values()
            if not live.planned_all
        )
        return planned_pending + self._agreeing_tokens

    async def _wait_for_lookahead_room(self) -> None:
        budget = self.config.resolved_admission_lookahead_tokens
        async with self._lookahead_changed:
            while self._lookahead_tokens() >= budget:
                await self._lookahead_changed.wait()

    @staticmethod
    async def _notify(condition: asyncio.Condition) -> None:
        async with condition:
            condition.notify_all()

    async def _wait_for_prefix_owner(self, request: PromptRequest) -> None:
        """Wait while a live request computes a large enough part of this prompt's prefix,
        then claim this prompt's blocks (until its agreement narrows the claim).

        "Large enough": at least one block and ``prefix_wait_min_fraction`` of the prompt, so a
        short shared system prompt never serialises requests. Bounded by the lease. The check
        and the claim run without an await between them, so requests admitted in order see
        each other's claims in order.
        """
        try:
            hashes = self.controller.block_hashes(request)
        except ValueError:
            return  # a bad prompt fails in the agreement with its own error
        min_blocks = max(1, int(self.config.prefix_wait_min_fraction * len(hashes)))
        deadline = time.monotonic() + self.config.lease_s
        waited = False
        while True:
            owner, num_blocks = self.inflight_prefixes.deepest_overlap(hashes)
            if owner is None or num_blocks < min_blocks or time.monotonic() > deadline:
                break
            waited = True
            async with self._prefixes_changed:
                try:
                    await asyncio.wait_for(
                        self._prefixes_changed.wait(), max(0.0, deadline - time.monotonic())
                    )
                except TimeoutError:
                    break
        self.num_prefix_waits += int(waited)
        self.inflight_prefixes.add(request.request_id, hashes)

    # ---- scheduling ----------------------------------------------------------------------

    def _remaining_new_tokens(self) -> int:
        return sum(
            live.progress.num_prompt_tokens - live.progress.num_computed_tokens
            for live in self.active
        )

    def _more_work_queued(self) -> bool:
        """Requests on their way to admission (wave mode): in the intake, or admission tasks
        not yet in ``prepared`` (agreeing, waiting for a prefix owner or for capacity)."""
        if not self.config.resolved_async_agreement:
            return False
        return not self.intake.empty() or any(not t.done() for t in self._admissions)

    async def _wait_for_slot(self) -> None:
        while len(self.inflight) >= self.config.resolved_max_inflight:
            self._slot_freed.clear()
            await self._slot_freed.wait()

    def _take_prepared(self) -> list[_Live]:
        """Everything admitted and waiting in ``prepared``, in order (without waiting)."""
        taken = []
        while True:
            try:
                taken.append(self.prepared.get_nowait())
            except asyncio.QueueEmpty:
                return taken

    async def _gather_work_async(self) -> None:
        self.active.extend(self._take_prepared())
        if not self.active:
            # Await first, then look up self.active: the failure paths (_fail_microbatch,
            # _expire_microbatch) rebind it meanwhile, and an append bound before the await
            # would put the request on the discarded list (admitted, never planned).
            live = await self.prepared.get()
            self.active.append(live)
        # An under-full micro-batch waits for work on its way: requests that finished
        # together are resubmitted together, and planning the first one admitted alone would
        # spend a pipeline slot on a sliver of work while the rest waits a whole micro-batch
        # for the next slot. It waits for agreements under way (an RPC: bounded), and for at
        # most UNDERFULL_WAIT_FRACTION x the target micro-batch cost for requests still before
        # their agreement (those may wait on capacity or a prefix owner that only this
        # micro-batch's requests can free, so an unbounded wait could deadlock).
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while self._remaining_new_tokens() < self.config.chunk_tokens:
            self._agreeing_changed.clear()
            if self._num_agreeing > 0:
                await self._agreeing_changed.wait()
            elif self._more_work_queued():
                if deadline is None:
                    deadline = loop.time() + UNDERFULL_WAIT_FRACTION * self._target_cost_s
                if loop.time() >= deadline:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._agreeing_changed.wait(), deadline - loop.time())
            else:
                break
            self.active.extend(self._take_prepared())

    async def _gather_work_sync(self) -> None:
        # TensorRT-LLM's PP loop: the first rank schedules; new requests get their KV resources
        # on the critical path, one at a time. A request that does not fit is retried until it
        # does; meanwhile the loop runs what it already has (never waits on blocks that only
        # its own unscheduled requests hold).
        while self._remaining_new_tokens() < self.config.chunk_tokens:
            if self._sync_head is None:
                if self.active and self.intake.empty():
                    return
                self._sync_head = (*await self.intake.get(), 0)
            request, future, num_refusals = self._sync_head
            generation = self._capacity_generation
            try:
                with self.telemetry.request_context(request.request_id):
                    ticket = await self.controller.agree(request)
            except AgreementRefused as exc:
                self._sync_head = None
                self._fail(request, future, str(exc))
                continue
            except Exception as exc:
                log.exception("agreement for %s failed", request.request_id)
                self._sync_head = None
                self._fail(request, future, f"agreement failed: {exc}")
                continue
            if ticket is None:
                self._sync_head = (request, future, num_refusals + 1)
                if self.active:
                    return
                await self._wait_for_capacity(generation)
                continue
            self._sync_head = None
            ticket.num_refusals = num_refusals
            self.active.append(self._admitted(request, future, ticket))

    async def _wait_for_capacity(self, generation: int) -> None:
        async with self._capacity_changed:
            if generation == self._capacity_generation and self.inflight:
                await self._capacity_changed.wait()
                return
        # Nothing in flight will free blocks: only lease expiry can. Back off.
        await asyncio.sleep(0.05)

    async def _scheduling_loop(self) -> None:
        gather = (
            self._gather_work_async
            if self.config.resolved_async_agreement
            else self._gather_work_sync
        )
        while True:
            await self._wait_for_slot()
            await gather()
            await self._plans_open.wait()
            progress = [live.progress for live in self.active]
            self._planning_started_s = time.time()
            chunks = self.planner.plan_microbatch(
                progress,
                num_stages=self.num_stages,
                num_inflight=len(self.inflight),
                more_work_queued=self._more_work_queued(),
            )
            if not chunks:
                self.active = [live for live in self.active if not live.planned_all]
                if not self.active:
                    continue
                await asyncio.sleep(0)
                continue
            await self._publish(chunks)
            self.active = [live for live in self.active if not live.planned_all]

    async def _publish(self, chunks: list) -> None:  # list[Chunk]
        microbatch_id = self._next_microbatch_id
        self._next_microbatch_id += 1
        now = time.time()
        planned: list[PlannedChunk] = []
        request_ids: list[str] = []
        for chunk in chunks:
            live = self.by_id[chunk.request_id]
            tokens = live.ticket.request.token_ids[
                chunk.context_offset : chunk.context_offset + chunk.num_tokens
            ]
            planned.append(
                PlannedChunk(
                    request_id=chunk.request_id,
                    chunk_index=chunk.chunk_index,
                    context_offset=chunk.context_offset,
                    token_ids=tokens,
                    is_last=chunk.is_last,
                    return_logits=live.ticket.request.return_logits and chunk.is_last,
                )
            )
            if chunk.request_id not in request_ids:
                request_ids.append(chunk.request_id)
                live.num_inflight_microbatches += 1
            if not live.outcome.first_scheduled_s:
                live.outcome.first_scheduled_s = now
            if chunk.is_last:
                live.planned_all = True
        self.inflight[microbatch_id] = request_ids
        self._published_at_s[microbatch_id] = time.monotonic()
        self.stats.num_microbatches += 1
        await self._notify(self._lookahead_changed)
        self.stats.microbatch_tokens.append(sum(c.num_tokens for c in chunks))
        traceparent, headers = self.telemetry.microbatch_published(
            microbatch_id,
            [
                ChunkInfo(c.request_id, c.chunk_index, c.num_tokens, c.context_offset)
                for c in chunks
            ],
            self._planning_started_s or now,
            now,
        )
        plan = MicroBatchPlan(
            microbatch_id=microbatch_id,
            chunks=planned,
            published_at_s=now,
            traceparent=traceparent,
            epoch=self.epoch,
        )
        self.ledger.published(microbatch_id, plan, [c.request_id for c in chunks])
        await self.nc.publish(self.subjects.plan, plan.model_dump_json().encode(), headers=headers)

    # ---- completion ----------------------------------------------------------------------

    async def _on_done(self, msg: Msg) -> None:
        try:
            done = MicroBatchDone.model_validate_json(msg.data)
        except ValueError as exc:
            log.error("invalid done message dropped: %s", exc)
            return
        await self._handle_done(done)

    async def _handle_done(self, done: MicroBatchDone) -> None:
        """Apply one stage's done message, once per (micro-batch, stage)."""
        if done.epoch and done.epoch != self.epoch:
            return  # a previous scheduler's micro-batch
        if not 0 <= done.rank < self.num_stages:
            log.error("done message from rank %d dropped (S=%d)", done.rank, self.num_stages)
            return
        owners = self.ledger.owners(done.microbatch_id)
        if self.ledger.report(done.microbatch_id, done.rank) in (Report.DUPLICATE, Report.UNKNOWN):
            return
        missing = self.ledger.missing_before(done.rank, done.microbatch_id)
        if missing:  # stages report in order: earlier done messages of this rank were lost
            self._pull_dones_soon(done.rank, missing)
        if self.on_stage_done is not None:
            self.on_stage_done(done, owners)
        self.stats.spans.append(
            StageSpan(
                rank=done.rank,
                microbatch_id=done.microbatch_id,
                num_tokens=done.num_tokens,
                prepare_start_s=done.prepare_start_s,
                prepare_end_s=done.prepare_end_s,
                execute_start_s=done.execute_start_s,
                execute_end_s=done.execute_end_s,
            )
        )
        self.telemetry.stage_done(done)
        for request_id, num_agreed in zip(owners, done.num_agreed_blocks, strict=False):
            recent = self._recent.get(request_id)
            if recent is not None:
                recent.stage_agreed_blocks.append((done.rank, num_agreed))
        if done.error:
            self._fail_microbatch(done.microbatch_id, done.error)
        if done.rank != self.num_stages - 1:
            return
        request_ids = self.inflight.pop(done.microbatch_id, [])
        self._published_at_s.pop(done.microbatch_id, None)
        self._slot_freed.set()
        now = time.time()
        for result in done.results:
            live = self.by_id.get(result.request_id)
            if live is None or live.finished:
                continue
            live.finished = True
            live.outcome.first_token_id = result.first_token_id
            live.outcome.logits = result.logits
            live.outcome.finished_s = now
            self._complete(live.future, live.outcome)
        to_release = []
        for request_id in request_ids:
            live = self.by_id.get(request_id)
            if live is None:
                continue
            live.num_inflight_microbatches -= 1
            if live.num_inflight_microbatches == 0 and (live.finished or live.planned_all):
                if not live.finished:  # last chunk ran without a result: report, never hang
                    live.finished = True
                    live.outcome.error = live.outcome.error or "no result from the last stage"
                    live.outcome.finished_s = now
                    self._complete(live.future, live.outcome)
                del self.by_id[request_id]
                to_release.append(request_id)
        if to_release:
            await self._release_and_wake(to_release)

    def _fail_microbatch(self, microbatch_id: int, error: str) -> None:
        for request_id in self.inflight.get(microbatch_id, []):
            live = self.by_id.get(request_id)
            if live is None or live.finished:
                continue
            live.finished = True
            live.planned_all = True
            live.outcome.error = error
            live.outcome.finished_s = time.time()
            self._complete(live.future, live.outcome)
        self.active = [live for live in self.active if not live.finished]

    async def _deadline_loop(self) -> None:
        """Every quarter deadline (at most 1 s), expire the micro-batches past their deadline."""
        deadline_s = self.config.microbatch_deadline_s
        while True:
            await asyncio.sleep(min(1.0, deadline_s / 4))
            now = time.monotonic()
            for microbatch_id, published_s in list(self._published_at_s.items()):
                if now - published_s > deadline_s:
                    await self._expire_microbatch(microbatch_id)

    async def _expire_microbatch(self, microbatch_id: int) -> None:
        """Fail the unfinished requests of a micro-batch past ``microbatch_deadline_s``.

        Each request is answered once, with an error naming the micro-batch and how many stages
        reported it; a result arriving later is dropped (the request is no longer live). Pins
        and reservations are released on every stage that answers; a dead stage's go with it.
        """
        self._published_at_s.pop(microbatch_id, None)
        request_ids = self.inflight.pop(microbatch_id, [])
        num_reports = self.ledger.num_reports(microbatch_id)
        self.ledger.drop(microbatch_id)
        error = (
            f"micro-batch {microbatch_id} not finished within microbatch_deadline_s="
            f"{self.config.microbatch_deadline_s} s ({num_reports} of {self.num_stages} stages "
            "reported it): a stage died or lost the plan"
        )
        log.error("%s; failing requests %s", error, request_ids)
        self._slot_freed.set()
        to_release = []
        for request_id in request_ids:
            live = self.by_id.pop(request_id, None)
            if live is None:
                continue
            if not live.finished:
                live.finished = True
                live.planned_all = True
                live.outcome.error = error
                live.outcome.finished_s = time.time()
                self._complete(live.future, live.outcome)
            to_release.append(request_id)
        self.active = [live for live in self.active if not live.finished]
        if to_release:
            await self._release_and_wake(to_release)

    async def _release_and_wake(self, request_ids: list[str]) -> None:
        """Release finished (or failed) requests, then wake the admissions waiting for their
        prefix or for the capacity they held."""
        await self._release(request_ids)
        if self.config.resolved_prefix_wait:
            for request_id in request_ids:
                self.inflight_prefixes.remove(request_id)
            async with self._prefixes_changed:
                self._prefixes_changed.notify_all()
        async with self._capacity_changed:
            self._capacity_generation += 1
            self._capacity_changed.notify_all()
        self._admission_open.set()

    async def _release(self, request_ids: list[str]) -> None:
        """Release on every stage; if a stage does not answer (its reply lost in a reconnect, a
        dead stage), retry in the background for up to ``lease_s``, after which leases free
        the pins anyway. Release is idempotent; a request id live again is not retried."""
        try:
            await self.controller.release(request_ids)
        except Exception as exc:  # noqa: BLE001
            log.warning("release of %s failed (%r); retrying", request_ids, exc)
            task = asyncio.ensure_future(self._retry_release(request_ids))
            self._pulls.add(task)
            task.add_done_callback(self._pulls.discard)

    async def _retry_release(self, request_ids: list[str]) -> None:
        deadline = time.monotonic() + self.config.lease_s
        delay_s = 0.2
        while time.monotonic() < deadline:
            await asyncio.sleep(delay_s)
            ids = [r for r in request_ids if r not in self.by_id]
            if not ids:
                return
            try:
                await self.controller.release(ids)
                return
            except Exception as exc:  # noqa: BLE001
                log.warning("release of %s failed again (%r)", ids, exc)
            delay_s = min(2.0, 2 * delay_s)

    # ---- gap-free delivery across reconnects ----------------------------------------------

    async def _on_plan_replay(self, msg: Msg) -> None:
        try:
            ask = PlanReplay.model_validate_json(msg.data)
        except ValueError as exc:
            log.error("invalid plan replay ask dropped: %s", exc)
            return
        plans = (
            [plan for _, plan in self.ledger.replay(ask.from_id, ask.to_id)]
            if ask.epoch == self.epoch
            else []
        )
        if plans:
            log.warning(
                "replaying plans %s to stage %d", [p.microbatch_id for p in plans], ask.rank
            )
        self.num_plans_resent += len(plans)
        reply = PlanReplayReply(epoch=self.epoch, next_id=self._next_microbatch_id, plans=plans)
        await msg.respond(reply.model_dump_json().encode())

    async def _on_resync(self, msg: Msg) -> None:
        try:
            notice = StageResync.model_validate_json(msg.data)
        except ValueError as exc:
            log.error("invalid resync notice dropped: %s", exc)
            return
        if 0 <= notice.rank < self.num_stages:
            self._pull_dones_soon(notice.rank, self.ledger.unreported(notice.rank))

    async def _on_reconnected(self) -> None:
        """Republish the outstanding plans (stages drop the ones they have) and ask every stage
        for the done messages this side has not seen."""
        for _, plan in self.ledger.replay(0):
            await self.nc.publish(self.subjects.plan, plan.model_dump_json().encode())
            self.num_plans_resent += 1
        for rank in range(self.num_stages):
            self._pull_dones_soon(rank, self.ledger.unreported(rank))

    def _pull_dones_soon(self, rank: int, microbatch_ids: list[int]) -> None:
        if microbatch_ids:
            task = asyncio.ensure_future(self._pull_dones(rank, microbatch_ids))
            self._pulls.add(task)
            task.add_done_callback(self._pulls.discard)

    async def _pull_dones(self, rank: int, microbatch_ids: list[int]) -> None:
        ask = DoneReplay(epoch=self.epoch, microbatch_ids=microbatch_ids[:4096])
        try:
            msg = await self.nc.request(
                self.subjects.stage_dones(rank),
                ask.model_dump_json().encode(),
                timeout=min(2.0, self.config.request_timeout_s),
            )
            reply = DoneReplayReply.model_validate_json(msg.data)
        except Exception as exc:  # noqa: BLE001 - it resyncs when it reconnects
            log.warning("done replay from stage %d failed: %r", rank, exc)
            return
        for done in reply.dones:
            if done.rank == rank and self.ledger.report_pending(done.microbatch_id, rank):
                self.num_dones_recovered += 1
                await self._handle_done(done)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            try:
                await self.controller.renew_leases()
            except Exception as exc:
                log.warning("lease renewal failed: %s", exc)
