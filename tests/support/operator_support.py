"""Fixtures for the operator tests: kmock's Kubernetes emulator, kopf in a thread, kubectl.

The emulator serves in the test's event loop. kopf runs in its own thread and loop, as in
production: at exit kopf cancels every task created after it started in its loop, which would
include the emulator's request handlers if both shared one.

What the emulator lacks (see shared/k8s-testing.md) and how this file fills it in:
- server-side apply (``PATCH`` with ``application/apply-patch+yaml``, the operator's write path
  for children): kmock 0.8 treats every PATCH as a merge of an existing object and answers 404
  for an absent one. :class:`WaveEmulator` turns an apply of an absent object into a create;
  an apply of an existing one stays kmock's recursive merge. That approximates server-side apply
  only: kmock keeps no field ownership (``managedFields``), so a field the operator stops sending
  is not removed and conflicts do not exist. ``scripts/kind-e2e.sh`` runs the real thing;
- list requests honour equality ``labelSelector`` terms (kmock ignores the selector);
- every write sets a new ``metadata.resourceVersion`` (kmock keeps the one it was given);
- list responses get ``kind``/``apiVersion`` (kubectl needs them);
- ``kubectl get`` asks for a server-side Table: :class:`WaveEmulator` renders it from the CRD's
  additionalPrinterColumns, as the API server does;
- no controllers: :class:`Cluster` plays the StatefulSet and Deployment controllers' part
  explicitly (tests create pods and write their status).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import httpx2
import kmock
import kopf
import pytest
import yaml

from wavepp.operator import kube
from wavepp.operator.crdgen import CRD_PATHS
from wavepp.operator.naming import (
    LABEL_COMPONENT,
    LABEL_PIPELINE,
    LABEL_REPLICA,
    POD_INDEX_LABEL,
    admission_name,
    gateway_name,
    pool_configmap_name,
    statefulset_name,
)

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "default"
TEST_USER_AGENT = "wavepp-tests"
CRD = yaml.safe_load(CRD_PATHS[0].read_text())
PRINTER_COLUMNS = CRD["spec"]["versions"][0]["additionalPrinterColumns"]
_uids = itertools.count(1)
_resource_versions = itertools.count(2)


def _jsonpath(obj: dict[str, Any], path: str) -> Any:
    node: Any = obj
    for part in path.strip(".").split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    then = dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int((dt.datetime.now(dt.UTC) - then).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m"


APPLY_PATCH = "application/apply-patch+yaml"


def _is_apply_of_absent(emulator: kmock.KubernetesEmulator, request: Any) -> bool:
    if request.action != kmock.action.UPDATE or request.subresource is not None:
        return False
    if not request.headers.get("Content-Type", "").startswith(APPLY_PATCH):
        return False
    key = (request.resource, request.namespace, request.name)
    return key not in emulator.objects or emulator.objects[key].deleted


@attrs.define(kw_only=True)
class WaveEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus create-on-apply, label selectors, list kinds and server-side tables.

    NOTE (test-side approximation of server-side apply): an apply-patch of an absent object is
    served as a create; of an existing object, as kmock's merge. kmock keeps no field ownership.
    ``created_by_apply`` holds the ids of the apply requests that created an object (a real API
    server authorizes those as ``create`` too).
    """

    created_by_apply: set[int] = attrs.field(factory=set)
    # "plural/name" -> (HTTP code, message): writes of that object are refused as a real API
    # server's validation or admission would (kmock validates nothing).
    refusals: dict[str, tuple[int, str]] = attrs.field(factory=dict)

    async def _handle(self, request: Any) -> Any:
        """Create on apply; set what a real API server sets on create (uid, resourceVersion,
        generation, time); refuse a JSON patch whose resourceVersion test fails with 422, as a
        real API server does (kmock raised, answering 500, and kopf retried the stale patch
        instead of re-reading: found as a flaky e2e test once writes bumped resourceVersion)."""
        refusal = self._refusal(request)
        if refusal is not None:
            code, message = refusal
            return aiohttp.web.json_response(
                {
                    "apiVersion": "v1",
                    "kind": "Status",
                    "status": "Failure",
                    "reason": "Invalid",
                    "code": code,
                    "message": message,
                },
                status=code,
            )
        if self._fails_resource_version_test(request):
            return aiohttp.web.json_response(
                {
                    "apiVersion": "v1",
                    "kind": "Status",
                    "status": "Failure",
                    "reason": "Invalid",
                    "code": 422,
                    "message": "the JSON patch's resourceVersion test failed",
                },
                status=422,
            )
        if _is_apply_of_absent(self, request):
            # Store an empty object with the server-set fields; kmock's merge of the PATCH below
            # fills it in. NOTE: watchers see MODIFIED for it, not ADDED (kopf watches only
            # pipelines and pods, which are never applied).
            key = (request.resource, request.namespace, request.name)
            self.objects[key] = {"metadata": self._server_set(request.name)}
            self.created_by_apply.add(request.id)
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            for field_name, value in self._server_set(meta.get("name")).items():
                meta.setdefault(field_name, value)
        elif request.action == kmock.action.UPDATE and isinstance(request.data, dict):
            # kmock stores the parsed body (request.body keeps the bytes as sent).
            meta = request.data.setdefault("metadata", {})
            meta["resourceVersion"] = str(next(_resource_versions))
        return await super()._handle(request)

    def _refusal(self, request: Any) -> tuple[int, str] | None:
        if request.resource is None or request.action not in (
            kmock.action.CREATE,
            kmock.action.UPDATE,
        ):
            return None
        name = request.name or ((request.data or {}).get("metadata") or {}).get("name")
        return self.refusals.get(f"{request.resource.plural}/{name}")

    def _fails_resource_version_test(self, request: Any) -> bool:
        if request.action != kmock.action.UPDATE or not isinstance(request.data, list):
            return False
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return False
        current = self.objects[key].get("metadata", {}).get("resourceVersion")
        return any(
            op.get("op") == "test"
            and op.get("path") == "/metadata/resourceVersion"
            and op.get("value") != current
            for op in request.data
            if isinstance(op, dict)
        )

    @staticmethod
    def _server_set(name: str | None) -> dict[str, Any]:
        return {
            "uid": f"uid-{name}-{next(_uids)}",
            "resourceVersion": "1",
            "generation": 1,
            "creationTimestamp": _now(),
        }

    async def _serve_list(self, request: Any) -> Any:
        payload = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            wanted = dict(term.split("=", 1) for term in selector.split(","))
            payload["items"] = [
                item
                for item in payload["items"]
                if all(
                    (item.get("metadata", {}).get("labels") or {}).get(k) == v
                    for k, v in wanted.items()
                )
            ]
        resource = request.resource
        info = self.resources[resource]
        group_version = f"{resource.group}/{resource.version}".lstrip("/")
        accept = request.headers.get("Accept", "")
        if "as=Table" in accept and resource.plural == "wavepipelines":
            return self._table(payload["items"])
        kind = info.kind or resource.plural.capitalize()
        return {"kind": f"{kind}List", "apiVersion": group_version, **payload}

    def _table(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        columns = [{"name": "Name", "type": "string", "format": "name", "priority": 0}]
        columns += [
            {"name": c["name"], "type": c["type"], "format": "", "priority": c.get("priority", 0)}
            for c in PRINTER_COLUMNS
        ]
        rows = []
        for item in items:
            cells: list[Any] = [item["metadata"]["name"]]
            for c in PRINTER_COLUMNS:
                value = _jsonpath(item, c["jsonPath"])
                cells.append(_age(value) if c["type"] == "date" else value)
            meta = {k: item["metadata"][k] for k in ("name", "namespace") if k in item["metadata"]}
            rows.append(
                {
                    "cells": cells,
                    "object": {
                        "kind": "PartialObjectMetadata",
                        "apiVersion": "meta.k8s.io/v1",
                        "metadata": meta,
                    },
                }
            )
        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": "1"},
            "columnDefinitions": columns,
            "rows": rows,
        }


