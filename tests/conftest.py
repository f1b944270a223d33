"""Shared fixtures: a real nats-server on a free port, and a client connected to it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect


@pytest.fixture
def nats_server() -> Iterator[EmbeddedNatsServer]:
    server = EmbeddedNatsServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def nc(nats_server: EmbeddedNatsServer) -> AsyncIterator[object]:
    client = await connect(nats_server.url, name="test")
    try:
        yield client
    finally:
        await client.drain()
