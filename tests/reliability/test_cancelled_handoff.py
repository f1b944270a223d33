"""A request the gateway gave up on stops being served and leaves nothing behind on the stages.

Real nats-server (JetStream), two emulated stage processes with their KV transfer servers, the
admission service and the gateway in the test's process.

- Handoff: the admission's plans are held (``pause_plans``, as while the stages re-form) so that
  the request is admitted (its blocks pinned) but not planned when the gateway gives up on it
  (its client leaves): it is withdrawn from the scheduler and its pins are gone from every stage
  while the plans are still held, with no handoff lease left. A cancelled message delivered
  later (a redelivery) is acked unserved. A retry of the cancelled request (same id) is
  answered. The same run shows the measure sees a lease: an answered request's lease stays until
  released.
- Mid-prefill: a long prompt (seven chunks of ``chunk_tokens``) cancelled by its client after
  its first micro-batch is planned gets no further chunk planned; its pins are released once
  that micro-batch is done, and a short request sent after it is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from gateway_support import tiny_gateway_config
from nats.aio.client import Client as NATS
from reliability_support import BLOCK_SIZE, COST, MODEL, random_tokens, wait_until

from wavepp.api.prefill import IntakeCancel, IntakeRequest
from wavepp.api.subjects import cancel_subject, intake_stream, intake_subject
from wavepp.gateway.config import ReplicaInfo
from wavepp.gateway.core import Gateway
from wavepp.gateway.validation import ParsedRequest
from wavepp.integrations.vllm.pull import stage_stats
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.serving.handoff import release_handoff
from wavepp.runtime.serving.local import LocalPipeline
from wavepp.runtime.serving.service import AdmissionService
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LEASE_S = 60.0  # handoff_lease_s: the cancelled request's lease must end long before it
RELEASED_WITHIN_S = 10.0
CHUNK_TOKENS = 256
LONG_TOKENS = 7 * CHUNK_TOKENS - 40  # seven chunks of the static policy


def _leases(addrs: list[str]) -> list[int]:
    return [int(stage_stats(a)["leases"]) for a in addrs]


def _no_pins(addrs: list[str]) -> bool:
    return all(s["leases"] == 0 and s["pinned_blocks"] == 0 for s in map(stage_stats, addrs))


@dataclass
class Served:
    service: AdmissionService
    gateway: Gateway
    gateway_nc: NATS
    addrs: list[str]  # each stage's KV transfer server
    config: RuntimeConfig


@contextlib.asynccontextmanager
async def _served(tmp_path, **overrides: object) -> AsyncIterator[Served]:  # noqa: ANN001
    """Two emulated stages, the admission service and a gateway over a real nats-server;
    ``overrides``: RuntimeConfig fields."""
    server = EmbeddedNatsServer(jetstream=True, store_dir=str(tmp_path / "js"))
    server.start()
    config = RuntimeConfig(
        model=MODEL, engine="emulated", cost_model=COST.to_dict(), num_stages=2,
        block_size=BLOCK_SIZE, num_kv_blocks=[128], pipeline="p-r0", handoff_lease_s=LEASE_S,
        **overrides,
    )  # fmt: skip
    pipeline = LocalPipeline(config, COST, nats_url=server.url, log_dir=str(tmp_path / "stages"))
    stop = asyncio.Event()
    service_task = None
    gateway = None
    connections = []
    try:
        await pipeline.start()
        # the stages only: the admission service below is the replica's scheduler
        assert pipeline.scheduler is not None
        await pipeline.scheduler.stop()
        pipeline.scheduler = None
        addrs = list(pipeline.handoff_addrs)
        assert len(addrs) == 2 and all(addrs)
        for name in ("admission", "gateway"):
            connections.append(await connect(server.url, name=name, anonymous_ok=True))
        admission_nc, gateway_nc = connections
        service = AdmissionService(
            config,
            admission_nc,
            COST,
            pool="p",
            bus_key=pipeline.bus_key,
            ack_wait_s=2.0,
            drain_timeout_s=5.0,
        )
        service_task = asyncio.create_task(service.run(stop))
        gateway = Gateway(
            tiny_gateway_config(
                replicas=[ReplicaInfo(pipeline="p-r0", num_stages=2)],
                max_prompt_tokens=4096,
                request_timeout_s=30.0,
            ),
            gateway_nc,
            bus_key=pipeline.bus_key,
        )
        await gateway.start()
        await wait_until(gateway.is_ready, timeout_s=60)
        yield Served(service, gateway, gateway_nc, addrs, config)
    finally:
        stop.set()
        if service_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(service_task, 30)
        if gateway is not None:
            await gateway.stop()
        for nc in connections:
            with contextlib.suppress(Exception):
                await nc.close()
        await pipeline.stop()
        server.stop()


async def test_a_request_the_gateway_gave_up_on_leaves_no_handoff_lease(tmp_path) -> None:  # noqa: ANN001
    async with _served(tmp_path) as served:
        service, gateway, gateway_nc, addrs, config = (
            served.service, served.gateway, served.gateway_nc, served.addrs, served.config
        )  # fmt: skip
        # an answered request: its lease stays on both stages until released
        answered, _ = await gateway.prefill(
            ParsedRequest("default", "kept", random_tokens(1, 200), handoff=True)
        )
        assert answered.kv_transfer_params, answered.error
        assert _leases(addrs) == [1, 1]
        assert await release_handoff(answered.kv_transfer_params) == 2
        await wait_until(lambda: _no_pins(addrs), timeout_s=10)

        # the client leaves while the prefill is held (the stages re-forming)
        service.scheduler.pause_plans()
        left = asyncio.create_task(
            gateway.prefill(ParsedRequest("default", "left", random_tokens(2, 200), handoff=True))
        )
        await wait_until(lambda: service._runs.get("default.left") is not None, timeout_s=10)
        # agreed (its blocks pinned on the stages), not yet computed
        await wait_until(lambda: not _no_pins(addrs), timeout_s=10)
        left.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await left
        await wait_until(lambda: len(service.cancelled) == 1, timeout_s=5)
        cancelled = time.monotonic()
        # withdrawn: released while the plans are still held, no prefill, no lease
        await wait_until(lambda: _no_pins(addrs), timeout_s=RELEASED_WITHIN_S)
        took_s = time.monotonic() - cancelled
        await wait_until(lambda: service.num_cancelled == 1, timeout_s=5)
        assert service.num_withdrawn == 1
        service.scheduler.reopen_plans()
        assert await gateway.stored_result("default.left") is None  # nobody waits for it

        # the client retries with the same request id, within the intake's duplicate window:
        # answered (a new message, not the cancelled one deduplicated and never answered)
        retried, is_duplicate = await gateway.prefill(
            ParsedRequest("default", "left", random_tokens(2, 200), handoff=True)
        )
        assert retried.kv_transfer_params and not is_duplicate, retried.error
        assert _leases(addrs) == [1, 1]
        assert await release_handoff(retried.kv_transfer_params) == 2
        await wait_until(lambda: _no_pins(addrs), timeout_s=10)

        # a cancelled message delivered later (a redelivery) is acked, not prefilled
        js = gateway_nc.jetstream()
        late = IntakeRequest(
            key="default.late", request_id="late", tenant="default", cache_salt="s",
            token_ids=random_tokens(3, 200), arrival_s=time.time(), handoff=True,
        )  # fmt: skip
        cancel = IntakeCancel(key=late.key, arrival_s=late.arrival_s)
        await gateway_nc.publish(
            cancel_subject("p-r0", namespace=config.namespace), cancel.model_dump_json().encode()
        )
        await wait_until(lambda: late in service.cancelled, timeout_s=5)
        await js.publish(
            intake_subject("p-r0", namespace=config.namespace),
            late.model_dump_json().encode(),
            stream=intake_stream("p-r0", namespace=config.namespace),
            headers={"Nats-Msg-Id": late.key},
        )
        await wait_until(lambda: service.num_cancelled == 2, timeout_s=10)
        assert service.num_withdrawn == 1  # never ran
        info = await js.consumer_info(
            intake_stream("p-r0", namespace=config.namespace), "admission"
        )
        assert info.num_pending + info.num_ack_pending == 0
        assert _no_pins(addrs) and await gateway.stored_result(late.key) is None
        print(f"cancelled handoff: no pins {took_s:.2f} s after the cancel, plans held")


async def test_a_long_prompt_cancelled_mid_prefill_gets_no_further_chunk(tmp_path) -> None:  # noqa: ANN001
    async with _served(tmp_path, chunk_policy="static", chunk_tokens=CHUNK_TOKENS) as served:
        service, gateway, addrs = served.service, served.gateway, served.addrs
        scheduler = service.scheduler
        planned: list[int] = []  # tokens of each chunk of the long prompt planned
        first_planned = asyncio.Event()
        take_planned = scheduler.core.take_planned

        def counting(chunks, planning_started_s):  # noqa: ANN001, ANN202
            for chunk in chunks:
                if chunk.request_id.startswith("default.long@"):
                    planned.append(chunk.num_tokens)
                    if len(planned) == 1:  # hold the next plans until the client left
                        scheduler.pause_plans()
                        first_planned.set()
            return take_planned(chunks, planning_started_s)

        scheduler.core.take_planned = counting  # type: ignore[method-assign]
        long = asyncio.create_task(
            gateway.prefill(ParsedRequest("default", "long", random_tokens(4, LONG_TOKENS)))
        )
        await asyncio.wait_for(first_planned.wait(), 30)
        long.cancel()  # the client leaves (as the gateway's timeout does)
        with contextlib.suppress(asyncio.CancelledError):
            await long
        await wait_until(lambda: service.num_withdrawn == 1, timeout_s=10)
        scheduler.reopen_plans()
        await wait_until(lambda: service.num_cancelled == 1, timeout_s=10)
        await wait_until(lambda: _no_pins(addrs), timeout_s=RELEASED_WITHIN_S)
        short, _ = await gateway.prefill(ParsedRequest("default", "short", random_tokens(5, 3)))
        assert not short.error, short.error
        assert [t.rank for t in short.stages] == [0, 1]  # per-stage timings of its own run
        assert planned == [CHUNK_TOKENS]  # one chunk of its seven; none after the cancel
        assert sum(planned) < LONG_TOKENS
        assert await gateway.stored_result("default.long") is None
        await wait_until(lambda: _no_pins(addrs), timeout_s=RELEASED_WITHIN_S)