class Cluster:
    """Test-side API access to the emulator, and the controllers' part of the work."""

    def __init__(
        self, emulator: WaveEmulator, client: kube.KubeClient, kubeconfig: Path, server: str
    ) -> None:
        self.emulator = emulator
        self.client = client
        self.kubeconfig = kubeconfig
        self.server = server  # the emulator's URL

    # -- objects --------------------------------------------------------------------------

    async def create_pipeline(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {
            "apiVersion": "wavepp.dev/v1alpha1",
            "kind": "WavePipeline",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": spec,
        }
        return await self.client.create(body)

    async def pipeline(self, name: str) -> dict[str, Any] | None:
        return await self.client.get("WavePipeline", NAMESPACE, name)

    async def edit_spec(self, name: str, spec_patch: dict[str, Any]) -> None:
        """A spec edit as the API server records it: merge the spec, bump the generation."""
        body = await self.pipeline(name)
        assert body is not None
        generation = int(body["metadata"].get("generation", 1)) + 1
        await self.client.patch(
            "WavePipeline",
            NAMESPACE,
            name,
            {"metadata": {"generation": generation}, "spec": spec_patch},
        )

    async def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return await self.client.get(kind, NAMESPACE, name)

    async def list(self, kind: str, pipeline: str) -> list[dict[str, Any]]:
        return await self.client.list(kind, NAMESPACE, {LABEL_PIPELINE: pipeline})

    # -- the controllers' part ------------------------------------------------------------

    async def run_statefulset(
        self, name: str, *, phase: str = "warm", ranks: list[int] | None = None
    ) -> list[str]:
        """Create the pods of StatefulSet ``name`` (as its controller would) in ``phase``.

        Returns:
            The pod names created (existing pods are left alone).
        """
        sts = await self.get("StatefulSet", name)
        assert sts is not None, f"StatefulSet {name} does not exist"
        template = sts["spec"]["template"]
        created = []
        for rank in ranks if ranks is not None else range(sts["spec"]["replicas"]):
            pod_name = f"{name}-{rank}"
            if await self.get("Pod", pod_name) is not None:
                continue
            labels = dict(template["metadata"]["labels"]) | {POD_INDEX_LABEL: str(rank)}
            await self._create_pod(
                pod_name, template, phase, labels=labels, uid=f"{pod_name}-uid{next(_uids)}"
            )
            created.append(pod_name)
        return created

    async def run_admission(self, pipeline: str, replica: int, *, ready: bool = True) -> str:
        """Create the admission pod of ``replica`` from its Deployment's template."""
        dep = await self.get("Deployment", admission_name(pipeline, replica))
        assert dep is not None
        assert dep["spec"]["replicas"] == 1, "the operator scaled this admission controller to 0"
        pod_name = f"{admission_name(pipeline, replica)}-{next(_uids)}"
        await self._create_pod(pod_name, dep["spec"]["template"], "warm" if ready else "scheduled")
        return pod_name

    async def run_gateway(self, pipeline: str, *, ready: bool = True) -> str:
        """Create (or set the readiness of) the gateway pod from its Deployment's template."""
        pod_name = f"{gateway_name(pipeline)}-x"
        if await self.get("Pod", pod_name) is not None:
            await self.set_pod_phase(pod_name, "warm" if ready else "formed")
            return pod_name
        dep = await self.get("Deployment", gateway_name(pipeline))
        assert dep is not None
        await self._create_pod(pod_name, dep["spec"]["template"], "warm" if ready else "formed")
        return pod_name

    async def _create_pod(
        self,
        name: str,
        template: dict[str, Any],
        phase: str,
        *,
        labels: dict[str, str] | None = None,
        uid: str | None = None,
    ) -> None:
        """Create pod ``name`` from a pod ``template`` (with its labels unless ``labels`` are
        given, and ``uid`` if given) in the kubelet ``phase`` of ``pod_status``."""
        metadata: dict[str, Any] = {
            "name": name,
            "namespace": NAMESPACE,
            "labels": dict(template["metadata"]["labels"]) if labels is None else labels,
        }
        if uid is not None:
            metadata["uid"] = uid
        await self.client.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": metadata,
                "spec": template["spec"],
                "status": pod_status(phase),
            }
        )

    async def pool(self, pipeline: str) -> dict[int, bool]:
        """Replica -> admitting, from the pool ConfigMap the gateway reads."""
        cm = await self.get("ConfigMap", pool_configmap_name(pipeline))
        if cm is None:
            return {}
        entries = json.loads(cm["data"]["pool.json"])["replicas"]
        return {e["replica"]: e["admitting"] for e in entries}

    async def admission_pods(self, pipeline: str, replica: int) -> list[dict[str, Any]]:
        pods = await self.list("Pod", pipeline)
        return [
            p
            for p in pods
            if p["metadata"]["labels"].get(LABEL_COMPONENT) == "admission"
            and p["metadata"]["labels"].get(LABEL_REPLICA) == str(replica)
        ]

    async def stop_admission(self, pipeline: str, replica: int) -> None:
        """The admission pod finished draining and exited (what SIGTERM leads to)."""
        for pod in await self.admission_pods(pipeline, replica):
            await self.client.delete("Pod", NAMESPACE, pod["metadata"]["name"])

    async def set_pod_phase(self, name: str, phase: str, **extra: Any) -> None:
        await self.client.patch(
            "Pod", NAMESPACE, name, {"status": pod_status(phase, **extra)}, subresource="status"
        )

    async def serve_replica(self, pipeline: str, replica: int) -> None:
        """Stage pods warm and the admission controller ready: the replica can serve."""
        await self.run_statefulset(statefulset_name(pipeline, replica))
        # The operator applies the Deployments after the StatefulSet, in the same pass or the
        # next: wait for them (a CI flake: "assert dep is not None" under a slow reconcile).
        admission = admission_name(pipeline, replica)
        await wait_for(lambda: self.get("Deployment", admission), what=f"Deployment {admission}")
        if not await self.admission_pods(pipeline, replica):
            await self.run_admission(pipeline, replica)
        gateway = gateway_name(pipeline)
        await wait_for(lambda: self.get("Deployment", gateway), what=f"Deployment {gateway}")
        if await self.get("Pod", f"{gateway}-x") is None:
            await self.run_gateway(pipeline)

    async def kubectl(self, *args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            "kubectl",
            "--kubeconfig",
            str(self.kubeconfig),
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else None,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout=30)
        return proc.returncode or 0, out.decode(), err.decode()


