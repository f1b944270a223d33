"""Scale 1 -> 3 -> 1 under load, the operator on kmock, its pods as processes.

The operator (kopf, in a thread) reconciles a WavePipeline on kmock's emulated API server. The
emulator has no controllers and no kubelet, so :class:`Kubelet` plays both, from what the
operator wrote: for each pod the StatefulSets and Deployments ask for it creates the pod object
and starts its container as a process (the rendered args and env; only the mounted ConfigMaps,
the NATS URL, the rendezvous address and the ports are made local), reports it Ready once its
``/readyz`` answers 200, SIGTERMs it when the operator scales its Deployment to 0 or deletes its
StatefulSet, and deletes the pod object once the process exited (no garbage collection either).

Under a steady closed loop of requests through the gateway Deployment's 2 pods (in turn):

- 1 -> 3: the new replicas join both gateways' pools without a gateway restart (each read
  ``pool.json`` with one replica at start) and answer requests;
- 3 -> 1: the operator drains replicas 1 and 2 (admission scaled to 0: SIGTERM), they leave
  the pools at once (seen as draining: the gateways wait for their answers), answer what they
  were sent and exit 0; the operator then deletes them;
- every request sent is answered 200: none lost on the way down (or up).

The times for the pool to follow each step are printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from operator_support import NAMESPACE, Cluster, pod_status, wait_for
from pod_support import Load

from wavepp.operator.gateway_builders import GATEWAY_REPLICAS
from wavepp.operator.naming import LABEL_COMPONENT, LABEL_REPLICA, admission_name
from wavepp.runtime.procs import stop_processes
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PIPELINE = "scale"
SPEC: dict[str, Any] = {
    "model": {"name": "tiny-llama"},
    "stages": 1,
    "replicas": 1,
    "engine": "emulated",
    "engineOptions": {"timeScale": 0.05, "kvBlocks": 256},
    "resources": {"gpusPerStage": 0},
    "rollout": {"drainTimeoutSeconds": 20},
}
REPO = Path(__file__).resolve().parents[2]
# Each load client's pause between an answer and its next request, seconds: requests stay in
# flight through every step (tens a second), while the pods' start-up, the operator and the
# kubelet here keep CPU on a 2-core host (at full speed the loop took most of it).
LOAD_PAUSE_S = 0.1


def _http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 2.0) -> tuple[int, Any]:
    """(status, parsed JSON) of a GET (or a POST of ``body``); status 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(ValueError):
            return exc.code, json.loads(exc.read() or b"{}")
        return exc.code, {}
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


