"""Speculative planning: build the next plan while the agreement's round trip is under way.

At small C (C = S, MiniMax-M2.7 high reuse: docs/bench/simulator.md) stage 0 idles one return path
per round: the last stage's done, the successor's agreement (one round trip), the scheduler's
host time, the plan on the bus. The host time need not wait for the agreement's reply: the
planner needs only the agreed prefix L* of each request, and the scheduler can predict it from
the prefixes it saw agreed before. So, in wave mode, while agreements are under way and every
one of them has a prediction, the scheduler plans with the predicted L* (provisional progress,
never attached to a record) and holds the result as a ``Speculation``. When the replies are in:

* every speculated request admitted with exactly its predicted L* and the planning set exactly
  the speculated requests, in the state they were planned from: the speculative chunks are the
  plan (``SchedulerCore.schedule_speculated``); its host time counted from when it was planned;
* anything else (a different L*, a refusal or failure, a request more or fewer): the
  speculation is dropped and the plan is built as without it, host time counted from then.

A published plan therefore always carries the real, agreed L* (a chunk starts at the record's
real progress); the stages receive the same plan messages either way.

``AgreedPrefixIndex`` is the prediction: a bounded LRU set of the chained block hashes of every
prefix agreed or computed lately. Hashes are chained, so the deepest block of a new prompt found
there names the longest prefix known cached; the live requests' pins cannot predict it at C = S
(no live request holds the returning request's prefix: it is cached and unpinned). A block
evicted since makes the prediction too long: the reply differs, and the speculation is dropped.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import Chunk, ChunkPlanner, RequestProgress
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.scheduling.records import RequestRecord, ScheduledMicroBatch

DEFAULT_INDEX_ENTRIES = 65536  # block hashes remembered (~8 MiB at most with the dict's cost)


class AgreedPrefixIndex:
    """The prefixes known cached on every stage lately: the chained hash of each block of every
    prefix agreed (L* blocks at admission) or computed (a request's full blocks once its result
    is in), LRU-bounded. A block's chained hash names its whole prefix, so the deepest block of
    a prompt found here is the longest prefix the scheduler has seen cached.

    Args:
        capacity: block hashes kept (>= 1); the least recently recorded or predicted go first.

    Raises:
        ValueError: capacity < 1.
    """

    def __init__(self, capacity: int = DEFAULT_INDEX_ENTRIES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: must be >= 1 prefix")
        self.capacity = capacity
        self._ends: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ends)

    def record(self, block_hashes: Sequence[bytes], num_blocks: int) -> None:
        """The first ``num_blocks`` blocks of ``block_hashes`` are cached on every stage (a
        request admitted with L* = ``num_blocks``, or computed)."""
        ends = self._ends
        for end in block_hashes[: max(0, num_blocks)]:
            ends[end] = None
            ends.move_to_end(end)
        while len(ends) > self.capacity:
            ends.popitem(last=False)

    def predict(self, block_hashes: Sequence[bytes]) -> int:
        """The longest prefix of ``block_hashes`` agreed before, in blocks (0: none)."""
        for index in range(len(block_hashes) - 1, -1, -1):
            if block_hashes[index] in self._ends:
                self._ends.move_to_end(block_hashes[index])
                return index + 1
        return 0


@dataclass
class Speculation:
    """A micro-batch planned from predicted L*s, not yet published.

    ``predicted``: request id -> predicted L* (blocks) of each request still agreeing when it
    was planned. ``base``: request id -> (computed tokens, chunks planned) each planned request
    was planned from (its real state must equal it); ``final``: the same after the chunks.
    ``started_s``: event-loop time the planning began (the host time counts from it);
    ``planning_started_s``: wall-clock time of the same (telemetry); ``cpu_s``: the planner's
    own CPU seconds.
    """

    predicted: dict[str, int]
    base: dict[str, tuple[int, int]]
    final: dict[str, tuple[int, int]]
    chunks: list[Chunk]
    started_s: float
    planning_started_s: float
    cpu_s: float = 0.0
    request_ids: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.request_ids = frozenset(self.base)


class SchedulerState(Protocol):
    """What speculation reads and calls of ``SchedulerCore`` (which imports this module)."""

    config: RuntimeConfig
    planner: ChunkPlanner
    num_stages: int
    state_interval_blocks: int
    agreed_prefixes: AgreedPrefixIndex
    active: list[RequestRecord]
    live: dict[str, RequestRecord]

    @property
    def num_inflight(self) -> int: ...

    def block_hashes(self, request: PromptRequest) -> list[bytes]: ...

    def is_plannable(self, record: RequestRecord) -> bool: ...

    def closed_loop_target_s(self, extra_works_s: Sequence[float] = ()) -> float | None: ...

    def is_underfull_over(
        self, progresses: Sequence[RequestProgress], target_s: float | None
    ) -> bool: ...

    def take_planned(
        self, chunks: list[Chunk], planning_started_s: float
    ) -> ScheduledMicroBatch: ...


def predict_agreed_blocks(core: SchedulerState, request: PromptRequest) -> int:
    """The L* the scheduler expects ``request``'s agreement to return, from scheduler-held
    state only: the longest prefix agreed before (``core.agreed_prefixes``), capped as the
    agreement caps it (at least one token computed; a multiple of the state interval)."""
    hashes = core.block_hashes(request)
    num_blocks = core.agreed_prefixes.predict(hashes)
    num_blocks = min(num_blocks, (request.num_tokens - 1) // core.config.block_size)
    interval = core.state_interval_blocks
    return max(0, num_blocks // interval * interval)


def speculate(
    core: SchedulerState,
    agreeing: Sequence[RequestRecord],
    *,
    more_work_queued: bool,
    started_s: float,
) -> Speculation | None:
    """Plan the next micro-batch from the planning set and the requests still agreeing, each
    with its predicted L*; touches no record. None when there is nothing to speculate on, the
    set would be under-full (the plan would wait for more anyway), or the planner made none.
    """
    if not agreeing or core.planner.budget_accounting != "exact":
        return None
    cpu_started_s = time.perf_counter()
    planning_started_s = time.time()
    progresses: list[RequestProgress] = []
    for record in core.active:
        if core.is_plannable(record):
            assert record.progress is not None
            progresses.append(dataclasses.replace(record.progress))
    predicted: dict[str, int] = {}
    extra_works_s: list[float] = []
    for record in agreeing:
        request = record.request
        try:
            num_blocks = predict_agreed_blocks(core, request)
        except ValueError:
            return None  # a bad prompt: its agreement fails with its own error
        num_cached = num_blocks * core.config.block_size
        predicted[request.request_id] = num_blocks
        extra_works_s.append(core.planner.request_work_s(num_cached, request.num_tokens))
        progresses.append(
            RequestProgress(
                request_id=request.request_id,
                num_prompt_tokens=request.num_tokens,
                num_computed_tokens=num_cached,
                arrival_s=request.arrival_s,
            )
        )
    base = {p.request_id: (p.num_computed_tokens, p.num_planned_chunks) for p in progresses}
    if len(base) != len(progresses):
        return None  # one request id twice (rejected by its agreement)
    target_s = core.closed_loop_target_s(extra_works_s)
    if core.is_underfull_over(progresses, target_s):
        return None
    chunks = core.planner.plan_microbatch(
        progresses,
        num_stages=core.num_stages,
        num_inflight=core.num_inflight,
        more_work_queued=more_work_queued,
        target_cost_s=target_s,
    )
    if not chunks:
        return None
    final = {p.request_id: (p.num_computed_tokens, p.num_planned_chunks) for p in progresses}
    return Speculation(
        predicted=predicted,
        base=base,
        final=final,
        chunks=chunks,
        started_s=started_s,
        planning_started_s=planning_started_s,
        cpu_s=time.perf_counter() - cpu_started_s,
    )


def holds(core: SchedulerState, spec: Speculation) -> bool:
    """The speculation is still the plan: every request it predicted was admitted with exactly
    the predicted L*, the planning set's plannable requests are exactly the speculated ones, and
    each is in the state it was planned from."""
    plannable = [record for record in core.active if core.is_plannable(record)]
    if {record.request_id for record in plannable} != spec.request_ids:
        return False
    if len(plannable) != len(spec.request_ids):
        return False
    for request_id, num_blocks in spec.predicted.items():
        record = core.live.get(request_id)
        if record is None or record.ticket is None or record.ticket.num_agreed_blocks != num_blocks:
            return False
    for record in plannable:
        progress = record.progress
        assert progress is not None
        state = (progress.num_computed_tokens, progress.num_planned_chunks)
        if state != spec.base[record.request_id]:
            return False
    return True


def schedule_speculated(core: SchedulerState, spec: Speculation) -> ScheduledMicroBatch | None:
    """``SchedulerCore.schedule`` with the speculation's chunks, if it ``holds``; else None
    (and nothing changed)."""
    if not holds(core, spec):
        return None
    for record in core.active:
        if record.request_id in spec.final:
            assert record.progress is not None
            computed, planned = spec.final[record.request_id]
            record.progress.num_computed_tokens = computed
            record.progress.num_planned_chunks = planned
    return core.take_planned(spec.chunks, spec.planning_started_s)
