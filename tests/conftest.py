"""Shared fixtures: a real nats-server on a free port, and a client connected to it.

Also what running the suite in parallel (pytest-xdist, ``-n 2``: scripts/test.sh) needs:

* each worker draws ports from its own part of ``natsio.FREE_PORT_RANGE`` (``free_port`` never
  repeats a port within a process, but two workers could draw the same one; see
  ``_split_free_ports``);
* a test marked ``serial`` runs while no other worker runs a test (its assertions measure wall
  time: the other worker's load would be noise in them); see tests/support/xdist_turns.py.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from wavepp.runtime.transport import natsio
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect

# `wavepp up` as a real process tree, shared by tests/up, tests/gateway and others; the turns of
# the xdist workers (tests marked `serial`).
pytest_plugins = ["up_fixtures", "xdist_turns"]

# torch in this process (the engine, layer and reference tests run it in-process) uses one
# thread, as a stage process does (``RuntimeConfig.torch_threads`` defaults to 1 and the stage
# sets it). torch's default, one per core, makes those tests' tiny ops wait for a second thread
# on a machine whose cores are shared (slower, and more CPU). Set before torch is imported (nothing imports it before this file); a
# stage process still sets its own count, and a value set outside the run is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _split_free_ports() -> None:
    """Under xdist, worker ``gwK`` of N takes the K-th of N equal parts of the port range, in
    this process and, through ``WAVEPP_FREE_PORTS``, in every process it starts (``wavepp up``
    draws its children's ports itself)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return
    index = int(worker.removeprefix("gw"))
    low, high = natsio.DEFAULT_FREE_PORT_RANGE
    size = (high - low) // count
    part = (low + index * size, low + (index + 1) * size)
    os.environ[natsio.FREE_PORTS_ENV] = f"{part[0]}-{part[1]}"
    natsio.FREE_PORT_RANGE = part


_split_free_ports()


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


@pytest.fixture(scope="session")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A random Kimi-Linear checkpoint (5 layers, vocabulary 256; KDA and MLA layers): its
    directory and the transformers model saved there (the reference). Skipped without
    transformers. Read-only: tests must not change the directory."""
    pytest.importorskip("transformers")
    from wavepp.bench.checkpoints import save_random_checkpoint

    out = tmp_path_factory.mktemp("kimi")
    return out, save_random_checkpoint("kimi_linear", out, num_layers=5, vocab_size=256)
