"""The operator's stage pod for ``tensorParallelSize: 2`` requests 2 GPUs and its one container
process starts 2 stage processes (TP rank 0 + one follower), which serve requests.

The rendered pod is run as ``test_runtime_contract`` runs pods (the rendered args and env, local
files, ports and nats-server). No GPU is at hand here: the pods that run are rendered from the
same spec with ``resources.gpusPerStage: 0`` (the CPU, gloo), whose container args equal the GPU
spec's; the GPU request and the device each process takes (``cuda:0``, ``cuda:1``) are checked
on the rendered manifest and the derived RuntimeConfig.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from http_support import post_json
from pod_support import (
    CLUSTER_NATS_URL,
    REF,
    container_of,
    expand,
    kubelet_env,
    localize,
    probe_path,
    stage_pod,
    start_wavepp,
    wait_200,
)
from proc_support import children_running

from wavepp.api.spec import check_spec
from wavepp.launch.runtime_config import runtime_configs_from_spec
from wavepp.operator import builders as b
from wavepp.operator.containers import HEALTH_PORT, HTTP_PORT, POOL_FILE, SPEC_FILE
from wavepp.operator.gateway_builders import build_gateway_deployment
from wavepp.operator.naming import spec_hash
from wavepp.runtime.procs import stop_processes
from wavepp.runtime.stage.engine import ChunkSpec, make_engine
from wavepp.runtime.stage.engine.tensor_parallel import tp_device
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, free_port

pytestmark = pytest.mark.timeout(240)

RAW: dict[str, Any] = {
    "model": {"name": "tiny-llama"},
    "stages": 2,
    "replicas": 1,
    "engine": "torch",
    "tensorParallelSize": 2,
    "engineOptions": {"kvBlocks": 64},
}


def _spec(raw: dict[str, Any]) -> Any:
    spec, issues = check_spec(raw, default_image="wavepp:test", default_nats_url=CLUSTER_NATS_URL)
    assert spec is not None, issues
    return spec


def _followers(pid: int) -> list[int]:
    """Child processes of ``pid`` running the tensor-parallel follower module."""
    return children_running(pid, "wavepp.runtime.stage.tp_launch")


def test_rendered_stage_pod_requests_one_gpu_per_tp_process() -> None:
    spec = _spec(RAW)
    sts = b.build_stage_statefulset(REF, spec, spec_hash(spec), 0)
    container = container_of(sts)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "2"
    config = runtime_configs_from_spec(spec, pool=REF.name)[0]
    assert config.tensor_parallel_size == 2 and config.device == "cuda"
    assert [tp_device(config.device, t) for t in range(2)] == ["cuda:0", "cuda:1"]
    cpu = _spec(RAW | {"resources": {"gpusPerStage": 0}})
    assert (
        container_of(b.build_stage_statefulset(REF, cpu, spec_hash(cpu), 0))["args"]
        == (container["args"])
    )
    # More GPUs than TP processes would sit idle: refused, naming the field.
    _, issues = check_spec(
        RAW | {"resources": {"gpusPerStage": 4}}, default_image="i", default_nats_url="nats://n"
    )
    assert any("gpusPerStage" in str(i) for i in issues), issues


def _expected_first_token(config: Any, tokens: list[int]) -> int:
    """The seeded model in one process, no TP (checked against transformers elsewhere)."""
    n = config.model.num_layers
    engine = make_engine(
        "torch", model=config.model, first_layer=0, last_layer=n, num_layers_total=n
    )
    blocks = -(-len(tokens) // config.block_size)
    engine.allocate_kv(blocks, config.block_size)
    spec = ChunkSpec("x", 0, len(tokens), tuple(range(blocks)), tuple(tokens), is_last=True)
    logits = engine.execute(engine.prepare([spec]), None).last_token_logits["x"]
    return int(logits.argmax())


@pytest.mark.slow
def test_rendered_tp_stage_pods_start_two_processes_each_and_serve(tmp_path: Path) -> None:
    spec = _spec(
        RAW | {"resources": {"gpusPerStage": 0}, "telemetry": {"metricsPort": free_port()}}
    )
    hash_ = spec_hash(spec)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(b.build_spec_configmap(REF, spec, hash_)["data"]["spec.json"])
    pool_path = tmp_path / "pool.json"
    pool_cm = b.build_pool_configmap(REF, [b.PoolEntry(0, hash_, admitting=False)])
    pool_path.write_text(pool_cm["data"]["pool.json"])
    sts = b.build_stage_statefulset(REF, spec, hash_, 0)
    stage_c = container_of(sts)
    admission_c = container_of(b.build_admission_deployment(REF, spec, hash_, 0, running=True))
    gateway_c = container_of(build_gateway_deployment(REF, spec, hash_))
    cluster = {
        "--config": SPEC_FILE,
        "--nats-url": CLUSTER_NATS_URL,
        "--pool-file": POOL_FILE,
        "--dist-url": f"tcp://{sts['metadata']['name']}-0.{sts['metadata']['name']}:29500",
        "--health-port": {str(HEALTH_PORT), str(HTTP_PORT)},
        "--port": str(HTTP_PORT),
        "--metrics-port": str(spec.telemetry.metrics_port),  # each stage's own /metrics
    }
    procs: list[subprocess.Popen[bytes]] = []
    with EmbeddedNatsServer(jetstream=True, store_dir=str(tmp_path / "js")) as nats:
        common = {"--config": str(spec_path), "--nats-url": nats.url, "--pool-file": str(pool_path)}
        dist_url = f"tcp://127.0.0.1:{free_port()}"

        def start(name: str, container: dict, local: dict[str, str], env: dict) -> Any:
            args = [expand(a, env) for a in container["args"]]
            log = tmp_path / f"{name}.log"
            proc = start_wavepp(localize(args, common | local, cluster), log, env)
            procs.append(proc)
            return proc, log

        try:
            stages = []
            for rank in range(spec.num_stages):
                local, env, port = stage_pod(sts, stage_c, rank, dist_url)
                proc, log = start(f"stage-{rank}", stage_c, local, env)
                stages.append((proc, log, f"http://127.0.0.1:{port}"))
            adm_env = kubelet_env(admission_c, "tiny-r0-admission-x", {})
            start("admission", admission_c, {"--health-port": str(free_port())}, adm_env)
            gateway_port = free_port()
            gw_env = kubelet_env(gateway_c, "tiny-gateway-x", {})
            gw, gw_log = start("gateway", gateway_c, {"--port": str(gateway_port)}, gw_env)
            for proc, log, base in stages:
                wait_200(f"{base}{probe_path(stage_c, 'readinessProbe')}", proc, log)
                # One container process, two stage processes: it and its TP follower.
                assert len(_followers(proc.pid)) == 1, _followers(proc.pid)
            gateway = f"http://127.0.0.1:{gateway_port}"
            wait_200(f"{gateway}{probe_path(gateway_c, 'readinessProbe')}", gw, gw_log)
            tokens = [(7 * i) % 200 + 1 for i in range(3 * spec.cache.block_size + 5)]
            status, first = post_json(
                f"{gateway}/v1/prefill", {"tenant": "default", "token_ids": tokens}
            )
            assert status == 200 and not first["error"], first
            config = runtime_configs_from_spec(spec, pool=REF.name)[0]
            assert first["first_token_id"] == _expected_first_token(config, tokens)
            status, second = post_json(
                f"{gateway}/v1/prefill", {"tenant": "default", "token_ids": tokens}
            )
            assert status == 200 and second["num_cached_tokens"] == 3 * spec.cache.block_size
            assert second["first_token_id"] == first["first_token_id"]
            # A follower that dies takes its stage down (the pod restarts whole).
            (follower,) = _followers(stages[1][0].pid)
            os.kill(follower, 9)
            assert stages[1][0].wait(30) == 1
            assert "tensor-parallel follower(s)" in stages[1][1].read_text()
        finally:
            stop_processes(reversed(procs))
        for proc, _, _ in stages:  # the followers left with their leaders
            assert not _followers(proc.pid)
