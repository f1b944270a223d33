"""The HTTP layer's error mapping, without a pipeline: a request the pipeline failed is a 500
in the documented error shape (a 503 with Retry-After when the failure is transient), a wrong
method a 405, all counted under the tenant.

The Gateway core is replaced by a stand-in whose ``prefill`` returns a failed result (a
pipeline failing on demand is what this test needs and a real one cannot give cheaply); the
HTTP app, validation, error middleware and metrics are the real ones.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer
from gateway_support import tiny_gateway_config

from wavepp.api.prefill import PrefillResult
from wavepp.gateway.http import GatewayServer
from wavepp.gateway.metrics import GatewayLoad, GatewayMetrics
from wavepp.gateway.tenants import TenantPolicy

CONFIG = tiny_gateway_config(tenants=[TenantPolicy(name="alice", cache_salt="a")])


async def test_failed_request_is_500_in_the_error_shape_and_405_too() -> None:
    async def prefill(request):  # noqa: ANN001, ANN202 - the stand-in's one method
        # "r" requests fail for a transient cause (a stage re-forming)
        transient = request.request_id.startswith("r")
        error = "agreement failed: stage 1: no stage listens" if transient else "stage 1 lost"
        return PrefillResult(
            request_id=request.request_id, tenant="alice", error=error, retryable=transient
        ), False

    metrics = GatewayMetrics(lambda: GatewayLoad({}, {}, 0, 1, {}))
    gateway = SimpleNamespace(
        config=CONFIG,
        metrics=metrics,
        tenants={"alice": None},
        prefill=prefill,
        clock=time.monotonic,
    )
    server = GatewayServer(gateway)  # type: ignore[arg-type]
    async with TestClient(TestServer(server.app)) as client:
        response = await client.post("/v1/prefill", json={"tenant": "alice", "token_ids": [1, 2]})
        body = await response.json()
        assert response.status == 500
        assert (
            body["error"]["type"] == "server_error" and body["error"]["message"] == "stage 1 lost"
        )
        response = await client.post(
            "/v1/prefill", json={"tenant": "alice", "request_id": "r1", "token_ids": [1, 2]}
        )
        body = await response.json()
        assert response.status == 503 and response.headers["Retry-After"] == "2"
        assert body["error"]["type"] == "unavailable" and "no stage listens" in str(body)
        response = await client.get("/v1/prefill", headers={"X-WavePP-Tenant": "alice"})
        body = await response.json()
        assert response.status == 405 and body["error"]["field"] == "method"
        response = await client.post("/v1/prefill", json={"tenant": "alice", "token_ids": "x"})
        assert response.status == 400
    scrape = metrics.scrape()[0].decode()
    for code in (500, 503, 405, 400):
        assert f'wavepp_gateway_requests_total{{code="{code}",tenant="alice"}} 1.0' in scrape
