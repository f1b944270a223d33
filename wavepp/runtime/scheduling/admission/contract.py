"""The admission contract: what ``WaveScheduler`` calls on its strategy, and what it offers one.

``AdmissionStrategy``'s abstract methods are every call the scheduler makes; its two
overridable methods (``host_floor_s``, ``agrees_in_lockstep``) are how the loop and the
simulator pace the strategy, by default the baseline's switches as the config resolves them
(``RuntimeConfig.resolved_baseline``: all off in wave mode). The concrete helpers (the capacity
signal a release raises, ``_admitted``, ``_fail``) are shared by the implementations;
``_admitted`` applies the baseline's ``prefix_reuse`` switch (off: the agreed prefix is 0 blocks).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Protocol

from wavepp.runtime.agreement import (
    AgreementController,
    AgreementRefused,
    StageUnavailableError,
    Ticket,
)
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.scheduling.core import RequestRecord, SchedulerCore
from wavepp.runtime.scheduling.speculation import Speculation
from wavepp.telemetry.pipeline import PipelineTelemetry


class AdmissionHost(Protocol):
    """What a strategy needs of its scheduler (``WaveScheduler``)."""

    config: RuntimeConfig
    core: SchedulerCore
    controller: AgreementController
    telemetry: PipelineTelemetry
    intake: asyncio.Queue[RequestRecord]

    def deliver_finished(self) -> None:
        """Tell the callers of the requests the core answered."""
        ...

    def speculation_discarded(self) -> None:
        """Count one dropped speculative plan."""
        ...


class AdmissionStrategy(ABC):
    """How requests get from the scheduler's intake into the core's planning set.

    The abstract methods are every call ``WaveScheduler`` makes on its strategy. A strategy
    takes records from ``scheduler.intake``, agrees on each (``scheduler.controller.agree``),
    hands the admitted ones to ``scheduler.core`` (``admitted`` then ``activate``, or
    ``fail`` + ``scheduler.deliver_finished`` for a refused one) and must never touch the
    transport. ``host_floor_s`` and ``agrees_in_lockstep`` have defaults a strategy may
    override. The concrete helpers (the capacity signal a release raises, ``_admitted``,
    ``_fail``) are shared by the implementations; a strategy may use or ignore them.

    Attributes:
        num_agreement_retries: agreements retried after a stage did not answer.
        num_prefix_waits: admissions that waited for a live request computing their prefix.
    """

    def __init__(self, scheduler: AdmissionHost) -> None:
        self.scheduler = scheduler
        self.core = scheduler.core
        self.config = scheduler.config
        self.controller = scheduler.controller
        self.telemetry = scheduler.telemetry
        self.num_agreement_retries = 0
        self.num_prefix_waits = 0
        self._capacity_generation = 0
        self._capacity_changed = asyncio.Condition()

    # ---- the contract (what the scheduler calls) ------------------------------------------

    @abstractmethod
    def start(self) -> list[asyncio.Task[None]]:
        """Start the strategy's background tasks; returns them (the scheduler cancels them
        at stop)."""

    @abstractmethod
    def tasks(self) -> list[asyncio.Task[None]]:
        """Tasks under way now (cancelled at stop)."""

    @abstractmethod
    async def gather(self) -> None:
        """Called by the scheduling loop once a pipeline slot is free: move admitted requests
        into the core's planning set (``core.activate``), waiting as the strategy sees fit.
        Returning with nothing plannable is allowed (the loop calls again)."""

    @abstractmethod
    def more_work_queued(self) -> bool:
        """Requests on their way to the planning set that the planner should wait for."""

    @abstractmethod
    def take_queued(self) -> list[RequestRecord]:
        """Admitted records not yet in the planning set, in order, removed from the strategy
        (a re-form re-admits them)."""

    @abstractmethod
    def num_prepared(self) -> int:
        """Admitted records waiting to enter the planning set (a telemetry gauge)."""

    @abstractmethod
    def reopen(self) -> None:
        """A re-form ended: admit again."""

    @abstractmethod
    async def released(self) -> None:
        """Requests released their pins and reservations: wake what waits on capacity or on a
        prefix owner."""

    @abstractmethod
    async def microbatch_published(self) -> None:
        """A plan went out (the admission lookahead has room again)."""

    @abstractmethod
    def take_speculation(self) -> Speculation | None:
        """The micro-batch planned speculatively during the last ``gather``, if any (handed over
        once)."""

    @abstractmethod
    def take_idle_wake_s(self) -> float | None:
        """Event-loop time at which the last ``gather`` got a request after waiting with
        nothing to plan, if it did and the strategy counts host time from then (handed over
        once; ``SyncAdmission``)."""

    # ---- pacing (overridable; the baseline's switches by default) --------------------------

    def host_floor_s(self) -> float:
        """The least host time, seconds, the scheduling loop spends before each plan's publish
        on this strategy's behalf: TensorRT-LLM's host loop
        (``BaselineConfig.iteration_overhead_s``) when the config runs the baseline, else 0.
        The loop tops it up to the caller's own floor, never adds to it."""
        return self.config.resolved_baseline.iteration_overhead_s

    @classmethod
    def agrees_in_lockstep(cls, config: RuntimeConfig) -> bool:
        """Whether the simulator models this strategy's agreement as TensorRT-LLM's ranks in
        lockstep: no KV round trips, every stage given the smallest stage's pool
        (``BaselineConfig.lockstep_admission`` when ``config`` runs the baseline). Asked before
        the strategy exists (the stages are built first); the real runtime agrees over NATS
        whatever this says."""
        return config.resolved_baseline.lockstep_admission

    # ---- shared helpers -------------------------------------------------------------------

    async def _capacity_released(self) -> None:
        """Wake what waits in ``_wait_for_capacity``."""
        async with self._capacity_changed:
            self._capacity_generation += 1
            self._capacity_changed.notify_all()

    async def _wait_for_capacity(self, generation: int) -> None:
        async with self._capacity_changed:
            if generation == self._capacity_generation and self.core.num_inflight:
                await self._capacity_changed.wait()
                return
        # Nothing in flight will free blocks: only lease expiry can. Back off.
        await asyncio.sleep(0.05)

    def _fail(self, record: RequestRecord, error: str, *, is_retryable: bool = False) -> None:
        self.core.fail(record, error, is_retryable=is_retryable)
        self.scheduler.deliver_finished()

    def _agreement_failed(self, record: RequestRecord, exc: Exception) -> None:
        """Answer ``record`` for its failed agreement (call it in the ``except`` clause): a
        refusal's own message; any other error logged and answered as ``agreement failed``,
        retryable when a stage did not answer. Nothing when it was withdrawn meanwhile
        (answered already)."""
        if record.status.is_finished:
            return
        if isinstance(exc, AgreementRefused):
            self._fail(record, str(exc))
            return
        logging.getLogger(type(self).__module__).exception(
            "agreement for %s failed", record.request.request_id
        )
        self._fail(
            record,
            f"agreement failed: {exc}",
            is_retryable=isinstance(exc, StageUnavailableError),
        )

    def _admitted(self, record: RequestRecord, ticket: Ticket) -> None:
        if not self.config.resolved_baseline.prefix_reuse and ticket.num_agreed_blocks:
            # The baseline without block reuse: L* = 0, every stage computes the whole prompt
            # (a stage whose hit exceeds L* recomputes and keeps its cached blocks as they are).
            ticket = replace(ticket, num_agreed_blocks=0)
        request = record.request
        self.telemetry.admitted(
            request.request_id,
            num_prompt_tokens=request.num_tokens,
            num_cached_tokens=ticket.num_cached_tokens,
            agreement_s=ticket.agreement_s,
            num_refusals=ticket.num_refusals,
        )
        self.core.admitted(record, ticket)
