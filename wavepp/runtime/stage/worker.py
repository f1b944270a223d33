"""The stage worker: one process per pipeline stage.

Threads and ownership::

    asyncio loop thread (owns the StageKVManager)        compute thread (owns torch.distributed)
    ---------------------------------------------        ---------------------------------------
    {p}.stage.{r}.kv  -> handle_kv_request -> reply       take (plan, chunks, prepared) in order
    {p}.plan          -> block tables from the manager    recv activations from rank r-1
                         -> prepare() when local_prepare   prepare() here when not local_prepare
                         -> hand over to compute            execute() the stage's layers
    after a micro-batch: mark_computed, KV events,   <-    isend activations to rank r+1
                         publish {p}.done                   (last stage: first token, logits)

Plans arrive from one publisher on one subject; a ``PlanSequencer`` hands them to the compute
thread in id order, exactly once, and fills a hole left by a NATS reconnect from the scheduler's
replay (``{p}.plan.replay``), so the activations of micro-batch m on the wire between two stages
always belong to m. Done messages are kept a while and resent on the scheduler's ask
(``{p}.stage.{r}.dones``); after its own reconnect a stage says so on ``{p}.resync``. A micro-batch whose block tables cannot be built (a lease
expired, a bad plan) still moves zeros of the right shape through the pipeline, so no stage
waits forever, and its ``MicroBatchDone`` carries the error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import signal
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from wavepp.api.messages import (
    DoneReplay,
    DoneReplayReply,
    KVEventBatch,
    MicroBatchDone,
    MicroBatchPlan,
    PlanReplay,
    PlanReplayReply,
    RequestResult,
    StageResync,
)
from wavepp.runtime.agreement import StageRequest, handle_kv_request
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.stage.engine import ChunkSpec, make_engine
from wavepp.runtime.stage.sequencing import PlanSequencer
from wavepp.runtime.transport.natsio import connect, on_reconnect
from wavepp.telemetry import tracing
from wavepp.telemetry.pipeline import StageTelemetry

log = logging.getLogger(__name__)

_MAX_PENDING_SENDS = 16
_DONE_LOG = 1024  # done messages kept for the scheduler's replay asks


@dataclass
class _Work:
    plan: MicroBatchPlan
    chunks: list[ChunkSpec]
    prepared: object | None
    prepare_start_s: float
    prepare_end_s: float
    error: str
    num_agreed_blocks: list[int]


def build_engine(config: RuntimeConfig, rank: int):  # noqa: ANN201 - StageEngine protocol
    """The stage's engine for its layer range (torch or emulated), with its KV allocated."""
    first, last = config.layers_of(rank)
    cost_model = None
    extra: dict[str, object] = {}
    if config.engine == "emulated":
        from wavepp.runtime.planning import CostModel

        cost_model = CostModel.from_dict(config.cost_model or {})
        extra["time_scale"] = config.time_scale
    engine = make_engine(
        config.engine,
        model=config.model,
        first_layer=first,
        last_layer=last,
        num_layers_total=config.model.num_layers,
        device=config.device,
        cost_model=cost_model,
        **extra,
    )
    engine.allocate_kv(config.kv_blocks_of(rank), config.block_size)
    return engine


