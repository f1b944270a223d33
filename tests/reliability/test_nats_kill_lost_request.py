"""A JetStream request written to a nats-server that then dies is lost with it: its reply never
comes. ``natsio.resend_after_reconnect`` sends it again once the client reconnected, instead of
waiting out the call's whole timeout (the gateway's is 120 s: after a nats-server kill `wavepp
up` did not serve within 60 s in 2 of 5 CI runs). Real nats-server with JetStream; the request
is made to be in flight at the kill by stopping the server (SIGSTOP) first: it is written to
the socket and never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import KeyValueConfig, StreamConfig
from reliability_support import stopped, wait_until

from wavepp.runtime.transport.natsio import (
    EmbeddedNatsServer,
    connect,
    resend_after_reconnect,
)

pytestmark = pytest.mark.timeout(60)

PLAIN_TIMEOUT_S = 4.0  # the plain call's timeout: it waits all of it
TIMEOUT_S = 30.0  # the resent calls' own timeout: they are answered long before it


async def test_a_request_lost_with_a_killed_server_is_sent_again_after_the_reconnect(
    tmp_path,
) -> None:
    server = EmbeddedNatsServer(jetstream=True, store_dir=str(tmp_path / "js"))
    server.start()
    nc = await connect(server.url, name="lost-request", anonymous_ok=True)
    try:
        js = nc.jetstream(timeout=TIMEOUT_S)
        kv = await js.create_key_value(KeyValueConfig(bucket="results", history=1))
        await kv.put("k", b"v")
        plain_kv = await nc.jetstream(timeout=PLAIN_TIMEOUT_S).key_value("results")
        await js.add_stream(StreamConfig(name="INTAKE", subjects=["intake"]))

        async def timed(call) -> tuple[object, float]:  # noqa: ANN001
            start = time.monotonic()
            try:
                return await call, time.monotonic() - start
            except NatsTimeoutError as exc:
                return exc, time.monotonic() - start

        sent_before = nc.stats["out_msgs"]
        os.kill(server.pid, signal.SIGSTOP)
        # Stopped before anything is written: a server thread still running would read and
        # answer the requests (the plain one then succeeds).
        await wait_until(lambda: stopped(server.pid), timeout_s=10)
        plain = asyncio.create_task(timed(plain_kv.get("k")))
        get = asyncio.create_task(
            timed(resend_after_reconnect(nc, lambda: kv.get("k"), what="kv get"))
        )
        publish = asyncio.create_task(
            timed(
                resend_after_reconnect(
                    nc,
                    lambda: js.publish("intake", b"x", headers={"Nats-Msg-Id": "m1"}),
                    what="intake publish",
                )
            )
        )
        # All three written to the stopped server's socket (not held in the client's buffer,
        # which it would send to the next server: then nothing is lost).
        await wait_until(
            lambda: nc.stats["out_msgs"] >= sent_before + 3 and nc.pending_data_size == 0,
            timeout_s=10,
        )
        await asyncio.sleep(0.2)
        os.kill(server.pid, signal.SIGKILL)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(server.restart)  # same port and store, as `wavepp up`'s watchdog
        (plain_result, plain_s), (entry, get_s), (ack, publish_s) = await asyncio.gather(
            plain, get, publish
        )
        # The loss is real: the plain call waited its whole timeout for a reply that never came.
        assert isinstance(plain_result, NatsTimeoutError) and plain_s >= PLAIN_TIMEOUT_S - 0.1
        # Sent again after the reconnect: answered long before their own timeout (under a
        # second here; the server's restart takes most of it).
        assert getattr(entry, "value", None) == b"v" and get_s < TIMEOUT_S / 2, (entry, get_s)
        assert getattr(ack, "stream", None) == "INTAKE" and publish_s < TIMEOUT_S / 2, (
            ack,
            publish_s,
        )
        # The publish reached the stream once (a resend is deduplicated by its Nats-Msg-Id).
        assert (await js.stream_info("INTAKE")).state.messages == 1
    finally:
        await nc.close()
        server.stop()


async def test_without_a_reconnect_the_call_is_awaited_once(nc) -> None:
    """No reconnect: the call's result or error, once and unchanged (a client not made by
    ``connect``, which reports no reconnect, is simply awaited)."""
    calls = []

    async def call() -> int:
        calls.append(1)
        await asyncio.sleep(0.01)
        return 7

    assert await resend_after_reconnect(nc, call, what="x") == 7
    assert await resend_after_reconnect(object(), call, what="x") == 7

    async def failing() -> int:
        calls.append(2)
        raise NatsTimeoutError

    with pytest.raises(NatsTimeoutError):
        await resend_after_reconnect(nc, failing, what="x")
    assert calls == [1, 1, 2]


async def test_a_result_published_while_the_server_was_down_is_read_from_the_bucket(
    tmp_path,
) -> None:
    """The replica stores a result, then publishes it; a publish made while the server is down
    never reaches the gateway (core NATS keeps nothing). After the reconnect the gateway reads
    the bucket for every waiting request (``Gateway.recover_results``) instead of waiting for
    the request's deadline (120 s by default, past a typical client's 60 s)."""
    from gateway_support import tiny_gateway_config

    from wavepp.api.prefill import Heartbeat, PrefillResult
    from wavepp.api.subjects import heartbeat_subject, results_bucket
    from wavepp.gateway.core import Gateway
    from wavepp.gateway.validation import ParsedRequest

    server = EmbeddedNatsServer(jetstream=True, store_dir=str(tmp_path / "js"))
    server.start()
    nc = await connect(server.url, name="gateway-recover", anonymous_ok=True)
    config = tiny_gateway_config(model_id="m", max_prompt_tokens=1024, request_timeout_s=40.0)
    gateway = Gateway(config, nc)
    beating: asyncio.Task[None] | None = None
    try:
        await gateway.start()
        replica = config.replicas[0].pipeline
        beat = Heartbeat(
            pipeline=replica, ready=True, num_stages_formed=2, num_inflight=0, instance="i",
            pool=config.pool, num_stages=2,
        )  # fmt: skip

        async def beats() -> None:  # the replica stays in the pool throughout, as a live one
            while True:
                with contextlib.suppress(Exception):
                    data = beat.model_dump_json().encode()
                    await nc.publish(heartbeat_subject(replica, namespace="local"), data)
                await asyncio.sleep(0.3)

        beating = asyncio.create_task(beats())
        await asyncio.sleep(0.5)
        request = ParsedRequest(tenant="default", request_id="r1", token_ids=[1, 2, 3])
        task = asyncio.create_task(gateway.prefill(request))
        await wait_until(lambda: "default.r1" in gateway._waiters, timeout_s=5)
        answer = PrefillResult(request_id="r1", tenant="default", replica=replica, first_token_id=7)
        kv = await nc.jetstream().key_value(results_bucket(config.pool, namespace="local"))
        await kv.put("default.r1", answer.model_dump_json().encode())  # stored; never published
        server.stop()  # down ...
        await asyncio.sleep(0.5)
        started = time.monotonic()
        server.start()  # ... and back: the client reconnects
        result, _ = await asyncio.wait_for(task, 20)
        assert result.first_token_id == 7 and time.monotonic() - started < 15
        assert replica in {r.name for r in gateway.router.pool(gateway.clock())}
    finally:
        if beating is not None:
            beating.cancel()
        await gateway.stop()
        await nc.close()
        server.stop()
