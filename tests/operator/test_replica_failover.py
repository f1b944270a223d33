"""Two replicas as pods, one stage SIGKILLed and started again.

The processes run with the args and env the operator renders (as in ``test_runtime_contract``:
only the mounted files, the NATS URL, the rendezvous and the ports are made local): a
nats-server with JetStream, per replica ``wavepp stage`` x 2 and ``wavepp admission``, one
``wavepp gateway``. Stage 1 of replica 0 is SIGKILLed under a steady load:

- every request sent after the kill (and every one in flight at it) is answered 200 within
  5 s, by replica 1 (replica 0 leaves the gateway's pool: its heartbeat turns not ready);
- the stage is started again with the same args, as the kubelet would: the survivor (stage 0
  of replica 0) and it re-form their torch.distributed group in a new epoch of the rendezvous
  bucket, and replica 0 answers again; the time from the restart to its first answer is
  printed; no other stage process was restarted (same pids, still running).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from http_support import post_json
from pod_support import (
    CLUSTER_NATS_URL,
    REF,
    Load,
    container_of,
    expand,
    kubelet_env,
    localize,
    log_tail,
    start_wavepp,
)

from wavepp.api.spec import check_spec
from wavepp.operator import builders as b
from wavepp.operator.containers import HEALTH_PORT, HTTP_PORT, POOL_FILE, SPEC_FILE
from wavepp.operator.gateway_builders import build_gateway_deployment
from wavepp.operator.naming import POD_INDEX_LABEL, spec_hash, stage_pod_name
from wavepp.runtime.procs import stop_processes
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPEC: dict[str, Any] = {
    "model": {"name": "tiny-llama"},
    "stages": 2,
    "replicas": 2,
    "engine": "emulated",
    "engineOptions": {"timeScale": 0.05, "kvBlocks": 256},
}
ANSWER_WITHIN_S = 5.0


def _get_json(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def _wait(predicate, what: str, timeout_s: float, logs: list[Path]) -> float:  # noqa: ANN001
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what} not within {timeout_s}s:\n" + "\n".join(log_tail(p) for p in logs))
        time.sleep(0.05)
    return time.monotonic() - started


def test_stage_killed_replica_fails_over_then_reforms_in_place(tmp_path: Path) -> None:
    spec, issues = check_spec(SPEC, default_image="wavepp:test", default_nats_url=CLUSTER_NATS_URL)
    assert spec is not None, issues
    hash_ = spec_hash(spec)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(b.build_spec_configmap(REF, spec, hash_)["data"]["spec.json"])
    pool_path = tmp_path / "pool.json"
    entries = [b.PoolEntry(i, hash_, admitting=True) for i in range(2)]
    pool_path.write_text(b.build_pool_configmap(REF, entries)["data"]["pool.json"])
    gateway_c = container_of(build_gateway_deployment(REF, spec, hash_))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    commands: dict[str, tuple[list[str], dict[str, str]]] = {}
    logs: dict[str, Path] = {}

    def launch(name: str) -> subprocess.Popen[bytes]:
        args, env = commands[name]
        procs[name] = start_wavepp(args, logs[name], env, append=True)
        return procs[name]

    with EmbeddedNatsServer(jetstream=True, store_dir=str(tmp_path / "js")) as nats:
        common = {
            "--config": str(spec_path),
            "--nats-url": nats.url,
            "--pool-file": str(pool_path),
        }

        def add(
            name: str, container: dict, local: dict[str, str], cluster: dict, env: dict
        ) -> None:
            args = [expand(a, env) for a in container["args"]]
            commands[name] = (
                localize(args, common | local, {**cluster, "--nats-url": CLUSTER_NATS_URL}),
                env,
            )
            logs[name] = tmp_path / f"{name}.log"

        cluster = {"--config": SPEC_FILE, "--pool-file": POOL_FILE}
        for replica in range(2):
            sts = b.build_stage_statefulset(REF, spec, hash_, replica)
            stage_c = container_of(sts)
            sts_name = sts["metadata"]["name"]
            dist_url = f"tcp://127.0.0.1:{free_port()}"
            for rank in range(spec.num_stages):
                labels = sts["spec"]["template"]["metadata"]["labels"] | {
                    POD_INDEX_LABEL: str(rank)
                }
                env = kubelet_env(stage_c, stage_pod_name(REF.name, replica, rank), labels)
                add(
                    f"r{replica}-stage-{rank}",
                    stage_c,
                    {
                        "--dist-url": dist_url,
                        "--health-port": str(free_port()),
                        "--metrics-port": str(free_port()),
                    },
                    cluster
                    | {
                        "--dist-url": f"tcp://{sts_name}-0.{sts_name}:29500",
                        "--health-port": str(HEALTH_PORT),
                        "--metrics-port": str(spec.telemetry.metrics_port),
                    },
                    env,
                )
            admission_c = container_of(
                b.build_admission_deployment(REF, spec, hash_, replica, running=True)
            )
            add(
                f"r{replica}-admission",
                admission_c,
                {"--health-port": str(free_port())},
                cluster | {"--health-port": str(HTTP_PORT)},
                # Each admission pod serves metrics on the spec's port; here one port each.
                kubelet_env(admission_c, f"tiny-r{replica}-admission-x", {})
                | {"WAVEPP_METRICS_PORT": str(free_port())},
            )
        gateway_port = free_port()
        add(
            "gateway",
            gateway_c,
            {"--port": str(gateway_port)},
            cluster | {"--port": str(HTTP_PORT)},
            kubelet_env(gateway_c, "tiny-gateway-x", {}),
        )
        gateway = f"http://127.0.0.1:{gateway_port}"
        replica_names = [f"{REF.name}-r{i}" for i in range(2)]
        try:
            for name in commands:
                launch(name)

            def in_pool() -> dict[str, bool]:
                replicas = _get_json(f"{gateway}/readyz").get("replicas", {})
                return {n: bool(replicas.get(n, {}).get("in_pool")) for n in replica_names}

            _wait(
                lambda: all(in_pool().values()),
                "both replicas in the pool",
                150,
                list(logs.values()),
            )
            stage_pids = {n: p.pid for n, p in procs.items() if "stage" in n}
            load = Load([f"{gateway}/v1/prefill"], 2 * spec.cache.block_size + 3, post_json).start()
            _wait(lambda: len(load.records) >= 10, "10 answers before the kill", 60, [])
            victim = "r0-stage-1"
            procs[victim].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            left_pool_s = _wait(
                lambda: not in_pool()[replica_names[0]], "replica 0 out of the pool", 10, []
            )
            time.sleep(3.0)  # serve on replica 1 alone for a while
            procs[victim].wait(5)
            launch(victim)  # the kubelet's restart: same args, same env
            restarted = time.monotonic()
            _wait(lambda: in_pool()[replica_names[0]], "replica 0 back in the pool", 120,
                  [logs[victim], logs["r0-stage-0"], logs["r0-admission"]])  # fmt: skip
            back_in_pool_s = time.monotonic() - restarted

            def served_by_r0_after_restart() -> bool:
                return any(
                    sent > restarted and body.get("replica") == replica_names[0]
                    for sent, _took, http_status, body in list(load.records)
                )

            _wait(served_by_r0_after_restart, "an answer from replica 0", 60, [])
            first_r0_answer_s = min(
                sent + took - restarted
                for sent, took, http_status, body in list(load.records)
                if sent > restarted and body.get("replica") == replica_names[0]
            )
            time.sleep(1.0)
            load.stop(join_s=60)
            for name, pid in stage_pids.items():
                if name != victim:
                    assert procs[name].pid == pid and procs[name].poll() is None, name
            survivor_log = logs["r0-stage-0"].read_text(errors="replace")
        finally:
            stop_processes(procs.values())
    reformed = re.search(r"re-formed in epoch 2 in ([0-9.]+) s", survivor_log)
    assert reformed, survivor_log[-3000:]
    after = [r for r in load.records if r[0] + r[1] > killed]  # answered after the kill
    bad = [(round(s - killed, 2), round(t, 2), st, body.get("error") or body)
           for s, t, st, body in after if st != 200 or t > ANSWER_WITHIN_S]  # fmt: skip
    assert not bad, bad
    during = [r for r in after if killed < r[0] < restarted]
    assert during and all(r[3]["replica"] == replica_names[1] for r in during if r[0] > killed + 2)
    print(
        f"failover: {len(after)} requests answered after the kill, all 200, slowest "
        f"{max(r[1] for r in after):.2f} s; replica 0 left the pool {left_pool_s:.2f} s after "
        f"the kill; stage restarted {restarted - killed:.1f} s after the kill; replica 0 back "
        f"in the pool {back_in_pool_s:.2f} s and its first answer {first_r0_answer_s:.2f} s "
        f"after the restart (the survivor's re-form itself: {reformed.group(1)} s); the 3 other "
        "stage processes never restarted"
    )
