"""Two same-named pipelines in two namespaces on one nats-server share nothing.

``team-a/tiny`` and ``team-b/tiny`` run as the operator's containers would (its args and env,
the kubelet's downward API resolved: ``WAVEPP_NAMESPACE`` differs), as real processes on one real
nats-server. Every message on the server is recorded: no plan or intake of one namespace carries
a prompt of the other, each gateway's answers are its own, and the JetStream streams are per
namespace. Deleting one pool's streams (what the operator's finalizer does) leaves the other's.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from http_support import http_status, post_json
from pod_support import kubelet_env, start_wavepp

from wavepp.api.spec import check_spec
from wavepp.operator import builders as b
from wavepp.operator.containers import POOL_FILE, SPEC_FILE
from wavepp.operator.gateway_builders import build_gateway_deployment
from wavepp.operator.naming import POD_INDEX_LABEL, PipelineRef, spec_hash
from wavepp.operator.nats_cleanup import delete_pool_streams
from wavepp.runtime.procs import stop_processes
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, flush_in_order, free_port

NAMESPACES = ("team-a", "team-b")
RAW_SPEC: dict[str, Any] = {
    "model": {"name": "tiny-llama"},
    "stages": 1,
    "replicas": 1,
    "engine": "emulated",
    "engineOptions": {"timeScale": 0.05, "kvBlocks": 256},
}
WAIT_S = 60.0
PROMPTS = 5

pytestmark = pytest.mark.timeout(240)


class Pipeline:
    """One namespace's ``tiny``: a stage, an admission controller and a gateway process."""

    def __init__(self, namespace: str, nats_url: str, tmp: Path) -> None:
        self.namespace = namespace
        self.ref = PipelineRef(name="tiny", namespace=namespace, uid=f"uid-{namespace}")
        raw = RAW_SPEC | {"telemetry": {"metricsPort": free_port()}}
        spec, issues = check_spec(raw, default_image="wavepp:test", default_nats_url=nats_url)
        assert spec is not None, issues
        hash_ = spec_hash(spec)
        self.dir = tmp / namespace
        self.dir.mkdir()
        (self.dir / "spec.json").write_text(
            b.build_spec_configmap(self.ref, spec, hash_)["data"]["spec.json"]
        )
        pool = b.build_pool_configmap(self.ref, [b.PoolEntry(0, hash_, admitting=False)])
        (self.dir / "pool.json").write_text(pool["data"]["pool.json"])
        self.sts = b.build_stage_statefulset(self.ref, spec, hash_, 0)
        self.stage = self.sts["spec"]["template"]["spec"]["containers"][0]
        admission = b.build_admission_deployment(self.ref, spec, hash_, 0, running=True)
        self.admission = admission["spec"]["template"]["spec"]["containers"][0]
        gateway = build_gateway_deployment(self.ref, spec, hash_)
        self.gateway = gateway["spec"]["template"]["spec"]["containers"][0]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stage_port, self.admission_port, self.gateway_port = (free_port() for _ in range(3))

    def start(self) -> None:
        labels = self.sts["spec"]["template"]["metadata"]["labels"] | {POD_INDEX_LABEL: "0"}
        local = {
            SPEC_FILE: str(self.dir / "spec.json"),
            POOL_FILE: str(self.dir / "pool.json"),
        }
        for name, container, pod, port_flag, port in (
            ("stage", self.stage, "tiny-r0-0", "--health-port", self.stage_port),
            (
                "admission",
                self.admission,
                "tiny-r0-admission-x",
                "--health-port",
                self.admission_port,
            ),
            ("gateway", self.gateway, "tiny-gateway-x", "--port", self.gateway_port),
        ):
            env = kubelet_env(container, pod, labels, namespace=self.namespace)
            args = [
                re.sub(r"\$\((\w+)\)", lambda m, e=env: e[m.group(1)], a) for a in container["args"]
            ]
            args = [local.get(a, a) for a in args]
            args[args.index(port_flag) + 1] = str(port)
            if name == "stage":
                args[args.index("--dist-url") + 1] = f"tcp://127.0.0.1:{free_port()}"
                args[args.index("--metrics-port") + 1] = str(free_port())
            self.procs.append(start_wavepp(args, self.dir / f"{name}.log", env))

    def wait_ready(self) -> None:
        deadline = time.monotonic() + WAIT_S
        for port in (self.stage_port, self.admission_port, self.gateway_port):
            while http_status(f"http://127.0.0.1:{port}/readyz") != 200:
                for proc in self.procs:
                    if proc.poll() is not None:
                        logs = [p.read_text()[-2000:] for p in self.dir.glob("*.log")]
                        pytest.fail(f"{self.namespace}: a process exited: {logs}")
                assert time.monotonic() < deadline, f"{self.namespace}: not ready in {WAIT_S} s"
                time.sleep(0.1)

    def stop(self) -> None:
        stop_processes(reversed(self.procs))


def _prompt(namespace: str, index: int) -> list[int]:
    """Prompts of team-a use tokens 1..99, those of team-b 100..199: a plan names its owner."""
    base = 1 if namespace == "team-a" else 100
    return [base + (7 * index + 3 * i) % 99 for i in range(40)]