def pod_status(phase: str, *, restarts: int = 0, exit_code: int = 1) -> dict[str, Any]:
    """A pod ``status`` as the kubelet reports it for a stage phase (or "crashed")."""
    scheduled = {"type": "PodScheduled", "status": "True"}
    ready = {"type": "Ready", "status": "True" if phase == "warm" else "False"}
    container: dict[str, Any] = {
        "name": "stage",
        "ready": phase == "warm",
        "started": phase in ("formed", "warm"),
        "restartCount": restarts,
        "state": {"running": {}} if phase in ("formed", "warm") else {"waiting": {}},
    }
    if phase == "crashed":
        container["restartCount"] = max(restarts, 1)
        container["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
        container["lastState"] = {"terminated": {"exitCode": exit_code, "reason": "Error"}}
    if phase == "pending":
        return {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]}
    return {
        "phase": "Running" if phase != "scheduled" else "Pending",
        "conditions": [scheduled, ready],
        "containerStatuses": [container],
    }


async def wait_for(
    check: Callable[[], Any], *, timeout_s: float = 30.0, what: str = "condition"
) -> Any:
    """Poll the async ``check`` until it returns a truthy value; fail with ``what`` at timeout."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last: {last!r}")


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    """An emulated API server with the WavePipeline resource declared, and a kubeconfig."""
    async with WaveEmulator() as emulator, kmock.Server(emulator) as server:
        emulator.resources.load_bundled()
        emulator.resources["wavepp.dev/v1alpha1/wavepipelines"] = kmock.ResourceInfo(
            kind="WavePipeline",
            singular="wavepipeline",
            namespaced=True,
            shortnames={"wpp"},
            verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
            subresources={"status", "scale"},
        )
        kubeconfig = tmp_path / "kubeconfig.yaml"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "kmock", "cluster": {"server": str(server.url)}}],
                    "users": [{"name": "test", "user": {}}],
                    "contexts": [
                        {
                            "name": "kmock",
                            "context": {"cluster": "kmock", "user": "test", "namespace": NAMESPACE},
                        }
                    ],
                    "current-context": "kmock",
                }
            )
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        url = str(server.url).rstrip("/")
        info = kopf.ConnectionInfo(server=url)
        async with kube.KubeClient(info, transport=UserAgentTransport) as client:
            yield Cluster(emulator, client, kubeconfig, url)


class UserAgentTransport(httpx2.AsyncBaseTransport):
    """HTTP with the tests' User-Agent, so that the RBAC test can tell their requests apart."""

    def __init__(self) -> None:
        self._inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        request.headers["User-Agent"] = TEST_USER_AGENT
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


