"""``AsyncAdmission``: WavePP's strategy, agreements concurrent with execution::

intake --> admission tasks (<= max_agreements_in_flight, concurrent with execution;
           lookahead-bounded; optionally waiting for a live request computing its prefix)
           probe-reserve ---> prepared queue (bounded, max_prepared) --> planning set
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from wavepp.runtime.agreement import StageUnavailableError, Ticket
from wavepp.runtime.request import RequestStatus
from wavepp.runtime.scheduling import speculation
from wavepp.runtime.scheduling.admission.contract import AdmissionHost, AdmissionStrategy
from wavepp.runtime.scheduling.core import RequestRecord
from wavepp.runtime.scheduling.speculation import Speculation
from wavepp.telemetry import tracing

log = logging.getLogger(__name__)

# Wave mode: an under-full micro-batch waits at most this fraction of the planner's target
# micro-batch cost for requests still before their agreement (see AsyncAdmission.gather).
UNDERFULL_WAIT_FRACTION = 0.05


class AsyncAdmission(AdmissionStrategy):
    """Agreements run concurrently with execution, off the critical path (wave mode)."""

    def __init__(self, scheduler: AdmissionHost) -> None:
        super().__init__(scheduler)
        self.prepared: asyncio.Queue[RequestRecord] = asyncio.Queue(
            maxsize=self.config.max_prepared
        )
        self._admissions: set[asyncio.Task[None]] = set()
        self._agreements = asyncio.Semaphore(self.config.max_agreements_in_flight)
        self._retry_lock = asyncio.Lock()
        self._open = asyncio.Event()  # cleared while a refused request waits for capacity
        self._open.set()
        self._prefixes_changed = asyncio.Condition()
        self._lookahead_changed = asyncio.Condition()
        self._agreeing_tokens = 0
        # Agreements whose RPC is under way or that succeeded and are not in `prepared` yet;
        # an under-full micro-batch waits for them (see gather).
        self._num_agreeing = 0
        self._agreeing_changed = asyncio.Event()
        self._target_cost_s = scheduler.core.planner.target_cost_s()
        # Speculative planning (speculation.py): the records whose agreement RPC is under way,
        # an event set when one starts or ends, and the plan made from their predicted L*.
        self._speculative = self.config.resolved_speculative_planning
        self._agreeing_records: dict[str, RequestRecord] = {}
        self._agreements_moved = asyncio.Event()
        self.speculation: Speculation | None = None

    def start(self) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self._admission_loop(), name="admission")]

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._admissions)

    def more_work_queued(self) -> bool:
        """Requests in the intake, or admission tasks not yet in ``prepared`` (agreeing,
        waiting for a prefix owner or for capacity)."""
        return not self.scheduler.intake.empty() or any(not t.done() for t in self._admissions)

    def take_queued(self) -> list[RequestRecord]:
        """Everything admitted and waiting in ``prepared``, in order (without waiting)."""
        taken = []
        while True:
            try:
                taken.append(self.prepared.get_nowait())
            except asyncio.QueueEmpty:
                return taken

    def num_prepared(self) -> int:
        return self.prepared.qsize()

    def reopen(self) -> None:
        self._open.set()

    def take_speculation(self) -> Speculation | None:
        spec, self.speculation = self.speculation, None
        return spec

    def take_idle_wake_s(self) -> float | None:
        return None  # host time counts from the end of gather (agreements ran ahead)

    async def released(self) -> None:
        # a request released before it was fully planned (withdrawn, failed) no longer counts
        # its unplanned tokens against the lookahead
        await _notify(self._lookahead_changed)
        if self.config.resolved_prefix_wait:
            await _notify(self._prefixes_changed)
        await self._capacity_released()
        self._open.set()

    async def microbatch_published(self) -> None:
        await _notify(self._lookahead_changed)

    # ---- intake -> admission tasks --------------------------------------------------------

    async def _admission_loop(self) -> None:
        intake = self.scheduler.intake
        while True:
            record = await intake.get()
            await self._open.wait()
            await self._wait_for_lookahead_room()
            if record.status.is_finished:  # withdrawn while it queued (core.withdraw)
                continue
            num_new_tokens = self._estimated_new_tokens(record)
            self._agreeing_tokens += num_new_tokens
            record.status = RequestStatus.AGREEING
            task = asyncio.create_task(self._admit(record, num_new_tokens))
            self._admissions.add(task)
            task.add_done_callback(self._admissions.discard)

    def _estimated_new_tokens(self, record: RequestRecord) -> int:
        """What an agreeing request counts against the lookahead (a budget of new tokens):
        its prompt less the leading blocks live requests hold pinned (cached on every stage),
        so requests sharing a cached prefix do not exhaust the budget with tokens nobody
        computes. At least 1.
        """
        request = record.request
        try:
            hashes = self.controller.block_hashes(request)
        except ValueError:
            return request.num_tokens  # a bad prompt fails in the agreement with its own error
        num_cached = self.core.num_pinned_prefix_blocks(hashes) * self.config.block_size
        return max(1, request.num_tokens - num_cached)

    async def _wait_for_lookahead_room(self) -> None:
        budget = self.config.resolved_admission_lookahead_tokens
        async with self._lookahead_changed:
            while self.core.unplanned_tokens() + self._agreeing_tokens >= budget:
                await self._lookahead_changed.wait()

    async def _admit(self, record: RequestRecord, num_new_tokens: int) -> None:
        request = record.request
        if self.config.resolved_prefix_wait:
            await self._wait_for_prefix_owner(record)
        admitted = False
        await self._agreements.acquire()
        try:
            admitted = await self._agree(record)
            if admitted:
                try:
                    await self.prepared.put(record)
                finally:
                    self._agreement_ended(record)
        finally:
            self._agreements.release()
            self._agreeing_tokens -= num_new_tokens
            await _notify(self._lookahead_changed)
            if self.config.resolved_prefix_wait:
                if not admitted:
                    self.core.inflight_prefixes.remove(request.request_id)
                await _notify(self._prefixes_changed)

    async def _agree(self, record: RequestRecord) -> bool:
        """Agree and admit; False when the request failed or was withdrawn (answered
        already). A reservation made for a request withdrawn while it agreed is released."""
        if record.status.is_finished:  # withdrawn while it waited for a prefix or its turn
            return False
        if self.core.reject_if_live(record):
            self.scheduler.deliver_finished()
            return False
        request = record.request
        try:
            with self.telemetry.request_context(request.request_id):
                ticket = await self._agree_until_admitted(record)
        except Exception as exc:
            self._agreement_failed(record, exc)
            return False
        if ticket is None:  # withdrawn while it waited for capacity (refused: holds nothing)
            return False
        if record.status.is_finished:  # withdrawn while it agreed: free what the ticket holds
            self._agreement_ended(record)
            with contextlib.suppress(Exception):  # else the stages' leases expire
                await self.controller.release([request.request_id])
            return False
        self._admitted(record, ticket)
        return True

    async def _agree_until_admitted(self, record: RequestRecord) -> Ticket | None:
        """Agree; on refusal wait until some request releases blocks, then retry.

        Refused requests retry one at a time, in order (a FIFO lock), and no new agreement
        starts while one waits: backpressure instead of rounds of probe-reserve/release that
        cannot fit; new agreements start again once it leaves the wait (admitted, withdrawn,
        or failed by a retry's error). None: the request was withdrawn while it waited.
        """
        ticket = await self._agree_through_outages(record)
        if ticket is not None:
            return ticket
        num_refusals = 1
        async with self._retry_lock:
            try:
                while True:
                    self._open.clear()
                    generation = self._capacity_generation
                    with tracing.span("reservation.wait", **{"reservation.refusals": num_refusals}):
                        await self._wait_for_capacity(generation)
                    if record.status.is_finished:  # withdrawn (core.withdraw)
                        return None
                    ticket = await self._agree_through_outages(record)
                    if ticket is not None:
                        ticket.num_refusals = num_refusals
                        return ticket
                    num_refusals += 1
            finally:
                self._open.set()

    async def _agree_through_outages(self, record: RequestRecord) -> Ticket | None:
        """``controller.agree``, retried while a stage does not answer (NATS reconnecting, a
        stage restarting), for ``agreement_retry_s``; each retry first releases what the failed
        attempt may have left (a probe-reserve is idempotent per request id).

        Raises:
            StageUnavailableError: a stage still did not answer when the retry time ran out,
                or the request was withdrawn (``SchedulerCore.withdraw``) meanwhile: it is not
                agreed again.
        """
        request = record.request
        deadline = time.monotonic() + self.config.agreement_retry_s
        delay_s = 0.1
        while True:
            self._num_agreeing += 1
            if self._speculative:
                self._agreeing_records[request.request_id] = record
                self._agreements_moved.set()
            try:
                ticket = await self.controller.agree(request)
            except BaseException as exc:
                self._agreement_ended(record)
                if not isinstance(exc, StageUnavailableError):
                    raise
                if time.monotonic() + delay_s > deadline:
                    raise
                log.warning("agreement for %s: %s; retrying", request.request_id, exc)
                self.num_agreement_retries += 1
                failure = exc
            else:
                if ticket is None:  # refused: the caller waits for capacity, not counted
                    self._agreement_ended(record)
                return ticket  # counted until it is in `prepared` (_admit)
            await asyncio.sleep(delay_s)
            delay_s = min(1.0, 2 * delay_s)
            with contextlib.suppress(Exception):
                await self.controller.release([request.request_id])
            if record.status.is_finished:  # withdrawn meanwhile: nobody waits for it any more
                raise failure

    def _agreement_ended(self, record: RequestRecord) -> None:
        self._num_agreeing -= 1
        self._agreeing_changed.set()
        if self._speculative:
            self._agreeing_records.pop(record.request_id, None)
            self._agreements_moved.set()
            spec = self.speculation
            if spec is not None and record.request_id in spec.predicted:
                ticket = record.ticket
                if ticket is None or ticket.num_agreed_blocks != spec.predicted[record.request_id]:
                    # Refused, failed, or another L*: the speculation is no plan; drop it now.
                    self.speculation = None
                    self.scheduler.speculation_discarded()

    def _maybe_speculate(self) -> None:
        """While ``gather`` waits for agreements: plan from their predicted L*
        (``speculation.speculate``), again whenever the requests to plan changed.

        Only when every record counted as agreeing still awaits its reply (none admitted and
        held up before ``prepared``) and nothing admitted waits in ``prepared``.
        """
        agreeing = list(self._agreeing_records.values())
        if not agreeing or not self.prepared.empty():
            return
        if len(agreeing) != self._num_agreeing or any(r.ticket is not None for r in agreeing):
            return
        core = self.core
        request_ids = {r.request_id for r in agreeing}
        request_ids.update(r.request_id for r in core.active if core.is_plannable(r))
        if self.speculation is not None and self.speculation.request_ids == request_ids:
            return
        # More work: what the scheduler would see once these are admitted (their own tasks
        # finished by then).
        num_running = sum(not task.done() for task in self._admissions)
        more_work_queued = not self.scheduler.intake.empty() or num_running > len(agreeing)
        self.speculation = speculation.speculate(
            core,
            agreeing,
            more_work_queued=more_work_queued,
            started_s=asyncio.get_running_loop().time(),
        )

    async def _wait_for_prefix_owner(self, record: RequestRecord) -> None:
        """Wait while a live request computes a large enough part of this prompt's prefix,
        then claim this prompt's blocks (until its agreement narrows the claim).

        "Large enough": waiting would spare at least one block and ``prefix_wait_min_fraction``
        of the prompt, so a short shared system prompt never serialises requests. Bounded by
        the lease. The check and the claim run without an await between them, so requests
        admitted in order see each other's claims in order.

        Neither the wait nor the claim covers the leading blocks a live request holds pinned
        as its agreed prefix (``SchedulerCore.num_pinned_prefix_blocks``): those are cached on
        every stage, nobody computes them (requests sharing a cached prefix would otherwise
        agree one after another, a round trip each).
        """
        request = record.request
        try:
            hashes = self.controller.block_hashes(request)
        except ValueError:
            return  # a bad prompt fails in the agreement with its own error
        prefixes = self.core.inflight_prefixes
        min_blocks = max(1, int(self.config.prefix_wait_min_fraction * len(hashes)))
        deadline = time.monotonic() + self.config.lease_s
        waited = False
        while True:
            owner, num_blocks = prefixes.deepest_overlap(hashes)
            num_spared = num_blocks - self.core.num_pinned_prefix_blocks(hashes)
            if owner is None or num_spared < min_blocks or time.monotonic() > deadline:
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
        prefixes.add(request.request_id, hashes[self.core.num_pinned_prefix_blocks(hashes) :])

    # ---- prepared -> planning set ---------------------------------------------------------

    async def gather(self) -> None:
        """Move admitted requests into the planning set; wait while it is under-full."""
        core = self.core
        self.speculation = None
        core.activate(self.take_queued())
        if not core.active:
            if self._speculative:
                # As prepared.get(), but awake when an agreement starts (to speculate): every
                # put into `prepared` is followed by _agreement_ended, which sets the event.
                while self.prepared.empty():
                    self._maybe_speculate()
                    self._agreements_moved.clear()
                    await self._agreements_moved.wait()
            else:
                core.activate([await self.prepared.get()])
            # NOTE: requests admitted together sit in `prepared` together; take them all before
            # judging the set under-full (else the first one alone looks like a sliver's worth
            # and the under-full wait sleeps to its deadline, or plans it alone).
            core.activate(self.take_queued())
        # An under-full micro-batch waits for work on its way: requests that finished
        # together are resubmitted together, and planning the first one admitted alone would
        # spend a pipeline slot on a sliver of work while the rest waits a whole micro-batch
        # for the next slot. It waits for agreements under way (an RPC: bounded), and for at
        # most UNDERFULL_WAIT_FRACTION x the target micro-batch cost for requests still before
        # their agreement (those may wait on capacity or a prefix owner that only this
        # micro-batch's requests can free, so an unbounded wait could deadlock). With the
        # closed-loop target it also waits that long for requests not submitted yet: the open
        # population says they are coming back (a finished micro-batch's requests return
        # together), and a slot spent on a sliver now costs a whole micro-batch of fill.
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while core.is_underfull():
            self._agreeing_changed.clear()
            if self._num_agreeing > 0:
                if self._speculative:
                    self._maybe_speculate()
                await self._agreeing_changed.wait()
            elif self.more_work_queued() or core.closed_loop_target_s() is not None:
                if deadline is None:
                    deadline = loop.time() + UNDERFULL_WAIT_FRACTION * self._target_cost_s
                if loop.time() >= deadline:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._agreeing_changed.wait(), deadline - loop.time())
            else:
                break
            core.activate(self.take_queued())


async def _notify(condition: asyncio.Condition) -> None:
    async with condition:
        condition.notify_all()
