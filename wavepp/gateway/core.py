"""The gateway's engine: tenant limits, fair-share queue, routing, durable intake, results.

One ``Gateway`` per process, over one NATS connection. ``prefill`` is the whole path of one
request after validation::

    stored result? (duplicate: the stored answer) -> same key pending? (join it)
    -> queue limit: max_queued_requests queued or running in this gateway (429)
    -> tenant limits (429)
    -> fair-share queue (a slot among max_outstanding_per_replica x replicas in the pool)
    -> router: replica with the longest reusable prefix (ties: least loaded)
    -> JetStream publish {p}.intake, Nats-Msg-Id = key -> wait for wavepp.{pool}.result.{key}
       (the replica leaves the pool meanwhile: publish to another replica)

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
from nats.js.errors import KeyNotFoundError
from pydantic import BaseModel, ConfigDict, Field

from wavepp.api.messages import KVEventBatch
from wavepp.api.prefill import Heartbeat, IntakeRequest, PrefillResult
from wavepp.api.signing import BusKey
from wavepp.api.subjects import (
    ReplicaSubjects,
    heartbeat_subject,
    intake_stream,
    intake_subject,
    replica_prefix,
    result_subject,
)
from wavepp.gateway.metrics import GatewayLoad, GatewayMetrics
from wavepp.gateway.router import PoolRouter, RoutingPolicy
from wavepp.gateway.tenants import FairShareQueue, LimitExceeded, TenantLimiter, TenantPolicy
from wavepp.gateway.trust import BusGuard
from wavepp.gateway.validation import ParsedRequest, PromptLimits
from wavepp.runtime.kv import hash_prompt_blocks
from wavepp.runtime.transport.jetstream import ensure_intake, ensure_results

log = logging.getLogger(__name__)


class ReplicaInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pipeline: str
    num_stages: int = Field(ge=1)
    # KV blocks of each stage: the router's index of that stage holds at most this many hashes
    # (empty: router.DEFAULT_STAGE_BLOCKS each).
    stage_blocks: list[int] = Field(default_factory=list)


class GatewayConfig(BaseModel):
    """Everything the gateway process needs (``wavepp up`` writes it from the spec)."""

    model_config = ConfigDict(extra="forbid")

    pool: str
    replicas: list[ReplicaInfo] = Field(min_length=1)
    model_name: str
    model_id: str
    block_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    max_prompt_tokens: int = Field(ge=1)
    tenants: list[TenantPolicy] = Field(min_length=1)
    routing: RoutingPolicy = "prefix"
    max_outstanding_per_replica: int = Field(8, ge=1)
    # NOTE: a global bound on requests queued or running in this gateway. Past it a request is
    # refused at once (429, field "queue") instead of waiting: when the stages cannot reserve
    # (memory pressure) the fair-share queue would otherwise grow without bound.
    max_queued_requests: int = Field(1024, ge=1)
    queue_retry_after_s: float = Field(1.0, gt=0)
    request_timeout_s: float = Field(120.0, gt=0)
    replica_timeout_s: float = Field(3.0, gt=0)
    tokenizer: str | None = None

    @property
    def limits(self) -> PromptLimits:
        return PromptLimits(
            vocab_size=self.vocab_size,
            max_prompt_tokens=self.max_prompt_tokens,
            tenants=frozenset(t.name for t in self.tenants),
        )


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
        self.js = nc.jetstream()
        self.clock = clock
        self.tenants = {t.name: t for t in config.tenants}
        self.limiter = TenantLimiter(config.tenants, max_prompt_tokens=config.max_prompt_tokens)
        self.fair: FairShareQueue[asyncio.Future[None]] = FairShareQueue(
            {t.name: t.weight for t in config.tenants}
        )
        self.router = PoolRouter(
            [(r.pipeline, r.num_stages, r.stage_blocks) for r in config.replicas],
            policy=config.routing,
            timeout_s=config.replica_timeout_s,
        )
        self.metrics = GatewayMetrics(self.load)
        self.num_outstanding = 0
        self._pending: dict[str, asyncio.Future[PrefillResult]] = {}
        self._waiters: dict[str, asyncio.Future[PrefillResult]] = {}
        self._routed: dict[str, set[str]] = {}  # key -> replicas its intake was published to
        self.guard = BusGuard(bus_key, [r.pipeline for r in config.replicas])
        self._kv = None
        self._subs: list[object] = []

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        for replica in self.config.replicas:
            await ensure_intake(self.js, replica.pipeline)
        self._kv = await ensure_results(self.js, self.config.pool)
        self._subs.append(
            await self.nc.subscribe(
                result_subject(self.config.pool, "*.*").replace("*.*", ">"), cb=self._on_result
            )
        )
        for replica in self.config.replicas:
            self._subs.append(
                await self.nc.subscribe(
                    heartbeat_subject(replica.pipeline),
                    cb=functools.partial(self._on_heartbeat, replica.pipeline),
                )
            )
            self._subs.append(
                await self.nc.subscribe(
                    ReplicaSubjects(replica_prefix(replica.pipeline)).kv_events("*"),
                    cb=functools.partial(self._on_kv_events, replica.pipeline),
                )
            )
        await self.nc.flush()

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # type: ignore[attr-defined]
        self._subs = []
        self.metrics.shutdown()

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
            self.router.on_heartbeat(replica, self.clock(), is_ready=beat.ready)
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
        """Every replica heartbeats and reports every stage formed."""
        now = self.clock()
        return all(self.router.is_alive(r.name, now) and r.is_ready for r in self.router.replicas)

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
            is_replica_up={r.name: self.router.is_alive(r.name, now) for r in self.router.replicas},
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

    # ---- the request path ----------------------------------------------------------------

    async def stored_result(self, key: str) -> PrefillResult | None:
        assert self._kv is not None, "gateway not started"
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return None
        try:
            result = PrefillResult.model_validate_json(entry.value or b"")
        except ValueError:
            result = None
        if result is None or not self.guard.stored(key, result):
            log.error("results bucket entry %s ignored: not a result a replica stored", key)
            return None
        return result

    async def prefill(self, request: ParsedRequest) -> tuple[PrefillResult, bool]:
        """Serve one validated request.

        Returns:
            (result, is_duplicate): a duplicate gets the stored or pending answer of the first
            request with the same tenant and request id, which ran once.

        Raises:
            LimitExceeded: over the gateway's queue limit or a tenant limit (HTTP 429).
            TimeoutError: no answer within ``request_timeout_s`` (HTTP 504).
        """
        key = f"{request.tenant}.{request.request_id}"
        stored = await self.stored_result(key)
        if stored is not None:
            return stored, True
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending), True
        self.check_queue_limit()
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
        try:
            while True:
                try:
                    replica, num_reusable = self.router.choose(
                        hashes, self.clock(), exclude=excluded
                    )
                except LookupError:
                    excluded = []
                    replica, num_reusable = self.router.choose(hashes, self.clock())
                self.metrics.routed(replica.name, num_reusable)
                routed.add(replica.name)
                replica.num_outstanding += 1
                try:
                    ack = await self.js.publish(
                        intake_subject(replica.name),
                        data,
                        stream=intake_stream(replica.name),
                        headers={"Nats-Msg-Id": intake.key},
                    )
                    if ack.duplicate:
                        # Accepted before (a client retry after a gateway restart): its answer
                        # may have been published before our waiter existed; the KV has it.
                        stored = await self.stored_result(intake.key)
                        if stored is not None:
                            return stored
                    while True:
                        done, _ = await asyncio.wait({waiter}, timeout=0.5)
                        if done:
                            return waiter.result()
                        now = self.clock()
                        if now > deadline:
                            stored = await self.stored_result(intake.key)
                            if stored is not None:
                                return stored
                            raise TimeoutError(
                                f"no answer for {intake.key} in {self.config.request_timeout_s}s"
                            )
                        others = [r for r in self.router.pool(now) if r.name != replica.name]
                        if not self.router.is_alive(replica.name, now) and others:
                            log.warning(
                                "replica %s left the pool; re-routing %s", replica.name, intake.key
                            )
                            excluded.append(replica.name)
                            break
                finally:
                    replica.num_outstanding -= 1
        finally:
            self._waiters.pop(intake.key, None)
            self._routed.pop(intake.key, None)


__all__ = ["Gateway", "GatewayConfig", "GatewayMetrics", "LimitExceeded", "ReplicaInfo"]