class StageWorker:
    """Serves one stage: KV ops over NATS, plans, activations over torch.distributed."""

    def __init__(self, config: RuntimeConfig, rank: int, nc: NATS, engine: object) -> None:
        self.config = config
        self.rank = rank
        self.nc = nc
        self.engine = engine
        self.manager = StageKVManager(BlockPool(config.kv_blocks_of(rank), config.block_size))
        self.requests: dict[str, StageRequest] = {}
        self.is_first = rank == 0
        self.is_last = rank == config.num_stages - 1
        self.prefix = config.subject_prefix
        self.subjects = config.subjects
        self._work: queue.Queue[_Work | None] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_microbatches = 0
        self.telemetry = StageTelemetry(rank)
        # NOTE: the readiness probe (/readyz): True between subscribing and the stop request.
        self.is_serving = False
        self.sequencer: PlanSequencer[tuple[MicroBatchPlan, object]] = PlanSequencer()
        self._done_log: OrderedDict[tuple[str, int], MicroBatchDone] = OrderedDict()
        self._replay_task: asyncio.Task[None] | None = None
        self._open_replay = False  # the next replay asks for every plan from next_id on

    # ---- loop thread ---------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._compute_loop, name="compute", daemon=True)
        self._thread.start()
        await self.nc.subscribe(self.subjects.stage_kv(self.rank), cb=self._on_kv)
        await self.nc.subscribe(self.subjects.plan, cb=self._on_plan)
        await self.nc.subscribe(self.subjects.stage_dones(self.rank), cb=self._on_done_replay)
        on_reconnect(self.nc, self._on_reconnected)
        await self.nc.flush()
        log.info("stage %d serving layers %s", self.rank, self.config.layers_of(self.rank))
        expiry = asyncio.create_task(self._expire_loop())
        self.is_serving = True
        try:
            await stop.wait()
        finally:
            self.is_serving = False
            expiry.cancel()
            self._work.put(None)

    async def _on_kv(self, msg: Msg) -> None:
        reply = handle_kv_request(self.manager, self.rank, msg.data, self.requests)
        await msg.respond(reply.model_dump_json().encode())
        await self._publish_events()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.lease_s / 4))
            for request_id in self.manager.expire():
                self.requests.pop(request_id, None)
                log.warning("stage %d: lease of %s expired; released", self.rank, request_id)
            await self._publish_events()

    async def _publish_events(self) -> None:
        events = self.manager.take_events()
        if not events:
            return
        batch = KVEventBatch(
            rank=self.rank,
            stored=[[h.hex() for h in e.block_hashes] for e in events if e.kind == "stored"],
            removed=[[h.hex() for h in e.block_hashes] for e in events if e.kind == "removed"],
        )
        await self.nc.publish(self.subjects.kv_events(self.rank), batch.model_dump_json().encode())

    async def _on_plan(self, msg: Msg) -> None:
        try:
            plan = MicroBatchPlan.model_validate_json(msg.data)
        except ValueError as exc:
            log.error("stage %d: invalid plan dropped: %s", self.rank, exc)
            return
        for ready, headers in self.sequencer.offer(
            plan.epoch, plan.microbatch_id, (plan, msg.headers)
        ):
            self._accept_plan(ready, headers)
        self._fill_gaps()

    # ---- gap-free plan delivery ----------------------------------------------------------

    def _fill_gaps(self) -> None:
        """Start the replay task when plans wait on a hole (or after a reconnect)."""
        wanted = self._open_replay or self.sequencer.gap() is not None
        if wanted and (self._replay_task is None or self._replay_task.done()):
            self._replay_task = asyncio.ensure_future(self._replay_loop())

    async def _replay_loop(self) -> None:
        """Ask the scheduler for missed plans until no hole is left; back off while it is away."""
        delay_s = 0.05
        while True:
            epoch = self.sequencer.epoch
            if self._open_replay and epoch:
                span: tuple[int, int | None] | None = (self.sequencer.next_id, None)
            else:
                span = self.sequencer.gap()
            self._open_replay = False
            if span is None:
                return
            ask = PlanReplay(epoch=epoch, from_id=span[0], to_id=span[1], rank=self.rank)
            try:
                msg = await self.nc.request(
                    self.subjects.plan_replay,
                    ask.model_dump_json().encode(),
                    timeout=min(2.0, self.config.request_timeout_s),
                )
                reply = PlanReplayReply.model_validate_json(msg.data)
            except Exception as exc:  # noqa: BLE001 - no responder yet, timeout, a bad reply
                log.warning("stage %d: plan replay %s failed: %r", self.rank, span, exc)
                if span[1] is None:
                    self._open_replay = True
                await asyncio.sleep(delay_s)
                delay_s = min(1.0, delay_s * 2)
                continue
            if reply.epoch != epoch:
                # The scheduler that published the held plans is gone: run what we hold, in
                # order, rather than wait for plans nobody can replay.
                log.warning(
                    "stage %d: replay answered by epoch %s, held plans are of %s; running them",
                    self.rank,
                    reply.epoch,
                    epoch,
                )
                for ready, headers in self.sequencer.flush_held():
                    self._accept_plan(ready, headers)
                return
            limit = reply.next_id if span[1] is None else min(span[1], reply.next_id)
            items = [(p.microbatch_id, (p, None)) for p in reply.plans]
            skipped = self.sequencer.num_skipped
            for ready, headers in self.sequencer.settle(epoch, limit, items):
                self._accept_plan(ready, headers)
            if self.sequencer.num_skipped > skipped:
                log.warning(
                    "stage %d: %d plan(s) expired before they reached this stage; skipped",
                    self.rank,
                    self.sequencer.num_skipped - skipped,
                )
            delay_s = 0.05

    async def _on_reconnected(self) -> None:
        """After a NATS reconnect: fetch plans published meanwhile, let the scheduler ask for
        done messages it may have lost."""
        self._open_replay = True
        self._fill_gaps()
        try:
            await self.nc.publish(
                self.subjects.resync, StageResync(rank=self.rank).model_dump_json().encode()
            )
        except Exception as exc:  # noqa: BLE001 - the scheduler's own reconnect asks anyway
            log.warning("stage %d: resync notice failed: %r", self.rank, exc)

    async def _on_done_replay(self, msg: Msg) -> None:
        try:
            ask = DoneReplay.model_validate_json(msg.data)
        except ValueError as exc:
            log.error("stage %d: invalid done replay ask dropped: %s", self.rank, exc)
            return
        dones = [
            self._done_log[(ask.epoch, mb)]
            for mb in ask.microbatch_ids
            if (ask.epoch, mb) in self._done_log
        ]
        reply = DoneReplayReply(rank=self.rank, dones=dones)
        await msg.respond(reply.model_dump_json().encode())

    def _accept_plan(self, plan: MicroBatchPlan, headers: object) -> None:
        """Build the block tables (and prepare, in wave mode) and queue the plan for compute."""
        prepare_start = time.time()
        error = ""
        chunks: list[ChunkSpec] = []
        self.telemetry.plan_received(plan, headers)  # type: ignore[arg-type]
        try:
            for c in plan.chunks:
                chunks.append(
                    ChunkSpec(
                        request_id=c.request_id,
                        context_offset=c.context_offset,
                        num_tokens=len(c.token_ids),
                        block_ids=tuple(self.manager.block_table(c.request_id)),
                        token_ids=tuple(c.token_ids) if self.is_first else None,
                        is_last=c.is_last,
                    )
                )
        except (KeyError, ValueError) as exc:
            error = f"stage {self.rank}: cannot build block tables: {exc!r}"
        prepared = None
        if not error and self.config.resolved_local_prepare:
            try:
                prepared = self.engine.prepare(chunks)  # type: ignore[attr-defined]
            except ValueError as exc:
                error = f"stage {self.rank}: prepare failed: {exc}"
        agreed = [
            self.requests[c.request_id].num_agreed_blocks if c.request_id in self.requests else -1
            for c in plan.chunks
        ]
        self._work.put(_Work(plan, chunks, prepared, prepare_start, time.time(), error, agreed))

    def _after_microbatch(self, work: _Work, done: MicroBatchDone) -> None:
        self.telemetry.microbatch_done(work.plan, done)
        self._done_log[(work.plan.epoch, done.microbatch_id)] = done
        while len(self._done_log) > _DONE_LOG:
            self._done_log.popitem(last=False)
        if not done.error:
            for chunk in work.chunks:
                record = self.requests.get(chunk.request_id)
                if record is None:
                    continue
                try:
                    self.manager.mark_computed(
                        chunk.request_id,
                        chunk.context_offset + chunk.num_tokens,
                        record.block_hashes,
                    )
                except KeyError:
                    pass  # released meanwhile (lease expiry): nothing to cache
        self.num_microbatches += 1
        asyncio.ensure_future(self._publish_done(done))

    async def _publish_done(self, done: MicroBatchDone) -> None:
        await self.nc.publish(self.subjects.done, done.model_dump_json().encode())
        await self._publish_events()

    # ---- compute thread ------------------------------------------------------------------

    def _compute_loop(self) -> None:
        torch.set_num_threads(self.config.torch_threads)
        pending_sends: deque[object] = deque()
        engine = self.engine
        while True:
            work = self._work.get()
            if work is None:
                break
            num_tokens = sum(len(c.token_ids) for c in work.plan.chunks)
            hidden_in = None
            if not self.is_first:
                hidden_in = torch.empty(
                    num_tokens,
                    engine.hidden_size,  # type: ignore[attr-defined]
                    dtype=engine.activation_dtype,  # type: ignore[attr-defined]
                )
                dist.recv(hidden_in, src=self.rank - 1)
            error = work.error
            prepare_start, prepare_end = work.prepare_start_s, work.prepare_end_s
            results: list[RequestResult] = []
            hidden_out = None
            exec_start = exec_end = time.time()
            if not error:
                try:
                    prepared = work.prepared
                    if prepared is None:
                        prepare_start = time.time()
                        prepared = engine.prepare(work.chunks)  # type: ignore[attr-defined]
                        prepare_end = time.time()
                    exec_start = time.time()
                    out = engine.execute(prepared, hidden_in)  # type: ignore[attr-defined]
                    exec_end = time.time()
                    hidden_out = out.hidden
                    if self.is_last:
                        results = self._results(work, out.last_token_logits)
                except Exception as exc:  # keep the pipeline moving; report the error
                    log.exception(
                        "stage %d: micro-batch %d failed", self.rank, work.plan.microbatch_id
                    )
                    error = f"stage {self.rank}: execute failed: {exc!r}"
            done = MicroBatchDone(
                rank=self.rank,
                microbatch_id=work.plan.microbatch_id,
                num_tokens=num_tokens,
                prepare_start_s=prepare_start,
                prepare_end_s=prepare_end,
                execute_start_s=exec_start,
                execute_end_s=exec_end,
                results=results,
                error=error,
                num_agreed_blocks=work.num_agreed_blocks,
                epoch=work.plan.epoch,
            )
            # Cache the computed blocks before the activations leave: a release for this
            # request can only follow the last stage's result, hence this send.
            assert self._loop is not None, "compute thread started before serve()"
            self._loop.call_soon_threadsafe(self._after_microbatch, work, done)
            if not self.is_last:
                if hidden_out is None or error:
                    hidden_out = torch.zeros(
                        num_tokens,
                        engine.hidden_size,  # type: ignore[attr-defined]
                        dtype=engine.activation_dtype,  # type: ignore[attr-defined]
                    )
                pending_sends.append(
                    (dist.isend(hidden_out.contiguous(), dst=self.rank + 1), hidden_out)
                )
                while len(pending_sends) > _MAX_PENDING_SENDS:
                    pending_sends.popleft()[0].wait()  # type: ignore[index]
        for handle, _ in pending_sends:  # type: ignore[misc]
            handle.wait()

    def _results(self, work: _Work, logits: dict[str, torch.Tensor]) -> list[RequestResult]:
        results = []
        for chunk in work.plan.chunks:
            if not chunk.is_last:
                continue
            row = logits[chunk.request_id]
            results.append(
                RequestResult(
                    request_id=chunk.request_id,
                    first_token_id=int(torch.argmax(row).item()),
                    logits=[float(v) for v in row.tolist()] if chunk.return_logits else None,
                )
            )
        return results