class Kubelet:
    """The StatefulSet and Deployment controllers and the kubelet, for one pipeline's pods."""

    def __init__(self, cluster: Cluster, nats_url: str, tmp: Path) -> None:
        self.cluster = cluster
        self.nats_url = nats_url
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}  # pod -> its local health/HTTP port
        self.ready: set[str] = set()
        self.stopping: set[str] = set()
        self.dist_urls: dict[str, str] = {}  # StatefulSet -> its local rendezvous
        self.exited_at: dict[str, float] = {}
        self.events: list[tuple[float, str]] = []  # (monotonic, what): SIGTERM, pod deleted

    # -- one container as a process ----------------------------------------------------

    async def _mounts(self, pod: dict[str, Any]) -> dict[str, str]:
        """mountPath -> a local directory holding the ConfigMap's files."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        out: dict[str, str] = {}
        for mount in pod["spec"]["containers"][0].get("volumeMounts", []):
            cm = volumes[mount["name"]].get("configMap")
            if cm is None:
                continue
            body = await self.cluster.get("ConfigMap", cm["name"])
            assert body is not None, f"ConfigMap {cm['name']} of {pod['metadata']['name']}"
            local = self.tmp / "cm" / pod["metadata"]["name"] / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            for key, value in body["data"].items():
                (local / key).write_text(value)
            out[mount["mountPath"]] = str(local)
        return out

    def _env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        labels = pod["metadata"]["labels"]
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
                continue
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
            env[item["name"]] = (
                NAMESPACE
                if path == "metadata.namespace"
                else pod["metadata"]["name"]
                if path == "metadata.name"
                else labels[label.group(1)]  # type: ignore[union-attr]
            )
        if "WAVEPP_METRICS_PORT" in env:  # one host: a port each
            env["WAVEPP_METRICS_PORT"] = str(free_port())
        return env

    async def start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        (container,) = pod["spec"]["containers"]
        env = self._env(pod, container)
        mounts = await self._mounts(pod)
        args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a)
                for a in container["args"]]  # fmt: skip
        assert "--nats-creds" not in args, args
        port = free_port()
        self.ports[name] = port
        local = {
            "--nats-url": self.nats_url,
            "--health-port": str(port),
            "--port": str(port),
            "--metrics-port": str(free_port()),
        }
        sts = pod["metadata"]["labels"].get(LABEL_REPLICA)
        if "--dist-url" in args:
            local["--dist-url"] = self.dist_urls.setdefault(
                str(sts), f"tcp://127.0.0.1:{free_port()}"
            )
        for i, arg in enumerate(args[:-1]):
            if arg in local:
                args[i + 1] = local[arg]
        for path, directory in mounts.items():
            args = [directory + a[len(path) :] if a.startswith(path + "/") else a for a in args]
        with open(self.tmp / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "wavepp.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=os.environ | env | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                start_new_session=True,
            )

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, name: str) -> str:
        return self.log(name)[-2500:]

    # -- the controllers' loop -----------------------------------------------------------

    async def step(self) -> None:
        pods = {p["metadata"]["name"]: p for p in await self.cluster.list("Pod", PIPELINE)}
        want: set[str] = set()
        for sts in await self.cluster.list("StatefulSet", PIPELINE):
            sts_name = sts["metadata"]["name"]
            for rank in range(sts["spec"]["replicas"]):
                want.add(f"{sts_name}-{rank}")
            try:
                created_pods = await self.cluster.run_statefulset(sts_name, phase="scheduled")
            except AssertionError:  # deleted since the list: the next step sees it
                continue
            for created in created_pods:
                pod = await self.cluster.get("Pod", created)
                assert pod is not None
                await self.start(pod)
        for dep in await self.cluster.list("Deployment", PIPELINE):
            component = dep["metadata"]["labels"][LABEL_COMPONENT]
            mine = [
                n
                for n, p in pods.items()
                if p["metadata"]["labels"].get(LABEL_COMPONENT) == component
                and p["metadata"]["labels"].get(LABEL_REPLICA)
                == dep["metadata"]["labels"].get(LABEL_REPLICA)
            ]
            if component == "gateway":  # its replicas (2): one pod and process each
                want.update(mine)
                for index in range(dep["spec"]["replicas"]):
                    name = f"{dep['metadata']['name']}-{index}"
                    if name not in pods:
                        await self.cluster.client.create(_pod(dep, name))
                        pod = await self.cluster.get("Pod", name)
                        assert pod is not None
                        await self.start(pod)
                        want.add(name)
                continue
            if dep["spec"]["replicas"] >= 1:
                want.update(mine)
                if not mine:
                    replica = int(dep["metadata"]["labels"][LABEL_REPLICA])
                    try:
                        created = await self.cluster.run_admission(PIPELINE, replica, ready=False)
                    except AssertionError:  # scaled to 0 or deleted since the list
                        continue
                    pod = await self.cluster.get("Pod", created)
                    assert pod is not None
                    await self.start(pod)
                    want.add(created)
        # what nothing asks for any more: SIGTERM, and the pod object goes once it exited
        for name in list(self.procs):
            proc = self.procs[name]
            if name not in want and name not in self.stopping and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                self.stopping.add(name)
                self.events.append((time.monotonic(), f"SIGTERM {name}"))
            if proc.poll() is not None and name not in want:
                self.exited_at.setdefault(name, time.monotonic())
                if name in pods:
                    await self.cluster.client.delete("Pod", NAMESPACE, name)
                    self.events.append((time.monotonic(), f"exited, pod deleted {name}"))
                self.ready.discard(name)
        for name in pods:
            if name not in want and name not in self.procs:
                await self.cluster.client.delete("Pod", NAMESPACE, name)
        # readiness, from each process's own /readyz (what the kubelet's probe reads)
        for name, proc in self.procs.items():
            if name in self.ready or name in self.stopping or name not in pods:
                continue
            assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{self.log_tail(name)}"
            status, _ = await asyncio.to_thread(
                _http, f"http://127.0.0.1:{self.ports[name]}/readyz", None, 0.5
            )
            if status == 200:
                await self.cluster.set_pod_phase(name, "warm")
                self.ready.add(name)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.step()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)

    def stop_all(self) -> None:
        stop_processes(self.procs.values())


def _pod(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    """A pod of ``deployment`` as its ReplicaSet would make it (not ready yet)."""
    template = deployment["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": dict(template["metadata"]["labels"]),
        },
        "spec": template["spec"],
        "status": pod_status("formed"),
    }


async def test_scale_1_3_1_under_load_the_pool_follows_and_nothing_is_lost(
    cluster: Cluster, operator: Any, tmp_path: Path
) -> None:
    replicas = [f"{PIPELINE}-r{i}" for i in range(3)]
    with EmbeddedNatsServer(jetstream=True, store_dir=str(tmp_path / "js")) as nats:
        kubelet = Kubelet(cluster, nats.url, tmp_path)
        stop = asyncio.Event()
        controllers = asyncio.create_task(kubelet.run(stop))
        load: Load | None = None

        def gateway_urls() -> list[str]:
            names = sorted(n for n in kubelet.procs if "gateway" in n)
            return [f"http://127.0.0.1:{kubelet.ports[n]}" for n in names]

        seen_draining: set[str] = set()  # replicas a gateway saw draining (waited for them)

        async def pools() -> dict[str, dict[str, bool]]:
            """Each gateway pod's pool: replica -> in it."""
            out = {}
            for url in gateway_urls():
                _, body = await asyncio.to_thread(_http, f"{url}/readyz")
                members = (body or {}).get("replicas", {})
                seen_draining.update(r for r, m in members.items() if m.get("draining"))
                out[url] = {r: bool(members.get(r, {}).get("in_pool")) for r in replicas}
            return out

        changes: list[tuple[float, dict[str, dict[str, bool]]]] = []  # the pools as they changed

        async def pool_is(expected: dict[str, bool]) -> bool:
            """Every gateway pod (GATEWAY_REPLICAS of them) has ``expected`` as its pool."""
            assert not controllers.done(), controllers
            now = await pools()
            if not changes or changes[-1][1] != now:
                changes.append((time.monotonic(), now))
            return len(now) == GATEWAY_REPLICAS and all(p == expected for p in now.values())

        def left_at(replica: str, after: float) -> float:
            """When the replica was out of every gateway's pool."""
            return min(
                t
                for t, by_gateway in changes
                if t > after and not any(m.get(replica) for m in by_gateway.values())
            )

        async def ready_replicas(n: int) -> bool:
            assert not controllers.done(), controllers
            body = await cluster.pipeline(PIPELINE)
            status = (body or {}).get("status") or {}
            if status.get("readyReplicas") == n and status.get("replicas") == n:
                return True
            return status or None

        try:
            await cluster.create_pipeline(PIPELINE, SPEC)
            one = {replicas[0]: True, replicas[1]: False, replicas[2]: False}
            await wait_for(lambda: pool_is(one), timeout_s=120, what="replica 0 in the pool")
            await wait_for(lambda: ready_replicas(1), timeout_s=30, what="1 ready replica")
            load = Load(
                [f"{url}/v1/prefill" for url in gateway_urls()],
                40,
                lambda url, body: _http(url, body, 60.0),
                num_clients=4,
                pause_s=LOAD_PAUSE_S,
            ).start()
            await asyncio.sleep(1.0)

            scaled_up = time.monotonic()
            await cluster.edit_spec(PIPELINE, {"replicas": 3})
            three = dict.fromkeys(replicas, True)
            await wait_for(lambda: pool_is(three), timeout_s=120, what="3 replicas in both pools")
            joined_s = time.monotonic() - scaled_up
            for name in replicas[1:]:
                await wait_for(
                    lambda n=name: asyncio.sleep(0, load.answered_by(n, scaled_up)),  # noqa: B023
                    timeout_s=30,
                    what=f"an answer from {name}",
                )
            answered_s = time.monotonic() - scaled_up
            await wait_for(lambda: ready_replicas(3), timeout_s=30, what="3 ready replicas")
            await asyncio.sleep(1.0)

            scaled_down = time.monotonic()
            await cluster.edit_spec(PIPELINE, {"replicas": 1})
            try:
                await wait_for(
                    lambda: pool_is(one), timeout_s=60, what="replicas 1, 2 out of the pool"
                )
            except AssertionError as exc:
                raise AssertionError(
                    f"{exc}\npools as they changed: {changes[-4:]}\nkubelet: {kubelet.events[-12:]}"
                    + "".join(
                        f"\n{n}: {kubelet.log_tail(n)[-600:]}"
                        for n in sorted(kubelet.procs)
                        if "r1" in n or "gateway" in n
                    )
                ) from exc
            left_s = {r: left_at(r, scaled_down) - scaled_down for r in replicas[1:]}

            async def deleted() -> bool:
                await pool_is(one)  # and keep watching the gateway's pool meanwhile
                return await _all_gone(cluster, replicas[1:])

            await wait_for(deleted, timeout_s=60, what="replicas 1, 2 deleted")
            deleted_s = time.monotonic() - scaled_down
            await wait_for(lambda: ready_replicas(1), timeout_s=30, what="1 ready replica")
            await asyncio.sleep(1.0)
            load.stop()
        finally:
            if load is not None:
                load.stop()
            stop.set()
            with contextlib.suppress(Exception):
                await controllers
            kubelet.stop_all()
    records = load.records
    sigterm = {r: min(t for t, what in kubelet.events if what.startswith(f"SIGTERM {r}-adm"))
               for r in replicas[1:]}  # fmt: skip
    exited = {r: min(t for t, what in kubelet.events if what.startswith(f"exited, pod deleted {r}-adm"))
              for r in replicas[1:]}  # fmt: skip
    steps = "; ".join(
        f"{r}: SIGTERM {sigterm[r] - scaled_down:.1f} s, out of the pool "
        f"{left_s[r] - (sigterm[r] - scaled_down):.2f} s after it, exited "
        f"{exited[r] - sigterm[r]:.1f} s after it"
        for r in replicas[1:]
    )
    bad = [(round(s - scaled_down, 2), round(t, 2), st, body) for s, t, st, body in records
           if st != 200 or body.get("error")]  # fmt: skip
    assert not bad, bad
    drained = [n for n in kubelet.exited_at if "admission" in n]
    for name in drained:
        log = kubelet.log_tail(name)
        assert "drained in" in log and kubelet.procs[name].returncode == 0, log
    assert len(drained) == 2, drained
    # Each left the pool as draining: the gateways logged it (their /readyz shows the state for
    # as little as DRAIN_SETTLE_S, which a poll on a loaded host can miss).
    gateway_logs = "".join(kubelet.log(n) for n in kubelet.procs if "gateway" in n)
    logged = {r for r in replicas[1:] if f"replica {r} draining" in gateway_logs}
    assert logged | seen_draining == set(replicas[1:]), (logged, seen_draining)
    by_replica = {r: sum(1 for rec in records if rec[3].get("replica") == r) for r in replicas}
    during_down = [r for r in records if scaled_down <= r[0] + r[1] <= scaled_down + deleted_s]
    print(
        f"scale 1->3->1 under load: {len(records)} requests sent, {len(records)} answered 200 "
        f"(by replica: {by_replica}) through 2 gateway pods; up: 2 replicas in both gateways' "
        f"pools {joined_s:.1f} s after "
        f"the spec edit (pods started from scratch), both answering {answered_s:.1f} s after; "
        f"down: the operator deleted both {deleted_s:.1f} s after the spec edit ({steps}); "
        f"{len(during_down)} answered during the scale-down, 0 lost"
    )


async def _all_gone(cluster: Cluster, names: list[str]) -> bool:
    for name in names:
        if await cluster.get("StatefulSet", name) is not None:
            return False
        if await cluster.get("Deployment", admission_name(PIPELINE, int(name[-1]))) is not None:
            return False
    return True
