"""Group lifecycle under disruption, and a status that cannot lie, on the kmock emulator.

The operator runs in-process against the emulator; the test plays the controllers' part (the
StatefulSet controller creating pods, the kubelet writing their status).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import time
from typing import Any

import pytest
from operator_support import NAMESPACE, Cluster, pod_status, tiny_spec, wait_for

from wavepp.api.spec import CONFIG_EXIT_CODE
from wavepp.operator.naming import LABEL_COMPONENT, admission_name
from wavepp.operator.observe import ANNOTATION_FORMING, ANNOTATION_MEMBERS, ANNOTATION_RESTARTS

pytestmark = pytest.mark.timeout(90)


def _condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((body or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


async def _condition_is(cluster: Cluster, name: str, type_: str, status: str, reason: str) -> Any:
    body = await cluster.pipeline(name)
    c = _condition(body, type_)
    return body if (c.get("status"), c.get("reason")) == (status, reason) else None


async def _serving(cluster: Cluster, name: str) -> None:
    await wait_for(lambda: cluster.get("StatefulSet", f"{name}-r0"), what="StatefulSet")
    await cluster.serve_replica(name, 0)
    await wait_for(
        lambda: _condition_is(cluster, name, "Ready", "True", "AllReplicasServing"), what="Ready"
    )


async def _annotation(cluster: Cluster, sts: str, key: str) -> Any:
    obj = await cluster.get("StatefulSet", sts)
    raw = ((obj or {}).get("metadata") or {}).get("annotations", {}).get(key)
    return json.loads(raw) if raw else None


async def _stage_pods(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return [
        p
        for p in await cluster.list("Pod", name)
        if p["metadata"]["labels"].get(LABEL_COMPONENT) == "stage"
    ]


async def test_a_recreated_stage_pod_makes_the_replica_re_form(
    cluster: Cluster, operator: Any
) -> None:
    """An evicted (or preempted, or lost with its node) stage pod comes back with a new uid: the
    group it formed is gone, so the replica re-forms at once instead of waiting for the
    recreated pod's startup probe. The recreated pod is warm: only the uid rule can restart
    the group, and the recorded reason names the pod (not a NotReady or forming timeout)."""
    await cluster.create_pipeline("demo", tiny_spec(replicas=1))
    await _serving(cluster, "demo")
    members = await wait_for(
        lambda: _annotation(cluster, "demo-r0", ANNOTATION_MEMBERS), what="members recorded"
    )
    assert sorted(members) == ["0", "1", "2", "3"]
    old = await cluster.get("Pod", "demo-r0-2")
    assert members["2"] == old["metadata"]["uid"]
    # The eviction: the pod goes, the StatefulSet controller makes it again (a new uid).
    await cluster.client.delete("Pod", NAMESPACE, "demo-r0-2")
    await cluster.run_statefulset("demo-r0", ranks=[2])
    recreated = time.monotonic()
    new = await cluster.get("Pod", "demo-r0-2")
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    # Re-formed: the group's other pods deleted (a torch.distributed group cannot take a new
    # member), one re-formation counted, the reason names the pod. (The operator may see the
    # pod gone before it comes back: either reason is the same lost member.)
    body = await wait_for(lambda: _restarted(cluster, "demo"), what="re-formation")
    await wait_for(lambda: _others_deleted(cluster, members), what="the group's pods deleted")
    elapsed_s = time.monotonic() - recreated
    (replica,) = body["status"]["replicaStatuses"]
    assert replica["numRestarts"] == 1
    assert "pod demo-r0-2 " in replica["message"]
    assert "was recreated" in replica["message"] or "is gone" in replica["message"]
    assert _condition(body, "Ready")["status"] == "False"
    print(f"re-formed {elapsed_s:.2f} s after the pod came back with a new uid")
    assert len(await _annotation(cluster, "demo-r0", ANNOTATION_RESTARTS)) == 1
    # The new group forms and serves again once the drained admission controller is back;
    # its members are the new pods.
    await cluster.stop_admission("demo", 0)
    await wait_for(lambda: _admission_running(cluster, "demo"), what="admission scaled back")
    await cluster.serve_replica("demo", 0)
    await wait_for(
        lambda: _condition_is(cluster, "demo", "Ready", "True", "AllReplicasServing"),
        what="Ready after re-forming",
    )
    members_after = await wait_for(
        lambda: _annotation(cluster, "demo-r0", ANNOTATION_MEMBERS), what="new members"
    )
    assert set(members_after.values()).isdisjoint(members.values())


async def _restarted(cluster: Cluster, name: str) -> Any:
    body = await cluster.pipeline(name)
    replicas = ((body or {}).get("status") or {}).get("replicaStatuses") or []
    return body if replicas and replicas[0].get("numRestarts") == 1 else None


async def _admission_running(cluster: Cluster, name: str) -> bool:
    dep = await cluster.get("Deployment", admission_name(name, 0))
    return dep is not None and dep["spec"]["replicas"] == 1


async def _others_deleted(cluster: Cluster, members: dict[str, str]) -> bool:
    for rank in ("0", "1", "3"):
        pod = await cluster.get("Pod", f"demo-r0-{rank}")
        if pod is not None and pod["metadata"]["uid"] == members[rank]:
            return False
    return True


async def _keep_pods_forming(cluster: Cluster, sts: str, stop: asyncio.Event) -> None:
    """The StatefulSet controller and kubelet of a replica that hangs while forming: pods are
    (re)created and start, none ever becomes Ready."""
    while not stop.is_set():
        obj = await cluster.get("StatefulSet", sts)
        if obj is not None and obj["spec"]["replicas"] > 0:
            for pod in await cluster.run_statefulset(sts, phase="formed"):
                del pod
        await asyncio.sleep(0.1)


async def _forming_annotations(cluster: Cluster, sts: str) -> dict[str, str] | None:
    obj = await cluster.get("StatefulSet", sts)
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    return annotations if ANNOTATION_FORMING in annotations else None


async def test_a_replica_that_hangs_while_forming_reaches_degraded_within_the_budget(
    cluster: Cluster, operator: Any
) -> None:
    """Pods that start but never turn Ready: the operator re-forms the replica each time it has
    been forming for formingTimeoutSeconds and stops it (Degraded, RestartBudgetExceeded) at the
    re-formation past maxRestarts. Checked on the operator's own clock (the forming-since and
    restarts annotations, epoch s), not on the test's: a loaded machine stretches the
    reconcile passes, not the budget."""
    # A window wider than the least (2 x 6 s): a late reconcile pass on a loaded machine does
    # not let the first re-formation fall out of it before the second is counted. A forming
    # timeout long next to a late pass (seconds under load) lets the gaps be bounded above too.
    budget = {"maxRestarts": 1, "formingTimeoutSeconds": 6, "windowSeconds": 60}
    await cluster.create_pipeline("hang", tiny_spec(replicas=1, restartBudget=budget))
    # The operator's memory of the replica as first seen: forming since its first pass over it
    # (and, on a test loop stalled past the forming timeout, since the re-formations it counts).
    first_seen = await wait_for(
        lambda: _forming_annotations(cluster, "hang-r0"), what="forming-since recorded"
    )
    forming_since = float(first_seen[ANNOTATION_FORMING])
    num_restarts_seen = len(json.loads(first_seen.get(ANNOTATION_RESTARTS) or "[]"))
    started = time.monotonic()
    stop = asyncio.Event()
    controller = asyncio.create_task(_keep_pods_forming(cluster, "hang-r0", stop))
    try:
        body = await wait_for(
            lambda: _condition_is(cluster, "hang", "Degraded", "True", "RestartBudgetExceeded"),
            timeout_s=90,
            what="Degraded",
        )
    finally:
        stop.set()
        await controller
    elapsed_s = time.monotonic() - started
    message = _condition(body, "Degraded")["message"]
    assert "not formed within restartBudget.formingTimeoutSeconds=6 s" in message
    assert "2 re-formations" in message
    print(f"Degraded {elapsed_s:.1f} s after creation (budget: 2 x 6 s forming + passes)")
    restarts = await _annotation(cluster, "hang-r0", ANNOTATION_RESTARTS)
    # Stopped at the re-formation past the budget, not before, not after.
    assert len(restarts) == budget["maxRestarts"] + 1, restarts
    assert await _annotation(cluster, "hang-r0", ANNOTATION_FORMING) is None, "forms no more"
    # Each re-formation came once the replica had been forming for the timeout, not before and
    # not much after (a pass's lateness), on the operator's clock: from its first forming-since
    # to the first, from each to the next.
    gaps = [later - earlier for earlier, later in itertools.pairwise(restarts)]
    if num_restarts_seen == 0:
        gaps.insert(0, restarts[0] - forming_since)
    else:  # seen re-forming already: forming since its last re-formation
        assert forming_since == restarts[num_restarts_seen - 1], (forming_since, restarts)
    assert min(gaps) >= budget["formingTimeoutSeconds"], (forming_since, restarts)
    assert max(gaps) <= 1.5 * budget["formingTimeoutSeconds"], (forming_since, restarts)
    sts = await cluster.get("StatefulSet", "hang-r0")
    assert sts["spec"]["replicas"] == 0  # stopped: no pods cycling forever


async def test_a_stage_whose_compute_loop_died_turns_ready_false_then_re_forms(
    cluster: Cluster, operator: Any
) -> None:
    """The kubelet reports the stage NotReady (its /readyz answers 503 once the compute thread
    died, see tests/runtime/stage/test_stage_health.py): the pipeline is not Ready at once, and past
    restartBudget.notReadySeconds the replica re-forms."""
    spec = tiny_spec(replicas=1, restartBudget={"maxRestarts": 2, "notReadySeconds": 2})
    await cluster.create_pipeline("dead", spec)
    await _serving(cluster, "dead")
    await wait_for(lambda: _annotation(cluster, "dead-r0", ANNOTATION_MEMBERS), what="members")
    status = pod_status("formed")  # started, not Ready: what a failing readiness probe gives
    since = dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    status["conditions"][1]["lastTransitionTime"] = since
    await cluster.client.patch(
        "Pod", NAMESPACE, "dead-r0-1", {"status": status}, subresource="status"
    )
    body = await wait_for(
        lambda: _condition_is(cluster, "dead", "Ready", "False", "ReplicasNotServing"),
        what="Ready False",
    )
    assert "stage 1 formed" in _condition(body, "Ready")["message"]
    body = await wait_for(lambda: _restarted(cluster, "dead"), what="re-formed")
    assert "stage 1: pod dead-r0-1 NotReady for" in body["status"]["replicaStatuses"][0]["message"]


async def test_a_config_error_is_reported_with_its_field_not_as_a_restart_budget(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create_pipeline("cfg", tiny_spec(replicas=1))
    await wait_for(lambda: cluster.get("StatefulSet", "cfg-r0"), what="StatefulSet")
    await cluster.run_statefulset("cfg-r0", phase="scheduled")
    message = (
        "wavepp stage: spec.resources.gpusPerStage > 0: this stage computes on cuda, but torch "
        "2.5 (CUDA build None) sees no CUDA device"
    )
    status = pod_status("crashed", exit_code=CONFIG_EXIT_CODE)
    status["containerStatuses"][0]["lastState"]["terminated"]["message"] = message
    await cluster.client.patch(
        "Pod", NAMESPACE, "cfg-r0-0", {"status": status}, subresource="status"
    )
    body = await wait_for(
        lambda: _condition_is(cluster, "cfg", "Degraded", "True", "InvalidRuntimeConfig"),
        what="InvalidRuntimeConfig",
    )
    assert "spec.resources.gpusPerStage" in _condition(body, "Degraded")["message"]
    (replica,) = body["status"]["replicaStatuses"]
    assert (replica["phase"], replica["reason"]) == ("Degraded", "InvalidRuntimeConfig")
    assert replica["numRestarts"] == 0  # not a crash loop: nothing counted, nothing cycling
    sts = await cluster.get("StatefulSet", "cfg-r0")
    assert sts["spec"]["replicas"] == 0


async def test_a_child_the_api_server_refuses_is_named_in_the_status(
    cluster: Cluster, operator: Any
) -> None:
    message = (
        'StatefulSet.apps "bad-r0" is invalid: spec.template.spec.priorityClassName: '
        'Not found: "gold"'
    )
    cluster.emulator.refusals["statefulsets/bad-r0"] = (422, message)
    await cluster.create_pipeline("bad", tiny_spec(replicas=1))
    body = await wait_for(
        lambda: _condition_is(cluster, "bad", "Degraded", "True", "ApplyFailed"),
        what="ApplyFailed",
    )
    text = _condition(body, "Degraded")["message"]
    assert "StatefulSet bad-r0: HTTP 422" in text and "priorityClassName" in text
    assert _condition(body, "Progressing")["reason"] == "ApplyFailed"
    # Fixed (the class exists now): the condition clears.
    del cluster.emulator.refusals["statefulsets/bad-r0"]
    await wait_for(
        lambda: _condition_is(cluster, "bad", "Degraded", "False", "AsExpected"),
        what="recovered",
    )


async def test_deleting_a_pipeline_removes_its_jetstream_state_only(
    cluster: Cluster, operator: Any, tmp_path: Any
) -> None:
    """The finalizer's one job beyond the garbage collector: the pool's intake streams and
    results bucket on NATS (named by namespace and name) go with it; a same-named pool's in
    another namespace stays."""
    from wavepp.runtime.transport.jetstream import ensure_intake, ensure_results
    from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect

    with EmbeddedNatsServer(jetstream=True, store_dir=str(tmp_path / "js")) as nats:
        nc = await connect(nats.url, name="test")
        js = nc.jetstream()
        for namespace in (NAMESPACE, "elsewhere"):
            await ensure_intake(js, "gone-r0", namespace=namespace)
            await ensure_results(js, "gone", namespace=namespace)
        await cluster.create_pipeline("gone", tiny_spec(replicas=1, nats={"url": nats.url}))
        await wait_for(lambda: cluster.get("Deployment", "gone-gateway"), what="gateway")
        await cluster.client.delete("WavePipeline", NAMESPACE, "gone")
        await wait_for(lambda: _absent(cluster, "gone"), what="pipeline gone")
        left = sorted(info.config.name for info in await js.streams_info())
        await nc.drain()
    assert left == ["KV_WAVEPP_RESULTS_elsewhere_gone", "WAVEPP_INTAKE_elsewhere_gone-r0"]


async def _absent(cluster: Cluster, name: str) -> bool:
    return await cluster.pipeline(name) is None
