"""Pool router with R = 2 replicas (real processes): prefix-aware routing vs round-robin on the
same requests, both measured here.

One `wavepp up` (2 replicas x 1 stage, routing=prefix) serves tenant alice; a second `wavepp
gateway` process on the same replicas, with routing=round_robin, serves tenant bob. The tenants'
cache salts differ, so neither run can reuse the other's blocks: the two runs are independent.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from wavepp.runtime.transport.natsio import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

POOL_SPEC = {
    "model": {"name": "tiny-llama"},
    "stages": 1,
    "replicas": 2,
    "engineOptions": {"kvBlocks": 512},
    "cache": {"blockSize": 16},
    "tenants": [{"name": "alice"}, {"name": "bob"}],
}


def workload() -> list[tuple[int, list[int]]]:
    """3 documents of 64 tokens, each asked 4 times with a fresh 8-token question, interleaved
    (d0 d1 d2 d0 d1 d2 ...): round-robin over 2 replicas sends every document to both."""
    rng = random.Random(0)
    docs = [[rng.randrange(1, 1024) for _ in range(64)] for _ in range(3)]
    return [
        (d, docs[d] + [rng.randrange(1, 1024) for _ in range(8)])
        for _ in range(4)
        for d in range(3)
    ]


async def _run(endpoint: str, tenant: str) -> list[dict]:
    answers = []
    async with aiohttp.ClientSession() as session:
        for doc, tokens in workload():
            body = {"tenant": tenant, "token_ids": tokens}
            async with session.post(f"{endpoint}/v1/prefill", data=json.dumps(body)) as response:
                assert response.status == 200, await response.text()
                answers.append({"doc": doc, **(await response.json())})
    return answers


async def _wait_ready(endpoint: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{endpoint}: its process exited"
            try:
                # Ready means one replica admits; this test needs both in the pool: every
                # replica's wavepp_gateway_replica_up is 1 (else round robin sends a document
                # twice to the one replica already in).
                async with session.get(f"{endpoint}/metrics") as response:
                    text = await response.text() if response.status == 200 else ""
                ups = [
                    line.rsplit(" ", 1)[-1]
                    for line in text.splitlines()
                    if line.startswith("wavepp_gateway_replica_up{")
                ]
                if len(ups) >= 2 and all(float(v) == 1.0 for v in ups):
                    return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    pytest.fail(f"gateway {endpoint} not ready in {timeout_s}s")


async def test_prefix_routing_beats_round_robin(tmp_path: Path, serving) -> None:  # noqa: ANN001
    service = serving.start_up(tmp_path, POOL_SPEC, ["--routing", "prefix"])
    port = free_port()
    rr_gateway = subprocess.Popen(
        [sys.executable, "-m", "wavepp.cli", "gateway",
         "--gateway-config", str(service.state_dir / "gateway.json"),
         "--nats-url", service.processes()["nats_url"], "--port", str(port),
         "--routing", "round_robin",
         "--nats-creds", service.processes()["nats_creds"]["gateway-default"]],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        rr_endpoint = f"http://127.0.0.1:{port}"
        await _wait_ready(rr_endpoint, rr_gateway, 60)
        await _wait_ready(service.endpoint, service.proc, 60)
        prefix = await _run(service.endpoint, "alice")
        round_robin = await _run(rr_endpoint, "bob")
        rerouted = await _stop_answering(service, prefix)
    finally:
        rr_gateway.terminate()
        rr_gateway.wait(30)
        assert serving.stop_up(service.proc) == 0
    cached_prefix = sum(a["num_cached_tokens"] for a in prefix)
    cached_rr = sum(a["num_cached_tokens"] for a in round_robin)
    print(
        f"cached tokens over 12 requests: prefix routing {cached_prefix}, round-robin {cached_rr}"
    )
    assert cached_prefix > cached_rr
    # prefix routing keeps each document on one replica; round-robin spreads it over both
    for doc in range(3):
        assert len({a["replica"] for a in prefix if a["doc"] == doc}) == 1
        assert len({a["replica"] for a in round_robin if a["doc"] == doc}) == 2
    # both replicas are used (ties go to the least loaded / next replica)
    assert len({a["replica"] for a in prefix}) == 2
    # after its first request, every repeat of a document hits under prefix routing
    assert all(a["num_cached_tokens"] > 0 for a in prefix[3:])
    # a replica that stops answering leaves the pool; its requests are answered by the other
    stopped, answers, pool_after = rerouted
    assert [a["replica"] for a in answers] == [_other(stopped)] * len(answers)
    assert pool_after[stopped]["in_pool"] is False


def _other(replica: str) -> str:
    return "default-r1" if replica == "default-r0" else "default-r0"


async def _stop_answering(service, prefix: list[dict]) -> tuple[str, list[dict], dict]:  # noqa: ANN001
    """SIGSTOP the admission of the replica holding document 0, then ask for document 0 again
    (the router still prefers that replica until its heartbeat times out, 3 s)."""
    replica = next(a["replica"] for a in prefix if a["doc"] == 0)
    pid = service.processes()["pids"][f"admission-{replica}"]
    os.kill(pid, signal.SIGSTOP)
    try:
        _, tokens = workload()[0]
        async with aiohttp.ClientSession() as session:

            async def ask(i: int) -> dict:
                body = {"tenant": "alice", "token_ids": tokens + [i + 1]}
                async with session.post(
                    f"{service.endpoint}/v1/prefill", data=json.dumps(body)
                ) as response:
                    assert response.status == 200, await response.text()
                    return await response.json()

            answers = await asyncio.gather(*(ask(i) for i in range(4)))
            async with session.get(f"{service.endpoint}/readyz") as response:
                pool_after = (await response.json())["replicas"]
    finally:
        os.kill(pid, signal.SIGCONT)
    return replica, list(answers), pool_after
