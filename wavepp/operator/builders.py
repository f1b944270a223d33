"""Pure manifest builders: a resolved WavePipelineSpec in, Kubernetes objects (dicts) out.

No I/O here; handlers.py applies what these functions return. One builder per kind of child;
the names, labels and owner reference come from ``naming.py``, the container contract with the
runtime's processes from ``containers.py`` (both re-exported here, so callers keep
``from wavepp.operator import builders as b``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from wavepp.api.pod import HANDOFF_PORT
from wavepp.api.spec import API_GROUP, API_VERSION, DECODE_PORT, KIND, WavePipelineSpec
from wavepp.operator.containers import (
    HEALTH_PORT,
    HTTP_PORT,
    RENDEZVOUS_PORT,
    config_volumes,
    pod_container,
    pod_spec_common,
)
from wavepp.operator.decode_builders import (
    decode_pod_selector,
)
from wavepp.operator.naming import (
    ANNOTATION_SPEC_HASH,
    LABEL_REPLICA,
    LABEL_SPEC_HASH,
    PipelineRef,
    admission_name,
    base_labels,
    child_metadata,
    gateway_name,
    pod_selector,
    pool_configmap_name,
    spec_configmap_name,
    statefulset_name,
)
from wavepp.operator.resources import stage_resources

# ---- children -----------------------------------------------------------------------------


def build_spec_configmap(ref: PipelineRef, spec: WavePipelineSpec, hash_: str) -> dict[str, Any]:
    """Immutable ConfigMap with ``spec.json``: the resolved spec that every process reads."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(
            ref,
            spec_configmap_name(ref.name, hash_),
            "config",
            annotations={ANNOTATION_SPEC_HASH: hash_},
            extra_labels={LABEL_SPEC_HASH: hash_},
        ),
        "immutable": True,
        "data": {"spec.json": json.dumps(spec.to_wire(), indent=2, sort_keys=True)},
    }


@dataclass(frozen=True)
class PoolEntry:
    """One replica as the gateway sees it: admit to it only when ``admitting``."""

    replica: int
    spec_hash: str | None
    admitting: bool


def build_pool_configmap(ref: PipelineRef, entries: list[PoolEntry]) -> dict[str, Any]:
    """ConfigMap ``pool.json`` that the gateway reads to route requests to admitting replicas.

    ``pool.json``: ``{"pipeline": p, "replicas": [{"replica": i, "specHash": h, "admitting": b,
    "admissionUrl": "http://{p}-r{i}-admission.{ns}.svc:8080"}]}``, replicas in index order.
    """
    pool = {
        "pipeline": ref.name,
        "replicas": [
            {
                "replica": e.replica,
                "specHash": e.spec_hash,
                "admitting": e.admitting,
                "admissionUrl": (
                    f"http://{admission_name(ref.name, e.replica)}.{ref.namespace}.svc:{HTTP_PORT}"
                ),
            }
            for e in sorted(entries, key=lambda e: e.replica)
        ],
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(ref, pool_configmap_name(ref.name), "pool"),
        "data": {"pool.json": json.dumps(pool, indent=2, sort_keys=True)},
    }


def build_stage_service(ref: PipelineRef, replica: int) -> dict[str, Any]:
    """Headless Service: stable DNS ``{p}-r{i}-{rank}.{p}-r{i}`` for the rendezvous.

    NOTE: publishNotReadyAddresses, because the group forms before any stage is ready.
    """
    name = statefulset_name(ref.name, replica)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(ref, name, "stage", replica=replica),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": pod_selector(ref.name, "stage", replica),
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}
            ],
        },
    }


def _topology_spread(spec: WavePipelineSpec, ref: PipelineRef) -> list[dict[str, Any]]:
    """The spec's constraints; one without labelSelector counts this pipeline's stage pods."""
    constraints = []
    for constraint in spec.topology_spread_constraints:
        c = dict(constraint)
        c.setdefault("labelSelector", {"matchLabels": pod_selector(ref.name, "stage")})
        constraints.append(c)
    return constraints


