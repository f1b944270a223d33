"""A pipeline of pure cores, driven step by step, with a place for an attacker's messages.

``MiniPipeline`` wires the real pieces with no I/O: an ``AgreementController`` over
``LocalStageClient``s (the stages' KV wire handler), a ``SchedulerCore`` and S ``StageCore``s,
all sharing a replica's bus key. ``run`` admits the requests, then plans micro-batches; each
plan goes to every stage through its ``receive_plan`` (the bus), every stage's done goes to the
scheduler's ``update_from_done`` (the bus), releases go back over the KV handler. Before each
delivery it hands the attacker a ``Tap`` to inject forged messages or to replay, duplicate and
reorder captured genuine ones. Answers are the requests' first tokens (a function of the
request id), so an answer the attacker changed shows.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from wavepp.api.kv_reply import KVBatchReply, decode_reply
from wavepp.api.messages import KVReply, MicroBatchDone, MicroBatchPlan, RequestResult
from wavepp.api.signing import BusKey
from wavepp.bench.grid import GridSpec, Setting
from wavepp.launch.grid import runtime_config
from wavepp.runtime.agreement import AgreementController, LocalStageClient
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.planning import ChunkPlanner
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.scheduling.core import SchedulerCore
from wavepp.runtime.stage.core import StageCore

BLOCK = 4
NUM_BLOCKS = 64
PIPELINE = "p0"


def first_token(request_id: str) -> int:
    """The answer the last stage gives for ``request_id``."""
    return zlib.crc32(request_id.encode()) % 1000


def prompt(index: int, num_tokens: int) -> list[int]:
    return [(7 * index + j) % 500 + 1 for j in range(num_tokens)]


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def forged_done(
    rank: int,
    microbatch_id: int,
    results: list[RequestResult],
    *,
    error: str = "",
    epoch: str = "",
    num_tokens: int = 1,
) -> MicroBatchDone:
    """A done message as a forger writes it: zero timings, unsigned, the given results."""
    return MicroBatchDone(
        rank=rank,
        microbatch_id=microbatch_id,
        num_tokens=num_tokens,
        prepare_start_s=0.0,
        prepare_end_s=0.0,
        execute_start_s=0.0,
        execute_end_s=0.0,
        results=results,
        error=error,
        epoch=epoch,
    )


@dataclass
class Snapshot:
    """A stage manager's whole visible state: requests, tables, pool counts."""

    requests: list[str]
    tables: dict[str, tuple[int, ...]]
    num_free_blocks: int
    num_pinned_blocks: int


def snapshot(manager: StageKVManager) -> Snapshot:
    return Snapshot(
        requests=manager.request_ids(),
        tables={rid: manager.held_blocks(rid) for rid in manager.request_ids()},
        num_free_blocks=manager.pool.num_free_blocks,
        num_pinned_blocks=manager.pool.num_pinned_blocks,
    )


@dataclass
class Tap:
    """What an attacker sees and may do at one point of the run."""

    pipe: MiniPipeline
    point: str  # "plan" (before stages get a plan) or "done" (before the scheduler gets dones)
    plans_seen: list[MicroBatchPlan] = field(default_factory=list)
    dones_seen: list[MicroBatchDone] = field(default_factory=list)
    kv_seen: list[tuple[int, bytes]] = field(default_factory=list)

    def kv(self, rank: int, payload: bytes) -> KVReply | KVBatchReply:
        """Send a KV request to stage ``rank`` (the bus: its wire handler)."""
        return self.pipe.send_kv(rank, payload)

    def plan(self, rank: int, plan: MicroBatchPlan) -> None:
        """Publish a plan as stage ``rank`` receives it; what it runs is the pipeline's."""
        self.pipe.deliver_plan(rank, plan)

    def done(self, done: MicroBatchDone) -> None:
        """Publish a done message to the scheduler."""
        self.pipe.deliver_done(done)


Attacker = Callable[[Tap], None]


