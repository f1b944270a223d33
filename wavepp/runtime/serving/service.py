"""The admission service (``wavepp admission``): one pipeline replica's admission controller and
wave scheduler, serving requests from its durable JetStream intake.

    gateway --js publish {p}.intake (Nats-Msg-Id = key)--> stream WAVEPP_INTAKE_{ns}_{pipeline}
    admission: durable pull consumer "admission"
        result already in KV?  -> republish it, ack (a redelivery or a duplicate: answered once)
        else submit to the WaveScheduler (in_progress() keeps the message while it runs)
             -> PrefillResult -> KV put -> publish wavepp.{ns}.{pool}.result.{key} -> ack

Delivery is at-least-once: a service killed mid-request leaves its messages unacked; JetStream
redelivers them after ``ack_wait_s`` to the next service, which finds no stored result and runs
them. Scheduler request ids are ``{key}@{instance}.{n}`` (``runs.Runs``; n: the instance's run
count), so a rerun never collides with the pins a dead instance, or a withdrawn run of this
one, left behind (their leases expire, or the run's release frees them).

The service also publishes a heartbeat (``{p}.admission.heartbeat``, every 0.5 s) with whether
every stage answered its last health probe (probed every beat once serving) and no re-form is
under way; the gateway's router uses it for pool membership and ``/readyz``.

Draining (``run``'s ``stop``: SIGTERM, as the kubelet sends when the operator scales a replica
away or replaces it): a heartbeat at once says ``draining`` and not ready, so the gateway takes
the replica out of the pool and routes nothing new to it, but waits for its answers instead of
re-routing them. The service keeps serving its intake until the stream holds nothing for it
(no message pending or unacked, none running, and at least ``DRAIN_SETTLE_S`` after that beat,
so that requests the gateway published before it saw the beat are served too), then sends a
last beat (not draining) and returns. Bounded by ``drain_timeout_s`` (the pod's grace period
less a margin); requests left then stay in the durable intake, and the gateway re-routes them
on that last beat. A drain whose stages stop answering (a failure drain: the stage pods go at
the same time) ends after ``DRAIN_UNFORMED_BEATS`` beats; its heartbeat meanwhile says not
draining, so the gateway re-routes at once. Around a re-form of
the stages' group (``serving.reform``) it holds its plans, then re-admits what it had admitted.
A request re-routed by the gateway may run on two replicas: an error stored by one never hides
the other's answer (a stored error of another replica is run again here; an error never
overwrites a stored answer). It subscribes to the pipeline's plans and done messages to report per-stage
timings of each request (prepare and execute seconds, summed over the request's micro-batches).

Cancels: the gateway publishes an ``IntakeCancel`` on ``{p}.cancel`` for a request it gave up
on (answered with an error, or its client left). The service remembers it
(``cancels.CancelMemory``); the cancelled message (same key and ``arrival_s``) is then acked
unserved when it is delivered (a redelivery). One already running, with no other message
waiting on its run, is withdrawn from the scheduler (``WaveScheduler.withdraw``): queued or
agreeing, it leaves at once; admitted, no further chunk of it is planned, its micro-batches in
flight finish and its pins are then released on every stage (counted in ``num_withdrawn``).
One whose last chunk is already planned, or that a retry joined before the cancel came, runs to
its end and has its KV handoff lease released on every stage as soon as its prefill ends. In
every case its result is neither stored nor published (counted in ``num_cancelled``, once per
message). A retry of it (same key, another arrival) that comes while it runs revokes the cancel
and gets its answer; one that comes after its run was withdrawn starts a new run. A cancel lost
on the bus (none of the replica's admission instances subscribed: one restarting) leaves the
lease to its expiry (``handoff_lease_s``).

With a bus key (``wavepp.api.signing``; ``bus_key``) the service signs its KV ops, plans,
heartbeats (numbered, stamped) and results with its replica's key, and answers a redelivery
from the results bucket only with an entry whose tag checks (an entry planted by a client is
ignored and overwritten).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import defaultdict
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
)

from wavepp.api.messages import MicroBatchDone
from wavepp.api.prefill import (
    Heartbeat,
    IntakeCancel,
    IntakeRequest,
    PrefillResult,
    StageTiming,
)
from wavepp.api.signing import BusKey
from wavepp.api.subjects import (
    cancel_subject,
    heartbeat_subject,
    intake_stream,
    intake_subject,
    result_subject,
)
from wavepp.runtime.agreement import StageVersionError
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.heap import settle_heap
from wavepp.runtime.planning import CostModel, planner_for
from wavepp.runtime.request import PromptRequest, RequestOutcome
from wavepp.runtime.scheduling.nats_transport import NatsPlanTransport
from wavepp.runtime.scheduling.scheduler import WaveScheduler
from wavepp.runtime.serving.cancels import CancelMemory
from wavepp.runtime.serving.controller import replica_controller
from wavepp.runtime.serving.handoff import kv_transfer_params, release_handoff, stage_endpoints
from wavepp.runtime.serving.reform import ReformTracker
from wavepp.runtime.serving.results import ResultStore, result_from_outcome, result_is_authentic
from wavepp.runtime.serving.runs import Runs
from wavepp.runtime.transport.jetstream import ensure_intake

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
# A drain waits at least this long after its first draining beat before it may end: requests
# the gateway published before it took the replica out of the pool are then in the intake.
DRAIN_SETTLE_S = 1.0
# A drain ends early after this many beats in a row with a stage not formed (it cannot finish).
DRAIN_UNFORMED_BEATS = 3
# The gateway takes at most one heartbeat per 0.1 s per replica (gateway.trust): an early beat
# (the drain's) waits this long after the previous one.
MIN_BEAT_GAP_S = 0.15
# How long a JetStream call of the service may wait for the server (a pause, a restart).
STORE_TIMEOUT_S = 60.0


class AdmissionService:
    """Serves one replica's intake; see the module docstring.

    Args:
        config: the replica's RuntimeConfig (its ``pipeline`` names the replica).
        nc: the process's NATS connection (owned by the caller).
        planner_cost_model: the chunk planner's cost model.
        pool: the pool's name (results bucket and result subjects).
        ack_wait_s: JetStream redelivers a message unacked for this long (a dead service).
        max_concurrent: requests taken from the stream and not yet answered, at most.
        startup_timeout_s: how long to wait for every stage to answer a health probe.
        store_timeout_s: how long a JetStream call (the results bucket) may wait for the server.
        bus_key: the deployment's bus key (``load_bus_key``); this replica signs with the key
            derived for it. None: unsigned (insecure mode).
        drain_timeout_s: after ``stop``, how long to keep serving what the intake holds (>= 0).

    Raises:
        ValueError: ``drain_timeout_s`` < 0.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        nc: NATS,
        planner_cost_model: CostModel,
        *,
        pool: str,
        ack_wait_s: float = 10.0,
        max_concurrent: int = 64,
        startup_timeout_s: float = 300.0,
        store_timeout_s: float = STORE_TIMEOUT_S,
        bus_key: BusKey | None = None,
        drain_timeout_s: float = 30.0,
    ) -> None:
        if not drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s={drain_timeout_s}: must be >= 0")
        self.config = config
        self.drain_timeout_s = drain_timeout_s
        self.is_draining = False
        self.drained_at_s: float | None = None  # monotonic, when the drain ended
        self._unformed_beats = 0
        self._version_refusal = ""  # the last stage-version refusal logged (logged once)
        self._beat_now = asyncio.Event()
        self._num_beats = 0
        self.nc = nc
        self.pool = pool
        self.ack_wait_s = ack_wait_s
        self.max_concurrent = max_concurrent
        self.startup_timeout_s = startup_timeout_s
        self.instance = uuid.uuid4().hex[:8]
        self.bus_key = bus_key
        self.replica_key = None if bus_key is None else bus_key.for_replica(config.pipeline)
        # JetStream calls (results get/put) wait out a paused or restarting server for as long
        # as the intake message stays ours (kept in progress meanwhile), not the client's 5 s.
        self.js = nc.jetstream(timeout=store_timeout_s)
        self.results = ResultStore(nc, self.js, functools.partial(result_is_authentic, bus_key))
        self.controller = replica_controller(nc, config, planner_cost_model, self.replica_key)
        planner = planner_for(config, planner_cost_model)
        # Micro-batch ids start at wall-clock ms: logs and traces of successive instances do
        # not repeat ids (the plans' epoch already keeps their done messages apart).
        self.scheduler = WaveScheduler(
            config,
            NatsPlanTransport(nc, config.subjects),
            self.controller,
            planner,
            on_stage_done=self._on_stage_done,
            first_microbatch_id=int(time.time() * 1000),
        )
        self.num_stages_formed = 0
        self.stage_epochs: tuple[int, ...] = ()
        self.handoff_addrs: list[str] = []  # each stage's KV transfer server, its last health
        self.reform = ReformTracker()
        self.num_answered = 0
        self.num_duplicates = 0
        self._runs = Runs(self.instance)  # by key: its run on the scheduler
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(max_concurrent)
        self._timings: dict[str, dict[int, StageTiming]] = defaultdict(dict)
        self.cancelled = CancelMemory()
        # Cancelled messages acked unserved or whose run's result was dropped; of those,
        # ``num_withdrawn``: runs withdrawn from the scheduler before their prefill ended.
        self.num_cancelled = 0
        self.num_withdrawn = 0

    @property
    def is_intake_open(self) -> bool:
        """The results bucket is open and the intake about to be (or being) served."""
        return self.results.is_open

    # ---- lifecycle -----------------------------------------------------------------------

    async def wait_formed(self) -> None:
        """Wait until every stage answers a health probe (deadline ``startup_timeout_s``).

        Raises:
            StageVersionError: a stage speaks another protocol version (logged as one line
                naming both; no round is attempted).
            TimeoutError: not every stage formed before the deadline.
        """
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                if await self._probe_stages():
                    return
            except StageVersionError as exc:
                log.error("%s: %s", self.config.pipeline, exc)
                raise
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.config.pipeline}: {self.num_stages_formed}/{self.config.num_stages} "
                    f"stages formed after {self.startup_timeout_s}s"
                )
            await asyncio.sleep(0.2)

    async def _probe_stages(self) -> bool:
        """Whether every stage answered a health probe formed. Raises ``StageVersionError``
        for a stage of another protocol version (counted as none formed)."""
        try:
            replies = await asyncio.wait_for(self.controller.health(), 2.0)
            self.num_stages_formed = sum(1 for r in replies if r.ok)
            self.stage_epochs = tuple(r.group_epoch for r in replies)
            self.handoff_addrs = [r.handoff_addr for r in replies]
        except StageVersionError:
            self.num_stages_formed = 0
            raise
        except Exception:  # noqa: BLE001 - any stage silent: not formed
            self.num_stages_formed = 0
        return self.num_stages_formed == self.config.num_stages

    async def run(self, stop: asyncio.Event) -> None:
        """Form, serve the intake until ``stop`` is set, then drain in-flight requests."""
        heartbeat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        try:
            await self.wait_formed()
            await self.scheduler.start()
            await ensure_intake(self.js, self.config.pipeline, namespace=self.config.namespace)
            await self.results.open(self.pool, self.config.namespace)
            cancels = await self.nc.subscribe(
                cancel_subject(self.config.pipeline, namespace=self.config.namespace),
                cb=self._on_cancel,
            )
            psub = await self.js.pull_subscribe(
                intake_subject(self.config.pipeline, namespace=self.config.namespace),
                durable="admission",
                stream=intake_stream(self.config.pipeline, namespace=self.config.namespace),
                config=ConsumerConfig(
                    ack_policy=AckPolicy.EXPLICIT,
                    ack_wait=self.ack_wait_s,
                    max_ack_pending=self.max_concurrent * 4,
                ),
            )
            settle_heap()  # start-up's objects frozen, young collections short
            log.info("%s: admission %s serving", self.config.pipeline, self.instance)
            fetcher = asyncio.create_task(self._fetch_loop(psub), name="fetch")
            await stop.wait()
            await self._drain(psub)
            fetcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await fetcher
            # A cancelled fetch leaves the pull subscription waiting; drop it so that the
            # connection's drain does not wait on it.
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
            with contextlib.suppress(Exception):
                await cancels.unsubscribe()
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            if self.is_draining:
                await asyncio.sleep(MIN_BEAT_GAP_S)
                await self._publish_beat(last=True)
            await self.scheduler.stop()

    async def _drain(self, psub) -> None:  # noqa: ANN001 - PullSubscription
        """Leave the pool and serve what the intake holds; see the module docstring."""
        self.is_draining = True
        self._beat_now.set()
        started = time.monotonic()
        log.info(
            "%s: draining (at most %.0f s): %d requests running",
            self.config.pipeline,
            self.drain_timeout_s,
            len(self._runs),
        )
        left = -1
        while True:
            now = time.monotonic()
            if now - started >= self.drain_timeout_s:
                break
            if self._unformed_beats >= DRAIN_UNFORMED_BEATS:
                log.warning("%s: stages not formed; drain ends", self.config.pipeline)
                break
            if now - started >= DRAIN_SETTLE_S and not self._tasks:
                try:
                    info = await asyncio.wait_for(psub.consumer_info(), 2.0)
                    left = info.num_pending + info.num_ack_pending
                except Exception:  # noqa: BLE001 - a slow server: ask again
                    left = -1
                if left == 0 and not self._tasks:
                    break
            await asyncio.sleep(0.05)
        self.drained_at_s = time.monotonic()
        if left != 0 or self._tasks:
            log.warning(
                "%s: drain ended after %.1f s with requests left (%d running); the gateway "
                "re-routes them",
                self.config.pipeline,
                self.drained_at_s - started,
                len(self._runs),
            )
        else:
            log.info(
                "%s: drained in %.1f s, %d answered in all",
                self.config.pipeline,
                self.drained_at_s - started,
                self.num_answered,
            )

    async def _heartbeat_loop(self) -> None:
        while True:
            if self.scheduler.is_serving:
                try:
                    formed = await self._probe_stages()
                except StageVersionError as exc:  # a stage replaced by another build: held
                    if str(exc) != self._version_refusal:
                        log.error("%s: %s", self.config.pipeline, exc)
                    self._version_refusal, formed = str(exc), False
                else:
                    self._version_refusal = ""
                await self._follow_stages(formed)
                self._unformed_beats = 0 if formed else self._unformed_beats + 1
            await self._publish_beat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), HEARTBEAT_INTERVAL_S)
            if self._beat_now.is_set():  # the drain's beat: at once, past the gateway's limit
                self._beat_now.clear()
                await asyncio.sleep(MIN_BEAT_GAP_S)

    async def _publish_beat(self, *, last: bool = False) -> None:
        """One heartbeat; ``last``: the drain is over (neither ready nor draining)."""
        formed = (
            self.scheduler.is_serving
            and self.num_stages_formed == self.config.num_stages
            and not self.reform.is_paused
        )
        beat = Heartbeat(
            pipeline=self.config.pipeline,
            ready=formed and not self.is_draining,
            num_stages_formed=self.num_stages_formed,
            num_inflight=len(self._runs),
            instance=self.instance,
            pool=self.pool,
            num_stages=self.config.num_stages,
            draining=formed and self.is_draining and not last,
            seq=self._num_beats,
            sent_at_s=time.time(),
        )
        self._num_beats += 1
        if self.replica_key is not None:
            beat = self.replica_key.sign(beat)
        subject = heartbeat_subject(self.config.pipeline, namespace=self.config.namespace)
        with contextlib.suppress(Exception):
            await self.nc.publish(subject, beat.model_dump_json().encode())
            if last:
                await self.nc.flush(timeout=1)

    async def _follow_stages(self, is_formed: bool) -> None:
        """Hold plans while a stage is not formed; after a re-form, re-admit (see module)."""
        action = self.reform.observe(is_formed, self.stage_epochs)
        if action == "pause":
            log.warning(
                "%s: %d/%d stages formed; plans held",
                self.config.pipeline,
                self.num_stages_formed,
                self.config.num_stages,
            )
            self.scheduler.pause_plans()
        elif action == "resume":
            self.scheduler.reopen_plans()
        elif action == "readmit":
            # The stages released everything they held; renew no lease of it.
            self.controller.forget(sorted(self.controller.live_request_ids))
            self.scheduler.resume_plans(readmit=True)
            log.warning(
                "%s: stages re-formed (epochs %s); %d requests re-admitted so far",
                self.config.pipeline,
                self.stage_epochs,
                self.scheduler.num_readmitted,
            )

    # ---- intake --------------------------------------------------------------------------

    async def _fetch_loop(self, psub) -> None:  # noqa: ANN001 - PullSubscription
        while True:
            await self._slots.acquire()
            try:
                msgs = await psub.fetch(batch=1, timeout=1.0)
            except (NatsTimeoutError, TimeoutError):
                self._slots.release()
                continue
            except Exception as exc:  # noqa: BLE001 - server restarting: retry
                self._slots.release()
                log.warning("intake fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                task = asyncio.create_task(self._handle(msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _on_cancel(self, msg: Msg) -> None:
        """Remember an ``IntakeCancel``, and withdraw its run from the scheduler when every
        message waiting on the run is the cancelled one (module docstring); a malformed one is
        dropped."""
        try:
            cancel = IntakeCancel.model_validate_json(msg.data)
        except ValueError as exc:
            log.warning("invalid cancel dropped: %s", exc)
            return
        self.cancelled.add(cancel, time.monotonic())
        run = self._runs.get(cancel.key)
        if run is None or run.withdrawn or run.arrivals != {cancel.arrival_s}:
            return
        if self.scheduler.withdraw(run.scheduler_id):
            run.withdrawn = True
            self.num_withdrawn += 1
            log.info("%s: cancelled by the gateway; withdrawn from the scheduler", cancel.key)

    async def _handle(self, msg: Msg) -> None:
        try:
            try:
                request = IntakeRequest.model_validate_json(msg.data)
            except ValueError as exc:
                log.error("invalid intake message terminated: %s", exc)
                await msg.term()
                return
            if request in self.cancelled:
                if not self._runs.is_running(request.key):
                    await self._ack_cancelled(msg, request)
                    return
            elif self._runs.is_running(request.key):
                # a retry (another arrival) joins the cancelled one's run: it is answered
                self.cancelled.discard(request.key)
            stored = await self.results.get(request.key)
            if request in self.cancelled and not self._runs.is_running(request.key):
                await self._ack_cancelled(msg, request)  # cancelled while the store answered
                return
            foreign = stored is not None and stored.result.replica != self.config.pipeline
            if foreign and stored.result.error:
                stored = None  # failed on a replica the gateway re-routed it from: run it here
            if stored is not None:
                self.num_duplicates += 1
                await self.nc.publish(
                    result_subject(self.pool, request.key, namespace=self.config.namespace),
                    stored.data,
                )
                await msg.ack()
                return
            run = self._runs.get(request.key)
            if run is None or run.withdrawn:  # a withdrawn run answers nobody: a new one
                run = self._runs.start(
                    request.key,
                    lambda scheduler_id: asyncio.create_task(self._execute(request, scheduler_id)),
                )
            run.arrivals.add(request.arrival_s)
            keepalive = asyncio.create_task(self._keep_in_progress(msg))
            try:
                result = await asyncio.shield(run.task)
                if run.withdrawn or request in self.cancelled:
                    await self._drop_cancelled(request, result, withdrawn=run.withdrawn)
                    await msg.ack()
                    return
                if self.replica_key is not None:
                    result = self.replica_key.sign(result)
                data = result.model_dump_json().encode()
                answered = await self.results.get(request.key) if result.error else None
                if answered is not None and not answered.result.error:
                    data = (
                        answered.data
                    )  # another replica answered it: an error never overwrites that
                else:
                    await self.results.put(request.key, data)
                await self.nc.publish(
                    result_subject(self.pool, request.key, namespace=self.config.namespace), data
                )
                await msg.ack()
            finally:
                keepalive.cancel()
            self.num_answered += 1
        except Exception:
            log.exception("intake message failed; it will be redelivered")
        finally:
            self._slots.release()

    async def _ack_cancelled(self, msg: Msg, request: IntakeRequest) -> None:
        log.info("%s: cancelled by the gateway; acked unserved", request.key)
        self.num_cancelled += 1
        await msg.ack()

    async def _drop_cancelled(
        self, request: IntakeRequest, result: PrefillResult, *, withdrawn: bool
    ) -> None:
        """A cancelled request's run ended (its prefill, or ``withdrawn`` from the scheduler):
        release its handoff lease on every stage now; nobody waits for its result, which is
        neither stored nor published."""
        self.num_cancelled += 1
        released = 0
        if result.kv_transfer_params:
            released = await release_handoff(result.kv_transfer_params)
        log.info(
            "%s: cancelled by the gateway; its %s, handoff released on %d stages",
            request.key,
            "run withdrawn" if withdrawn else "prefill ended",
            released,
        )

    async def _keep_in_progress(self, msg: Msg) -> None:
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def _execute(self, request: IntakeRequest, scheduler_id: str) -> PrefillResult:
        if request.handoff and self.replica_key is None:
            return PrefillResult(
                request_id=request.request_id,
                tenant=request.tenant,
                replica=self.config.pipeline,
                error="kv_transfer_params: this deployment has no bus key, so no decode engine "
                "can be authenticated and every stage refuses a pull (WAVEPP_BUS_KEY)",
            )
        outcome = await self.scheduler.submit(
            PromptRequest(
                request_id=scheduler_id,
                token_ids=request.token_ids,
                cache_salt=request.cache_salt,
                arrival_s=time.time(),
                handoff=request.handoff,
                traceparent=request.traceparent,
            )
        )
        timings = self._timings.pop(scheduler_id, {})
        transfer = None
        if request.handoff and outcome.ok:
            try:
                transfer = self._kv_transfer_params(outcome)
            except ValueError as exc:
                outcome.error = str(exc)  # the stages' leases expire unpulled
        return result_from_outcome(
            request,
            outcome,
            replica=self.config.pipeline,
            stages=[timings[r] for r in sorted(timings)],
            transfer=transfer,
        )

    def _kv_transfer_params(self, outcome: RequestOutcome) -> dict[str, Any]:
        """The ``kv_transfer_params`` of a handed-off ``outcome`` (its scheduler id names the
        stages' leases), stage addresses from the last health replies.

        Raises:
            ValueError: no lease was stamped, or a stage has no KV transfer server.
        """
        assert self.replica_key is not None, "checked before the request ran"
        if not outcome.handoff_expires:
            raise ValueError(f"request {outcome.request_id!r}: no handoff lease was stamped")
        endpoints = stage_endpoints(
            self.handoff_addrs, [self.config.layers_of(r) for r in range(self.config.num_stages)]
        )
        return kv_transfer_params(
            self.replica_key,
            outcome.request_id,
            outcome.num_prompt_tokens,
            outcome.handoff_expires,
            endpoints,
        )

    # ---- per-stage timings ---------------------------------------------------------------

    def _on_stage_done(self, done: MicroBatchDone, owners: list[str]) -> None:
        """Sum each stage's prepare/execute time per request (the scheduler calls this once per
        micro-batch and stage, with the request id of each chunk)."""
        agreed = list(done.num_agreed_blocks) + [-1] * len(owners)
        for request_id, num_agreed in zip(owners, agreed, strict=False):
            if self._runs.of_scheduler_id(request_id) is None:
                continue  # not (or no longer) running here: nobody reads its timings
            timing = self._timings[request_id].setdefault(done.rank, StageTiming(rank=done.rank))
            timing.prepare_s += done.prepare_end_s - done.prepare_start_s
            timing.execute_s += done.execute_end_s - done.execute_start_s
            timing.num_agreed_blocks = num_agreed
