"""Each decode request opens its own connection to the decode endpoint.

Behind a Kubernetes Service the proxy picks a pod per connection: a kept-alive connection would
keep sending requests to a decode pod that is being scaled down (it left the endpoints but still
holds the connection) and none to a pod the autoscaler just added. The decode endpoint here is
an aiohttp stand-in that records the client port of every request it serves.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from wavepp.api.kv_handoff import PARAMS_KEY
from wavepp.api.prefill import PrefillResult
from wavepp.gateway.decode import DecodePool
from wavepp.gateway.decode_flow import DecodeFlow
from wavepp.gateway.validation import CompletionRequest, ParsedRequest, Sampling
from wavepp.runtime.transport.natsio import free_port

pytestmark = pytest.mark.timeout(60)


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_every_decode_request_uses_a_new_connection() -> None:
    client_ports: list[int] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny"}]})

    async def completions(request: web.Request) -> web.Response:
        assert request.transport is not None
        client_ports.append(request.transport.get_extra_info("peername")[1])
        choice = {"index": 0, "text": "ab", "token_ids": [5, 6], "finish_reason": "length"}
        return web.json_response({"choices": [choice], "usage": {"completion_tokens": 2}})

    decode_app = web.Application()
    decode_app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
    decode, decode_url = await _serve(decode_app)
    flow = DecodeFlow(DecodePool([decode_url]), model_name="tiny")
    handoff = {"request_id": "r1", "num_tokens": 4, "expires": 9e9, "token": "ab" * 32,
               "stages": [["127.0.0.1:1", 0, 1]]}  # fmt: skip
    result = PrefillResult(
        request_id="r1",
        tenant="default",
        num_prompt_tokens=4,
        num_cached_tokens=0,
        kv_transfer_params={"do_remote_prefill": True, PARAMS_KEY: handoff},
    )

    async def handle(request: web.Request) -> web.StreamResponse:
        async def prefill() -> tuple[int, object, dict]:
            return 200, result, {}

        prompt = ParsedRequest("default", "r1", [1, 2, 3, 4], handoff=True)
        batch = CompletionRequest([prompt], "tiny", stream=False, sampling=Sampling(8))
        return await flow.complete(
            request, batch, prefill=prefill, cache_salt="s", answered=lambda _: None
        )

    gateway_app = web.Application()
    gateway_app.add_routes([web.post("/v1/completions", handle)])
    gateway, gateway_url = await _serve(gateway_app)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                async with session.post(f"{gateway_url}/v1/completions", json={}) as response:
                    assert response.status == 200, await response.text()
                    assert (await response.json())["choices"][0]["token_ids"] == [5, 6]
    finally:
        await flow.close()
        await gateway.cleanup()
        await decode.cleanup()
    assert len(client_ports) == 3
    assert len(set(client_ports)) == 3, f"a connection was reused: client ports {client_ports}"
