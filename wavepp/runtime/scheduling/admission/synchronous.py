"""``SyncAdmission``: the baseline's strategy, mirroring TensorRT-LLM's ``_executor_loop_pp``::

scheduling loop, on the critical path: for each new request probe-reserve, retrying
until the reservation fits (head of line waits) --> planning set
"""

from __future__ import annotations

import asyncio
import contextlib

from wavepp.runtime.request import RequestStatus
from wavepp.runtime.scheduling.admission.contract import AdmissionHost, AdmissionStrategy
from wavepp.runtime.scheduling.core import RequestRecord
from wavepp.runtime.scheduling.speculation import Speculation


class SyncAdmission(AdmissionStrategy):
    """Agreement on the critical path, one request at a time (the baseline).

    TensorRT-LLM's PP loop: the first rank schedules; new requests get their KV resources on
    the critical path, one at a time. A request that does not fit is retried until it does;
    meanwhile the loop runs what it already has (never waits on blocks that only its own
    unscheduled requests hold).
    """

    def __init__(self, scheduler: AdmissionHost) -> None:
        super().__init__(scheduler)
        self._head: RequestRecord | None = None  # the request being agreed, refused so far
        self._head_refusals = 0
        self._idle_wake_s: float | None = None

    def start(self) -> list[asyncio.Task[None]]:
        return []  # it agrees inside gather, on the scheduling loop

    def tasks(self) -> list[asyncio.Task[None]]:
        return []

    def more_work_queued(self) -> bool:
        return False  # gather takes from the intake itself; nothing sits in between

    def take_queued(self) -> list[RequestRecord]:
        return []  # an admitted record enters the planning set at once

    def num_prepared(self) -> int:
        return 0

    def reopen(self) -> None:
        return None  # gather never closes

    async def released(self) -> None:
        await self._capacity_released()

    async def microbatch_published(self) -> None:
        return None

    def take_speculation(self) -> Speculation | None:
        return None  # it agrees on the critical path: nothing to plan ahead

    def take_idle_wake_s(self) -> float | None:
        wake_s, self._idle_wake_s = self._idle_wake_s, None
        return wake_s

    async def gather(self) -> None:
        core = self.core
        intake = self.scheduler.intake
        # NOTE: fills to chunk_tokens of what the static budget charges for the requests the
        # planner may cut now (the baseline switches: budget accounting, one chunk in flight).
        while core.plannable_budget_tokens() < self.config.chunk_tokens:
            if self._head is None:
                if core.active and intake.empty():
                    return
                idle = not core.active and intake.empty()
                self._head = await intake.get()
                if self._head.status.is_finished:  # withdrawn while it queued
                    self._head = None
                    continue
                if idle:
                    # NOTE: TensorRT-LLM's loop with nothing to run blocks in
                    # _fetch_new_requests; its host stages (the broadcast to the ranks,
                    # scheduling, prepare_resources, _prepare_inputs) run once the request is in
                    # hand, so the iteration's host time counts from here (docs/bench/baseline.md)
                    self._idle_wake_s = asyncio.get_running_loop().time()
                self._head.status = RequestStatus.AGREEING
                self._head_refusals = 0
            record = self._head
            request = record.request
            if record.status.is_finished:  # withdrawn while it waited for capacity
                self._head = None
                continue
            generation = self._capacity_generation
            try:
                with self.telemetry.request_context(request.request_id):
                    ticket = await self.controller.agree(request)
            except Exception as exc:
                self._head = None
                self._agreement_failed(record, exc)
                continue
            if record.status.is_finished:  # withdrawn while it agreed: free what it holds
                self._head = None
                with contextlib.suppress(Exception):  # else the stages' leases expire
                    await self.controller.release([request.request_id])
                continue
            if ticket is None:
                self._head_refusals += 1
                if core.active:
                    return
                await self._wait_for_capacity(generation)
                continue
            self._head = None
            ticket.num_refusals = self._head_refusals
            self._admitted(record, ticket)
            core.activate([record])
