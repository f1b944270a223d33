"""The gateway's engine: tenant limits, fair-share queue, routing, durable intake, results.

One ``Gateway`` per process, over one NATS connection. ``prefill`` is the whole path of one
request after validation::

    stored result? (duplicate: the stored answer) -> same key pending? (join it)
    -> queue limit: max_queued_requests queued or running in this gateway (429)
    -> tenant limits (429): max_queued waiting, max_concurrency, tokens_per_s
    -> fair-share queue (a slot among max_outstanding_per_replica x replicas in the pool)
    -> router: replica with the longest reusable prefix (ties: least loaded)
    -> JetStream publish {p}.intake, Nats-Msg-Id = key -> wait for wavepp.{ns}.{pool}.result.{key}
       (the replica leaves the pool meanwhile: publish to another replica; an error answer
       from a replica it left is not the answer, the other replica's is; with no other
       replica in the pool, fail after ``replica_unready_fail_s`` with ReplicaUnavailable;
       a replica that leaves because it drains (scale-down: heartbeat ``draining``) is
       waited for, not re-routed from, while it beats)
    -> given up (an error raised, or the caller cancelled: its client left): ``IntakeCancel``
       to every replica it was published to, which then neither serves it later (a
       redelivery, a re-admission) nor keeps its KV handoff lease (``AdmissionService``)

The pool follows the heartbeats (``heartbeat_wildcard``: the heartbeats of its namespace): a replica of this pool that was not
configured is added when it beats (a scale-up), one silent for ``replica_forget_s`` is dropped
(a scale-down). The gateway is ready while at least one replica is in the pool.

Heartbeats, results (published and stored) and KV events count only when ``trust.BusGuard``
accepts them: signed by the replica (with a bus key), a result only from a replica the request
was routed to, heartbeats fresh and rate-limited.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js.errors import APIError

from wavepp.api.messages import KVEventBatch
from wavepp.api.prefill import Heartbeat, IntakeCancel, IntakeRequest, PrefillResult
from wavepp.api.signing import BusKey
from wavepp.api.subjects import (
    ReplicaSubjects,
    cancel_subject,
    heartbeat_subject,
    heartbeat_wildcard,
    intake_stream,
    intake_subject,
    replica_prefix,
    result_subject,
)
from wavepp.gateway.bus_watch import BusWatch
from wavepp.gateway.config import (
    INTAKE_RETRY_AFTER_S,
    GatewayConfig,
    IntakeUnavailable,
    ReplicaUnavailable,
)
from wavepp.gateway.metrics import GatewayLoad, GatewayMetrics, JetStreamStore
from wavepp.gateway.router import PoolRouter
from wavepp.gateway.tenants import FairShareQueue, LimitExceeded, TenantLimiter
from wavepp.gateway.trust import BusGuard
from wavepp.gateway.validation import ParsedRequest
from wavepp.runtime.kv import hash_prompt_blocks
from wavepp.runtime.serving.results import ResultStore
from wavepp.runtime.transport.jetstream import ensure_intake
from wavepp.runtime.transport.natsio import flush_in_order, on_reconnect, resend_after_reconnect
from wavepp.telemetry import tracing

log = logging.getLogger(__name__)

# How many keys given up on (cancelled) the gateway remembers, for retries of them (``_run``).
MAX_GIVEN_UP = 65536


class Gateway:
    """See the module docstring. ``clock`` is monotonic seconds (tests may pass a fake);
    ``bus_key`` the deployment's (``load_bus_key``), None: insecure mode."""

    def __init__(
        self,
        config: GatewayConfig,
        nc: NATS,
        *,
        clock: Callable[[], float] = time.monotonic,
        bus_key: BusKey | None = None,
    ) -> None:
        self.config = config
        self.nc = nc
        # JetStream calls (the results lookup of every request, the intake publish) wait out a
        # paused or restarting server for as long as a request may, not the client's 5 s.
        self.js = nc.jetstream(timeout=config.request_timeout_s)
        self.clock = clock
        self.tenants = {t.name: t for t in config.tenants}
        self.limiter = TenantLimiter(config.tenants, max_prompt_tokens=config.max_prompt_tokens)
        self.fair: FairShareQueue[asyncio.Future[None]] = FairShareQueue(
            {t.name: t.weight for t in config.tenants},
            {t.name: t.priority for t in config.tenants},
        )
        self.router = PoolRouter(
            [(r.pipeline, r.num_stages, r.stage_blocks) for r in config.replicas],
            policy=config.routing,
            timeout_s=config.replica_timeout_s,
        )
        self.metrics = GatewayMetrics(self.load, pool=config.pool)
        self.num_outstanding = 0
        self._pending: dict[str, asyncio.Future[PrefillResult]] = {}
        self._waiters: dict[str, asyncio.Future[PrefillResult]] = {}
        self._routed: dict[str, set[str]] = {}  # key -> replicas its intake was published to
        # keys this gateway gave up on and cancelled (``_cancel``), oldest first, at most
        # MAX_GIVEN_UP: a retry of one is published anew, not deduplicated into the cancelled one
        self._given_up: dict[str, bool] = {}
        self.guard = BusGuard(
            bus_key, [r.pipeline for r in config.replicas], max_added=config.max_replicas
        )
        self.results = ResultStore(self.nc, self.js, self.guard.stored)
        self._subs: list[object] = []
        self._watched: set[str] = set()  # replicas whose KV events feed the router
        self._configured = {r.pipeline for r in config.replicas}
        self.bus = BusWatch(nc, clock)

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        for replica in self.config.replicas:
            await ensure_intake(self.js, replica.pipeline, namespace=self.config.namespace)
        await self.results.open(self.config.pool, self.config.namespace)
        self._subs.append(
            await self.nc.subscribe(
                result_subject(self.config.pool, ">", namespace=self.config.namespace),
                cb=self._on_result,
            )
        )
        for replica in self.config.replicas:
            self._subs.append(
                await self.nc.subscribe(
                    heartbeat_subject(replica.pipeline, namespace=self.config.namespace),
                    cb=functools.partial(self._on_heartbeat, replica.pipeline),
                )
            )
            await self._watch_kv_events(replica.pipeline)
        self._subs.append(
            await self.nc.subscribe(
                heartbeat_wildcard(namespace=self.config.namespace),
                cb=self._on_pool_heartbeat,
            )
        )
        await flush_in_order(self.nc)
        on_reconnect(self.nc, self.recover_results)
        self.bus.start()

    def is_bus_silent(self, now: float) -> bool:
        """The server has not answered this gateway for a while (``BusWatch.is_silent``)."""
        return self.bus.is_silent(now)

    @property
    def jetstream_store(self) -> JetStreamStore | None:
        """The account's JetStream store as the bus watch last read it (None: not yet)."""
        return self.bus.store

    async def _watch_kv_events(self, pipeline: str) -> None:
        self._watched.add(pipeline)
        self._subs.append(
            await self.nc.subscribe(
                ReplicaSubjects(
                    replica_prefix(pipeline, namespace=self.config.namespace)
                ).kv_events("*"),
                cb=functools.partial(self._on_kv_events, pipeline),
            )
        )

    async def stop(self) -> None:
        await self.bus.stop()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # type: ignore[attr-defined]
        self._subs = []
        self.metrics.shutdown()

    async def recover_results(self) -> None:
        """After a reconnect: answer every waiting request whose result is in the results
        bucket. A result published while the server was down (or restarting) never reached
        this gateway; the replica stored it first, so the bucket has it. Without this the
        request waited for its deadline (``request_timeout_s``) before looking there."""
        for key, waiter in list(self._waiters.items()):
            if waiter.done():
                continue
            try:
                stored = await self.stored_result(key)
            except Exception as exc:  # noqa: BLE001 - the deadline's own lookup still follows
                log.warning("results lookup of %s after a reconnect failed: %r", key, exc)
                continue
            if stored is not None and not waiter.done():
                waiter.set_result(stored)

    # ---- subscriptions -------------------------------------------------------------------

    async def _on_result(self, msg: Msg) -> None:
        try:
            result = PrefillResult.model_validate_json(msg.data)
        except ValueError:
            return
        key = f"{result.tenant}.{result.request_id}"
        waiter = self._waiters.get(key)
        if waiter is None or waiter.done():
            return
        if not self.guard.result(result, self._routed.get(key, ())):
            log.error(
                "result for %s on %s dropped: not signed by a replica it was routed to",
                key,
                msg.subject,
            )
            return
        waiter.set_result(result)

    async def _on_heartbeat(self, replica: str, msg: Msg) -> None:
        try:
            beat = Heartbeat.model_validate_json(msg.data)
        except ValueError:
            return
        if self.guard.heartbeat(replica, beat, self.clock(), time.time()):
            self._take_beat(replica, beat)

    async def _on_pool_heartbeat(self, msg: Msg) -> None:
        """A heartbeat of any replica: add one of this pool not known yet (it scaled up),
        drop those silent for ``replica_forget_s`` (scaled down)."""
        try:
            beat = Heartbeat.model_validate_json(msg.data)
        except ValueError:
            return
        now = self.clock()
        for state in list(self.router.replicas):
            silent_s = now - state.last_heartbeat_s
            if state.last_heartbeat_s >= 0 and silent_s > self.config.replica_forget_s:
                log.warning(
                    "replica %s silent for %.0f s: dropped from the pool", state.name, silent_s
                )
                self.router.forget(state.name)
                self.guard.forget_replica(state.name)
        if beat.pool != self.config.pool:
            return
        if beat.pipeline in self._configured and beat.pipeline in self.router.by_name:
            return  # its own subscription (_on_heartbeat) takes its beats
        if beat.pipeline not in self.router.by_name:
            if beat.num_stages < 1 or len(self.router.replicas) >= self.config.max_replicas:
                return
            if not self.guard.add_replica(beat.pipeline, beat):
                return  # unsigned (with a bus key), or max_replicas added: nothing kept
        if not self.guard.heartbeat(beat.pipeline, beat, self.clock(), time.time()):
            if beat.pipeline not in self.router.by_name:
                self.guard.forget_replica(beat.pipeline)  # stale: not kept either
            return  # unsigned, stale, repeated or too frequent: not a member speaking
        if beat.pipeline not in self.router.by_name:
            await ensure_intake(self.js, beat.pipeline, namespace=self.config.namespace)
            self.router.add_replica(beat.pipeline, beat.num_stages)
            if beat.pipeline not in self._watched:
                await self._watch_kv_events(beat.pipeline)
            log.info("replica %s joined the pool", beat.pipeline)
        self._take_beat(beat.pipeline, beat)

    def _take_beat(self, replica: str, beat: Heartbeat) -> None:
        if self.router.on_heartbeat(
            replica, self.clock(), is_ready=beat.ready, is_draining=beat.draining
        ):
            log.info("replica %s draining: out of the pool, it finishes what it was sent", replica)
        self._dispatch()

    async def _on_kv_events(self, replica: str, msg: Msg) -> None:
        try:
            batch = KVEventBatch.model_validate_json(msg.data)
            if not self.guard.kv_events(replica, batch, self.router.by_name[replica].num_stages):
                log.warning("KV event batch on %s dropped: not signed by its replica", msg.subject)
                return
            self.router.on_kv_events(
                replica,
                batch.rank,
                [[bytes.fromhex(h) for h in hashes] for hashes in batch.stored],
                [[bytes.fromhex(h) for h in hashes] for hashes in batch.removed],
            )
        except (ValueError, KeyError) as exc:
            log.warning("bad KV event batch from %s: %s", msg.subject, exc)

    # ---- state views ---------------------------------------------------------------------

    def is_ready(self) -> bool:
        """At least one replica is in the pool (heartbeats, every stage formed)."""
        return bool(self.router.pool(self.clock()))

    def capacity(self) -> int:
        num_alive = len(self.router.pool(self.clock()))
        return self.config.max_outstanding_per_replica * max(1, num_alive)

    def load(self) -> GatewayLoad:
        """The queues and the pool now (what the gateway's gauges report on a scrape)."""
        now = self.clock()
        return GatewayLoad(
            num_queued_by_tenant={t: self.fair.num_queued(t) for t in self.tenants},
            num_active_by_tenant={t: self.limiter.num_active[t] for t in self.tenants},
            num_requests_in_gateway=self.num_requests_in_gateway,
            max_queued_requests=self.config.max_queued_requests,
            is_replica_up={r.name: self.router.in_pool(r.name, now) for r in self.router.replicas},
            jetstream_store=self.jetstream_store,
        )

    @property
    def num_requests_in_gateway(self) -> int:
        """Requests queued or running here, all tenants (joined duplicates not counted)."""
        return len(self._pending)

    def check_queue_limit(self) -> None:
        """Refuse a new request when ``max_queued_requests`` are already queued or running.

        Raises:
            LimitExceeded: field ``queue``, limit ``max_queued_requests`` (HTTP 429 with
                Retry-After ``queue_retry_after_s``).
        """
        limit = self.config.max_queued_requests
        num_requests = self.num_requests_in_gateway
        if num_requests >= limit:
            raise LimitExceeded(
                "queue",
                limit,
                self.config.queue_retry_after_s,
                f"queue: {num_requests} requests are queued or running in the gateway, the "
                f"limit is {limit} (max_queued_requests); retry after "
                f"{self.config.queue_retry_after_s:g} s",
            )

    def check_tenant_queue(self, tenant: str) -> None:
        """Refuse a request that would wait while ``tenant`` has ``max_queued`` waiting.

        Raises:
            LimitExceeded: field ``max_queued`` (HTTP 429 with Retry-After).
        """
        limit = self.tenants[tenant].max_queued
        if limit is None:
            return
        must_wait = len(self.fair) > 0 or self.num_outstanding >= self.capacity()
        num_queued = self.fair.num_queued(tenant)
        if must_wait and num_queued >= limit:
            raise LimitExceeded(
                "max_queued",
                limit,
                self.config.queue_retry_after_s,
                f"tenant {tenant!r} has {num_queued} requests waiting for a slot; limit "
                f"max_queued={limit}",
            )

    # ---- the request path ----------------------------------------------------------------

    async def stored_result(self, key: str) -> PrefillResult | None:
        """The trusted result stored for ``key``, or None (``ResultStore.get``)."""
        stored = await self.results.get(key)
        return None if stored is None else stored.result

    async def prefill(self, request: ParsedRequest) -> tuple[PrefillResult, bool]:
        """Serve one validated request.

        Returns:
            (result, is_duplicate): a duplicate gets the stored or pending answer of the first
            request with the same tenant and request id, which ran once.

        Raises:
            LimitExceeded: over the gateway's queue limit or a tenant limit (HTTP 429).
            TimeoutError: no answer within ``request_timeout_s`` (HTTP 504).
            IntakeUnavailable: JetStream refused the request (store full, JetStream disabled;
                HTTP 503 with ``Retry-After``), at once: nothing was accepted.
        """
        key = f"{request.tenant}.{request.request_id}"
        stored = await self.stored_result(key)
        if stored is not None:
            return stored, True
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending), True
        self.check_queue_limit()
        self.check_tenant_queue(request.tenant)
        self.limiter.acquire(request.tenant, len(request.token_ids), self.clock())
        future: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        arrival_s = time.time()
        try:
            queued_at = self.clock()
            await self._wait_turn(request)
            try:
                intake = IntakeRequest(
                    key=key,
                    request_id=request.request_id,
                    tenant=request.tenant,
                    cache_salt=self.tenants[request.tenant].cache_salt,
                    token_ids=request.token_ids,
                    priority=request.priority,
                    arrival_s=arrival_s,
                    queued_s=self.clock() - queued_at,
                    handoff=request.handoff,
                    # the caller's current span (decode_flow's ``prefill``): the admission's
                    # request span joins its trace
                    traceparent=tracing.current_traceparent(),
                )
                result = await self._run(intake)
            finally:
                self.num_outstanding -= 1
                self._dispatch()
            future.set_result(result)
            self._observe(result)
            return result, False
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: joined duplicates get it, nobody else must
            raise
        finally:
            self._pending.pop(key, None)
            self.limiter.release(request.tenant)

    def _observe(self, result: PrefillResult) -> None:
        self.metrics.result_served(
            result.tenant, result.num_prompt_tokens, result.num_cached_tokens, result.ttft_s
        )

    async def _wait_turn(self, request: ParsedRequest) -> None:
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.fair.push(
            request.tenant, ticket, cost=len(request.token_ids), priority=request.priority
        )
        self._dispatch()
        try:
            await ticket
        except asyncio.CancelledError:
            if not self.fair.remove(request.tenant, ticket) and ticket.done():
                self.num_outstanding -= 1  # granted, then cancelled: give the slot back
                self._dispatch()
            raise

    def _dispatch(self) -> None:
        while self.num_outstanding < self.capacity() and len(self.fair):
            _, ticket = self.fair.pop()
            if ticket.done():
                continue
            self.num_outstanding += 1
            ticket.set_result(None)

    async def _run(self, intake: IntakeRequest) -> PrefillResult:
        hashes = hash_prompt_blocks(
            intake.token_ids, self.config.block_size, self.config.model_id, intake.cache_salt
        )
        waiter: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        self._waiters[intake.key] = waiter
        routed = self._routed.setdefault(intake.key, set())
        deadline = self.clock() + self.config.request_timeout_s
        excluded: list[str] = []
        data = intake.model_dump_json().encode()
        answered = False
        try:
            result = await self._route(intake, hashes, waiter, routed, deadline, excluded, data)
            answered = True
            return result
        finally:
            self._waiters.pop(intake.key, None)
            self._routed.pop(intake.key, None)
            if not answered and routed:
                await self._cancel(intake, routed)

    async def _cancel(self, intake: IntakeRequest, replicas: set[str]) -> None:
        """Withdraw ``intake`` from every replica it was published to (``IntakeCancel``): the
        gateway answers its client with an error (or the client left), so a replica that runs
        it later (a redelivery, a re-admission after its stages re-form) must not prefill it
        or must release its KV handoff lease at once. Best effort: a lost cancel leaves the
        lease to its expiry (``handoff_lease_s``)."""
        cancel = (
            IntakeCancel(
                key=intake.key, arrival_s=intake.arrival_s, reason="the gateway gave up on it"
            )
            .model_dump_json()
            .encode()
        )
        self._given_up.pop(intake.key, None)
        self._given_up[intake.key] = True
        while len(self._given_up) > MAX_GIVEN_UP:
            del self._given_up[next(iter(self._given_up))]
        for name in sorted(replicas):
            with contextlib.suppress(Exception):
                await self.nc.publish(cancel_subject(name, namespace=self.config.namespace), cancel)

    async def _route(
        self,
        intake: IntakeRequest,
        hashes: list[bytes],
        waiter: asyncio.Future[PrefillResult],
        routed: set[str],
        deadline: float,
        excluded: list[str],
        data: bytes,
    ) -> PrefillResult:
        """Publish ``intake`` to a replica and wait for its answer, re-routing as the module
        docstring says; raises as ``prefill`` does."""
        while True:
            try:
                replica, num_reusable = self.router.choose(hashes, self.clock(), exclude=excluded)
            except LookupError:
                excluded = []
                replica, num_reusable = self.router.choose(hashes, self.clock())
            self.metrics.routed(replica.name, num_reusable)
            routed_in_pool = self.router.in_pool(replica.name, self.clock())
            unready_since: float | None = None
            routed.add(replica.name)
            replica.num_outstanding += 1
            try:
                try:
                    # Wait for the store as long as the request may (a paused server is
                    # not a lost request); a refusal (store full, JetStream off) is at once.
                    # Sent again if the server died with it (deduplicated by the id).
                    msg_id = intake.key
                    while True:
                        ack = await resend_after_reconnect(
                            self.nc,
                            lambda replica=replica, msg_id=msg_id: self.js.publish(
                                intake_subject(replica.name, namespace=self.config.namespace),
                                data,
                                stream=intake_stream(replica.name, namespace=self.config.namespace),
                                headers={"Nats-Msg-Id": msg_id},
                                timeout=max(deadline - self.clock(), 0.001),
                            ),
                            what=f"intake publish of {intake.key}",
                        )
                        if not (ack.duplicate and self._given_up.pop(intake.key, False)):
                            break
                        # A retry of a request this gateway gave up on (and cancelled) within
                        # the stream's duplicate window: the cancelled message will not be
                        # answered, so this one goes as a new message (its own arrival).
                        msg_id = f"{intake.key}@{intake.arrival_s!r}"
                except (APIError, NoRespondersError) as exc:
                    raise IntakeUnavailable(
                        f"intake of {replica.name} refused the request: {exc}",
                        INTAKE_RETRY_AFTER_S,
                    ) from exc
                if ack.duplicate:
                    # Accepted before (a client retry after a gateway restart): its answer
                    # may have been published before our waiter existed; the KV has it.
                    stored = await self.stored_result(intake.key)
                    if stored is not None:
                        return stored
                while True:
                    done, _ = await asyncio.wait({waiter}, timeout=0.25)
                    if done:
                        result = waiter.result()
                        if not (result.error and result.replica in excluded):
                            return result
                        # The replica it left failed it; the one it runs on answers.
                        waiter = asyncio.get_running_loop().create_future()
                        self._waiters[intake.key] = waiter
                        continue
                    now = self.clock()
                    if now > deadline:
                        stored = await self.stored_result(intake.key)
                        if stored is not None:
                            return stored
                        raise TimeoutError(
                            f"no answer for {intake.key} in {self.config.request_timeout_s}s "
                            "(the gateway's --request-timeout-s)"
                        )
                    others = [r for r in self.router.pool(now) if r.name != replica.name]
                    if (
                        self.router.in_pool(replica.name, now)
                        or self.router.is_finishing(replica.name, now)
                        or self.is_bus_silent(now)
                    ):
                        # In the pool, or draining (a scale-down): it answers what it
                        # was sent; re-routed only if it falls silent. A silent bus (the
                        # nats-server paused) is not the replica leaving.
                        unready_since = None
                    elif others:
                        log.warning(
                            "replica %s left the pool; re-routing %s", replica.name, intake.key
                        )
                        excluded.append(replica.name)
                        break
                    elif routed_in_pool:
                        unready_since = now if unready_since is None else unready_since
                        if now - unready_since > self.config.replica_unready_fail_s:
                            stored = await self.stored_result(intake.key)
                            if stored is not None:
                                return stored
                            raise ReplicaUnavailable(
                                f"replica {replica.name} left the pool (a stage dead or "
                                f"re-forming) {now - unready_since:.1f} s ago and no other "
                                f"replica is in it; {intake.request_id} was not answered, "
                                "retry it"
                            )
            finally:
                replica.num_outstanding -= 1
