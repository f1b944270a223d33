"""The stage worker: one process per pipeline stage; the I/O around its ``StageCore``.

The decisions (plan order, block tables, results, done messages, caching computed blocks) are
the core's (``wavepp.runtime.stage.core``), shared with the simulator. This module moves bytes:
NATS subscriptions, activations over torch.distributed, the compute thread, lease expiry.

Threads and ownership::

    asyncio loop thread (owns the StageCore)             compute thread (owns torch.distributed)
    ---------------------------------------------        ---------------------------------------
    {p}.stage.{r}.kv  -> core.handle_kv -> reply          take (work, prepared) in order
    {p}.plan          -> core.receive_plan, core.accept   recv activations from rank r-1
                         -> prepare() when local_prepare   prepare() here when not local_prepare
                         -> hand over to compute            execute() the stage's layers
    after a micro-batch: core.complete (mark         <-    core.results (last stage), done_message
                         computed), KV events,             isend activations to rank r+1
                         publish {p}.done

Plans arrive from one publisher on one subject; the core's ``PlanSequencer`` hands them to the
compute thread in id order, exactly once; this worker fills a hole left by a NATS reconnect from
the scheduler's replay (``{p}.plan.replay``), so the activations of micro-batch m on the wire
between two stages always belong to m. Done messages are kept a while (by the core) and resent
on the scheduler's ask (``{p}.stage.{r}.dones``); after its own reconnect a stage says so on
``{p}.resync``. A micro-batch whose block tables cannot be built (a lease expired, a bad plan)
still moves zeros of the right shape through the pipeline, so no stage waits forever, and its
``MicroBatchDone`` carries the error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from wavepp.api.messages import (
    DoneReplay,
    DoneReplayReply,
    MicroBatchDone,
    MicroBatchPlan,
    PlanReplay,
    PlanReplayReply,
    RequestResult,
    StageResync,
)
from wavepp.api.signing import BusKey
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.stage.core import StageCore, StageWork
from wavepp.runtime.stage.engine import PreparedBatch, StageEngine, make_engine
from wavepp.runtime.transport.buskey import load_bus_key
from wavepp.runtime.transport.natsio import connect, on_reconnect
from wavepp.telemetry import tracing
from wavepp.telemetry.pipeline import StageTelemetry

log = logging.getLogger(__name__)

_MAX_PENDING_SENDS = 16
_DONE_LOG = 1024  # done messages kept for the scheduler's replay asks


def build_engine(config: RuntimeConfig, rank: int) -> StageEngine:
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
    """Serves one stage: KV ops over NATS, plans, activations over torch.distributed.

    ``bus_key``: the deployment's bus key (``load_bus_key``); the stage signs and checks with
    its replica's key derived from it. None: unsigned (insecure mode).
    """

    def __init__(
        self,
        config: RuntimeConfig,
        rank: int,
        nc: NATS,
        engine: StageEngine,
        *,
        bus_key: BusKey | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.nc = nc
        self.engine = engine
        # NOTE: done messages carry wall-clock seconds (time.time()): they cross processes.
        self.core = StageCore(
            StageKVManager(
                BlockPool(config.kv_blocks_of(rank), config.block_size),
                max_lease_s=config.lease_s,
            ),
            rank=rank,
            num_stages=config.num_stages,
            local_prepare=config.resolved_local_prepare,
            clock=time.time,
            done_log_size=_DONE_LOG,
            bus_key=None if bus_key is None else bus_key.for_replica(config.pipeline),
        )
        self.is_first = rank == 0
        self.is_last = rank == config.num_stages - 1
        self.prefix = config.subject_prefix
        self.subjects = config.subjects
        self._work: queue.Queue[tuple[StageWork, PreparedBatch | None] | None] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.telemetry = StageTelemetry(rank)
        # NOTE: the readiness probe (/readyz): True between subscribing and the stop request.
        self.is_serving = False
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

    @property
    def num_microbatches(self) -> int:
        """Micro-batches this stage finished."""
        return self.core.num_microbatches

    async def _on_kv(self, msg: Msg) -> None:
        reply = self.core.handle_kv(msg.data)
        await msg.respond(reply.model_dump_json().encode())
        await self._publish_events()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.lease_s / 4))
            for request_id in self.core.expire():
                log.warning("stage %d: lease of %s expired; released", self.rank, request_id)
            await self._publish_events()

    async def _publish_events(self) -> None:
        batch = self.core.take_kv_events()
        if batch is None:
            return
        await self.nc.publish(self.subjects.kv_events(self.rank), batch.model_dump_json().encode())

    async def _on_plan(self, msg: Msg) -> None:
        try:
            plan = MicroBatchPlan.model_validate_json(msg.data)
        except ValueError as exc:
            log.error("stage %d: invalid plan dropped: %s", self.rank, exc)
            return
        num_forged = self.core.num_forged
        for ready, headers in self.core.receive_plan(plan, msg.headers):
            self._accept_plan(ready, headers)
        if self.core.num_forged > num_forged:
            log.error(
                "stage %d: plan %d of epoch %r dropped: no epoch, a left epoch, or its mac is "
                "missing or wrong (is WAVEPP_BUS_KEY the same in every process?)",
                self.rank,
                plan.microbatch_id,
                plan.epoch,
            )
        self._fill_gaps()

    # ---- gap-free plan delivery ----------------------------------------------------------

    def _fill_gaps(self) -> None:
        """Start the replay task when plans wait on a hole (or after a reconnect)."""
        wanted = self._open_replay or self.core.sequencer.gap() is not None
        if wanted and (self._replay_task is None or self._replay_task.done()):
            self._replay_task = asyncio.ensure_future(self._replay_loop())

    async def _replay_loop(self) -> None:
        """Ask the scheduler for missed plans until no hole is left; back off while it is away."""
        delay_s = 0.05
        while True:
            epoch = self.core.sequencer.epoch
            if self._open_replay and epoch:
                span: tuple[int, int | None] | None = (self.core.sequencer.next_id, None)
            else:
                span = self.core.sequencer.gap()
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
                items = self.core.replay_items(reply)
                if items is None:
                    raise ValueError("replay reply without an epoch or a valid mac")
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
                for ready, headers in self.core.sequencer.flush_held():
                    self._accept_plan(ready, headers)
                return
            limit = reply.next_id if span[1] is None else min(span[1], reply.next_id)
            skipped = self.core.sequencer.num_skipped
            for ready, headers in self.core.sequencer.settle(epoch, limit, items):
                self._accept_plan(ready, headers)
            if self.core.sequencer.num_skipped > skipped:
                log.warning(
                    "stage %d: %d plan(s) expired before they reached this stage; skipped",
                    self.rank,
                    self.core.sequencer.num_skipped - skipped,
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
        reply = DoneReplayReply(
            rank=self.rank, dones=self.core.dones(ask.epoch, ask.microbatch_ids)
        )
        await msg.respond(reply.model_dump_json().encode())

    def _accept_plan(self, plan: MicroBatchPlan, headers: Mapping[str, str] | None) -> None:
        """Let the core build the block tables, prepare in wave mode, queue for compute."""
        self.telemetry.plan_received(plan, headers)
        work = self.core.accept(plan)
        prepared = None
        if work.prepare_on_arrival:
            try:
                prepared = self.engine.prepare(work.chunks)
            except ValueError as exc:
                work.error = f"stage {self.rank}: prepare failed: {exc}"
        work.prepare_end_s = time.time()
        self._work.put((work, prepared))

    def _after_microbatch(self, work: StageWork, done: MicroBatchDone) -> None:
        self.telemetry.microbatch_done(work.plan, done)
        self.core.complete(work, done)
        asyncio.ensure_future(self._publish_done(done))

    async def _publish_done(self, done: MicroBatchDone) -> None:
        await self.nc.publish(self.subjects.done, done.model_dump_json().encode())
        await self._publish_events()

    # ---- compute thread ------------------------------------------------------------------

    def _compute_loop(self) -> None:
        torch.set_num_threads(self.config.torch_threads)
        pending_sends: deque[tuple[dist.Work | None, torch.Tensor]] = deque()
        engine = self.engine
        core = self.core
        while True:
            item = self._work.get()
            if item is None:
                break
            work, prepared = item
            num_tokens = work.num_tokens
            hidden_in = None
            if not self.is_first:
                hidden_in = torch.empty(
                    num_tokens, engine.hidden_size, dtype=engine.activation_dtype
                )
                dist.recv(hidden_in, src=self.rank - 1)
            results: list[RequestResult] = []
            hidden_out = None
            exec_start = exec_end = time.time()
            if not work.error:
                try:
                    if prepared is None:
                        work.prepare_start_s = time.time()
                        prepared = engine.prepare(work.chunks)
                        work.prepare_end_s = time.time()
                    exec_start = time.time()
                    out = engine.execute(prepared, hidden_in)
                    exec_end = time.time()
                    hidden_out = out.hidden
                    logits = out.last_token_logits
                    results = core.results(
                        work, partial(_first_token_id, logits), partial(_logits_list, logits)
                    )
                except Exception as exc:  # keep the pipeline moving; report the error
                    log.exception(
                        "stage %d: micro-batch %d failed", self.rank, work.plan.microbatch_id
                    )
                    work.error = f"stage {self.rank}: execute failed: {exc!r}"
            done = core.done_message(
                work, execute_start_s=exec_start, execute_end_s=exec_end, results=results
            )
            # Cache the computed blocks before the activations leave: a release for this
            # request can only follow the last stage's result, hence this send.
            assert self._loop is not None, "compute thread started before serve()"
            self._loop.call_soon_threadsafe(self._after_microbatch, work, done)
            if not self.is_last:
                if hidden_out is None or work.error:
                    hidden_out = torch.zeros(
                        num_tokens, engine.hidden_size, dtype=engine.activation_dtype
                    )
                pending_sends.append(
                    (dist.isend(hidden_out.contiguous(), dst=self.rank + 1), hidden_out)
                )
                while len(pending_sends) > _MAX_PENDING_SENDS:
                    _wait(pending_sends.popleft()[0])
        for handle, _ in pending_sends:
            _wait(handle)


def _first_token_id(logits: Mapping[str, torch.Tensor], request_id: str) -> int:
    """The greedy first output token: argmax of the request's last-token logits."""
    return int(torch.argmax(logits[request_id]).item())


def _logits_list(logits: Mapping[str, torch.Tensor], request_id: str) -> list[float]:
    return [float(v) for v in logits[request_id].tolist()]


def _wait(handle: dist.Work | None) -> None:
    """Wait for an ``isend`` (None: torch.distributed sent nothing; this rank is in no group)."""
    if handle is not None:
        handle.wait()


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
    bus_key = load_bus_key()
    nc = await connect(nats_url, name=f"{config.pipeline}-stage-{rank}", creds=nats_creds)
    try:
        worker = StageWorker(config, rank, nc, engine, bus_key=bus_key)
        if readiness is not None:
            readiness.worker = worker
        await worker.serve(stop)
    finally:
        await nc.drain()
        tracing.shutdown()
