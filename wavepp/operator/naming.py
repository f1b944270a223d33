"""Names, labels and the owner reference of every child of a WavePipeline.

Every child carries an owner reference to its pipeline and the labels below, and has a
deterministic name (the operator may rerun any handler):

| object                     | name                     | per      |
| -------------------------- | ------------------------ | -------- |
| ConfigMap (resolved spec)  | {p}-spec-{hash}          | spec     |
| ConfigMap (pool)           | {p}-pool                 | pipeline |
| StatefulSet (stages)       | {p}-r{i}                 | replica  |
| Service (headless)         | {p}-r{i}                 | replica  |
| Deployment + Service       | {p}-r{i}-admission       | replica  |
| Deployment + Service       | {p}-gateway              | pipeline |
| HorizontalPodAutoscaler    | {p}                      | pipeline |
| PodDisruptionBudget        | {p}-r{i}                 | replica  |
| PodDisruptionBudget        | {p}-gateway              | pipeline |
| PodGroup (optional)        | {p}-r{i}                 | replica  |
| NetworkPolicy              | {p}-stage, -admission, -gateway | pipeline |
| InferencePool (optional)   | {p}                      | pipeline |
| Deployment + Service       | {p}-decode (decode.pool) | pipeline |
| NetworkPolicy (decode.pool)| {p}-decode               | pipeline |
| HorizontalPodAutoscaler    | {p}-decode (autoscaling) | pipeline |

Stage pods are ``{p}-r{i}-{rank}``: the StatefulSet ordinal is the stage rank. The spec
ConfigMap's name carries the spec hash (:func:`spec_hash`), so replicas on the old and the new
spec coexist during a rolling update (each mounts its own) and a ConfigMap never changes under a
running pod.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from wavepp.api.spec import API_GROUP, API_VERSION, KIND, WavePipelineSpec

LABEL_PIPELINE = "wavepp.dev/pipeline"
LABEL_REPLICA = "wavepp.dev/replica"
LABEL_COMPONENT = "wavepp.dev/component"
LABEL_SPEC_HASH = "wavepp.dev/spec-hash"
ANNOTATION_SPEC_HASH = "wavepp.dev/spec-hash"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller (k8s >= 1.28)

# Spec fields that do not change what a replica's processes run: editing them never rolls.
_NOT_HASHED = (
    "replicas",
    "autoscaling",
    "restartBudget",
    "rollout",
    "networkPolicy",
    "inferencePool",
)


@dataclass(frozen=True)
class PipelineRef:
    """Identity of the owning WavePipeline object."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> PipelineRef:
        """Read name, namespace and uid from a WavePipeline object."""
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta.get("namespace") or "default", uid=meta["uid"])


# ---- names and labels ---------------------------------------------------------------------


def spec_hash(spec: WavePipelineSpec) -> str:
    """Hash of what a replica runs: the resolved spec without replicas/autoscaling/budget/rollout
    (and of ``decode.pool`` only its presence).

    Returns:
        10 lowercase hex characters of sha256 over canonical JSON (sorted keys).
    """
    wire = {k: v for k, v in spec.to_wire().items() if k not in _NOT_HASHED}
    if "pool" in wire.get("decode", {}):
        # A replica's processes see only that a pool exists (its Service is the gateway's
        # decode URL; the stages serve KV transfers): the pool's size, image and args roll
        # the decode Deployment alone.
        wire["decode"] = {"pool": True}
    canonical = json.dumps(wire, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def spec_configmap_name(pipeline: str, hash_: str) -> str:
    """``{p}-spec-{hash}``: the resolved spec of one spec hash."""
    return f"{pipeline}-spec-{hash_}"


def pool_configmap_name(pipeline: str) -> str:
    """``{p}-pool``: the replicas the gateway may send requests to."""
    return f"{pipeline}-pool"


def statefulset_name(pipeline: str, replica: int) -> str:
    """``{p}-r{i}``: the StatefulSet (and headless Service) of replica i."""
    return f"{pipeline}-r{replica}"


def stage_pod_name(pipeline: str, replica: int, rank: int) -> str:
    """``{p}-r{i}-{rank}``: the pod of one stage (StatefulSet ordinal = rank)."""
    return f"{statefulset_name(pipeline, replica)}-{rank}"


def admission_name(pipeline: str, replica: int) -> str:
    """``{p}-r{i}-admission``: Deployment and Service of replica i's admission controller."""
    return f"{pipeline}-r{replica}-admission"


def gateway_name(pipeline: str) -> str:
    """``{p}-gateway``: Deployment and Service of the pipeline's gateway."""
    return f"{pipeline}-gateway"


def base_labels(pipeline: str, component: str) -> dict[str, str]:
    """Labels on every child (and its pods): selectable by pipeline and component."""
    return {
        "app.kubernetes.io/name": "wavepp",
        "app.kubernetes.io/instance": pipeline,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "wavepp-operator",
        **pod_selector(pipeline, component),
    }


def pod_selector(pipeline: str, component: str, replica: int | None = None) -> dict[str, str]:
    """The matchLabels of a component's pods in a pipeline (of one replica when given)."""
    labels = {LABEL_PIPELINE: pipeline, LABEL_COMPONENT: component}
    if replica is not None:
        labels[LABEL_REPLICA] = str(replica)
    return labels


def stage_selector(pipeline: str) -> str:
    """Label selector of all stage pods of a pipeline (``status.selector``, used by the HPA)."""
    return f"{LABEL_PIPELINE}={pipeline},{LABEL_COMPONENT}=stage"


def owner_reference(ref: PipelineRef) -> dict[str, Any]:
    """The controller owner reference to the pipeline (garbage collection), built by kopf.

    NOTE: kopf's ``build_owner_reference`` is the reference part of ``kopf.adopt``; adopt itself
    would also copy the pipeline's labels onto every child, which the children do not carry.
    kopf is imported here, not at the top: the gateway and ``wavepp up`` import this module's
    names (through ``operator.containers``) and need no kopf (~0.4 s of CPU per process).
    """
    import kopf

    owner = {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": ref.name, "uid": ref.uid},
    }
    return dict(kopf.build_owner_reference(owner, controller=True, block_owner_deletion=True))


def child_metadata(
    ref: PipelineRef,
    name: str,
    component: str,
    *,
    replica: int | None = None,
    annotations: dict[str, str] | None = None,
    extra_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    labels = base_labels(ref.name, component) | (extra_labels or {})
    if replica is not None:
        labels[LABEL_REPLICA] = str(replica)
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ref.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(ref)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta
