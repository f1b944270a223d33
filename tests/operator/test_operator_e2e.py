"""End to end: kopf running the wavepp handlers against kmock's Kubernetes emulator."""

from __future__ import annotations

import asyncio
from typing import Any

from operator_support import (
    NAMESPACE,
    REPO,
    TEST_USER_AGENT,
    Cluster,
    render_chart,
    tiny_spec,
    wait_for,
)

from wavepp.operator.gateway_builders import GATEWAY_REPLICAS
from wavepp.operator.naming import (
    ANNOTATION_SPEC_HASH,
    PipelineRef,
    admission_name,
    owner_reference,
    spec_configmap_name,
)
from wavepp.runtime.transport.natsio import free_port


def _condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((body or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


async def test_create_makes_owned_children_and_status(cluster: Cluster, operator: Any) -> None:
    created = await cluster.create_pipeline("demo", tiny_spec())
    uid = created["metadata"]["uid"]

    async def children() -> list[dict[str, Any]] | None:
        objs = []
        for kind in ("StatefulSet", "Deployment", "Service", "ConfigMap"):
            objs += await cluster.list(kind, "demo")
        return objs if len(objs) >= 2 * 2 + 2 * 2 + 1 + 1 + 1 + 1 else None

    objs = await wait_for(children, what="children of demo")
    names = {(o["kind"] if "kind" in o else "", o["metadata"]["name"]) for o in objs}
    for o in objs:
        refs = o["metadata"]["ownerReferences"]
        assert refs == [owner_reference(PipelineRef("demo", NAMESPACE, uid))], o["metadata"]
    assert {n for _, n in names} >= {
        "demo-r0",
        "demo-r1",
        "demo-r0-admission",
        "demo-r1-admission",
        "demo-gateway",
        "demo-pool",
    }
    gateway_pdb = await wait_for(
        lambda: cluster.get("PodDisruptionBudget", "demo-gateway"), what="the gateway's PDB"
    )
    assert gateway_pdb["spec"]["minAvailable"] == 1
    gateway = await cluster.get("Deployment", "demo-gateway")
    assert gateway is not None and gateway["spec"]["replicas"] == GATEWAY_REPLICAS
    body = await wait_for(lambda: _status_is(cluster, "demo", replicas=2), what="status.replicas")
    status = body["status"]
    assert status["replicas"] == 2 and status["readyReplicas"] == 0
    assert status["selector"] == "wavepp.dev/pipeline=demo,wavepp.dev/component=stage"
    assert [
        (s["replica"], s["rank"], s["firstLayer"], s["lastLayer"], s["phase"])
        for s in status["stages"]
    ] == [(r, rank, 2 * rank, 2 * rank + 2, "pending") for r in range(2) for rank in range(4)]
    assert _condition(body, "Ready")["status"] == "False"
    assert _condition(body, "Progressing")["reason"] == "Forming"
    assert status["observedGeneration"] == 1


async def _status_is(cluster: Cluster, name: str, **expected: Any) -> dict[str, Any] | None:
    body = await cluster.pipeline(name)
    status = (body or {}).get("status") or {}
    return body if all(status.get(k) == v for k, v in expected.items()) else None


async def _stage_phases(cluster: Cluster, name: str) -> list[str]:
    body = await cluster.pipeline(name)
    return [s["phase"] for s in ((body or {}).get("status") or {}).get("stages") or []]


async def _wait_status(cluster: Cluster, name: str, what: str = "", **expected: Any) -> dict:
    return await wait_for(
        lambda: _status_is(cluster, name, **expected), what=what or f"status {expected}"
    )


async def _wait_condition(
    cluster: Cluster, name: str, type_: str, status: str, reason: str
) -> dict:
    async def check() -> dict[str, Any] | None:
        body = await cluster.pipeline(name)
        c = _condition(body, type_)
        return body if c.get("status") == status and c.get("reason") == reason else None

    return await wait_for(check, what=f"{type_}={status} ({reason})")


async def test_stage_pod_status_drives_phases_and_conditions(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create_pipeline("demo", tiny_spec(replicas=1))
    await wait_for(lambda: cluster.get("StatefulSet", "demo-r0"), what="StatefulSet demo-r0")
    pods = await cluster.run_statefulset("demo-r0", phase="pending")
    assert pods == [f"demo-r0-{rank}" for rank in range(4)]
    for phase in ("scheduled", "formed", "warm"):
        for pod in pods:
            await cluster.set_pod_phase(pod, phase)
        await wait_for(lambda p=phase: _stages_all(cluster, "demo", p), what=f"all stages {phase}")
        body = await cluster.pipeline("demo")
        assert _condition(body, "Ready")["status"] == "False"
        assert body["status"]["readyReplicas"] == 0
    # Stages are warm, but the replica serves only once its admission controller is ready.
    assert await cluster.pool("demo") == {0: False}
    await cluster.run_admission("demo", 0)
    # Every replica serves, but Ready also needs the gateway: absent or not ready, not Ready.
    await _wait_condition(cluster, "demo", "Ready", "False", "GatewayNotReady")
    await cluster.run_gateway("demo", ready=False)
    await _wait_condition(cluster, "demo", "Ready", "False", "GatewayNotReady")
    await cluster.run_gateway("demo")
    body = await _wait_condition(cluster, "demo", "Ready", "True", "AllReplicasServing")
    assert body["status"]["phase"] == "Ready"
    assert body["status"]["readyReplicas"] == 1
    assert await _stage_phases(cluster, "demo") == ["serving"] * 4
    assert await wait_for(lambda: _pool_is(cluster, "demo", {0: True}), what="pool admits r0")
    # One stage loses readiness: the replica stops serving, the condition says which stage.
    await cluster.set_pod_phase("demo-r0-2", "formed")
    body = await _wait_condition(cluster, "demo", "Ready", "False", "ReplicasNotServing")
    assert "replica 0: stage 2 formed" in _condition(body, "Ready")["message"]
    assert await _stage_phases(cluster, "demo") == ["warm", "warm", "formed", "warm"]
    assert await wait_for(lambda: _pool_is(cluster, "demo", {0: False}), what="pool drops r0")


async def _stages_all(cluster: Cluster, name: str, phase: str) -> bool:
    phases = await _stage_phases(cluster, name)
    return bool(phases) and all(p == phase for p in phases)


async def _pool_is(cluster: Cluster, name: str, expected: dict[int, bool]) -> bool:
    return await cluster.pool(name) == expected


async def _spec_hash(cluster: Cluster, sts_name: str) -> str | None:
    sts = await cluster.get("StatefulSet", sts_name)
    return (sts or {}).get("metadata", {}).get("annotations", {}).get(ANNOTATION_SPEC_HASH)


async def _admission_replicas(cluster: Cluster, name: str, replica: int) -> int | None:
    dep = await cluster.get("Deployment", admission_name(name, replica))
    return None if dep is None else dep["spec"]["replicas"]


async def test_spec_change_rolls_one_replica_at_a_time(cluster: Cluster, operator: Any) -> None:
    await cluster.create_pipeline("demo", tiny_spec(replicas=2))
    for replica in (0, 1):
        await wait_for(lambda r=replica: cluster.get("StatefulSet", f"demo-r{r}"), what="sts")
        await cluster.serve_replica("demo", replica)
    body = await _wait_condition(cluster, "demo", "Ready", "True", "AllReplicasServing")
    old_hash = body["status"]["specHash"]

    await cluster.edit_spec("demo", {"scheduler": {"chunkTokens": 4096}})
    body = await _wait_condition(cluster, "demo", "Progressing", "True", "RollingUpdate")
    new_hash = body["status"]["specHash"]
    assert new_hash != old_hash
    # Replica 0 leaves the pool first (its admission controller drains); replica 1 keeps serving.
    await wait_for(lambda: _pool_is(cluster, "demo", {0: False, 1: True}), what="r0 leaves")
    assert await _admission_replicas(cluster, "demo", 0) == 0
    assert await _admission_replicas(cluster, "demo", 1) == 1
    # Not replaced while its admission pod still finishes admitted requests.
    assert await _spec_hash(cluster, "demo-r0") == old_hash
    assert await cluster.get("Pod", "demo-r0-0") is not None
    await cluster.stop_admission("demo", 0)
    await wait_for(lambda: _hash_is(cluster, "demo-r0", new_hash), what="demo-r0 on the new spec")
    # Its stages are restarted together on the new template; replica 1 is untouched.
    await wait_for(lambda: _gone(cluster, "Pod", "demo-r0-0"), what="old r0 pods deleted")
    assert await _spec_hash(cluster, "demo-r1") == old_hash
    assert await _admission_replicas(cluster, "demo", 1) == 1
    assert await cluster.pool("demo") == {0: False, 1: True}
    await cluster.serve_replica("demo", 0)
    # Only when replica 0 serves again does replica 1 leave the pool.
    await wait_for(lambda: _pool_is(cluster, "demo", {0: True, 1: False}), what="r1 leaves")
    assert await _admission_replicas(cluster, "demo", 1) == 0
    await cluster.stop_admission("demo", 1)
    await wait_for(lambda: _hash_is(cluster, "demo-r1", new_hash), what="demo-r1 on new spec")
    await wait_for(lambda: _gone(cluster, "Pod", "demo-r1-0"), what="old r1 pods deleted")
    await cluster.serve_replica("demo", 1)
    body = await _wait_condition(cluster, "demo", "Progressing", "False", "Complete")
    assert body["status"]["updatedReplicas"] == 2
    assert _condition(body, "Ready")["status"] == "True"
    assert body["status"]["observedGeneration"] == 2
    # The old spec ConfigMap is collected once no replica runs it.
    await wait_for(
        lambda: _gone(cluster, "ConfigMap", spec_configmap_name("demo", old_hash)),
        what="old spec ConfigMap deleted",
    )
    cm = await cluster.get("ConfigMap", spec_configmap_name("demo", new_hash))
    assert '"chunkTokens": 4096' in cm["data"]["spec.json"]


async def _hash_is(cluster: Cluster, sts_name: str, expected: str) -> bool:
    return await _spec_hash(cluster, sts_name) == expected


async def _gone(cluster: Cluster, kind: str, name: str) -> bool:
    return await cluster.get(kind, name) is None


async def test_scale_via_spec_replicas(cluster: Cluster, operator: Any) -> None:
    await cluster.create_pipeline("demo", tiny_spec(replicas=1))
    await wait_for(lambda: cluster.get("StatefulSet", "demo-r0"), what="sts r0")
    await cluster.serve_replica("demo", 0)
    await _wait_status(cluster, "demo", readyReplicas=1, replicas=1)

    await cluster.edit_spec("demo", {"replicas": 3})
    for replica in (1, 2):
        await wait_for(lambda r=replica: cluster.get("StatefulSet", f"demo-r{r}"), what="new sts")
        await cluster.serve_replica("demo", replica)
    body = await _wait_status(cluster, "demo", readyReplicas=3, replicas=3)
    assert _condition(body, "Ready")["status"] == "True"

    await cluster.edit_spec("demo", {"replicas": 1})
    body = await _wait_condition(cluster, "demo", "Progressing", "True", "ScalingDown")
    await wait_for(lambda: _pool_is(cluster, "demo", {0: True, 1: False, 2: False}), what="pool")
    assert await _admission_replicas(cluster, "demo", 2) == 0
    assert await cluster.get("StatefulSet", "demo-r2") is not None  # still draining
    await cluster.stop_admission("demo", 1)
    await cluster.stop_admission("demo", 2)
    # One pass deletes a replica's children one API call after another: each is awaited gone,
    # not assumed gone once its StatefulSet is.
    for name in ("demo-r1", "demo-r2"):
        for kind, child in (
            ("StatefulSet", name),
            ("Service", name),
            ("Deployment", f"{name}-admission"),
        ):
            await wait_for(
                lambda k=kind, c=child: _gone(cluster, k, c), what=f"{kind} {child} deleted"
            )
    body = await _wait_status(cluster, "demo", replicas=1, readyReplicas=1)
    assert _condition(body, "Progressing")["reason"] == "Complete"


async def test_delete_removes_children_and_releases_finalizer(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create_pipeline("demo", tiny_spec(replicas=1))
    await wait_for(lambda: cluster.get("Deployment", "demo-gateway"), what="gateway")
    body = await cluster.pipeline("demo")
    assert "wavepp.dev/operator" in body["metadata"]["finalizers"]
    await cluster.client.delete("WavePipeline", NAMESPACE, "demo")
    await wait_for(lambda: _gone(cluster, "WavePipeline", "demo"), what="pipeline gone")
    for kind in ("StatefulSet", "Deployment", "Service", "ConfigMap"):
        assert await cluster.list(kind, "demo") == [], kind


async def test_crash_loop_exhausts_restart_budget_then_degraded(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create_pipeline("demo", tiny_spec(replicas=1))  # maxRestarts 2
    await wait_for(lambda: cluster.get("StatefulSet", "demo-r0"), what="sts")
    await cluster.serve_replica("demo", 0)
    await _wait_condition(cluster, "demo", "Ready", "True", "AllReplicasServing")
    for attempt in (1, 2):
        await cluster.set_pod_phase("demo-r0-2", "crashed", restarts=1)
        # The group re-forms: every stage pod is deleted, the admission controller drains.
        for rank in range(4):
            await wait_for(lambda r=rank: _gone(cluster, "Pod", f"demo-r0-{r}"), what="re-form")
        body = await _wait_status(cluster, "demo", phase="Progressing")
        replica = body["status"]["replicaStatuses"][0]
        assert (replica["numRestarts"], replica["phase"]) == (attempt, "Draining")
        assert await _admission_replicas(cluster, "demo", 0) == 0
        await cluster.stop_admission("demo", 0)
        await wait_for(lambda: _admission_is(cluster, "demo", 0, 1), what="admission back")
        await cluster.serve_replica("demo", 0)
        await _wait_condition(cluster, "demo", "Ready", "True", "AllReplicasServing")
    # The third failure within the window exceeds maxRestarts=2: the replica is stopped.
    await cluster.set_pod_phase("demo-r0-1", "crashed", restarts=1, exit_code=137)
    body = await _wait_condition(cluster, "demo", "Degraded", "True", "RestartBudgetExceeded")
    message = _condition(body, "Degraded")["message"]
    assert (
        "3 re-formations" in message and "maxRestarts=2" in message and "exit code 137" in message
    )
    assert body["status"]["phase"] == "Degraded"
    sts = await cluster.get("StatefulSet", "demo-r0")
    assert sts["spec"]["replicas"] == 0
    assert await _admission_replicas(cluster, "demo", 0) == 0
    assert await _stage_phases(cluster, "demo") == ["stopped"] * 4
    # It stays stopped (no restart loop) until the spec changes.
    assert await cluster.get("Pod", "demo-r0-0") is None
    await cluster.edit_spec("demo", {"image": "registry.example/wavepp:fixed"})
    await _wait_condition(cluster, "demo", "Degraded", "False", "AsExpected")
    sts = await cluster.get("StatefulSet", "demo-r0")
    assert sts["spec"]["replicas"] == 4
    assert (
        sts["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/wavepp:fixed"
    )


async def _admission_is(cluster: Cluster, name: str, replica: int, count: int) -> bool:
    return await _admission_replicas(cluster, name, replica) == count


async def test_invalid_spec_is_reported_with_the_field_and_recovers(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create_pipeline("bad", tiny_spec(replicas=1, layerPartition=[3, 3, 3, 3]))
    body = await _wait_condition(cluster, "bad", "Degraded", "True", "InvalidSpec")
    assert "spec.layerPartition" in _condition(body, "Degraded")["message"]
    assert "sums to 12" in _condition(body, "Degraded")["message"]
    assert body["status"]["phase"] == "Invalid"
    assert await cluster.list("StatefulSet", "bad") == []
    # An engine the CRD enum would reject on a real server: the operator names the field too.
    await cluster.edit_spec("bad", {"engine": "vllm", "layerPartition": None})
    body = await wait_for(
        lambda: _condition_mentions(cluster, "bad", "Degraded", "spec.engine"), what="spec.engine"
    )
    await cluster.edit_spec("bad", {"engine": "torch"})
    await _wait_condition(cluster, "bad", "Degraded", "False", "AsExpected")
    await wait_for(lambda: cluster.get("StatefulSet", "bad-r0"), what="sts after the fix")


async def _condition_mentions(cluster: Cluster, name: str, type_: str, text: str) -> bool:
    return text in _condition(await cluster.pipeline(name), type_).get("message", "")


async def test_kubectl_apply_example_and_get_printer_columns(
    cluster: Cluster, operator: Any
) -> None:
    example = REPO / "examples" / "wavepipeline.yaml"
    rc, out, err = await cluster.kubectl("apply", "--validate=false", "-f", str(example))
    assert rc == 0, err
    assert "wavepipeline.wavepp.dev/tiny created" in out
    await wait_for(lambda: cluster.get("StatefulSet", "tiny-r1"), what="children of tiny")
    await cluster.serve_replica("tiny", 0)
    await _wait_status(cluster, "tiny", readyReplicas=1)
    rc, out, err = await cluster.kubectl("get", "wavepipelines")
    assert rc == 0, err
    header, row = out.strip().splitlines()
    assert header.split() == ["NAME", "STAGES", "READY", "REPLICAS", "AGE"]
    assert row.split()[:4] == ["tiny", "4", "1", "2"]
    rc, out, err = await cluster.kubectl("get", "wpp", "tiny", "-o", "jsonpath={.status.phase}")
    assert (rc, out) == (0, "Progressing"), err


def _rbac_verbs(request: Any, created_by_apply: set[int]) -> set[str]:
    """The verbs the API server's authorizer checks for ``request``.

    A server-side apply that creates the object is checked as ``patch`` and as ``create``.
    """
    # NOTE: a write of an object whose owner reference sets blockOwnerDeletion is also checked
    # (OwnerReferencesPermissionEnforcement) as update of the owner's finalizers: see
    # _owner_checks.
    method = str(request.method.value if hasattr(request.method, "value") else request.method)
    method = method.upper()
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return {"watch"}
        return {"get" if request.name else "list"}
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
    return {verb, "create"} if request.id in created_by_apply else {verb}


async def test_every_operator_request_is_allowed_by_the_charts_role(
    cluster: Cluster, operator: Any, helm: str
) -> None:
    """Least privilege, checked from behaviour: each API call the operator made in a scenario
    that touches every path (HPA, re-form, scale-down, delete) is granted by the chart's role."""
    spec = tiny_spec(
        replicas=2, autoscaling={"minReplicas": 1, "maxReplicas": 3, "metric": "cpu", "target": 70}
    )
    await cluster.create_pipeline("demo", spec)
    await wait_for(lambda: cluster.get("HorizontalPodAutoscaler", "demo"), what="HPA")
    for replica in (0, 1):
        await wait_for(lambda r=replica: cluster.get("StatefulSet", f"demo-r{r}"), what="sts")
        await cluster.serve_replica("demo", replica)
    await _wait_condition(cluster, "demo", "Ready", "True", "AllReplicasServing")
    await cluster.set_pod_phase("demo-r0-3", "crashed")
    await wait_for(lambda: _gone(cluster, "Pod", "demo-r0-3"), what="re-form")
    await cluster.edit_spec("demo", {"autoscaling": None, "replicas": 1})
    await wait_for(lambda: _gone(cluster, "HorizontalPodAutoscaler", "demo"), what="HPA deleted")
    await cluster.stop_admission("demo", 1)
    await wait_for(lambda: _gone(cluster, "StatefulSet", "demo-r1"), what="scale-down")
    await cluster.client.delete("WavePipeline", NAMESPACE, "demo")
    await wait_for(lambda: _gone(cluster, "WavePipeline", "demo"), what="pipeline gone")

    role = next(
        o
        for o in render_chart(helm)
        if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "wavepp"
    )
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    used = set()
    for request in list(cluster.emulator):
        used |= _owner_checks(request)
        agent = request.headers.get("User-Agent", "")
        if request.resource is None or request.resource.plural is None:
            continue  # discovery: granted to every authenticated user
        if agent.startswith((TEST_USER_AGENT, "kubectl")):
            continue
        resource = request.resource.plural
        if request.subresource:
            resource += f"/{request.subresource}"
        for verb in _rbac_verbs(request, cluster.emulator.created_by_apply):
            used.add((request.resource.group, resource, verb))
    assert ("apps", "statefulsets", "delete") in used and ("", "pods", "delete") in used
    assert ("autoscaling", "horizontalpodautoscalers", "create") in used
    assert used - granted == set()
    # And nothing is granted that no call uses. Events: the tests turn kopf's posting off (the
    # emulator has no generateName); the chart's operator posts them. Secrets: the pipelines'
    # NATS credentials, rendered only with an account seed (the chart's default, NATS auth;
    # test_operator_natscreds), which this operator runs without.
    assert granted - used == {
        ("", "events", "create"),
        ("", "secrets", "create"),
        ("", "secrets", "patch"),
    }


def _owner_checks(request: Any) -> set[tuple[str, str, str]]:
    """``update`` of ``wavepipelines/finalizers`` for a create or apply of a child whose owner
    reference sets blockOwnerDeletion (what OwnerReferencesPermissionEnforcement checks)."""
    method = str(request.method.value if hasattr(request.method, "value") else request.method)
    if method.upper() not in ("POST", "PATCH", "PUT") or not isinstance(request.data, dict):
        return set()
    owners = (request.data.get("metadata") or {}).get("ownerReferences") or []
    if any(o.get("kind") == "WavePipeline" and o.get("blockOwnerDeletion") for o in owners):
        return {("wavepp.dev", "wavepipelines/finalizers", "update")}
    return set()


async def test_wavepp_operator_command_runs_as_a_process(cluster: Cluster) -> None:
    """`wavepp operator` (what the chart's Deployment runs): reconciles, serves /healthz,
    exits 0 on SIGTERM."""
    import os
    import signal
    import sys

    import aiohttp

    port = free_port()
    env = os.environ | {
        "KUBECONFIG": str(cluster.kubeconfig),
        "WAVEPP_DEFAULT_IMAGE": "registry.example/wavepp:proc",
        "WAVEPP_DEFAULT_NATS_URL": "nats://nats:4222",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "wavepp.cli", "operator", "--no-events", "--resync-s", "1",
        "--liveness-port", str(port),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        await cluster.create_pipeline("proc", tiny_spec(replicas=1))
        sts = await wait_for(
            lambda: cluster.get("StatefulSet", "proc-r0"), timeout_s=30, what="sts"
        )
        image = sts["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == "registry.example/wavepp:proc"
        await _wait_status(cluster, "proc", replicas=1)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/healthz") as response:
                assert response.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, output.decode()[-3000:]
    assert b"Traceback" not in output, output.decode()[-3000:]


async def test_a_decode_pool_is_rendered_and_both_pools_reach_ready(
    cluster: Cluster, operator: Any
) -> None:
    """spec.decode.pool: the decode Deployment and Service come with the replicas; Ready (the
    prefill side) and DecodeReady (a Ready decode pod) are reached; removing the section deletes
    the decode objects and the condition."""
    pool = {"replicas": 2, "image": "vllm-wavepp:1", "resources": {"gpus": 0}}
    spec = tiny_spec(
        replicas=1, model={"name": "tiny-llama", "pvc": {"claimName": "w"}}, decode={"pool": pool}
    )
    await cluster.create_pipeline("demo", spec)
    dep = await wait_for(lambda: cluster.get("Deployment", "demo-decode"), what="decode pool")
    assert dep["spec"]["replicas"] == 2
    assert await cluster.get("Service", "demo-decode") is not None
    await _wait_condition(cluster, "demo", "DecodeReady", "False", "NoDecodePodReady")
    await wait_for(lambda: cluster.get("StatefulSet", "demo-r0"), what="sts r0")
    await cluster.serve_replica("demo", 0)
    await _wait_condition(cluster, "demo", "Ready", "True", "AllReplicasServing")
    await cluster._create_pod("demo-decode-x", dep["spec"]["template"], "warm")
    body = await _wait_condition(cluster, "demo", "DecodeReady", "True", "DecodePodsReady")
    assert _condition(body, "DecodeReady")["message"] == "1/2 decode pods Ready"
    assert _condition(body, "Ready")["status"] == "True"

    await cluster.edit_spec("demo", {"decode": None})
    await wait_for(lambda: _gone(cluster, "Deployment", "demo-decode"), what="decode deleted")
    await wait_for(lambda: _gone(cluster, "Service", "demo-decode"), what="decode Service gone")
    await wait_for(lambda: _gone(cluster, "NetworkPolicy", "demo-decode"), what="its policy gone")
    body = await cluster.pipeline("demo")
    assert _condition(body, "DecodeReady") == {}