async def test_same_named_pipelines_in_two_namespaces_exchange_nothing(tmp_path: Path) -> None:
    with EmbeddedNatsServer(jetstream=True, store_dir=str(tmp_path / "js")) as nats:
        monitor = await connect(nats.url, name="monitor")
        seen: list[tuple[str, bytes]] = []

        async def record(msg: Any) -> None:
            seen.append((msg.subject, msg.data))

        await monitor.subscribe(">", cb=record)
        pipelines = [Pipeline(ns, nats.url, tmp_path) for ns in NAMESPACES]
        try:
            for p in pipelines:
                p.start()
            for p in pipelines:
                await asyncio.to_thread(p.wait_ready)
            answers: dict[str, list[dict[str, Any]]] = {}
            for p in pipelines:
                url = f"http://127.0.0.1:{p.gateway_port}/v1/prefill"
                answers[p.namespace] = []
                for i in range(PROMPTS):
                    body = {"tenant": "default", "token_ids": _prompt(p.namespace, i)}
                    status, answer = await asyncio.to_thread(post_json, url, body)
                    assert status == 200 and not answer.get("error"), answer
                    assert answer["num_prompt_tokens"] == 40
                    answers[p.namespace].append(answer)
            await flush_in_order(monitor)
            streams = await _streams(monitor)
        finally:
            for p in pipelines:
                p.stop()
        # Every plan and intake message sits under its namespace and carries only its prompts.
        crossing = 0
        counted = {ns: {"plan": 0, "intake": 0} for ns in NAMESPACES}
        prompts: dict[str, set[tuple[int, ...]]] = {ns: set() for ns in NAMESPACES}
        for subject, data in seen:
            match = re.fullmatch(r"wavepp\.([a-z0-9-]+)\.tiny-r0\.(plan|intake)", subject)
            if not match:
                continue
            namespace, kind = match.groups()
            assert namespace in NAMESPACES, subject
            counted[namespace][kind] += 1
            tokens = _tokens(json.loads(data))
            if kind == "intake":
                prompts[namespace].add(tuple(tokens))
            own = range(1, 100) if namespace == "team-a" else range(100, 200)
            crossing += sum(1 for t in tokens if t not in own)
        print(f"messages per namespace: {counted}; tokens crossing namespaces: {crossing}")
        assert crossing == 0
        for ns in NAMESPACES:
            assert len(prompts[ns]) == PROMPTS and counted[ns]["plan"] >= 1, counted
        assert all(
            not s.startswith("wavepp.tiny") for s, _ in seen
        )  # nothing on the old, unscoped subjects
        # Streams and buckets (intake, results, the stages' rendezvous), one set per namespace.
        assert {
            "WAVEPP_INTAKE_team-a_tiny-r0",
            "WAVEPP_INTAKE_team-b_tiny-r0",
            "KV_WAVEPP_RESULTS_team-a_tiny",
            "KV_WAVEPP_RESULTS_team-b_tiny",
            "KV_WAVEPP_RDZV_team-a_tiny-r0",
            "KV_WAVEPP_RDZV_team-b_tiny-r0",
        } <= set(streams), streams
        # The finalizer's cleanup of team-a/tiny leaves team-b's streams alone.
        removed = await delete_pool_streams(nats.url, "tiny", namespace="team-a")
        assert sorted(removed) == [
            "KV_WAVEPP_RDZV_team-a_tiny-r0",
            "KV_WAVEPP_RESULTS_team-a_tiny",
            "WAVEPP_INTAKE_team-a_tiny-r0",
        ]
        left = set(await _streams(monitor))
        assert {
            "WAVEPP_INTAKE_team-b_tiny-r0",
            "KV_WAVEPP_RESULTS_team-b_tiny",
            "KV_WAVEPP_RDZV_team-b_tiny-r0",
        } <= left
        assert not any("team-a" in s for s in left)
        await monitor.drain()


async def _streams(nc: Any) -> list[str]:
    return [info.config.name for info in await nc.jetstream().streams_info()]


def _tokens(payload: dict[str, Any]) -> list[int]:
    """Token ids of an intake request (``token_ids``) or a plan (its chunks' ``token_ids``)."""
    if "chunks" in payload:
        return [t for c in payload["chunks"] for t in (c.get("token_ids") or [])]
    return list(payload.get("token_ids") or [])


def test_subject_names_carry_namespace_and_name() -> None:
    from wavepp.api import subjects as s

    prefix = s.replica_prefix("tiny-r0", namespace="team-a")
    assert prefix == "wavepp.team-a.tiny-r0"
    assert s.ReplicaSubjects(prefix).kv_events(1).startswith(prefix + ".")
    assert s.intake_stream("tiny-r0", namespace="team-a") != s.intake_stream(
        "tiny-r0", namespace="team-b"
    )
    assert s.results_bucket("tiny", namespace="team-a") == "WAVEPP_RESULTS_team-a_tiny"
    names = [
        "WAVEPP_INTAKE_team-a_tiny-r0", "WAVEPP_INTAKE_team-a_tiny-r12", "KV_WAVEPP_RESULTS_team-a_tiny",
        "KV_WAVEPP_RDZV_team-a_tiny-r1",
        "WAVEPP_INTAKE_team-a_tiny-rx-r0", "WAVEPP_INTAKE_team-b_tiny-r0", "KV_WAVEPP_RESULTS_team-a_tinyx",
        "KV_WAVEPP_RDZV_team-b_tiny-r0", "KV_WAVEPP_RDZV_team-a_tinyx-r0",
    ]  # fmt: skip
    assert s.pool_streams(names, "tiny", namespace="team-a") == names[:4]
    assert s.rendezvous_bucket("tiny-r1", namespace="team-a") == "WAVEPP_RDZV_team-a_tiny-r1"
    assert s.heartbeat_wildcard(namespace="team-a") == "wavepp.team-a.*.admission.heartbeat"