def build_stage_statefulset(
    ref: PipelineRef, spec: WavePipelineSpec, hash_: str, replica: int, *, stopped: bool = False
) -> dict[str, Any]:
    """StatefulSet of one pipeline replica: one pod per stage, ordinal = rank.

    Parallel pod management (all stages start together and rendezvous); updateStrategy OnDelete:
    the operator restarts a replica's stages all at once (a torch.distributed group cannot
    lose a member), by deleting its pods, never one pod at a time.

    Args:
        ref: the owning pipeline.
        spec: the resolved spec.
        hash_: :func:`spec_hash` of ``spec``.
        replica: replica index i.
        stopped: True for a replica stopped by its restart budget (0 pods).
    """
    name = statefulset_name(ref.name, replica)
    selector = pod_selector(ref.name, "stage", replica)
    volumes, mounts = config_volumes(spec, ref, hash_, "stage", replica)
    volumes.append(
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shared_memory}}
    )
    mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    ports = [
        {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
        {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
    ]
    pod_spec: dict[str, Any] = pod_spec_common(spec) | {
        "containers": [
            pod_container("stage", spec, ref, replica, ports, stage_resources(spec), mounts)
        ],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 30,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations
        ]
    affinity = _replica_affinity(spec, ref, replica, dict(spec.affinity or {}))
    if affinity:
        pod_spec["affinity"] = affinity
    if spec.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = _topology_spread(spec, ref)
    overlay = spec.pod_template
    for key, value in (
        ("priorityClassName", overlay.priority_class_name),
        ("schedulerName", overlay.scheduler_name),
        ("runtimeClassName", overlay.runtime_class_name),
    ):
        if value:
            pod_spec[key] = value
    template_labels = base_labels(ref.name, "stage") | {
        LABEL_REPLICA: str(replica),
        LABEL_SPEC_HASH: hash_,
    }
    if spec.topology.pod_group:
        template_labels[POD_GROUP_LABEL] = name
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": child_metadata(
            ref, name, "stage", replica=replica, annotations={ANNOTATION_SPEC_HASH: hash_}
        ),
        "spec": {
            "replicas": 0 if stopped else spec.num_stages,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {
                    "labels": template_labels,
                    "annotations": {ANNOTATION_SPEC_HASH: hash_},
                },
                "spec": pod_spec,
            },
        },
    }


def _replica_affinity(
    spec: WavePipelineSpec, ref: PipelineRef, replica: int, affinity: dict[str, Any]
) -> dict[str, Any]:
    """``spec.affinity`` plus the per-replica topology: a replica's stage pods share one
    ``topology.replicaDomainKey`` domain (required pod affinity on the replica's stage pods; the
    first pod may go anywhere), and prefer ``spreadReplicasKey`` domains without the other
    replicas' stage pods (preferred anti-affinity)."""
    topology = spec.topology
    if topology.replica_domain_key:
        pod_affinity = dict(affinity.get("podAffinity") or {})
        pod_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = [
            *pod_affinity.get("requiredDuringSchedulingIgnoredDuringExecution", []),
            {
                "labelSelector": {"matchLabels": pod_selector(ref.name, "stage", replica)},
                "topologyKey": topology.replica_domain_key,
            },
        ]
        affinity["podAffinity"] = pod_affinity
    if topology.spread_replicas_key:
        anti = dict(affinity.get("podAntiAffinity") or {})
        anti["preferredDuringSchedulingIgnoredDuringExecution"] = [
            *anti.get("preferredDuringSchedulingIgnoredDuringExecution", []),
            {
                "weight": 100,
                "podAffinityTerm": {
                    "labelSelector": {
                        "matchLabels": pod_selector(ref.name, "stage"),
                        "matchExpressions": [
                            {"key": LABEL_REPLICA, "operator": "NotIn", "values": [str(replica)]}
                        ],
                    },
                    "topologyKey": topology.spread_replicas_key,
                },
            },
        ]
        affinity["podAntiAffinity"] = anti
    return affinity


# The gateway's autoscaling series (wavepp.gateway.metrics; the chart's adapter rule serves it).
BACKLOG_METRIC = "wavepp_gateway_backlog_requests"

POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"  # the coscheduling plugin's pod label