def init_distributed(config: RuntimeConfig, rank: int, dist_url: str) -> None:
    """Join the stages' process group (gloo on CPU, NCCL on CUDA) for activations."""
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=dist_url, rank=rank, world_size=config.num_stages)


@dataclass
class StageReadiness:
    """What a stage's health endpoints report (``wavepp stage --health-port``).

    ``is_formed``: the torch.distributed group has formed and the engine is built (/startupz).
    ``is_serving``: subscribed to its plans and KV requests, not stopping (/readyz).
    """

    is_formed: bool = False
    worker: StageWorker | None = None

    @property
    def is_serving(self) -> bool:
        return self.worker is not None and self.worker.is_serving


async def run_stage(
    config: RuntimeConfig,
    rank: int,
    nats_url: str,
    dist_url: str,
    *,
    nats_creds: str | None = None,
    readiness: StageReadiness | None = None,
) -> None:
    """Process main of ``wavepp stage``: form, serve until SIGTERM/SIGINT, drain, leave.

    Args:
        config: the replica's RuntimeConfig.
        rank: this stage's rank in [0, S).
        nats_url: NATS server URL.
        dist_url: torch.distributed init method (``tcp://host:port`` of rank 0).
        nats_creds: NATS credentials file (None: ``WAVEPP_NATS_CREDS`` or none).
        readiness: updated as the stage forms and serves (for health endpoints), if given.
    """
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s stage{rank} %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(config.torch_threads)
    tracing.setup(config.telemetry, f"wavepp-stage-{rank}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.to_thread(init_distributed, config, rank, dist_url)
    engine = await asyncio.to_thread(build_engine, config, rank)
    if readiness is not None:
        readiness.is_formed = True
    nc = await connect(nats_url, name=f"{config.pipeline}-stage-{rank}", creds=nats_creds)
    try:
        worker = StageWorker(config, rank, nc, engine)
        if readiness is not None:
            readiness.worker = worker
        await worker.serve(stop)
    finally:
        await nc.drain()
        tracing.shutdown()
