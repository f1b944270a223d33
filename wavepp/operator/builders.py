"""Pure manifest builders: a resolved WavePipelineSpec in, Kubernetes objects (dicts) out.

No I/O here; handlers.py applies what these functions return. Every child carries an owner
reference to its pipeline and the labels below, and has a deterministic name:

| object                     | name                     | per      |
| -------------------------- | ------------------------ | -------- |
| ConfigMap (resolved spec)  | {p}-spec-{hash}          | spec     |
| ConfigMap (pool)           | {p}-pool                 | pipeline |
| StatefulSet (stages)       | {p}-r{i}                 | replica  |
| Service (headless)         | {p}-r{i}                 | replica  |
| Deployment + Service       | {p}-r{i}-admission       | replica  |
| Deployment + Service       | {p}-gateway              | pipeline |
| HorizontalPodAutoscaler    | {p}                      | pipeline |

Stage pods are ``{p}-r{i}-{rank}``: the StatefulSet ordinal is the stage rank. The spec
ConfigMap's name carries the spec hash, so replicas on the old and the new spec coexist during a
rolling update (each mounts its own) and a ConfigMap never changes under a running pod.

The contract with the runtime's processes (``wavepp stage|admission|gateway``) is all in
:func:`container_args` and :func:`_probes`: flags, ports, and the HTTP endpoints the kubelet polls.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

import kopf

from wavepp.api.spec import API_GROUP, API_VERSION, KIND, WavePipelineSpec

LABEL_PIPELINE = "wavepp.dev/pipeline"
LABEL_REPLICA = "wavepp.dev/replica"
LABEL_COMPONENT = "wavepp.dev/component"
LABEL_SPEC_HASH = "wavepp.dev/spec-hash"
ANNOTATION_SPEC_HASH = "wavepp.dev/spec-hash"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller (k8s >= 1.28)

CONFIG_DIR = "/etc/wavepp"
SPEC_FILE = f"{CONFIG_DIR}/spec.json"
POOL_DIR = "/etc/wavepp-pool"
POOL_FILE = f"{POOL_DIR}/pool.json"
NATS_CREDS_DIR = "/etc/wavepp-nats"
NATS_TLS_DIR = "/etc/wavepp-nats-tls"
HTTP_PORT = 8080  # admission and gateway API
HEALTH_PORT = 8081  # stage: /startupz /readyz /healthz
RENDEZVOUS_PORT = 29500  # torch.distributed init (tcp://{rank-0 pod}:29500)

Component = Literal["stage", "admission", "gateway"]

# Spec fields that do not change what a replica's processes run: editing them never rolls.
_NOT_HASHED = ("replicas", "autoscaling", "restartBudget", "rollout")


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
    """Hash of what a replica runs: the resolved spec without replicas/autoscaling/budget/rollout.

    Returns:
        10 lowercase hex characters of sha256 over canonical JSON (sorted keys).
    """
    wire = {k: v for k, v in spec.to_wire().items() if k not in _NOT_HASHED}
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
        LABEL_PIPELINE: pipeline,
        LABEL_COMPONENT: component,
    }


def stage_selector(pipeline: str) -> str:
    """Label selector of all stage pods of a pipeline (``status.selector``, used by the HPA)."""
    return f"{LABEL_PIPELINE}={pipeline},{LABEL_COMPONENT}=stage"


def owner_reference(ref: PipelineRef) -> dict[str, Any]:
    """The controller owner reference to the pipeline (garbage collection), built by kopf.

    NOTE: kopf's ``build_owner_reference`` is the reference part of ``kopf.adopt``; adopt itself
    would also copy the pipeline's labels onto every child, which the children do not carry.
    """
    owner = {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": ref.name, "uid": ref.uid},
    }
    return dict(kopf.build_owner_reference(owner, controller=True, block_owner_deletion=True))


def _metadata(
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


# ---- container contract -------------------------------------------------------------------


def container_args(
    component: Component, spec: WavePipelineSpec, ref: PipelineRef, replica: int | None = None
) -> list[str]:
    """Arguments of ``wavepp <component>``: the one place that knows the runtime's flags.

    Args:
        component: stage, admission or gateway.
        spec: the resolved spec (NATS URL filled in).
        ref: the owning pipeline.
        replica: the pipeline replica (stage and admission only).

    Returns:
        ``args`` for a container whose ``command`` is ``["wavepp"]``. The stage's rank comes
        from ``$(WAVEPP_RANK)``, which Kubernetes expands from the env var set by the
        downward API (the pod's StatefulSet ordinal).

    Raises:
        ValueError: replica missing for stage/admission.
    """
    args = [component, "--config", SPEC_FILE, "--nats-url", str(spec.nats.url)]
    if spec.nats.credentials_secret:
        args += ["--nats-creds", f"{NATS_CREDS_DIR}/creds"]
    if spec.nats.tls_secret:
        args += ["--nats-tls-ca", f"{NATS_TLS_DIR}/ca.crt"]
        if spec.nats.tls_client_cert:
            args += [
                "--nats-tls-cert",
                f"{NATS_TLS_DIR}/tls.crt",
                "--nats-tls-key",
                f"{NATS_TLS_DIR}/tls.key",
            ]
    if component in ("stage", "admission"):
        if replica is None:
            raise ValueError(f"container_args({component!r}): replica is required")
        args += ["--replica", str(replica)]
    if component == "stage":
        sts = statefulset_name(ref.name, replica or 0)
        args += [
            "--rank",
            "$(WAVEPP_RANK)",
            "--dist-url",
            f"tcp://{sts}-0.{sts}:{RENDEZVOUS_PORT}",
            "--health-port",
            str(HEALTH_PORT),
        ]
    elif component == "admission":
        args += ["--port", str(HTTP_PORT)]
    else:
        args += ["--pool", POOL_FILE, "--port", str(HTTP_PORT)]
    return args


def _env(component: Component, spec: WavePipelineSpec, ref: PipelineRef) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "WAVEPP_PIPELINE", "value": ref.name},
        {"name": "HOME", "value": "/tmp"},  # non-root user, read-only root filesystem
        {
            "name": "WAVEPP_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "OTEL_SERVICE_NAME", "value": f"wavepp-{component}"},
        {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": str(spec.telemetry.sampling_ratio)},
        {"name": "WAVEPP_METRICS_PORT", "value": str(spec.telemetry.metrics_port)},
    ]
    if spec.telemetry.otlp_endpoint:
        env.append({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": spec.telemetry.otlp_endpoint})
    if component == "stage":
        env.insert(
            0,
            {
                "name": "WAVEPP_RANK",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}},
            },
        )
    return env


def _probes(component: Component) -> dict[str, Any]:
    """Kubelet probes; they define the stage phases the operator reports.

    stage: /startupz answers 200 once the torch.distributed group has formed (phase formed),
    /readyz once weights are loaded and warmed up (phase warm), /healthz while alive.
    admission and gateway: /readyz when ready to take requests, /healthz while alive.
    """
    port = HEALTH_PORT if component == "stage" else HTTP_PORT

    def get(path: str, period_s: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": port},
            "periodSeconds": period_s,
            "failureThreshold": failures,
        }

    probes = {
        "readinessProbe": get("/readyz", 5, 3),
        "livenessProbe": get("/healthz", 10, 6),
    }
    if component == "stage":
        # Loading weights and forming the group may take long: up to 30 min before liveness.
        probes["startupProbe"] = get("/startupz", 5, 360)
    return probes


def _container(
    component: Component,
    spec: WavePipelineSpec,
    ref: PipelineRef,
    replica: int | None,
    ports: list[dict[str, Any]],
    resources: dict[str, Any],
    mounts: list[dict[str, Any]],
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": component,
        "image": spec.image,
        "command": ["wavepp"],
        "args": container_args(component, spec, ref, replica),
        "env": _env(component, spec, ref),
        "ports": ports
        + [{"name": "metrics", "containerPort": spec.telemetry.metrics_port, "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
        **_probes(component),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def _config_volumes(
    spec: WavePipelineSpec, ref: PipelineRef, hash_: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": spec_configmap_name(ref.name, hash_)}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    # The root filesystem is read-only: Python, torch and the tracer write only under /tmp.
    volumes.append({"name": "tmp", "emptyDir": {}})
    mounts.append({"name": "tmp", "mountPath": "/tmp"})
    if spec.nats.credentials_secret:
        volumes.append(
            {"name": "nats-creds", "secret": {"secretName": spec.nats.credentials_secret}}
        )
        mounts.append({"name": "nats-creds", "mountPath": NATS_CREDS_DIR, "readOnly": True})
    if spec.nats.tls_secret:
        volumes.append({"name": "nats-tls", "secret": {"secretName": spec.nats.tls_secret}})
        mounts.append({"name": "nats-tls", "mountPath": NATS_TLS_DIR, "readOnly": True})
    return volumes, mounts


# Every pipeline pod runs as a non-root user with a read-only root filesystem and no
# capabilities (the chart's operator Deployment does the same).
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "fsGroup": 65532,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def _pod_spec_common(spec: WavePipelineSpec) -> dict[str, Any]:
    pod: dict[str, Any] = {"securityContext": dict(POD_SECURITY_CONTEXT)}
    if spec.service_account_name:
        pod["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    return pod


# ---- children -----------------------------------------------------------------------------


def build_spec_configmap(ref: PipelineRef, spec: WavePipelineSpec, hash_: str) -> dict[str, Any]:
    """Immutable ConfigMap with ``spec.json``: the resolved spec that every process reads."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(
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
        "metadata": _metadata(ref, pool_configmap_name(ref.name), "pool"),
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
        "metadata": _metadata(ref, name, "stage", replica=replica),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {
                LABEL_PIPELINE: ref.name,
                LABEL_REPLICA: str(replica),
                LABEL_COMPONENT: "stage",
            },
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}
            ],
        },
    }


