"""The stage worker: one process per pipeline stage; the I/O around its ``StageCore``.

The decisions (plan order, block tables, results, done messages, caching computed blocks) are
the core's (``wavepp.runtime.stage.core``), shared with the simulator. This module moves bytes:
NATS subscriptions, plan delivery, re-forming, lease expiry, on the asyncio loop thread; the
compute thread (activations over torch.distributed, the engine) is
``wavepp.runtime.stage.compute``, whose ``StageCompute`` this worker is. The process around it (connect, form, build the engine, signals, readiness) is
``wavepp.runtime.stage.process``.

Threads and ownership::

    asyncio loop thread (owns the StageCore)             compute thread (owns torch.distributed)
    ---------------------------------------------        ---------------------------------------
    {p}.stage.{r}.kv  -> core.handle_kv -> reply          take (work, prepared) in order
    {p}.stage.{r}.kvb, {p}.stages.kvb (a round to every
      stage) -> core.handle_kv_batch -> reply (its rank)
    {p}.plan          -> core.receive_plan, core.accept   recv activations from rank r-1
                         -> prepare() when local_prepare   prepare() here when not local_prepare
                         -> hand over to compute            execute() the stage's layers
    after a micro-batch: core.complete (mark         <-    core.results (last stage), done_message
                         computed), KV events,             isend activations to rank r+1
                         publish {p}.done

Plans arrive from one publisher on one subject; the core's ``PlanSequencer`` hands them to the
compute thread in id order, exactly once; this worker fills a hole left by a NATS reconnect from
the scheduler's resend (``{p}.plan.resend``), so the activations of micro-batch m on the wire
between two stages always belong to m. Done messages are kept a while (by the core) and resent
on the scheduler's ask (``{p}.stage.{r}.dones``); after its own reconnect a stage says so on
``{p}.resync``. A micro-batch whose block tables cannot be built (a lease expired, a bad plan)
still moves zeros of the right shape through the pipeline, so no stage waits forever, and its
``MicroBatchDone`` carries the error.

Re-forming in place (``stage.rendezvous``): the activations travel over the process group of the
current *epoch* (``self._pg``), owned by one compute thread per epoch. A later epoch in the
replica's rendezvous bucket (a restarted stage joined) or a failed send/receive takes the stage
out of service (KV requests refused, plans dropped, health not ok); on a later epoch it drops
its queued work and its group (a peer blocked on a receive from it then fails at once),
releases every request it holds (the scheduler re-admits them), forms the new epoch's group
and serves again. Work of an older epoch never publishes a done message.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections import deque
from collections.abc import Mapping

import torch.distributed as dist
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from wavepp.api.messages import (
    KV_REQUEST_ADAPTER,
    DoneResend,
    DoneResendReply,
    KVReply,
    MicroBatchDone,
    MicroBatchPlan,
    PlanResend,
    PlanResendReply,
    StageResync,
)
from wavepp.api.signing import BusKey
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.heap import collect_young_soon
from wavepp.runtime.kv import BlockPool, HostTier, StageKVManager
from wavepp.runtime.kv.handoff import HandoffLeases
from wavepp.runtime.stage.compute import StageCompute
from wavepp.runtime.stage.core import StageCore, StageWork
from wavepp.runtime.stage.engine import PreparedBatch, StageEngine
from wavepp.runtime.stage.handoff_server import HandoffServer
from wavepp.runtime.stage.loop_profile import LoopProfile
from wavepp.runtime.stage.rendezvous import (
    PEER_BEAT_S,
    EpochRendezvous,
    PeerPresence,
    StageGroupFactory,
)
from wavepp.runtime.transport.natsio import flush_in_order, on_reconnect
from wavepp.telemetry.pipeline import StageTelemetry

log = logging.getLogger(__name__)


_DONE_LOG = 1024  # done messages kept for the scheduler's resend asks


class StageWorker(StageCompute):
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
        group: dist.ProcessGroup | None = None,
        group_epoch: int = 0,
        rendezvous: EpochRendezvous | None = None,
        factory: StageGroupFactory | None = None,
        bus_key: BusKey | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.nc = nc
        self.engine = engine
        # NOTE: done messages carry wall-clock seconds (time.time()): they cross processes.
        self.core = StageCore(
            StageKVManager(
                BlockPool(
                    config.kv_blocks_of(rank),
                    config.block_size,
                    host=HostTier(config.host_kv_blocks_of(rank))
                    if config.host_kv_blocks_of(rank)
                    else None,
                ),
                max_lease_s=config.lease_s,
                max_blocks_per_owner=config.owner_blocks_of(rank),
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
        first_layer, last_layer = config.layers_of(rank)
        # the requests the KV manager released, appended on the loop thread and taken by the
        # compute thread (deque appends and pops are atomic): their engine state is dropped
        self._released: deque[str] = deque()
        self.core.manager.on_release = self._released.append
        self.handoff_leases = HandoffLeases(self.core.manager.pool)
        self.handoff = HandoffServer(
            self.handoff_leases,
            lambda: engine.handoff_caches(),  # type: ignore[attr-defined]
            first_layer=first_layer,
            last_layer=last_layer,
            block_size=config.block_size,
            key=self.core.bus_key,
        )
        self.prefix = config.subject_prefix
        self.subjects = config.subjects
        self._work: queue.Queue[tuple[StageWork, PreparedBatch | None] | None] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = None
        self.telemetry = StageTelemetry(rank)
        # NOTE: the readiness probe (/readyz): True between subscribing and the stop request.
        self.is_serving = False
        # NOTE: the compute thread's own liveness signal: it beats (monotonic seconds) at least
        # every _IDLE_BEAT_S while idle and after each receive and execute; it records the
        # exception that ended it. /healthz and /readyz read compute_alive.
        self.compute_beat = time.monotonic()
        self.compute_error: BaseException | None = None
        self.loop_profile = LoopProfile(rank) if config.profile_dir else None
        self._resend_task: asyncio.Task[None] | None = None
        self._open_resend = False  # the next resend asks for every plan from next_id on
        # The process group of the current epoch (None: single stage), its compute thread's
        # generation; ``is_formed`` is False from a group failure until the next epoch formed.
        self._pg = group
        self.group_epoch = group_epoch
        self.rendezvous = rendezvous
        self.factory = factory
        self.is_formed = True
        self.num_reforms = 0
        self._generation = 0
        # Peers of the current epoch that stopped beating in the rendezvous bucket (their
        # process is gone: so is the group); empty without a rendezvous (a single epoch).
        self.missing_peers: list[int] = []
        self._presence: PeerPresence | None = None

    # ---- loop thread ---------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._start_compute()
        await self.nc.subscribe(self.subjects.stage_kv(self.rank), cb=self._on_kv)
        await self.nc.subscribe(self.subjects.stage_kv_batch(self.rank), cb=self._on_kv_batch)
        # a round to every stage of the replica at once (one publish; the reply names the rank)
        await self.nc.subscribe(self.subjects.stages_kv_batch, cb=self._on_kv_batch)
        await self.nc.subscribe(self.subjects.plan, cb=self._on_plan)
        await self.nc.subscribe(self.subjects.stage_dones(self.rank), cb=self._on_done_resend)
        on_reconnect(self.nc, self._on_reconnected)
        if self.config.handoff_listen:
            host, _, port = self.config.handoff_listen.rpartition(":")
            addr = await self.handoff.start(host, int(port), self.config.handoff_advertise)
            log.info("stage %d: KV handoff server on %s", self.rank, addr)
        await flush_in_order(self.nc)  # subscribed on the server before it says it serves
        log.info("stage %d serving layers %s", self.rank, self.config.layers_of(self.rank))
        expiry = asyncio.create_task(self._expire_loop())
        watcher = asyncio.create_task(self._watch_epochs()) if self.rendezvous else None
        beats = asyncio.create_task(self._watch_peers()) if self.rendezvous else None
        self.is_serving = True
        try:
            await stop.wait()
        finally:
            self.is_serving = False
            expiry.cancel()
            await self.handoff.stop()
            self.handoff_leases.release_all()
            for task in (watcher, beats):
                if task is not None:
                    task.cancel()
            self._work.put(None)
            if self.loop_profile is not None:
                await self._write_profile()

    async def _write_profile(self) -> None:
        """Let the compute thread finish its micro-batch (at most 10 s), then write the profile
        to ``config.profile_dir``."""
        assert self.loop_profile is not None
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        try:
            path = self.loop_profile.write(self.config.profile_dir)
            log.info("stage %d: loop profile written to %s", self.rank, path)
        except OSError as exc:
            log.error("stage %d: loop profile not written: %r", self.rank, exc)

    # ---- re-forming in place -------------------------------------------------------------

    async def _watch_epochs(self) -> None:
        """Re-form whenever the rendezvous bucket moves past this stage's epoch."""
        assert self.rendezvous is not None
        while True:
            epoch = await self.rendezvous.wait_newer(self.group_epoch)
            try:
                await self._reform(epoch)
            except Exception:  # noqa: BLE001 - a member left again: wait for the next epoch
                log.exception("stage %d: forming epoch %d failed", self.rank, epoch)
                self.group_epoch = max(self.group_epoch, epoch)

    @property
    def is_group_complete(self) -> bool:
        """Formed in the current epoch and every peer of it still beating (readiness)."""
        return self.is_formed and not self.missing_peers

    async def _watch_peers(self) -> None:
        """Beat this stage's key of the current epoch and follow its peers' beats
        (``rendezvous.PeerPresence``) every ``PEER_BEAT_S``; ``missing_peers`` names those
        gone."""
        assert self.rendezvous is not None
        epoch, count = -1, 0
        while True:
            now = time.monotonic()
            if epoch != self.group_epoch or self._presence is None:
                epoch = self.group_epoch
                peers = [r for r in range(self.config.num_stages) if r != self.rank]
                self._presence = PeerPresence(peers, now)
            try:
                count += 1
                await self.rendezvous.beat(epoch, count)
                for rank, beat in (await self.rendezvous.peer_beats(epoch)).items():
                    self._presence.observe(rank, beat, time.monotonic())
            except Exception as exc:  # noqa: BLE001 - a reconnecting server: peers unseen meanwhile
                log.debug("stage %d: peer beats: %r", self.rank, exc)
            missing = self._presence.missing(time.monotonic())
            if missing and not self.missing_peers:
                log.warning(
                    "stage %d: peer(s) %s of epoch %d silent; group gone", self.rank, missing, epoch
                )
            self.missing_peers = missing
            await asyncio.sleep(PEER_BEAT_S)

    def _on_group_error(self, generation: int, exc: BaseException) -> None:
        """A send/receive of the group failed (a peer died): out of service until re-formed."""
        if generation == self._generation and self.is_formed:
            log.warning(
                "stage %d: group of epoch %d broke (%r); waiting for the next epoch",
                self.rank,
                self.group_epoch,
                exc,
            )
            self.is_formed = False

    async def _reform(self, epoch: int) -> None:
        """Leave the current group, release everything held, form ``epoch``'s group."""
        assert self.rendezvous is not None and self.factory is not None
        started = time.monotonic()
        self.is_formed = False
        self._generation += 1
        old_queue, self._work = self._work, queue.Queue()
        old_queue.put(None)  # the old compute thread leaves after its current step
        self._pg = None  # its last reference goes with that thread: peers' receives fail
        released = self.core.reform()
        self.handoff_leases.release_all()
        while not await self.rendezvous.join(epoch):
            epoch = await self.rendezvous.wait_newer(epoch)
        self.group_epoch = epoch
        self._pg = await asyncio.to_thread(self.factory.form, epoch)
        self._start_compute()
        self.num_reforms += 1
        self.is_formed = True
        log.warning(
            "stage %d: re-formed in epoch %d in %.2f s (%d held requests released)",
            self.rank,
            epoch,
            time.monotonic() - started,
            len(released),
        )

    @property
    def num_microbatches(self) -> int:
        """Micro-batches this stage finished."""
        return self.core.num_microbatches

    async def _on_kv(self, msg: Msg) -> None:
        if self.is_formed:
            reply = self.core.handle_kv(msg.data)
            if self.group_epoch:
                reply = reply.model_copy(update={"group_epoch": self.group_epoch})
            if self.handoff.addr:
                reply = reply.model_copy(update={"handoff_addr": self.handoff.addr})
        else:
            reply = self._refuse_kv(msg.data)
        await msg.respond(reply.model_dump_json().encode())
        await self._publish_events()

    async def _on_kv_batch(self, msg: Msg) -> None:
        if self.is_formed:
            reply = self.core.handle_kv_batch(msg.data)
        else:  # re-forming: a release batch is applied, anything else refused per request
            reply = self.core.handle_kv_batch(
                msg.data,
                refuse=f"stage {self.rank}: re-forming its group (epoch {self.group_epoch})",
            )
        await msg.respond(reply)
        collect_young_soon()  # answered: the young generation now, not inside a later round
        await self._publish_events()

    def _refuse_kv(self, payload: bytes) -> KVReply:
        """Out of service (re-forming): a release is applied, anything else refused."""
        try:
            op = KV_REQUEST_ADAPTER.validate_json(payload).op
        except ValueError:
            op = "invalid"
        if op == "release":
            return self.core.handle_kv(payload)
        return KVReply(
            rank=self.rank,
            ok=False,
            error=f"stage {self.rank}: re-forming its group (epoch {self.group_epoch}); {op} "
            "refused",
            group_epoch=self.group_epoch,
        )

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.lease_s / 4))
            for request_id in self.core.expire():
                log.warning("stage %d: lease of %s expired; released", self.rank, request_id)
            for request_id in self.handoff_leases.expire(time.time()):
                log.warning(
                    "stage %d: handoff lease of %s ended unpulled; released", self.rank, request_id
                )
            await self._publish_events()

    async def _publish_events(self) -> None:
        batch = self.core.take_kv_events()
        if batch is None:
            return
        await self.nc.publish(self.subjects.kv_events(self.rank), batch.model_dump_json().encode())

    async def _on_plan(self, msg: Msg) -> None:
        if not self.is_formed:
            return  # for a broken group; the scheduler re-admits its requests after the re-form
        began = time.perf_counter()
        try:
            plan = MicroBatchPlan.model_validate_json(msg.data)
        except ValueError as exc:
            log.error("stage %d: invalid plan dropped: %s", self.rank, exc)
            return
        if self.loop_profile is not None:
            self.loop_profile.add("plan_decode", time.perf_counter() - began)
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
        """Start the resend task when plans wait on a hole (or after a reconnect)."""
        wanted = self._open_resend or self.core.sequencer.gap() is not None
        if wanted and (self._resend_task is None or self._resend_task.done()):
            self._resend_task = asyncio.ensure_future(self._resend_loop())

    async def _resend_loop(self) -> None:
        """Ask the scheduler for missed plans until no hole is left; back off while it is away."""
        delay_s = 0.05
        while True:
            epoch = self.core.sequencer.epoch
            if self._open_resend and epoch:
                span: tuple[int, int | None] | None = (self.core.sequencer.next_id, None)
            else:
                span = self.core.sequencer.gap()
            self._open_resend = False
            if span is None:
                return
            ask = PlanResend(epoch=epoch, from_id=span[0], to_id=span[1], rank=self.rank)
            try:
                msg = await self.nc.request(
                    self.subjects.plan_resend,
                    ask.model_dump_json().encode(),
                    timeout=min(2.0, self.config.request_timeout_s),
                )
                reply = PlanResendReply.model_validate_json(msg.data)
                items = self.core.resend_items(reply)
                if items is None:
                    raise ValueError("resend reply without an epoch or a valid mac")
            except Exception as exc:  # noqa: BLE001 - no responder yet, timeout, a bad reply
                log.warning("stage %d: plan resend %s failed: %r", self.rank, span, exc)
                if span[1] is None:
                    self._open_resend = True
                await asyncio.sleep(delay_s)
                delay_s = min(1.0, delay_s * 2)
                continue
            if reply.epoch != epoch:
                # The scheduler that published the held plans is gone: run what we hold, in
                # order, rather than wait for plans nobody can resend.
                log.warning(
                    "stage %d: resend answered by epoch %s, held plans are of %s; running them",
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
        self._open_resend = True
        self._fill_gaps()
        try:
            await self.nc.publish(
                self.subjects.resync, StageResync(rank=self.rank).model_dump_json().encode()
            )
        except Exception as exc:  # noqa: BLE001 - the scheduler's own reconnect asks anyway
            log.warning("stage %d: resync notice failed: %r", self.rank, exc)

    async def _on_done_resend(self, msg: Msg) -> None:
        try:
            ask = DoneResend.model_validate_json(msg.data)
        except ValueError as exc:
            log.error("stage %d: invalid done resend ask dropped: %s", self.rank, exc)
            return
        reply = DoneResendReply(
            rank=self.rank, dones=self.core.dones(ask.epoch, ask.microbatch_ids)
        )
        await msg.respond(reply.model_dump_json().encode())

    def _accept_plan(self, plan: MicroBatchPlan, headers: Mapping[str, str] | None) -> None:
        """Let the core build the block tables, prepare in wave mode, queue for compute."""
        began = time.perf_counter()
        self.telemetry.plan_received(plan, headers)
        work = self.core.accept(plan)
        prepared = None
        self._apply_transfers(work)
        if work.prepare_on_arrival:
            try:
                prepared = self.engine.prepare(work.chunks)
            except ValueError as exc:
                work.error = f"stage {self.rank}: prepare failed: {exc}"
        work.prepare_end_s = time.time()
        if self.loop_profile is not None:
            self.loop_profile.add("plan_accept", time.perf_counter() - began)
            self.loop_profile.plan_done()
        self._work.put((work, prepared))

    def _apply_transfers(self, work: StageWork) -> None:
        """Issue ``work``'s host-tier copies (``StageEngine.apply_transfers``) as its plan is
        accepted: every plan's, in plan order, whether it runs or not (a re-form drops queued
        work, never a copy the pool's bookkeeping has made). A failure fails the micro-batch
        and the pool forgets what the log claims (``StageCore.apply_transfers``)."""
        self.core.apply_transfers(work, self.engine.apply_transfers)

    def _after_microbatch(self, work: StageWork, done: MicroBatchDone) -> None:
        self.telemetry.microbatch_done(work.plan, done)
        self.core.complete(work, done)
        self.handoff.record_execute(done.execute_start_s, done.execute_end_s)
        if not done.error:
            self._hold_handoffs(work)
        asyncio.ensure_future(self._publish_done(done))

    def _hold_handoffs(self, work: StageWork) -> None:
        """Pin the blocks of each request of ``work`` whose prefill ended here and that is
        handed to a decode engine (``handoff_expires``), before the scheduler releases it."""
        for c in work.plan.chunks:
            if not (c.is_last and c.handoff_expires):
                continue
            try:
                self.handoff_leases.hold(
                    c.request_id,
                    tuple(self.core.manager.block_table(c.request_id)),
                    c.context_offset + len(c.token_ids),
                    c.handoff_expires,
                )
            except (KeyError, ValueError) as exc:
                log.warning("stage %d: no handoff for %s: %s", self.rank, c.request_id, exc)

    async def _publish_done(self, done: MicroBatchDone) -> None:
        await self.nc.publish(self.subjects.done, done.model_dump_json().encode())
        await self._publish_events()
