"""A request the gateway gave up on leaves no KV handoff lease behind on the stages.

Real nats-server (JetStream), two emulated stage processes with their KV transfer servers, the
admission service and the gateway in the test's process. The admission's plans are held
(``pause_plans``, as while the stages re-form) so that the request is admitted but its prefill
has not ended when the gateway gives up on it (its client leaves); the prefill then ends (plans
released, as after the re-form) and its handoff lease is gone from every stage at once, not
after ``handoff_lease_s``. A cancelled message delivered later (a redelivery) is acked unserved.
A retry of the cancelled request (same id) is answered. The same run shows the measure sees a
lease: an answered request's lease stays until released.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from gateway_support import tiny_gateway_config
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


def _leases(addrs: list[str]) -> list[int]:
    return [int(stage_stats(a)["leases"]) for a in addrs]


def _no_pins(addrs: list[str]) -> bool:
    return all(s["leases"] == 0 and s["pinned_blocks"] == 0 for s in map(stage_stats, addrs))


async def test_a_request_the_gateway_gave_up_on_leaves_no_handoff_lease(tmp_path) -> None:  # noqa: ANN001
    server = EmbeddedNatsServer(jetstream=True, store_dir=str(tmp_path / "js"))
    server.start()
    config = RuntimeConfig(
        model=MODEL, engine="emulated", cost_model=COST.to_dict(), num_stages=2,
        block_size=BLOCK_SIZE, num_kv_blocks=[128], pipeline="p-r0", handoff_lease_s=LEASE_S,
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
        await wait_until(lambda: "default.left" in service._running, timeout_s=10)
        left.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await left
        await wait_until(lambda: len(service.cancelled) == 1, timeout_s=5)
        # agreed (its blocks pinned on the stages), not yet computed
        await wait_until(lambda: not _no_pins(addrs), timeout_s=10)
        service.scheduler.reopen_plans()
        released = time.monotonic()
        await wait_until(lambda: _no_pins(addrs), timeout_s=RELEASED_WITHIN_S)
        took_s = time.monotonic() - released
        assert service.num_cancelled == 1
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
        info = await js.consumer_info(
            intake_stream("p-r0", namespace=config.namespace), "admission"
        )
        assert info.num_pending + info.num_ack_pending == 0
        assert _no_pins(addrs) and await gateway.stored_result(late.key) is None
        print(f"cancelled handoff: no lease {took_s:.2f} s after its prefill was released")
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
