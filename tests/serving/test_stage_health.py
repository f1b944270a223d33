"""A stage's health is its compute loop's: a compute thread that raises turns /healthz and
/readyz to 503 (real StageWorker, real nats-server, real aiohttp health server; the one thing
replaced is ``torch.distributed.recv``, which raises as a lost peer makes it raise)."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest

from wavepp.api.messages import MicroBatchPlan, PlannedChunk
from wavepp.api.spec import check_spec
from wavepp.cmd.stage import start_health_server
from wavepp.runtime.serving.from_spec import runtime_configs_from_spec
from wavepp.runtime.stage import worker as worker_module
from wavepp.runtime.stage.worker import StageReadiness, StageWorker, build_engine
from wavepp.runtime.transport.natsio import connect

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


async def test_a_compute_thread_that_raises_fails_readiness_and_liveness(
    nats_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = {
        "model": {"name": "tiny-llama"},
        "engine": "emulated",
        "stages": 2,
        "engineOptions": {"kvBlocks": 64, "timeScale": 0.01},
    }
    spec, issues = check_spec(raw, default_image="i", default_nats_url=nats_server.url)
    assert spec is not None, issues
    config = runtime_configs_from_spec(spec, pool="health", namespace="t")[0]
    rank = 1  # not the first stage: it receives activations before it computes

    def lost_peer(tensor, src):  # noqa: ANN001, ANN202
        raise RuntimeError(f"Connection closed by peer (rank {src})")

    monkeypatch.setattr(worker_module.dist, "recv", lost_peer)
    nc = await connect(nats_server.url, name="health-test")
    worker = StageWorker(config, rank, nc, build_engine(config, rank))
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

        plan = MicroBatchPlan(
            microbatch_id=0,
            epoch="e1",
            chunks=[
                PlannedChunk(
                    request_id="r", chunk_index=0, context_offset=0, token_ids=[1, 2], is_last=True
                )
            ],
        )
        await nc.publish(config.subjects.plan, plan.model_dump_json().encode())
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


def test_cuda_requested_but_absent_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = {"model": {"name": "tiny-llama"}, "stages": 2, "resources": {"gpusPerStage": 1}}
    spec, _ = check_spec(raw, default_image="i", default_nats_url="nats://n:4222")
    assert spec is not None
    config = runtime_configs_from_spec(spec, pool="p")[0]
    assert (config.device, config.model.dtype) == ("cuda", "bfloat16")
    monkeypatch.setattr(worker_module.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"spec.resources.gpusPerStage > 0: .* sees no CUDA"):
        worker_module.check_environment(config)
    missing = config.model_copy(update={"device": "cpu", "weights": "/nonexistent/ckpt"})
    with pytest.raises(ValueError, match="spec.model.path: '/nonexistent/ckpt' does not exist"):
        worker_module.check_environment(missing)