def _stage_resources(spec: WavePipelineSpec) -> dict[str, Any]:
    amounts: dict[str, Any] = {}
    if spec.resources.cpu:
        amounts["cpu"] = spec.resources.cpu
    if spec.resources.memory:
        amounts["memory"] = spec.resources.memory
    if spec.gpus_per_stage() > 0:
        amounts[spec.resources.gpu_resource_name] = str(spec.gpus_per_stage())
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _topology_spread(spec: WavePipelineSpec, ref: PipelineRef) -> list[dict[str, Any]]:
    """The spec's constraints; one without labelSelector counts this pipeline's stage pods."""
    constraints = []
    for constraint in spec.topology_spread_constraints:
        c = dict(constraint)
        c.setdefault(
            "labelSelector",
            {"matchLabels": {LABEL_PIPELINE: ref.name, LABEL_COMPONENT: "stage"}},
        )
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
    selector = {LABEL_PIPELINE: ref.name, LABEL_REPLICA: str(replica), LABEL_COMPONENT: "stage"}
    volumes, mounts = _config_volumes(spec, ref, hash_)
    volumes.append(
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shared_memory}}
    )
    mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    if spec.model.pvc is not None:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": spec.model.pvc.claim_name, "readOnly": True},
            }
        )
        mount: dict[str, Any] = {
            "name": "model",
            "mountPath": spec.model.pvc.mount_path,
            "readOnly": True,
        }
        if spec.model.pvc.sub_path:
            mount["subPath"] = spec.model.pvc.sub_path
        mounts.append(mount)
    ports = [
        {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
        {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
    ]
    pod_spec: dict[str, Any] = _pod_spec_common(spec) | {
        "containers": [
            _container("stage", spec, ref, replica, ports, _stage_resources(spec), mounts)
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
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    if spec.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = _topology_spread(spec, ref)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(
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
                    "labels": base_labels(ref.name, "stage")
                    | {LABEL_REPLICA: str(replica), LABEL_SPEC_HASH: hash_},
                    "annotations": {ANNOTATION_SPEC_HASH: hash_},
                },
                "spec": pod_spec,
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
    selector = {LABEL_PIPELINE: ref.name, LABEL_REPLICA: str(replica), LABEL_COMPONENT: "admission"}
    volumes, mounts = _config_volumes(spec, ref, hash_)
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    pod_spec = _pod_spec_common(spec) | {
        "containers": [_container("admission", spec, ref, replica, ports, {}, mounts)],
        "volumes": volumes,
        "terminationGracePeriodSeconds": math.ceil(spec.rollout.drain_timeout_s),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(
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
    selector = {LABEL_PIPELINE: ref.name, LABEL_COMPONENT: component}
    if replica is not None:
        selector[LABEL_REPLICA] = str(replica)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ref, name, component, replica=replica),
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http"}],
        },
    }


def build_admission_service(ref: PipelineRef, replica: int) -> dict[str, Any]:
    """ClusterIP Service of one replica's admission controller."""
    return _http_service(ref, admission_name(ref.name, replica), "admission", replica)


def build_gateway_deployment(ref: PipelineRef, spec: WavePipelineSpec, hash_: str) -> dict:
    """The gateway (prefill API, tenants): routes to the admitting replicas of ``pool.json``."""
    volumes, mounts = _config_volumes(spec, ref, hash_)
    volumes.append({"name": "pool", "configMap": {"name": pool_configmap_name(ref.name)}})
    mounts.append({"name": "pool", "mountPath": POOL_DIR, "readOnly": True})
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(
            ref, gateway_name(ref.name), "gateway", annotations={ANNOTATION_SPEC_HASH: hash_}
        ),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {LABEL_PIPELINE: ref.name, LABEL_COMPONENT: "gateway"}},
            "template": {
                "metadata": {
                    "labels": base_labels(ref.name, "gateway") | {LABEL_SPEC_HASH: hash_},
                },
                "spec": _pod_spec_common(spec)
                | {
                    "containers": [_container("gateway", spec, ref, None, ports, {}, mounts)],
                    "volumes": volumes,
                },
            },
        },
    }


