"""What the scheduler core and its driver hand each other: a request's record, a scheduled
micro-batch (chunks decided, not yet a plan), and what one stage's done message meant."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wavepp.api.messages import PlannedChunk
from wavepp.runtime.agreement import Ticket
from wavepp.runtime.planning import Chunk, RequestProgress
from wavepp.runtime.request import PromptRequest, RequestOutcome, RequestStatus


@dataclass(eq=False)
class RequestRecord:
    """One request on one scheduler: the only place its state lives.

    ``waiter`` is the caller's handle (the driver's future), handed back untouched with the
    outcome. ``ticket`` and ``progress`` exist from admission on. ``num_inflight_microbatches``:
    published micro-batches holding a chunk of it that the last stage has not reported.
    ``work_s``: its whole chunk work on the slowest stage (``ChunkPlanner.request_work_s``),
    fixed at admission (the closed-loop target sums it every micro-batch).
    """

    request: PromptRequest
    waiter: Any
    status: RequestStatus = RequestStatus.WAITING
    outcome: RequestOutcome | None = None
    ticket: Ticket | None = None
    progress: RequestProgress | None = None
    num_inflight_microbatches: int = 0
    work_s: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_unplanned_tokens(self) -> int:
        """New tokens admitted but not yet planned into a micro-batch."""
        if self.progress is None:
            return 0
        return self.progress.num_prompt_tokens - self.progress.num_computed_tokens


@dataclass
class ScheduledMicroBatch:
    """What ``schedule`` decided: the chunks of the next micro-batch, not yet a plan."""

    microbatch_id: int
    chunks: list[Chunk]
    planning_started_s: float
    published_s: float
    planned: list[PlannedChunk] = field(default_factory=list)


@dataclass
class DoneUpdate:
    """What one stage's done message meant. ``counted`` False: a duplicate or stale one."""

    counted: bool = False
    owners: list[str] = field(default_factory=list)  # request id of each chunk, plan order
    missing: list[int] = field(default_factory=list)  # this rank's earlier dones not seen
    slot_freed: bool = False  # the last stage reported: one micro-batch fewer in flight
    held: bool = False  # results of this micro-batch wait for a stage that has not reported
    to_release: list[str] = field(default_factory=list)