def build_pod_group(ref: PipelineRef, spec: WavePipelineSpec, replica: int) -> dict[str, Any]:
    """PodGroup (scheduler-plugins coscheduling) of one replica: its S stage pods are bound all
    or none (``minMember`` = stages), so a half-scheduled replica never holds GPUs."""
    return {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "kind": "PodGroup",
        "metadata": child_metadata(
            ref, statefulset_name(ref.name, replica), "stage", replica=replica
        ),
        "spec": {
            "minMember": spec.num_stages,
            "scheduleTimeoutSeconds": math.ceil(spec.restart_budget.forming_timeout_s),
        },
    }


def build_pdb(ref: PipelineRef, spec: WavePipelineSpec, replica: int) -> dict[str, Any]:
    """PodDisruptionBudget of one replica's stage pods: losing one stage stops the whole replica
    (a torch.distributed group cannot lose a member), so a serving replica admits no voluntary
    eviction (minAvailable = stages); a replica that is not serving (pods unready) may be
    evicted (unhealthyPodEvictionPolicy AlwaysAllow), so drains never wait on a broken one."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(
            ref, statefulset_name(ref.name, replica), "stage", replica=replica
        ),
        "spec": {
            "minAvailable": spec.num_stages,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": pod_selector(ref.name, "stage", replica)},
        },
    }


def build_network_policies(ref: PipelineRef, spec: WavePipelineSpec) -> list[dict[str, Any]]:
    """Ingress NetworkPolicies of the pipeline's pods (none when ``networkPolicy.enabled`` is
    false): stage pods accept only the pipeline's stage pods (the rendezvous port and gloo/NCCL's
    activation connections, on ports they choose) and anyone on the health port (probes) and
    the metrics port (Prometheus; it serves nothing else);
    admission pods accept the pipeline's gateway on the HTTP port and anyone on the metrics
    port; the gateway accepts ``networkPolicy.gatewayFrom`` (default: its namespace's pods).
    With a ``decode`` section the stage pods also accept exactly the decode pods
    (``decode_pod_selector``) on the KV transfer port ``HANDOFF_PORT``, and a rendered decode
    pool's pods accept only the pipeline's gateway and ``networkPolicy.scrapeFrom``
    (Prometheus: vLLM serves /metrics on its API port) on ``DECODE_PORT``."""
    if not spec.network_policy.enabled:
        return []

    def pods(component: str) -> dict[str, Any]:
        return {"matchLabels": pod_selector(ref.name, component)}

    def tcp(port: int) -> dict[str, Any]:
        return {"protocol": "TCP", "port": port}

    def policy(component: str, ingress: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": child_metadata(ref, f"{ref.name}-{component}", "network"),
            "spec": {
                "podSelector": pods(component),
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }

    gateway_from = list(spec.network_policy.gateway_from) or [{"podSelector": {}}]
    stage_ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": pods("stage")}]},
        {"ports": [tcp(HEALTH_PORT)]},
        {"ports": [tcp(spec.telemetry.metrics_port)]},
    ]
    decode_pods = decode_pod_selector(ref, spec)
    if decode_pods is not None:
        stage_ingress.append(
            {"from": [{"podSelector": {"matchLabels": decode_pods}}], "ports": [tcp(HANDOFF_PORT)]}
        )
    decode_policy = []
    if spec.decode is not None and spec.decode.pool is not None:
        decode_ingress = [{"from": [{"podSelector": pods("gateway")}], "ports": [tcp(DECODE_PORT)]}]
        if spec.network_policy.scrape_from:
            decode_ingress.append(
                {"from": list(spec.network_policy.scrape_from), "ports": [tcp(DECODE_PORT)]}
            )
        decode_policy.append(policy("decode", decode_ingress))
    return [
        policy("stage", stage_ingress),
        policy(
            "admission",
            [
                {"from": [{"podSelector": pods("gateway")}], "ports": [tcp(HTTP_PORT)]},
                {"ports": [tcp(spec.telemetry.metrics_port)]},
            ],
        ),
        policy("gateway", [{"from": gateway_from, "ports": [tcp(HTTP_PORT)]}]),
        *decode_policy,
    ]


def build_inference_pool(ref: PipelineRef, spec: WavePipelineSpec) -> dict[str, Any] | None:
    """InferencePool ``{p}`` (inference.networking.k8s.io/v1) over the gateway pods' HTTP port,
    with the cluster's endpoint picker; None unless ``inferencePool.enabled``."""
    pool = spec.inference_pool
    if not pool.enabled:
        return None
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": child_metadata(ref, ref.name, "gateway"),
        "spec": {
            "selector": {"matchLabels": pod_selector(ref.name, "gateway")},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": pool.endpoint_picker,
                "port": {"number": pool.endpoint_picker_port},
                "failureMode": pool.failure_mode,
            },
        },
    }