class RecordingClient(LocalStageClient):
    """A ``LocalStageClient`` that keeps every payload it sent (what a bus listener sees): JSON
    requests and binary rounds."""

    def __init__(self, *args: object, log: list[tuple[int, bytes]], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.log = log

    async def call(self, msg):  # noqa: ANN001, ANN201
        self.log.append((self.rank, msg.model_dump_json().encode()))
        return await super().call(msg)

    async def call_batch(self, payload: bytes) -> bytes:
        self.log.append((self.rank, payload))
        return await super().call_batch(payload)


class MiniPipeline:
    """See the module docstring. ``key``: the deployment's bus key (None: insecure mode)."""

    def __init__(self, key: BusKey | None, *, num_stages: int = 2) -> None:
        spec = GridSpec(
            time_scale=0.01, num_stages=num_stages, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK
        )
        config, cost = runtime_config(spec, Setting("glm-5.2", 16, "low", "wave"))
        self.config = config.model_copy(update={"chunk_tokens": 16, "pipeline": PIPELINE})
        self.key = None if key is None else key.for_replica(PIPELINE)
        self.clock = FakeClock()
        self.num_stages = num_stages
        self.stages = [
            StageCore(
                StageKVManager(
                    BlockPool(NUM_BLOCKS, BLOCK), clock=self.clock, max_lease_s=config.lease_s
                ),
                rank=rank,
                num_stages=num_stages,
                local_prepare=True,
                clock=self.clock,
                bus_key=self.key,
            )
            for rank in range(num_stages)
        ]
        self.kv_log: list[tuple[int, bytes]] = []  # every KV request the controller sent
        self.controller = AgreementController(
            [
                RecordingClient(stage.manager, rank, bus_key=self.key, log=self.kv_log)
                for rank, stage in enumerate(self.stages)
            ],
            block_size=BLOCK,
            model_id=self.config.model_id,
            lease_s=self.config.lease_s,
            bus_key=self.key,
        )
        planner = ChunkPlanner(cost, policy="dynamic", chunk_tokens=16, block_size=BLOCK)
        self.core = SchedulerCore(
            self.config,
            planner,
            block_hashes=self.controller.block_hashes,
            clock=self.clock,
            monotonic=self.clock,
            bus_key=self.key,
        )
        self.loop = asyncio.new_event_loop()
        self.answers: dict[str, tuple[int | None, str]] = {}
        self.answered_round: dict[str, int] = {}  # request id -> the round it was answered in
        self.round = 0
        self.pending_dones: list[MicroBatchDone] = []
        self.genuine_plans: list[MicroBatchPlan] = []
        self.genuine_dones: list[MicroBatchDone] = []
        self.max_rounds = 200

    def close(self) -> None:
        self.loop.close()

    # ---- the bus ---------------------------------------------------------------------------

    def send_kv(self, rank: int, payload: bytes) -> KVReply | KVBatchReply:
        """A KV payload to stage ``rank``'s wire handler: a binary round (``b"WKB"``) or a JSON
        request; its decoded reply."""
        stage = self.stages[rank]
        if payload[:3] == b"WKB":
            return decode_reply(stage.handle_kv_batch(payload))
        return stage.handle_kv(payload)

    def deliver_plan(self, rank: int, plan: MicroBatchPlan) -> None:
        stage = self.stages[rank]
        for ready, _ in stage.receive_plan(plan):
            work = stage.accept(ready)
            results = stage.results(work, first_token)
            done = stage.done_message(work, execute_start_s=0.0, execute_end_s=0.0, results=results)
            stage.complete(work, done)
            self.pending_dones.append(done)

    def deliver_done(self, done: MicroBatchDone) -> None:
        update = self.core.update_from_done(done)
        if update.to_release:
            self.loop.run_until_complete(self.controller.release(update.to_release))
            self.core.released(update.to_release)
        self._collect()

    def _seen(self) -> tuple[list[MicroBatchPlan], list[MicroBatchDone], list[tuple[int, bytes]]]:
        return list(self.genuine_plans), list(self.genuine_dones), list(self.kv_log)

    def _collect(self) -> None:
        for record in self.core.take_finished():
            outcome = record.outcome
            assert outcome is not None
            assert record.request_id not in self.answers, f"{record.request_id} answered twice"
            self.answers[record.request_id] = (outcome.first_token_id, outcome.error)
            self.answered_round[record.request_id] = self.round

    # ---- a run -----------------------------------------------------------------------------

    def run(
        self,
        requests: list[PromptRequest],
        attacker: Attacker | None = None,
        *,
        shuffle_dones: Callable[[list[MicroBatchDone]], list[MicroBatchDone]] | None = None,
    ) -> dict[str, tuple[int | None, str]]:
        """Admit ``requests``, run every micro-batch, return request id -> (token, error)."""
        for request in requests:
            record = self.core.add_request(request, waiter=None)
            ticket = self.loop.run_until_complete(self.controller.agree(request))
            assert ticket is not None, f"{request.request_id}: refused"
            self.core.admitted(record, ticket)
            self.core.activate([record])
        for round_index in range(self.max_rounds):
            self.round = round_index
            scheduled = self.core.schedule(more_work_queued=False, planning_started_s=0.0)
            if scheduled is None:
                break
            plan, _ = self.core.encoded_plan_of(scheduled)
            self.genuine_plans.append(plan)
            if attacker is not None:
                attacker(Tap(self, "plan", *self._seen()))
            for rank in range(self.num_stages):
                self.deliver_plan(rank, plan)
            dones, self.pending_dones = self.pending_dones, []
            self.genuine_dones.extend(dones)
            if attacker is not None:
                attacker(Tap(self, "done", *self._seen()))
            if shuffle_dones is not None:
                dones = shuffle_dones(dones)
            for done in dones:
                self.deliver_done(done)
            self.clock.now_s += 0.01
        self._collect()
        return self.answers


def admit_by_hand(pipe: MiniPipeline, name: str, index: int, num_tokens: int):  # noqa: ANN201
    """Add request ``name`` (``prompt(index, num_tokens)``) to ``pipe``'s core, agree it and
    admit it into the planning set; returns its RequestRecord."""
    record = pipe.core.add_request(PromptRequest(name, prompt(index, num_tokens)), waiter=None)
    ticket = pipe.loop.run_until_complete(pipe.controller.agree(record.request))
    assert ticket is not None
    pipe.core.admitted(record, ticket)
    pipe.core.activate([record])
    return record
