"""The pure planner with a fake clock and an in-memory object store (no API server)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from operator_support import pod_status

from wavepp.operator.naming import ANNOTATION_SPEC_HASH, POD_INDEX_LABEL
from wavepp.operator.observe import ANNOTATION_MEMBERS, pod_failure, stage_phase
from wavepp.operator.reconcile import (
    DRAIN_GRACE_S,
    Apply,
    Create,
    Defaults,
    Delete,
    Observed,
    Patch,
    plan,
)

DEFAULTS = Defaults(image="img:1", nats_url="nats://n:4222")


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


class World:
    """One pipeline, its children in a dict, and the planner run against them.

    An Apply creates the object or merges the manifest into it (as the test emulator does: an
    approximation of server-side apply without field ownership, see operator_support.py).
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        self.body: dict[str, Any] = {
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "generation": 1},
            "spec": spec,
        }
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.now = 1_000_000.0
        self.last_actions: list[Any] = []
        self.uids = 0

    def step(self, advance_s: float = 0.0) -> Any:
        self.now += advance_s
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for (kind, _), obj in sorted(self.objects.items()):
            by_kind.setdefault(kind, []).append(copy.deepcopy(obj))
        observed = Observed(
            statefulsets=by_kind.get("StatefulSet", []),
            deployments=by_kind.get("Deployment", []),
            pods=by_kind.get("Pod", []),
            configmaps=by_kind.get("ConfigMap", []),
            hpas=by_kind.get("HorizontalPodAutoscaler", []),
            services=by_kind.get("Service", []),
            pdbs=by_kind.get("PodDisruptionBudget", []),
            network_policies=by_kind.get("NetworkPolicy", []),
        )
        result = plan(self.body, observed, self.now, DEFAULTS)
        for action in result.actions:
            if isinstance(action, Apply | Create):
                key = (action.manifest["kind"], action.manifest["metadata"]["name"])
                if key not in self.objects:
                    self.objects[key] = copy.deepcopy(action.manifest)
                elif isinstance(action, Apply):
                    self.objects[key] = _merge(self.objects[key], action.manifest)
            elif isinstance(action, Patch):
                key = (action.kind, action.name)
                if key in self.objects:
                    self.objects[key] = _merge(self.objects[key], action.patch)
            elif isinstance(action, Delete):
                self.objects.pop((action.kind, action.name), None)
        self.body["status"] = result.status
        self.last_actions = result.actions
        return result

    # -- the controllers' part ------------------------------------------------------------

    def run_pods(self, replica: int, phase: str = "warm", admission: bool = True) -> None:
        sts = self.objects[("StatefulSet", f"p-r{replica}")]
        labels = sts["spec"]["template"]["metadata"]["labels"]
        for rank in range(sts["spec"]["replicas"]):
            name = f"p-r{replica}-{rank}"
            old = self.objects.get(("Pod", name))
            self.uids += 1
            uid = old["metadata"]["uid"] if old else f"uid-{self.uids}"
            self.objects[("Pod", name)] = {
                "metadata": {
                    "name": name,
                    "uid": uid,
                    "labels": labels | {POD_INDEX_LABEL: str(rank)},
                },
                "status": pod_status(phase),
            }
        dep = self.objects[("Deployment", f"p-r{replica}-admission")]
        if admission and dep["spec"]["replicas"] == 1:
            name = f"p-r{replica}-admission-x"
            self.objects[("Pod", name)] = {
                "metadata": {"name": name, "labels": dep["spec"]["template"]["metadata"]["labels"]},
                "status": pod_status("warm"),
            }

    def crash(self, pod: str) -> None:
        self.objects[("Pod", pod)]["status"] = pod_status("crashed")

    def stop_admission(self, replica: int) -> None:
        self.objects.pop(("Pod", f"p-r{replica}-admission-x"), None)

    def hash_of(self, replica: int) -> str:
        sts = self.objects[("StatefulSet", f"p-r{replica}")]
        return sts["metadata"]["annotations"][ANNOTATION_SPEC_HASH]

    def admission_replicas(self, replica: int) -> int:
        return self.objects[("Deployment", f"p-r{replica}-admission")]["spec"]["replicas"]

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.body["status"]["conditions"] if c["type"] == type_)

    def run_gateway(self, ready: bool = True) -> None:
        dep = self.objects[("Deployment", "p-gateway")]
        self.objects[("Pod", "p-gateway-x")] = {
            "metadata": {
                "name": "p-gateway-x",
                "labels": dep["spec"]["template"]["metadata"]["labels"],
            },
            "status": pod_status("warm" if ready else "formed"),
        }

    def serve_all(self, replicas: int) -> None:
        self.step()
        self.run_gateway()
        for replica in range(replicas):
            self.run_pods(replica)
        self.step()
        assert self.condition("Ready")["status"] == "True"


def spec(**raw: Any) -> dict[str, Any]:
    base = {"model": {"name": "tiny-llama"}, "stages": 2, "replicas": 1}
    return base | raw


