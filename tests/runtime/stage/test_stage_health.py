"""A stage's health is its compute loop's: a compute thread that raises turns /healthz and
/readyz to 503 (real StageWorker, real nats-server, real aiohttp health server; the one thing
replaced is the stage's process group, whose ``recv`` raises as a lost peer makes it raise).
Without a rendezvous (no re-forming in place) that ends the stage: the operator re-forms it."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
import torch
from stage_support import LostPeerGroup, emulated_two_stages, one_token_plan

from wavepp.api.spec import check_spec
from wavepp.launch.runtime_config import runtime_configs_from_spec
from wavepp.runtime.serving.health import start_health_server
from wavepp.runtime.stage.build import build_engine, check_environment
from wavepp.runtime.stage.process import StageReadiness
from wavepp.runtime.stage.rendezvous import open_rendezvous
from wavepp.runtime.stage.worker import StageWorker
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect

pytestmark = pytest.mark.timeout(60)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def _wait(check, what: str, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_compute_thread_that_raises_fails_readiness_and_liveness(nats_server) -> None:
    config = emulated_two_stages("health", nats_server.url)
    rank = 1  # not the first stage: it receives activations before it computes
    nc = await connect(nats_server.url, name="health-test")
    worker = StageWorker(config, rank, nc, build_engine(config, rank), group=LostPeerGroup())
    readiness = StageReadiness(is_formed=True, worker=worker)
    runner, port = await start_health_server(
        "127.0.0.1",
        0,
        {
            "/healthz": lambda: readiness.is_alive,
            "/readyz": lambda: readiness.is_serving,
        },
    )
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    base = f"http://127.0.0.1:{port}"
    try:
        await _wait(lambda: readiness.is_serving, "serving")
        assert await asyncio.to_thread(_status, f"{base}/readyz") == 200
        assert await asyncio.to_thread(_status, f"{base}/healthz") == 200
        # Idle, the compute thread keeps beating: still alive a few beats later.
        await asyncio.sleep(1.5)
        assert worker.compute_alive and readiness.is_serving

        await nc.publish(config.subjects.plan, one_token_plan().model_dump_json().encode())
        await _wait(lambda: worker.compute_error is not None, "the compute thread to die")
        assert "Connection closed by peer" in repr(worker.compute_error)
        assert not worker.compute_alive
        assert not readiness.is_serving and not readiness.is_alive
        assert await asyncio.to_thread(_status, f"{base}/readyz") == 503
        assert await asyncio.to_thread(_status, f"{base}/healthz") == 503
    finally:
        stop.set()
        await serving
        await runner.cleanup()
        await nc.drain()


async def test_a_lost_peer_with_a_rendezvous_waits_to_re_form_and_stays_alive() -> None:
    """With a rendezvous bucket (re-forming in place) the same lost peer takes the
    stage out of service (``is_formed`` False) but is no compute error: liveness stays 200, so
    the kubelet does not restart a stage that waits for its group's next epoch."""
    config = emulated_two_stages("health")
    rank = 1
    with EmbeddedNatsServer(jetstream=True) as server:
        nc = await connect(server.url, name="health-rdzv-test")
        rendezvous = await open_rendezvous(nc, config.pipeline, rank, 2, namespace="t")
        assert rendezvous is not None
        worker = StageWorker(
            config,
            rank,
            nc,
            build_engine(config, rank),
            group=LostPeerGroup(),
            rendezvous=rendezvous,
        )
        readiness = StageReadiness(is_formed=True, worker=worker)
        stop = asyncio.Event()
        serving = asyncio.create_task(worker.serve(stop))
        try:
            await _wait(lambda: readiness.is_serving, "serving")
            await nc.publish(config.subjects.plan, one_token_plan().model_dump_json().encode())
            await _wait(lambda: not worker.is_formed, "the group failure")
            assert worker.compute_error is None
            assert worker.compute_alive and readiness.is_alive
        finally:
            stop.set()
            await serving
            await nc.drain()


def test_cuda_requested_but_absent_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = {"model": {"name": "tiny-llama"}, "stages": 2, "resources": {"gpusPerStage": 1}}
    spec, _ = check_spec(raw, default_image="i", default_nats_url="nats://n:4222")
    assert spec is not None
    config = runtime_configs_from_spec(spec, pool="p")[0]
    assert (config.device, config.model.dtype) == ("cuda", "bfloat16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"spec.resources.gpusPerStage > 0: .* sees no CUDA"):
        check_environment(config)
    missing = config.model_copy(update={"device": "cpu", "weights": "/nonexistent/ckpt"})
    with pytest.raises(ValueError, match="spec.model.path: '/nonexistent/ckpt' does not exist"):
        check_environment(missing)