class OperatorThread:
    """kopf's operator running the wavepp handlers in a thread with its own event loop."""

    def __init__(self, options: Any) -> None:
        self.memo = kopf.Memo(options=options)
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kopf", daemon=True)

    def _run(self) -> None:
        import wavepp.operator.handlers  # noqa: F401 - registers the handlers

        try:
            asyncio.run(
                kopf.operator(
                    clusterwide=True,
                    standalone=True,
                    stop_flag=self.stop_flag,
                    ready_flag=self.ready_flag,
                    memo=self.memo,
                )
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the fixture
            self.error = exc

    @property
    def unexpected_errors(self) -> list[str]:
        state = getattr(self.memo, "state", None)
        return list(state.unexpected_errors) if state is not None else []


@pytest.fixture
async def operator(cluster: Cluster) -> AsyncIterator[OperatorThread]:
    """The operator against ``cluster``; on teardown it must stop cleanly with no errors."""
    from wavepp.operator.handlers import OperatorOptions

    options = OperatorOptions(
        default_image="registry.example/wavepp:test",
        default_nats_url="nats://nats.wavepp:4222",
        resync_s=0.5,
        post_events=False,
        fast_exit=True,
        nats_cleanup_tries=1,  # no NATS at nats.wavepp: the delete handler gives up at once
        nats_cleanup_timeout_s=0.5,
    )
    runner = OperatorThread(options)
    runner.thread.start()
    assert await asyncio.to_thread(runner.ready_flag.wait, 15), "kopf did not become ready"
    try:
        yield runner
    finally:
        runner.stop_flag.set()
        await asyncio.to_thread(runner.thread.join, 20)
    assert not runner.thread.is_alive(), "kopf did not stop within 20 s"
    assert runner.error is None, f"kopf exited with {runner.error!r}"
    assert runner.unexpected_errors == [], runner.unexpected_errors


def tiny_spec(**overrides: Any) -> dict[str, Any]:
    """A small valid spec: tiny-llama (8 layers) in 4 stages, 2 replicas."""
    spec: dict[str, Any] = {
        "model": {"name": "tiny-llama"},
        "stages": 4,
        "replicas": 2,
        "resources": {"gpusPerStage": 0},
        "restartBudget": {"maxRestarts": 2},
        "rollout": {"drainTimeoutSeconds": 30},
    }
    spec.update(overrides)
    return spec


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of helm: .venv/bin/helm, else on PATH, else installed by scripts/install-helm.sh."""
    candidates = [REPO / ".venv" / "bin" / "helm", shutil.which("helm")]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return str(candidate)
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-helm.sh")], capture_output=True, text=True
    )
    assert result.returncode == 0, f"scripts/install-helm.sh failed:\n{result.stderr}"
    return str(REPO / ".venv" / "bin" / "helm")


def render_chart(helm: str, *set_values: str) -> list[dict[str, Any]]:
    """``helm template`` of charts/wavepp (CRDs included) as a list of objects."""
    args = [helm, "template", "wavepp", str(REPO / "charts" / "wavepp")]
    args += ["--namespace", "wavepp-system", "--include-crds"]
    for value in set_values:
        args += ["--set", value]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def kubernetes_validate(objects: list[dict[str, Any]], tmp_path: Path) -> tuple[int, str]:
    """Run ``kubernetes-validate --strict`` on the objects; returns (exit status, output)."""
    path = tmp_path / "manifests.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    exe = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run(
        [str(exe), "--strict", "--quiet", str(path)], capture_output=True, text=True, timeout=120
    )
    return result.returncode, result.stdout + result.stderr
