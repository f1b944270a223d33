"""A stage's handoff server in process, over real sockets: an authenticated pull returns the
request's K/V per layer and releases its lease; a wrong token, an expired token, an unknown
request or an unkeyed stage are refused with the cause (for a handoff that ended here: how it
ended); a client that disconnects after asking releases the lease; an engine without K/V
caches answers an error and releases."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from wavepp.api.kv_handoff import HandoffError, HandoffParams, StageEndpoint, read_json, write_json
from wavepp.api.signing import BusKey
from wavepp.integrations.vllm.pull import pull_request, pull_stage, stage_stats
from wavepp.runtime.kv import BlockPool
from wavepp.runtime.kv.handoff import HandoffLeases
from wavepp.runtime.serving.handoff import handoff_token
from wavepp.runtime.stage.handoff_server import HandoffServer

BLOCK, HEADS, DIM, LAYERS = 4, 2, 8, 3


def _server(key: BusKey | None, caches=None) -> tuple[HandoffServer, list[torch.Tensor]]:
    pool = BlockPool(16, BLOCK)
    layer_caches = [torch.randn(2, 16 * BLOCK, HEADS, DIM) for _ in range(LAYERS)]
    server = HandoffServer(
        HandoffLeases(pool),
        caches or (lambda: layer_caches),
        first_layer=0,
        last_layer=LAYERS,
        block_size=BLOCK,
        key=key,
    )
    return server, layer_caches


def _hold(server: HandoffServer, request_id: str, num_tokens: int) -> tuple[int, ...]:
    pool = server.leases.pool
    blocks = pool.allocate(-(-num_tokens // BLOCK))
    assert blocks is not None
    server.leases.hold(request_id, tuple(blocks), num_tokens, expires=time.time() + 60)
    pool.free(blocks)  # the scheduler's release: only the lease holds them now
    return tuple(blocks)


def _params(
    key: BusKey, server: HandoffServer, request_id: str, num_tokens: int, **kw
) -> HandoffParams:
    expires = server.leases.get(request_id).expires if server.leases.get(request_id) else 1e10
    expires = kw.get("expires", expires)
    return HandoffParams(
        request_id=request_id,
        num_tokens=num_tokens,
        expires=expires,
        token=kw.get("token", handoff_token(key, request_id, expires)),
        stages=(StageEndpoint(server.addr, 0, LAYERS),),
    )


async def test_pull_auth_and_release() -> None:
    key = BusKey.generate().for_replica("p")
    server, caches = _server(key)
    await server.start("127.0.0.1", 0)
    try:
        free0 = server.leases.pool.num_free_blocks
        blocks = _hold(server, "r", 10)
        _hold(server, "s", 5)
        # wrong token, expired token, unknown request: refused, leases untouched
        with pytest.raises(HandoffError, match="token: not valid"):
            await asyncio.to_thread(pull_request, _params(key, server, "r", 10, token="ab" * 32))
        other = BusKey.generate().for_replica("p")
        with pytest.raises(HandoffError, match="token: not valid"):
            await asyncio.to_thread(pull_request, _params(other, server, "r", 10))
        with pytest.raises(HandoffError, match="ended at"):
            await asyncio.to_thread(pull_request, _params(key, server, "r", 10, expires=1.0))
        with pytest.raises(HandoffError, match="holds no handoff lease"):
            await asyncio.to_thread(pull_request, _params(key, server, "x", 10))
        assert len(server.leases) == 2
        pulled = await asyncio.to_thread(pull_request, _params(key, server, "r", 10))
        for layer, cache in zip(pulled.layers, caches, strict=True):
            for t in range(10):
                slot = blocks[t // BLOCK] * BLOCK + t % BLOCK
                assert torch.equal(layer[:, t], cache[:, slot])
        assert pulled.num_bytes == LAYERS * 2 * 10 * HEADS * DIM * 4
        assert server.leases.get("r") is None  # released by the client
        # a client that asks and vanishes before releasing: the lease goes at once
        host, port = server.addr.rsplit(":", 1)
        params = _params(key, server, "s", 5)

        def ask_and_vanish() -> bool:
            with socket.create_connection((host, int(port))) as sock:
                ask = {"op": "pull", "request_id": "s", "expires": params.expires}
                write_json(sock, ask | {"token": params.token})
                return bool(read_json(sock)["ok"])

        assert await asyncio.to_thread(ask_and_vanish)
        for _ in range(100):
            if server.leases.get("s") is None:
                break
            await asyncio.sleep(0.02)
        stats = await asyncio.to_thread(stage_stats, server.addr)
        assert stats["leases"] == 0 and stats["broken"] == 1 and stats["refused"] == 4
        assert stats["transfers"] >= 1 and server.leases.pool.num_free_blocks == free0
        # a later ask for an ended handoff is refused with how it ended
        with pytest.raises(HandoffError, match="holds no handoff lease.*: released after its pu"):
            await asyncio.to_thread(pull_request, _params(key, server, "r", 10))
        with pytest.raises(HandoffError, match="holds no handoff lease.*: its pull broke off"):
            await asyncio.to_thread(pull_request, params)
    finally:
        await server.stop()


async def test_unkeyed_stage_and_cacheless_engine_refuse() -> None:
    key = BusKey.generate().for_replica("p")
    server, _ = _server(None)
    await server.start("127.0.0.1", 0)
    try:
        _hold(server, "r", 4)
        with pytest.raises(HandoffError, match="no bus key"):
            await asyncio.to_thread(pull_request, _params(key, server, "r", 4))
    finally:
        await server.stop()

    def no_caches() -> list[torch.Tensor]:
        raise ValueError("layer 0: MLAAttention keeps no allocated K/V cache")

    server, _ = _server(key, caches=no_caches)
    await server.start("127.0.0.1", 0)
    try:
        _hold(server, "r", 4)
        with pytest.raises(HandoffError, match="cannot serve its KV: layer 0: MLAAttention"):
            await asyncio.to_thread(
                pull_stage, _params(key, server, "r", 4), StageEndpoint(server.addr, 0, LAYERS)
            )
        assert len(server.leases) == 0 and server.leases.pool.num_pinned_blocks == 0
    finally:
        await server.stop()


def test_handoff_listen_is_validated() -> None:
    from pydantic import ValidationError

    from wavepp.runtime.config import RuntimeConfig

    assert RuntimeConfig(handoff_listen="0.0.0.0:7000").handoff_listen == "0.0.0.0:7000"
    assert RuntimeConfig(handoff_listen="").handoff_listen == ""
    with pytest.raises(ValidationError, match="handoff_listen"):
        RuntimeConfig(handoff_listen="no-port")