def build_admission_deployment(
    ref: PipelineRef, spec: WavePipelineSpec, hash_: str, replica: int, *, running: bool
) -> dict[str, Any]:
    """The admission controller of one replica (1 pod; 0 while the replica leaves the pool).

    Scaling it to 0 is how a replica drains: the pod gets SIGTERM, stops admitting, lets the
    admitted requests finish within terminationGracePeriodSeconds (``rollout.drainTimeoutSeconds``)
    and exits; the operator replaces the stages only after the pod is gone.
    """
    name = admission_name(ref.name, replica)
    selector = pod_selector(ref.name, "admission", replica)
    volumes, mounts = config_volumes(spec, ref, hash_, "admission", replica)
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    pod_spec = pod_spec_common(spec) | {
        "containers": [pod_container("admission", spec, ref, replica, ports, {}, mounts)],
        "volumes": volumes,
        "terminationGracePeriodSeconds": math.ceil(spec.rollout.drain_timeout_s),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(
            ref, name, "admission", replica=replica, annotations={ANNOTATION_SPEC_HASH: hash_}
        ),
        "spec": {
            "replicas": 1 if running else 0,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {
                    "labels": base_labels(ref.name, "admission")
                    | {LABEL_REPLICA: str(replica), LABEL_SPEC_HASH: hash_},
                    "annotations": {ANNOTATION_SPEC_HASH: hash_},
                },
                "spec": pod_spec,
            },
        },
    }


def _http_service(ref: PipelineRef, name: str, component: str, replica: int | None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(ref, name, component, replica=replica),
        "spec": {
            "selector": pod_selector(ref.name, component, replica),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http"}],
        },
    }


def build_admission_service(ref: PipelineRef, replica: int) -> dict[str, Any]:
    """ClusterIP Service of one replica's admission controller."""
    return _http_service(ref, admission_name(ref.name, replica), "admission", replica)


def build_gateway_service(ref: PipelineRef) -> dict[str, Any]:
    """ClusterIP Service of the gateway: the pipeline's prefill endpoint."""
    return _http_service(ref, gateway_name(ref.name), "gateway", None)


def build_hpa(ref: PipelineRef, spec: WavePipelineSpec) -> dict[str, Any] | None:
    """autoscaling/v2 HPA on the pipeline's scale subresource, or None without autoscaling.

    backlog (default): External metric ``wavepp_gateway_backlog_requests`` selected by the
    pipeline's namespace and pool (its gateway exports it; the chart's prometheus-adapter rule
    serves it), ``target`` = requests per replica (AverageValue: the HPA divides by the
    pipeline's replicas). cpu: Resource metric, ``target`` = average utilisation in percent of
    the stage pods' CPU request. Both with stabilisation windows (``behavior``).
    """
    auto = spec.autoscaling
    if auto is None:
        return None
    if auto.metric == "backlog":
        metric: dict[str, Any] = {
            "type": "External",
            "external": {
                "metric": {
                    "name": BACKLOG_METRIC,
                    "selector": {"matchLabels": {"namespace": ref.namespace, "pool": ref.name}},
                },
                "target": {"type": "AverageValue", "averageValue": f"{auto.target:g}"},
            },
        }
    else:
        metric = {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": math.ceil(auto.target)},
            },
        }
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(ref, ref.name, "autoscaler"),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "name": ref.name,
            },
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [metric],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": auto.scale_up_window_s},
                "scaleDown": {"stabilizationWindowSeconds": auto.scale_down_window_s},
            },
        },
    }