def test_first_plan_creates_config_then_replicas_then_pool() -> None:
    world = World(spec(replicas=2))
    result = world.step()
    kinds = [(type(a).__name__, a.manifest["kind"]) for a in result.actions]
    assert kinds[0] == ("Create", "ConfigMap")  # the spec ConfigMap before any pod mounts it
    assert kinds.count(("Apply", "StatefulSet")) == 2
    assert result.status["phase"] == "Progressing"
    assert [r["phase"] for r in result.status["replicaStatuses"]] == ["Pending", "Pending"]
    assert world.step().actions[-3:] == result.actions[-3:]  # idempotent: same pool/gateway


def test_restart_budget_counts_only_failures_inside_the_window() -> None:
    world = World(
        spec(restartBudget={"maxRestarts": 1, "windowSeconds": 100, "formingTimeoutSeconds": 50})
    )
    world.serve_all(1)
    world.crash("p-r0-1")
    world.step()
    assert world.body["status"]["replicaStatuses"][0]["numRestarts"] == 1
    assert ("Pod", "p-r0-0") not in world.objects  # the whole group re-forms
    world.stop_admission(0)
    world.step()
    world.run_pods(0)
    world.step(150.0)  # the first failure leaves the window
    world.crash("p-r0-0")
    world.step()
    assert world.condition("Degraded")["status"] == "False"
    assert world.body["status"]["replicaStatuses"][0]["numRestarts"] == 1
    world.stop_admission(0)
    world.step()
    world.run_pods(0)
    world.step(50.0)  # the second failure is still inside the window: 2 > maxRestarts=1
    world.crash("p-r0-1")
    world.step()
    assert world.condition("Degraded")["reason"] == "RestartBudgetExceeded"
    assert world.objects[("StatefulSet", "p-r0")]["spec"]["replicas"] == 0
    # Stopped replicas stay stopped: later plans neither restart nor count again.
    world.step(10.0)
    assert world.objects[("StatefulSet", "p-r0")]["spec"]["replicas"] == 0
    assert world.body["status"]["phase"] == "Degraded"
    assert {s["phase"] for s in world.body["status"]["stages"]} == {"stopped"}


def test_drain_falls_back_to_the_timeout_when_the_admission_pod_hangs() -> None:
    world = World(spec(rollout={"drainTimeoutSeconds": 60}))
    world.serve_all(1)
    old = world.hash_of(0)
    world.body["spec"]["image"] = "img:2"
    result = world.step()
    assert world.admission_replicas(0) == 0 and world.hash_of(0) == old
    assert result.requeue_after_s == pytest.approx(60 + DRAIN_GRACE_S)
    world.step(60 + DRAIN_GRACE_S - 1)  # the admission pod never exits
    assert world.hash_of(0) == old
    world.step(1.0)
    assert world.hash_of(0) != old
    assert ("Pod", "p-r0-0") not in world.objects


def test_rollout_replaces_a_broken_replica_first_and_keeps_the_serving_one() -> None:
    world = World(spec(replicas=2))
    world.serve_all(2)
    world.objects[("Pod", "p-r1-1")]["status"] = pod_status("formed")  # r1 stops serving
    world.body["spec"]["image"] = "img:2"
    world.step()
    new = world.body["status"]["specHash"]
    assert world.hash_of(1) == new  # not serving: replaced at once, nothing to drain
    assert world.hash_of(0) != new and world.admission_replicas(0) == 1  # r0 keeps serving
    world.step(5.0)
    assert world.hash_of(0) != new and world.admission_replicas(0) == 1  # r1 not serving yet
    world.run_pods(1)
    world.step()
    assert world.admission_replicas(0) == 0  # now r0 leaves the pool
    pool = json.loads(world.objects[("ConfigMap", "p-pool")]["data"]["pool.json"])
    assert [(r["replica"], r["admitting"]) for r in pool["replicas"]] == [(0, False), (1, True)]


def test_invalid_spec_changes_nothing_and_keeps_transition_times() -> None:
    world = World(spec())
    world.serve_all(1)
    before = copy.deepcopy(world.objects)
    world.body["spec"]["layerPartition"] = [1, 1]
    result = world.step(5.0)
    assert result.actions == [] and world.objects == before
    assert result.status["phase"] == "Invalid"
    degraded = world.condition("Degraded")
    assert degraded["reason"] == "InvalidSpec" and "spec.layerPartition" in degraded["message"]
    first_time = degraded["lastTransitionTime"]
    world.step(120.0)
    assert world.condition("Degraded")["lastTransitionTime"] == first_time


def test_scale_to_zero_drains_then_deletes() -> None:
    world = World(spec())
    world.serve_all(1)
    world.body["spec"]["replicas"] = 0
    world.step()
    assert world.condition("Ready")["reason"] == "ScaledToZero"
    assert world.admission_replicas(0) == 0 and ("StatefulSet", "p-r0") in world.objects
    world.stop_admission(0)
    world.step()
    assert ("StatefulSet", "p-r0") not in world.objects
    assert ("Deployment", "p-r0-admission") not in world.objects


