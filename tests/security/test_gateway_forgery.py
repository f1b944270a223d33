"""The gateway's side of the forgeries, over a real nats-server with JetStream.

The test plays the replica (it answers the intake with results signed by the replica's key, and
heartbeats) and, on another connection, the forger (a client of the same server without the
key): a forged result published before the genuine one, an entry planted in the results bucket,
``ready: false`` heartbeats while the replica is healthy, ``ready: true`` ones after it died.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from wavepp.api.prefill import Heartbeat, IntakeRequest, PrefillResult
from wavepp.api.signing import BusKey
from wavepp.api.subjects import heartbeat_subject, intake_subject, result_subject, results_bucket
from wavepp.gateway.config import GatewayConfig, ReplicaInfo
from wavepp.gateway.core import Gateway
from wavepp.gateway.tenants import TenantPolicy
from wavepp.gateway.validation import ParsedRequest
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, flush_in_order

pytestmark = pytest.mark.timeout(60)

NS = "local"  # GatewayConfig.namespace's default
KEY = BusKey(b"g" * 32)
POOL = "pool"
REPLICA = "pool-0"
GENUINE_TOKEN = 11
FORGED_TOKEN = 666


def _config() -> GatewayConfig:
    return GatewayConfig(
        pool=POOL,
        replicas=[ReplicaInfo(pipeline=REPLICA, num_stages=2, stage_blocks=[64, 64])],
        model_name="m",
        model_id="m",
        block_size=4,
        vocab_size=1000,
        max_prompt_tokens=64,
        tenants=[TenantPolicy(name="t", cache_salt="salt")],
        request_timeout_s=10.0,
        replica_timeout_s=0.5,
    )


def _result(intake: IntakeRequest, token: int) -> PrefillResult:
    return PrefillResult(
        request_id=intake.request_id, tenant=intake.tenant, replica=REPLICA, first_token_id=token
    )


@pytest.fixture
def js_server():  # noqa: ANN201
    server = EmbeddedNatsServer(jetstream=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def _beats(nc, ready: bool, signed: bool, stop: asyncio.Event, every_s: float) -> None:  # noqa: ANN001
    seq = 0
    while not stop.is_set():
        seq += 1
        beat = Heartbeat(
            pipeline=REPLICA,
            ready=ready,
            num_stages_formed=2,
            num_inflight=0,
            instance="i1",
            seq=seq,
            sent_at_s=time.time(),
        )
        if signed:
            beat = KEY.for_replica(REPLICA).sign(beat)
        await nc.publish(heartbeat_subject(REPLICA, namespace=NS), beat.model_dump_json().encode())
        await asyncio.sleep(every_s)


async def _serve(js_server, *, forge_first: bool):  # noqa: ANN001, ANN202
    """A gateway, a replica answering its intake (signed, after 0.2 s) and a forger's
    connection (publishing a forged result first when ``forge_first``)."""
    gw_nc = await connect(js_server.url, name="gateway")
    replica_nc = await connect(js_server.url, name="replica")
    forger_nc = await connect(js_server.url, name="forger")
    gateway = Gateway(_config(), gw_nc, bus_key=KEY)
    await gateway.start()
    replica_key = KEY.for_replica(REPLICA)

    async def on_intake(msg) -> None:  # noqa: ANN001
        intake = IntakeRequest.model_validate_json(msg.data)
        subject = result_subject(POOL, intake.key, namespace=NS)
        if forge_first:  # the forger reads the intake too (or guesses the id) and answers first
            forged = _result(intake, FORGED_TOKEN).model_dump_json().encode()
            await forger_nc.publish(subject, forged)
            await flush_in_order(forger_nc)
        await asyncio.sleep(0.2)
        genuine = replica_key.sign(_result(intake, GENUINE_TOKEN))
        await replica_nc.publish(subject, genuine.model_dump_json().encode())

    await replica_nc.subscribe(intake_subject(REPLICA, namespace=NS), cb=on_intake)
    await flush_in_order(replica_nc)
    return gateway, (gw_nc, replica_nc, forger_nc)


async def _close(gateway: Gateway, ncs) -> None:  # noqa: ANN001
    await gateway.stop()
    for nc in ncs:
        await nc.close()


async def test_a_forged_result_published_first_does_not_answer(js_server) -> None:  # noqa: ANN001
    """A forged result published first on the result subject does not answer the waiting
    gateway; the genuine one does."""
    gateway, ncs = await _serve(js_server, forge_first=True)
    try:
        result, is_duplicate = await gateway.prefill(
            ParsedRequest(tenant="t", request_id="q1", token_ids=list(range(1, 9)))
        )
        assert (result.first_token_id, is_duplicate) == (GENUINE_TOKEN, False)
        assert gateway.guard.num_refused["result"] >= 1
    finally:
        await _close(gateway, ncs)


async def test_a_planted_bucket_entry_is_not_an_answer(js_server) -> None:  # noqa: ANN001
    """An entry planted in the results bucket is not returned for that request id."""
    gateway, ncs = await _serve(js_server, forge_first=False)
    try:
        bucket = await ncs[2].jetstream().key_value(results_bucket(POOL, namespace=NS))
        planted = PrefillResult(
            request_id="q2", tenant="t", replica=REPLICA, first_token_id=FORGED_TOKEN
        )
        await bucket.put("t.q2", planted.model_dump_json().encode())
        result, is_duplicate = await gateway.prefill(
            ParsedRequest(tenant="t", request_id="q2", token_ids=list(range(1, 9)))
        )
        assert (result.first_token_id, is_duplicate) == (GENUINE_TOKEN, False)
        assert gateway.guard.num_refused["stored_result"] >= 1
        await bucket.put("t.q3", b"{not json")  # not a result at all: no answer either
        assert await gateway.stored_result("t.q3") is None
    finally:
        await _close(gateway, ncs)


async def test_forged_heartbeats_neither_flap_readyz_nor_keep_a_dead_replica(js_server) -> None:  # noqa: ANN001
    gw_nc = await connect(js_server.url, name="gateway")
    replica_nc = await connect(js_server.url, name="replica")
    forger_nc = await connect(js_server.url, name="forger")
    gateway = Gateway(_config(), gw_nc, bus_key=KEY)
    await gateway.start()
    replica_alive, forging = asyncio.Event(), asyncio.Event()
    replica = asyncio.create_task(_beats(replica_nc, True, True, replica_alive, 0.1))
    forger = asyncio.create_task(_beats(forger_nc, False, False, forging, 0.01))
    try:
        await asyncio.sleep(0.3)
        polls = []
        for _ in range(20):
            polls.append(gateway.is_ready())
            await asyncio.sleep(0.05)
        assert all(polls), f"/readyz flapped: {polls.count(False)} of {len(polls)} not ready"
        forging.set()
        await forger
        # The replica dies; a forger says it is ready: it leaves the pool all the same.
        replica_alive.set()
        await replica
        forging.clear()
        forger = asyncio.create_task(_beats(forger_nc, True, False, forging, 0.05))
        await asyncio.sleep(1.0)
        assert not gateway.router.is_alive(REPLICA, gateway.clock())
        assert not gateway.is_ready()
        assert gateway.guard.num_refused["heartbeat"] > 10
    finally:
        forging.set()
        replica_alive.set()
        await asyncio.gather(forger, replica, return_exceptions=True)
        await gateway.stop()
        for nc in (gw_nc, replica_nc, forger_nc):
            await nc.close()


def _pool_beat(name: str, seq: int = 1, **fields: object) -> Heartbeat:
    return Heartbeat(
        pipeline=name, ready=True, num_stages_formed=2, num_inflight=0, instance="i1",
        pool=POOL, num_stages=2, seq=seq, sent_at_s=time.time(), **fields,
    )  # fmt: skip


async def test_unsigned_beats_of_unknown_replicas_leave_nothing_in_the_gateway(js_server) -> None:  # noqa: ANN001
    """Beats of the pool from names not configured, unsigned, each once (20,000 of 10 KB
    names): the gateway's memory stays bounded. An unsigned one adds nothing, a name past ``MAX_PIPELINE_NAME`` is not even parsed, signed
    ones add at most ``max_replicas``, and a forgotten replica leaves the guard too."""
    now = [1000.0]
    config = _config().model_copy(update={"max_replicas": 3, "replica_forget_s": 5.0})
    gw_nc = await connect(js_server.url, name="gateway")
    forger_nc = await connect(js_server.url, name="forger")
    gateway = Gateway(config, gw_nc, bus_key=KEY, clock=lambda: now[0])
    await gateway.start()

    async def publish(beat: Heartbeat | bytes, name: str) -> None:
        data = beat if isinstance(beat, bytes) else beat.model_dump_json().encode()
        await forger_nc.publish(heartbeat_subject(name, namespace=NS), data)

    try:
        for i in range(300):
            await publish(_pool_beat(f"{POOL}-x{i}"), f"{POOL}-x{i}")
        huge = _pool_beat("p").model_dump_json().replace('"p"', '"' + "a" * 10_000 + '"', 1)
        await publish(huge.encode(), "huge")
        await flush_in_order(forger_nc)
        deadline = time.monotonic() + 10
        while gateway.guard.num_refused["heartbeat_unknown"] < 300:
            assert time.monotonic() < deadline, gateway.guard.num_refused
            await asyncio.sleep(0.05)
        assert gateway.guard.replicas == [REPLICA] and len(gateway.guard._keys) == 1  # noqa: SLF001
        assert [r.name for r in gateway.router.replicas] == [REPLICA]
        # holders of the bus key: added up to max_replicas (3, with the configured one)
        for i in range(5):
            name = f"{POOL}-s{i}"
            await publish(KEY.for_replica(name).sign(_pool_beat(name)), name)
        await flush_in_order(forger_nc)
        deadline = time.monotonic() + 10
        while len(gateway.router.replicas) < 3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert len(gateway.guard.replicas) == 3 and len(gateway.router.replicas) == 3
        # both added ones fall silent: the next beat (of any replica) drops them, guard too
        now[0] += 10.0
        await publish(_pool_beat(f"{POOL}-late"), f"{POOL}-late")
        await flush_in_order(forger_nc)
        deadline = time.monotonic() + 10
        while len(gateway.guard.replicas) > 1:
            assert time.monotonic() < deadline, gateway.guard.replicas
            await asyncio.sleep(0.05)
        assert gateway.guard.replicas == [REPLICA]
    finally:
        await gateway.stop()
        for nc in (gw_nc, forger_nc):
            await nc.close()