def build_gateway_service(ref: PipelineRef) -> dict[str, Any]:
    """ClusterIP Service of the gateway: the pipeline's prefill endpoint."""
    return _http_service(ref, gateway_name(ref.name), "gateway", None)


def _milli(value: float) -> str:
    """A Kubernetes quantity for ``value`` (0.8 -> "800m")."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def build_hpa(ref: PipelineRef, spec: WavePipelineSpec) -> dict[str, Any] | None:
    """autoscaling/v2 HPA on the pipeline's scale subresource, or None without autoscaling.

    cpu: Resource metric, ``target`` = average utilisation in percent of the stage pods' CPU
    request. wave_fill / queue_depth: Pods metrics ``wavepp_wave_fill`` / ``wavepp_queue_depth``
    averaged over the pods of ``status.selector`` (needs a custom metrics adapter).
    """
    auto = spec.autoscaling
    if auto is None:
        return None
    if auto.metric == "cpu":
        metric = {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": math.ceil(auto.target)},
            },
        }
    else:
        metric = {
            "type": "Pods",
            "pods": {
                "metric": {"name": f"wavepp_{auto.metric}"},
                "target": {"type": "AverageValue", "averageValue": _milli(auto.target)},
            },
        }
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(ref, ref.name, "autoscaler"),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "name": ref.name,
            },
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [metric],
        },
    }