def test_leftovers_of_a_half_deleted_replica_are_removed() -> None:
    world = World(spec(replicas=2))
    world.serve_all(2)
    world.body["spec"]["replicas"] = 1
    del world.objects[("StatefulSet", "p-r1")]  # deleted, the rest not (operator restarted)
    world.step()
    assert ("Deployment", "p-r1-admission") not in world.objects
    assert ("Service", "p-r1") not in world.objects
    assert ("Service", "p-r1-admission") not in world.objects
    assert ("Deployment", "p-r0-admission") in world.objects


@pytest.mark.parametrize(
    ("status", "admitting", "phase"),
    [
        (None, False, "pending"),
        (pod_status("pending"), False, "pending"),
        (pod_status("scheduled"), False, "scheduled"),
        (pod_status("formed"), False, "formed"),
        (pod_status("warm"), False, "warm"),
        (pod_status("warm"), True, "serving"),
        (pod_status("crashed"), True, "failed"),
        ({"phase": "Failed"}, False, "failed"),
    ],
)
def test_stage_phase(status: dict[str, Any] | None, admitting: bool, phase: str) -> None:
    pod = None if status is None else {"metadata": {"name": "x"}, "status": status}
    assert stage_phase(pod, admitting=admitting, stopped=False) == phase
    assert stage_phase(pod, admitting=admitting, stopped=True) == "stopped"


def test_pod_failure_reports_exit_code() -> None:
    pod = {"metadata": {"name": "p-r0-1"}, "status": pod_status("crashed", exit_code=139)}
    assert "p-r0-1" in pod_failure(pod) and "exit code 139" in pod_failure(pod)
    assert pod_failure({"metadata": {"name": "ok"}, "status": pod_status("warm")}) is None
    # The kubelet restarted the container and it runs again: the stage re-forms in place with
    # the survivors (no pod is deleted); a restart that does not come back is still a failure.
    restarted = pod_status("warm", restarts=1)
    assert pod_failure({"metadata": {"name": "p-r0-1"}, "status": restarted}) is None
    assert stage_phase({"metadata": {"name": "p-r0-1"}, "status": restarted},
                       admitting=True, stopped=False) == "serving"  # fmt: skip


def test_a_member_recreated_with_a_new_uid_re_forms_the_replica() -> None:
    """Between two passes a stage pod was evicted and recreated (same name, new uid): the group
    that formed with the old pod is broken, so the replica re-forms at once."""
    world = World(spec(replicas=1, restartBudget={"maxRestarts": 2}))
    world.serve_all(1)
    world.step()
    sts = world.objects[("StatefulSet", "p-r0")]
    members = json.loads(sts["metadata"]["annotations"][ANNOTATION_MEMBERS])
    assert members == {"0": "uid-1", "1": "uid-2"}
    world.objects[("Pod", "p-r0-1")]["metadata"]["uid"] = "uid-new"
    result = world.step(1)
    assert Delete("Pod", "p-r0-0") in result.actions and Delete("Pod", "p-r0-1") in result.actions
    (replica,) = result.status["replicaStatuses"]
    assert replica["numRestarts"] == 1 and replica["reason"] == "StageFailed"
    assert "pod p-r0-1 was recreated (uid uid-2 -> uid-new)" in replica["message"]
    assert ANNOTATION_MEMBERS not in world.objects[("StatefulSet", "p-r0")]["metadata"].get(
        "annotations", {}
    )


def test_a_replica_that_never_forms_counts_against_the_budget_and_degrades() -> None:
    budget = {"maxRestarts": 1, "formingTimeoutSeconds": 100}
    world = World(spec(replicas=1, restartBudget=budget))
    world.step()
    phases = []
    for _ in range(30):
        world.run_pods(0, phase="formed")
        world.step(10)
        replica = world.body["status"]["replicaStatuses"][0]
        phases.append((round(world.now - 1_000_000), replica["phase"], replica.get("numRestarts")))
        if replica["phase"] == "Degraded":
            break
    assert phases[-1][1] == "Degraded" and phases[-1][0] <= 2 * 100 + 20, phases
    assert (
        "not formed within restartBudget.formingTimeoutSeconds=100 s"
        in world.condition("Degraded")["message"]
    )
    assert world.objects[("StatefulSet", "p-r0")]["spec"]["replicas"] == 0


def test_a_gateway_that_refuses_its_config_is_named() -> None:
    world = World(spec(replicas=1))
    world.serve_all(1)
    status = pod_status("crashed", exit_code=78)
    status["containerStatuses"][0]["lastState"]["terminated"]["message"] = (
        "wavepp gateway: --config /etc/wavepp/spec.json: spec.tenants: duplicate"
    )
    world.objects[("Pod", "p-gateway-x")]["status"] = status
    world.step()
    assert world.condition("Ready")["reason"] == "GatewayNotReady"
    degraded = world.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidRuntimeConfig")
    assert "gateway: pod p-gateway-x: wavepp gateway: --config" in degraded["message"]
    assert world.body["status"]["phase"] == "Degraded"
