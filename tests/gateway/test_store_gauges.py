"""The gateway's JetStream store gauges against a real nats-server with ``wavepp up``'s
credentials (``write_pool_auth`` with a disk limit): the gateway's account info carries the
account's limit and the bytes its streams hold, its ``/metrics`` text exports both, and the
server enforces the limit (a write past it is refused), so the exported limit is the one that
bites."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from gateway_support import tiny_gateway_config
from nats.js.errors import APIError
from prometheus_client.parser import text_string_to_metric_families

from wavepp.api.permissions import gateway_user_name
from wavepp.api.subjects import intake_subject
from wavepp.gateway.core import Gateway
from wavepp.runtime.transport.auth import write_pool_auth
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect

pytestmark = pytest.mark.timeout(60)

LIMIT = 4 * 2**20  # the account's JetStream disk limit (bytes)
PAYLOAD = 64 * 1024


def _store_series(gateway: Gateway) -> dict[str, float]:
    body, _ = gateway.metrics.scrape()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name.startswith("wavepp_gateway_jetstream_store_")
    }


async def _until(predicate, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the deadline"
        await asyncio.sleep(0.1)


async def test_gateway_exports_the_accounts_store_use_and_limit(tmp_path: Path) -> None:
    config = tiny_gateway_config(namespace="local")
    auth = write_pool_auth(
        tmp_path / "auth",
        pool=config.pool,
        replicas={r.pipeline: r.num_stages for r in config.replicas},
        namespace="local",
        store_dir=tmp_path / "js",
        max_file_store_bytes=LIMIT,
    )
    with EmbeddedNatsServer(config_file=auth.server_config) as server:
        nc = await connect(server.url, name="gateway", creds=auth.gateway(config.pool))
        gateway = Gateway(config, nc)
        await gateway.start()
        try:
            await _until(lambda: gateway.jetstream_store is not None)
            empty = _store_series(gateway)
            js = nc.jetstream()
            subject = intake_subject("p-r0", namespace="local")
            for i in range(8):  # 512 KiB of intake
                await js.publish(subject, bytes([i]) * PAYLOAD, headers={"Nats-Msg-Id": str(i)})
            await _until(
                lambda: (
                    _store_series(gateway)["wavepp_gateway_jetstream_store_used_bytes"]
                    >= 8 * PAYLOAD
                )
            )
            filled = _store_series(gateway)
            # the limit is honoured: the server refuses what would pass it
            with pytest.raises(APIError) as refused:
                for i in range(8, 8 + LIMIT // PAYLOAD + 1):
                    await js.publish(subject, bytes([i % 256]) * PAYLOAD)
        finally:
            await gateway.stop()
            await nc.close()
    assert refused.value.description == "resource limits exceeded for account", refused.value
    assert gateway_user_name(config.pool) in auth.creds
    assert empty["wavepp_gateway_jetstream_store_limit_bytes"] == LIMIT
    assert empty["wavepp_gateway_jetstream_store_used_bytes"] < 8 * PAYLOAD
    assert filled["wavepp_gateway_jetstream_store_limit_bytes"] == LIMIT
    assert 8 * PAYLOAD <= filled["wavepp_gateway_jetstream_store_used_bytes"] < LIMIT
