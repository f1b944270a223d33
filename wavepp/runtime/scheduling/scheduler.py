"""The wave scheduler: admitted requests -> micro-batches -> every stage at once.

``WaveScheduler`` is the driver: it owns the asyncio side (intake queue, loops, timers) and
calls three parts that hold no I/O of their own::

    submit --> intake --> AdmissionStrategy (admission/: AsyncAdmission, SyncAdmission)
                             prefix agreement (AgreementController)
                          --> SchedulerCore (core.py): request records, planning, done
                              accounting, deadlines, re-form; the one "finish a request" path
                          --> PlanTransport (transport.py): plans out, done messages in
                              (NATS: nats_transport.py; the simulator: its bus)

Both modes keep at most ``max_inflight`` (default S) micro-batches in the pipeline. The last
stage's ``MicroBatchDone`` frees a slot and carries the first tokens of finished requests, which
are answered once every stage reported that micro-batch (its deadline bounds the wait); a
request's pins and reservations are released once no micro-batch holding one of its chunks is
in flight.

Delivery across NATS reconnects: plans carry this scheduler's ``epoch`` and consecutive ids and
stay in a ``PlanLedger`` until every stage reported them done. Stages ask for plans they missed
(``{p}.plan.resend``); after a reconnect the scheduler republishes the outstanding plans and
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
from collections.abc import Callable

from wavepp.api.messages import (
    DoneResend,
    MicroBatchDone,
    PlanResend,
    PlanResendReply,
    StageResync,
)
from wavepp.runtime.agreement import AgreementController
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import ChunkPlanner
from wavepp.runtime.request import PromptRequest, RequestOutcome
from wavepp.runtime.scheduling import speculation
from wavepp.runtime.scheduling.admission import STRATEGIES, AdmissionStrategy
from wavepp.runtime.scheduling.core import RequestRecord, SchedulerCore
from wavepp.runtime.scheduling.stats import WaveStats
from wavepp.runtime.scheduling.transport import PlanTransport
from wavepp.telemetry.pipeline import ChunkInfo, PipelineTelemetry, tenant_of

log = logging.getLogger(__name__)

# A result held for a stage's late done asks that stage for it after this long (seconds).
HELD_PULL_DELAY_S = 0.25


class WaveScheduler:
    """Drives one pipeline: intake, admission, planning, publishing plans, collecting results.

    Args:
        config: the replica's RuntimeConfig.
        transport: plans out, done messages in (``NatsPlanTransport``, or the simulator's).
        controller: the agreement controller (agreement over the stages' KV clients).
        planner: the chunk planner.
        on_outcome: called with each request's outcome, once.
        on_stage_done: called once per (micro-batch, stage) with the chunks' request ids.
        first_microbatch_id: the first plan's id.
        stats: where micro-batch statistics accumulate (default: a WaveStats of the default
            window).
        host_overhead_s: the least host time before each plan's publish, seconds.
        admission: the admission strategy's class, built from this scheduler (default: the
            one ``config.resolved_agreement`` selects in ``STRATEGIES``).
    """

    def __init__(
        self,
        config: RuntimeConfig,
        transport: PlanTransport,
        controller: AgreementController,
        planner: ChunkPlanner,
        *,
        on_outcome: Callable[[RequestOutcome], None] | None = None,
        on_stage_done: Callable[[MicroBatchDone, list[str]], None] | None = None,
        first_microbatch_id: int = 0,
        stats: WaveStats | None = None,
        host_overhead_s: float = 0.0,
        admission: type[AdmissionStrategy] | None = None,
    ) -> None:
        self.config = config
        self.transport = transport
        self.controller = controller
        self.on_outcome = on_outcome
        self.on_stage_done = on_stage_done
        self.num_stages = config.num_stages
        self.core = SchedulerCore(
            config,
            planner,
            block_hashes=controller.block_hashes,
            first_microbatch_id=first_microbatch_id,
            state_interval_blocks=getattr(controller, "state_interval_blocks", 1),
            stats=stats,
            bus_key=controller.bus_key,
        )
        self.intake: asyncio.Queue[RequestRecord] = asyncio.Queue()
        # Recovery counters (a NATS reconnect): plans resent or republished to stages, done
        # messages recovered from stages; admitted requests sent back to admission by a re-form.
        self.num_plans_resent = 0
        self.num_dones_recovered = 0
        self.num_readmitted = 0
        self.telemetry = PipelineTelemetry(
            config.pipeline,
            self.num_stages,
            self.core.stats,
            lambda: {"intake": self.intake.qsize(), "prepared": self.admission.num_prepared()},
            bus_key=self.core.bus_key,
        )
        make_admission = admission or STRATEGIES[config.resolved_agreement]
        self.admission: AdmissionStrategy = make_admission(self)
        self._slot_freed = asyncio.Event()
        self._plans_open = asyncio.Event()  # cleared while the replica re-forms
        self._plans_open.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()  # done pulls, release retries
        # NOTE: the least host time before each plan's publish, on the critical path: the
        # caller's model of this scheduler's own cost (the simulator, where CPU is free), and
        # at least the strategy's floor (``AdmissionStrategy.host_floor_s``: in sync mode
        # TRT-LLM's host loop, BaselineConfig.iteration_overhead_s). Sync
        # counts from the free slot (its agreement is TRT-LLM's fetch and prepare_resources), or
        # from the request's arrival when its loop had nothing to run; wave from the end of
        # gather (its agreements ran ahead, off the critical path).
        self._host_floor_s = max(host_overhead_s, self.admission.host_floor_s())

    # ---- public views --------------------------------------------------------------------

    @property
    def stats(self) -> WaveStats:
        """The live statistics (the telemetry reads this object; see ``reset_stats``)."""
        return self.core.stats

    def reset_stats(self) -> None:
        """Start a new measured window (e.g. after warm-up), in place: metrics follow."""
        self.core.stats.reset()

    @property
    def is_serving(self) -> bool:
        """``start`` ran and ``stop`` did not."""
        return bool(self._tasks)

    @property
    def epoch(self) -> str:
        return self.core.epoch

    @property
    def next_microbatch_id(self) -> int:
        return self.core.next_microbatch_id

    @property
    def num_agreement_retries(self) -> int:
        """Agreements retried after a stage did not answer."""
        return self.admission.num_agreement_retries

    @property
    def num_prefix_waits(self) -> int:
        """Admissions that waited for a live request computing their prefix."""
        return self.admission.num_prefix_waits

    def speculation_discarded(self) -> None:
        """Count one dropped speculative plan: in the stats and the exported counter
        (``wavepp_speculations_discarded_total``); every drop, here or in the strategy,
        counts through this."""
        self.core.stats.num_speculations_discarded += 1
        self.telemetry.speculation_discarded()

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        await self.transport.start(self)
        await self.telemetry.start(self.transport, self.config.subject_prefix)
        self._tasks.extend(self.admission.start())
        self._tasks.append(asyncio.create_task(self._scheduling_loop(), name="scheduling"))
        self._tasks.append(asyncio.create_task(self._renew_loop(), name="renew"))
        self._tasks.append(asyncio.create_task(self._deadline_loop(), name="deadline"))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self.admission.tasks(), *self._background]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        await self.transport.close()
        await self.telemetry.close()

    def pause_plans(self) -> None:
        """Publish no micro-batch plan until :meth:`resume_plans` (the stages re-form).

        Plans are core NATS: one published while only some restarted stages have subscribed
        reaches a subset of them, and their activation streams desynchronise for good.
        Admission, deadlines and results go on meanwhile.
        """
        self._plans_open.clear()

    def reopen_plans(self) -> None:
        """Publish plans again after a pause in which the stages did not change (their plans
        in flight and the ledger stand); after a re-form use :meth:`resume_plans`."""
        self._plans_open.set()

    def resume_plans(self, *, readmit: bool = True) -> None:
        """Publish plans again (every stage subscribed); see :meth:`pause_plans`.

        The outstanding plans are forgotten (no resend to the new stages: the stages that held
        their requests are gone). With ``readmit`` (after a re-form: the new stages hold no
        KV state of anything admitted before), every admitted request not yet answered goes
        back to admission and is agreed and computed again on the new stages; its
        micro-batches in flight are forgotten, not failed. Requests already failed by the
        deadline stay failed (they were answered); one answered while its micro-batches were
        in flight (withdrawn, failed by a stage) leaves with them. The agreement controller
        renews the leases of neither.
        """
        if readmit:
            answered = [rid for rid, record in self.core.live.items() if record.status.is_finished]
            records = self.core.reform(self.admission.take_queued())
            self.controller.forget([*answered, *(record.request_id for record in records)])
            for record in records:
                self.intake.put_nowait(record)
            self.num_readmitted += len(records)
            if records:
                log.warning("re-form: %d admitted requests go back to admission", len(records))
            self._slot_freed.set()
            self.deliver_finished()  # results that waited for a stage's done (core.reform)
            self.admission.reopen()
        self.core.ledger.clear()
        self._plans_open.set()

    async def submit(self, request: PromptRequest) -> RequestOutcome:
        """Queue a request and wait for its outcome (never raises for request errors)."""
        future: asyncio.Future[RequestOutcome] = asyncio.get_running_loop().create_future()
        self.telemetry.request_arrived(
            request.request_id,
            request.arrival_s,
            request.num_tokens,
            tenant_of(getattr(request, "tenant", ""), request.cache_salt),
            traceparent=request.traceparent,
        )
        self.intake.put_nowait(self.core.add_request(request, future))
        return await future

    def withdraw(self, request_id: str) -> bool:
        """The caller gave up on ``request_id``: ``SchedulerCore.withdraw`` (its contract). Its
        submitter is answered with the withdrawal before this returns; when nothing of it is
        in flight it is released on every stage now (in the background), else by the last
        stage's report of its last micro-batch in flight.

        Returns:
            True if the request was withdrawn; False if unknown, finished, or fully planned.
        """
        if not self.core.withdraw(request_id):
            return False
        self.deliver_finished()
        releasable = self.core.take_releasable()
        if releasable:
            self._in_background(self._release_and_wake(releasable))
        return True

    def deliver_finished(self) -> None:
        """Tell the callers of every request the core answered since the last call."""
        for record in self.core.take_finished():
            outcome = record.outcome
            assert outcome is not None, f"{record.request_id}: finished without an outcome"
            self.telemetry.completed(
                outcome.request_id,
                ttft_s=outcome.ttft_s,
                finished_s=outcome.finished_s,
                error=outcome.error,
            )
            if self.on_outcome is not None:
                self.on_outcome(outcome)
            if not record.waiter.done():
                record.waiter.set_result(outcome)

    # ---- planning and publishing ---------------------------------------------------------

    async def _scheduling_loop(self) -> None:
        core = self.core
        loop = asyncio.get_running_loop()
        while True:
            while not core.has_free_slot():
                self._slot_freed.clear()
                await self._slot_freed.wait()
            started_s = loop.time()
            await self.admission.gather()
            await self._plans_open.wait()
            # A micro-batch planned while its agreements were under way (speculation.py): the
            # plan if every reply matched its prediction, its host time counted from when it
            # was planned; else dropped, and planned now as without it.
            spec = self.admission.take_speculation()
            if spec is not None and not speculation.holds(core, spec):
                self.speculation_discarded()
                spec = None
            slept_s = 0.0
            host_started_s = time.perf_counter()
            idle_wake_s = self.admission.take_idle_wake_s()
            if self._host_floor_s > 0 and any(core.is_plannable(r) for r in core.active):
                if self.config.mode != "sync":
                    started_s = spec.started_s if spec is not None else loop.time()
                elif idle_wake_s is not None:  # the baseline's loop waited for a request
                    started_s = max(started_s, idle_wake_s)
                slept_s = await self._host_time(started_s)
            scheduled = None
            if spec is not None:
                scheduled = speculation.schedule_speculated(core, spec)
                if scheduled is None:  # something changed during the host time: plan again
                    self.speculation_discarded()
                    slept_s += await self._host_time(loop.time())
                else:
                    self.stats.num_speculative_plans += 1
                    host_started_s -= spec.cpu_s
            if scheduled is None:
                scheduled = core.schedule(
                    more_work_queued=self.admission.more_work_queued(),
                    planning_started_s=time.time(),
                )
            if scheduled is None:
                if core.active and core.planner.one_chunk_inflight and core.num_inflight:
                    # Every request left has a chunk in flight: wait for one to come back
                    # (or for the next host iteration, which may find new requests).
                    self._slot_freed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            self._slot_freed.wait(), max(self._host_floor_s, 1e-3)
                        )
                elif core.active:
                    await asyncio.sleep(0)
                continue
            await self.admission.microbatch_published()
            traceparent, headers = self.telemetry.microbatch_published(
                scheduled.microbatch_id,
                [
                    ChunkInfo(c.request_id, c.chunk_index, c.num_tokens, c.context_offset)
                    for c in scheduled.chunks
                ],
                scheduled.planning_started_s,
                scheduled.published_s,
            )
            plan, data = core.encoded_plan_of(scheduled, traceparent)
            await self.transport.publish_plan(plan, headers, data)
            self.stats.record_host_time(time.perf_counter() - host_started_s - slept_s)

    async def _host_time(self, started_s: float) -> float:
        """Sleep what is left of the host-time floor counted from ``started_s`` (event-loop
        time); the wall seconds slept."""
        host_s = self._host_floor_s - (asyncio.get_running_loop().time() - started_s)
        if host_s <= 0:
            return 0.0
        before_s = time.perf_counter()
        await asyncio.sleep(host_s)
        return time.perf_counter() - before_s

    # ---- completion (PlanHandlers) -------------------------------------------------------

    async def on_done(self, done: MicroBatchDone) -> None:
        """Apply one stage's done message, once per (micro-batch, stage)."""
        update = self.core.update_from_done(done)
        if not update.counted:
            return
        if update.missing:
            self._pull_dones_soon(done.rank, update.missing)
        if update.held:
            self._in_background(self._pull_held(done.microbatch_id))
        if self.on_stage_done is not None:
            self.on_stage_done(done, update.owners)
        self.telemetry.stage_done(done)
        if update.slot_freed:
            self._slot_freed.set()
        self.deliver_finished()
        if update.to_release:
            await self._release_and_wake(update.to_release)

    async def _deadline_loop(self) -> None:
        """Every quarter deadline (at most 1 s), expire the micro-batches past their deadline."""
        while True:
            await asyncio.sleep(min(1.0, self.config.microbatch_deadline_s / 4))
            for microbatch_id in self.core.overdue():
                to_release = self.core.expire(microbatch_id)
                self._slot_freed.set()
                self.deliver_finished()
                if to_release:
                    await self._release_and_wake(to_release)

    async def _release_and_wake(self, request_ids: list[str]) -> None:
        """Release finished (or failed) requests, then wake the admissions waiting for their
        prefix or for the capacity they held."""
        await self._release(request_ids)
        self.core.released(request_ids)
        await self.admission.released()

    async def _release(self, request_ids: list[str]) -> None:
        """Release on every stage; if a stage does not answer (its reply lost in a reconnect, a
        dead stage), retry in the background for up to ``lease_s``, after which leases free
        the pins anyway. Release is idempotent; a request id live again is not retried."""
        try:
            await self.controller.release(request_ids)
        except Exception as exc:  # noqa: BLE001
            log.warning("release of %s failed (%r); retrying", request_ids, exc)
            self._in_background(self._retry_release(request_ids))

    async def _retry_release(self, request_ids: list[str]) -> None:
        deadline = time.monotonic() + self.config.lease_s
        delay_s = 0.2
        while time.monotonic() < deadline:
            await asyncio.sleep(delay_s)
            ids = [r for r in request_ids if not self.core.is_live(r)]
            if not ids:
                return
            try:
                await self.controller.release(ids)
                return
            except Exception as exc:  # noqa: BLE001
                log.warning("release of %s failed again (%r)", ids, exc)
            delay_s = min(2.0, 2 * delay_s)

    def _in_background(self, coro) -> None:  # noqa: ANN001 - a coroutine
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- gap-free delivery across reconnects (PlanHandlers) ------------------------------

    def on_plan_resend(self, ask: PlanResend) -> PlanResendReply:
        """The plans a stage missed (none from another epoch)."""
        core = self.core
        plans = (
            [plan for _, plan in core.ledger.resend(ask.from_id, ask.to_id)]
            if ask.epoch == core.epoch
            else []
        )
        if plans:
            log.warning(
                "resending plans %s to stage %d", [p.microbatch_id for p in plans], ask.rank
            )
        self.num_plans_resent += len(plans)
        reply = PlanResendReply(epoch=core.epoch, next_id=core.next_microbatch_id, plans=plans)
        return reply if core.bus_key is None else core.bus_key.sign(reply)

    def on_resync(self, notice: StageResync) -> None:
        if 0 <= notice.rank < self.num_stages:
            self._pull_dones_soon(notice.rank, self.core.ledger.unreported(notice.rank))

    async def on_reconnected(self) -> None:
        """Republish the outstanding plans (stages drop the ones they have) and ask every stage
        for the done messages this side has not seen."""
        for _, plan in self.core.ledger.resend(0):
            await self.transport.publish_plan(plan, None)
            self.num_plans_resent += 1
        for rank in range(self.num_stages):
            self._pull_dones_soon(rank, self.core.ledger.unreported(rank))

    async def _pull_held(self, microbatch_id: int) -> None:
        """A result waits for a stage's done that has not come: after HELD_PULL_DELAY_S (a
        done normally follows within milliseconds) ask each stage still missing for it, so a
        done lost in a quiet moment costs that delay, not the micro-batch deadline."""
        await asyncio.sleep(HELD_PULL_DELAY_S)
        for rank in range(self.num_stages):
            if self.core.ledger.report_pending(microbatch_id, rank):
                await self._pull_dones(rank, [microbatch_id])

    def _pull_dones_soon(self, rank: int, microbatch_ids: list[int]) -> None:
        if microbatch_ids:
            self._in_background(self._pull_dones(rank, microbatch_ids))

    async def _pull_dones(self, rank: int, microbatch_ids: list[int]) -> None:
        ask = DoneResend(epoch=self.core.epoch, microbatch_ids=microbatch_ids[:4096])
        try:
            reply = await self.transport.request_dones(
                rank, ask, min(2.0, self.config.request_timeout_s)
            )
        except Exception as exc:  # noqa: BLE001 - it resyncs when it reconnects
            log.warning("done resend from stage %d failed: %r", rank, exc)
            return
        for done in reply.dones:
            if done.rank == rank and self.core.ledger.report_pending(done.microbatch_id, rank):
                self.num_dones_recovered += 1
                await self.on_done(done)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            try:
                await self.controller.renew_leases()
            except Exception as exc:
                log.warning("lease renewal failed: %s", exc)
