"""A replica told to drain (a scale-down drains it first): SIGTERM to its admission
process, as the kubelet sends when the operator scales the admission Deployment to 0.

The stage and admission run as processes with the args and env the operator renders (as in
``test_runtime_contract``); the gateway runs in this process (its router is read directly), on
a real nats-server with JetStream. The admission takes at most 2 requests from its intake at a
time (``--max-outstanding 2``, added to the rendered args), so when SIGTERM comes 2 requests
run and 4 wait in its durable intake. Then:

- the replica leaves the gateway's pool at once (its heartbeat says ``draining``), and the
  gateway does not re-route or fail what it sent there (it is the only replica);
- every request is answered, by it, without an error;
- the process exits 0, after its last answer.

The stage process (its pod's rendered args, ``--metrics-port`` made local) serves its own
``/metrics`` (``wavepp.runtime.stage.metrics``): scraped at the end, it counts the micro-batches
it ran, their execute time, its KV blocks by state and its group.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from pod_support import (
    REF,
    container_of,
    expand,
    kubelet_env,
    localize,
    start_wavepp,
)
from prometheus_client.parser import text_string_to_metric_families

from wavepp.api.prefill import Heartbeat
from wavepp.api.spec import check_spec
from wavepp.api.subjects import heartbeat_subject
from wavepp.gateway.core import Gateway
from wavepp.gateway.validation import ParsedRequest
from wavepp.launch.gateway import gateway_config_from_spec
from wavepp.operator import builders as b
from wavepp.operator.containers import HEALTH_PORT, HTTP_PORT, SPEC_FILE
from wavepp.operator.naming import POD_INDEX_LABEL, spec_hash
from wavepp.runtime.procs import stop_processes
from wavepp.runtime.stage.metrics import STAGE_PROMETHEUS_NAMES
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SPEC: dict[str, Any] = {
    "model": {"name": "tiny-llama"},
    "stages": 1,
    "replicas": 1,
    "engine": "emulated",
    "engineOptions": {"timeScale": 60.0, "kvBlocks": 256},
    "rollout": {"drainTimeoutSeconds": 30},
}
NUM_REQUESTS = 6


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.mark.serial  # draining within 0.5 s of SIGTERM, out of the pool within 1 s
async def test_sigterm_drains_the_replica_every_admitted_request_answered(tmp_path: Path) -> None:
    spec, issues = check_spec(SPEC, default_image="wavepp:test", default_nats_url="nats://n:4222")
    assert spec is not None, issues
    hash_ = spec_hash(spec)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(b.build_spec_configmap(REF, spec, hash_)["data"]["spec.json"])
    sts = b.build_stage_statefulset(REF, spec, hash_, 0)
    admission = container_of(b.build_admission_deployment(REF, spec, hash_, 0, running=True))
    assert admission["args"][-2:] == ["--drain-timeout-s", "25"]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: tmp_path / f"{name}.log" for name in ("stage", "admission")}

    def launch(name: str, container: dict, env: dict, local: dict, cluster: dict, *extra: str):  # noqa: ANN202
        args = localize([expand(a, env) for a in container["args"]], local, cluster)
        procs[name] = start_wavepp([*args, *extra], logs[name], env)

    def tails() -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in logs.values())

    with EmbeddedNatsServer(jetstream=True, store_dir=str(tmp_path / "js")) as nats:
        nc = await connect(nats.url, name="test-drain")
        pool_doc = json.loads(
            b.build_pool_configmap(REF, [b.PoolEntry(0, hash_, admitting=True)])["data"][
                "pool.json"
            ]
        )
        gateway = Gateway(gateway_config_from_spec(spec, pool_doc, namespace=REF.namespace), nc)
        await gateway.start()
        replica = f"{REF.name}-r0"
        beats: list[tuple[float, Heartbeat]] = []

        async def on_beat(msg: Any) -> None:
            beats.append((time.monotonic(), Heartbeat.model_validate_json(msg.data)))

        await nc.subscribe(heartbeat_subject(replica, namespace=REF.namespace), cb=on_beat)
        try:
            stage_c = container_of(sts)
            labels = sts["spec"]["template"]["metadata"]["labels"] | {POD_INDEX_LABEL: "0"}
            stage_port, stage_metrics_port = free_port(), free_port()
            launch(
                "stage",
                stage_c,
                kubelet_env(stage_c, "tiny-r0-0", labels),
                {
                    "--config": str(spec_path),
                    "--nats-url": nats.url,
                    "--dist-url": f"tcp://127.0.0.1:{free_port()}",
                    "--health-port": str(stage_port),
                    "--metrics-port": str(stage_metrics_port),
                },
                {
                    "--config": SPEC_FILE,
                    "--nats-url": "nats://n:4222",
                    "--dist-url": "tcp://tiny-r0-0.tiny-r0:29500",
                    "--health-port": str(HEALTH_PORT),
                    "--metrics-port": str(spec.telemetry.metrics_port),
                },
            )
            admission_port = free_port()
            launch(
                "admission",
                admission,
                kubelet_env(admission, "tiny-r0-admission-x", {})
                | {"WAVEPP_METRICS_PORT": str(free_port())},
                {"--config": str(spec_path), "--nats-url": nats.url,
                 "--health-port": str(admission_port)},
                {"--config": SPEC_FILE, "--nats-url": "nats://n:4222",
                 "--health-port": str(HTTP_PORT)},
                "--max-outstanding", "2",
            )  # fmt: skip
            deadline = time.monotonic() + 60
            while not gateway.router.in_pool(replica, time.monotonic()):
                assert time.monotonic() < deadline, f"replica not in the pool:\n{tails()}"
                assert all(p.poll() is None for p in procs.values()), tails()
                await asyncio.sleep(0.1)
            assert _ready(f"http://127.0.0.1:{admission_port}/readyz")

            answered_at: dict[str, float] = {}

            async def ask(i: int) -> Any:
                tokens = [(i * 131 + 7 * t) % 997 + 1 for t in range(96)]
                request = ParsedRequest(tenant="default", request_id=f"q{i}", token_ids=tokens)
                result, _ = await gateway.prefill(request)
                answered_at[request.request_id] = time.monotonic()
                return result

            tasks = [asyncio.create_task(ask(i)) for i in range(NUM_REQUESTS)]
            # 2 running on the replica, the others waiting in its intake
            while not any(beat.num_inflight >= 2 for _, beat in beats[-2:]):
                assert time.monotonic() < deadline, tails()
                await asyncio.sleep(0.02)
            procs["admission"].send_signal(signal.SIGTERM)  # the kubelet, on a scale-down
            sigterm = time.monotonic()
            # at most 2 run: with 3 or more unanswered, one at least waits in the intake
            num_open = sum(not t.done() for t in tasks)
            assert num_open >= 3, "requests too short to drain mid-way"
            while gateway.router.in_pool(replica, time.monotonic()):
                assert time.monotonic() - sigterm < 5, "still in the pool"
                await asyncio.sleep(0.01)
            left_pool_s = time.monotonic() - sigterm
            assert gateway.router.is_finishing(replica, time.monotonic())
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            exit_code = await asyncio.to_thread(procs["admission"].wait, 30)
            exited = time.monotonic()
            with urllib.request.urlopen(
                f"http://127.0.0.1:{stage_metrics_port}/metrics", timeout=5
            ) as response:
                stage_metrics = response.read().decode()
        finally:
            stop_processes(procs.values())
            await gateway.stop()
            await nc.close()
    assert [r.error for r in results] == [""] * NUM_REQUESTS, tails()
    assert {r.replica for r in results} == {replica}
    assert exit_code == 0, tails()
    last_answer = max(answered_at.values())
    assert sigterm < last_answer < exited, (sigterm, answered_at, exited)
    draining = [t for t, beat in beats if beat.draining]
    assert draining and draining[0] - sigterm < 0.5
    assert left_pool_s < 1.0
    assert not beats[-1][1].draining and not beats[-1][1].ready  # its last word: gone
    assert "drained in" in logs["admission"].read_text(errors="replace")
    samples = {
        (s.name, s.labels.get("state")): s
        for family in text_string_to_metric_families(stage_metrics)
        for s in family.samples
    }
    assert {name for name, _ in samples} == set(STAGE_PROMETHEUS_NAMES), stage_metrics
    assert all(
        s.labels["pipeline"] == replica and s.labels["stage_rank"] == "0" for s in samples.values()
    )
    assert samples[("wavepp_stage_microbatches_run_total", None)].value >= 3  # 6 requests, 2 a time
    assert samples[("wavepp_stage_execute_seconds_total", None)].value > 0.1
    kv = {
        state: samples[("wavepp_stage_kv_blocks", state)].value
        for state in ("used", "cached", "free")
    }
    assert sum(kv.values()) == 256 and kv["used"] == 0 and kv["cached"] >= NUM_REQUESTS * 5, kv
    assert samples[("wavepp_stage_group_formed", None)].value == 1
    assert samples[("wavepp_stage_group_epoch", None)].value == 1
    print(
        f"drain: {NUM_REQUESTS} requests, {num_open} unanswered at SIGTERM (2 running, the others"
        f" in the intake), all answered by {replica}; left the pool {left_pool_s:.2f} s after SIGTERM; last "
        f"answer {last_answer - sigterm:.2f} s after SIGTERM; process exited 0 "
        f"{exited - last_answer:.2f} s after its last answer"
    )
