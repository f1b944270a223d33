"""The container contract with the runtime's processes (``wavepp stage|admission|gateway``).

All of it is here: :func:`container_args` (flags, from ``wavepp.api.cli_args``), :func:`_probes` (ports and the HTTP endpoints
the kubelet polls), the environment, the config volumes and the security contexts every pipeline
pod runs with. The per-kind builders (``builders.py``) put these containers into objects.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from wavepp.api.cli_args import NatsArgs, admission_args, gateway_args, stage_args
from wavepp.api.pod import (
    API_KEYS_DIR,
    API_KEYS_ENTRY,
    DRAIN_EXIT_MARGIN_S,
    HANDOFF_PORT,
    POD_IP_ENV,
)
from wavepp.api.spec import CONFIG_EXIT_CODE, WavePipelineSpec
from wavepp.operator.naming import (
    POD_INDEX_LABEL,
    PipelineRef,
    spec_configmap_name,
    statefulset_name,
)
from wavepp.operator.natscreds import (
    BUS_KEY_FILE,
    NATS_CREDS_DIR,
    creds_path,
    creds_volume,
    uses_rendered_creds,
)

CONFIG_DIR = "/etc/wavepp"
SPEC_FILE = f"{CONFIG_DIR}/spec.json"
POOL_DIR = "/etc/wavepp-pool"
POOL_FILE = f"{POOL_DIR}/pool.json"
NATS_TLS_DIR = "/etc/wavepp-nats-tls"
HTTP_PORT = 8080  # admission and gateway API
HEALTH_PORT = 8081  # stage: /startupz /readyz /healthz
RENDEZVOUS_PORT = 29500  # torch.distributed init (tcp://{rank-0 pod}:29500)

Component = Literal["stage", "admission", "gateway"]


# ---- container contract -------------------------------------------------------------------


def container_args(
    component: Component, spec: WavePipelineSpec, ref: PipelineRef, replica: int | None = None
) -> list[str]:
    """Arguments of ``wavepp <component>`` in a pod, from the runtime's one builder of each
    process's arguments (``wavepp.api.cli_args``, which the local supervisor uses too).

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
    creds = None
    if spec.nats.credentials_secret:
        rendered = uses_rendered_creds(spec, ref)
        creds = creds_path(component) if rendered else f"{NATS_CREDS_DIR}/creds"
    mutual = bool(spec.nats.tls_secret and spec.nats.tls_client_cert)
    nats = NatsArgs(
        str(spec.nats.url),
        creds=creds,
        tls_ca=f"{NATS_TLS_DIR}/ca.crt" if spec.nats.tls_secret else None,
        tls_cert=f"{NATS_TLS_DIR}/tls.crt" if mutual else None,
        tls_key=f"{NATS_TLS_DIR}/tls.key" if mutual else None,
    )
    if component == "gateway":
        return gateway_args(nats, config=SPEC_FILE, pool_file=POOL_FILE, port=HTTP_PORT)
    if replica is None:
        raise ValueError(f"container_args({component!r}): replica is required")
    if component == "admission":
        drain_s = max(0.0, spec.rollout.drain_timeout_s - DRAIN_EXIT_MARGIN_S)
        return admission_args(
            nats, config=SPEC_FILE, replica=replica, health_port=HTTP_PORT, drain_s=drain_s
        )
    sts = statefulset_name(ref.name, replica)
    return stage_args(
        nats,
        config=SPEC_FILE,
        replica=replica,
        rank="$(WAVEPP_RANK)",
        dist_url=f"tcp://{sts}-0.{sts}:{RENDEZVOUS_PORT}",
        health_port=HEALTH_PORT,
        metrics_port=spec.telemetry.metrics_port,
    )


def _env(component: Component, spec: WavePipelineSpec, ref: PipelineRef) -> list[dict[str, Any]]:
    """The container's environment (``WAVEPP_BUS_KEY_FILE`` when the operator renders the
    pipeline's credentials Secret, which holds its bus key)."""
    env: list[dict[str, Any]] = [
        {"name": "WAVEPP_PIPELINE", "value": ref.name},
        # A configuration error exits CONFIG_EXIT_CODE (not the CLI's 2): read as "refused its
        # config" (Degraded/InvalidRuntimeConfig), not restarted (wavepp.cmd.common).
        {"name": "WAVEPP_CONFIG_EXIT_CODE", "value": str(CONFIG_EXIT_CODE)},
        {"name": "HOME", "value": "/tmp"},  # non-root user, read-only root filesystem
        # Read by every process: part of each NATS subject, stream and bucket name.
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
    if spec.nats.credentials_secret and uses_rendered_creds(spec, ref):
        env.append({"name": "WAVEPP_BUS_KEY_FILE", "value": BUS_KEY_FILE})
    if spec.decode is not None and component != "gateway":
        # A replica's processes read it with a decode section: the stage's KV transfer
        # address (wavepp.launch.replica.pod_handoff).
        env.append({"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    if component == "stage":
        env += list(spec.pod_template.env)
        env.insert(
            0,
            {
                "name": "WAVEPP_RANK",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}},
            },
        )
    return env


STARTUP_PERIOD_S = 5


def _probes(component: Component, spec: WavePipelineSpec) -> dict[str, Any]:
    """Kubelet probes; they define the stage phases the operator reports.

    stage: /startupz answers 200 once the torch.distributed group has formed (phase formed),
    /readyz once weights are loaded and warmed up (phase warm), /healthz while its compute
    thread is alive. admission and gateway: /readyz when ready to take requests, /healthz while
    alive. The stage's startup probe allows ``restartBudget.formingTimeoutSeconds``.
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
        # Loading weights and forming the group may take long: formingTimeoutSeconds.
        failures = math.ceil(spec.restart_budget.forming_timeout_s / STARTUP_PERIOD_S)
        probes["startupProbe"] = get("/startupz", STARTUP_PERIOD_S, failures)
    return probes


def pod_container(
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
        "ports": ports + handoff_ports(component, spec) + metrics_ports(component, spec),
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
        # A config error (exit CONFIG_EXIT_CODE) names the field in its last log lines: they
        # become the termination message the operator reports.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **_probes(component, spec),
    }
    if component == "stage" and spec.pod_template.env_from:
        container["envFrom"] = list(spec.pod_template.env_from)
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def handoff_ports(component: Component, spec: WavePipelineSpec) -> list[dict[str, Any]]:
    """The ``handoff`` port (KV transfers to decode pods), declared on the stage only and only
    with a ``decode`` section (then its stage listens there: ``launch.replica.pod_handoff``)."""
    if component != "stage" or spec.decode is None:
        return []
    return [{"name": "handoff", "containerPort": HANDOFF_PORT, "protocol": "TCP"}]


def metrics_ports(component: Component, spec: WavePipelineSpec) -> list[dict[str, Any]]:
    """The ``metrics`` port, declared only where a process listens on it: the admission
    controller and each stage (``--metrics-port``, ``wavepp.runtime.stage.metrics``) serve
    Prometheus on ``telemetry.metricsPort``; the gateway serves its metrics on its HTTP port
    (``GET /metrics``)."""
    if component == "gateway":
        return []
    return [{"name": "metrics", "containerPort": spec.telemetry.metrics_port, "protocol": "TCP"}]


def config_volumes(
    spec: WavePipelineSpec,
    ref: PipelineRef,
    hash_: str,
    component: Component | None = None,
    replica: int | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A pipeline pod's volumes and mounts: the spec ConfigMap, /tmp, the NATS credentials
    and TLS Secrets, and the model's PVC (read-only; stage, admission and gateway pods all
    read the checkpoint)."""
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": spec_configmap_name(ref.name, hash_)}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    # The root filesystem is read-only: Python, torch and the tracer write only under /tmp.
    volumes.append({"name": "tmp", "emptyDir": {}})
    mounts.append({"name": "tmp", "mountPath": "/tmp"})
    if spec.nats.credentials_secret and component and uses_rendered_creds(spec, ref):
        volumes.append(creds_volume(component, ref, spec, replica))  # only its own users
        mounts.append({"name": "nats-creds", "mountPath": NATS_CREDS_DIR, "readOnly": True})
    elif spec.nats.credentials_secret:
        volumes.append(
            {"name": "nats-creds", "secret": {"secretName": spec.nats.credentials_secret}}
        )
        mounts.append({"name": "nats-creds", "mountPath": NATS_CREDS_DIR, "readOnly": True})
    if spec.nats.tls_secret:
        volumes.append({"name": "nats-tls", "secret": {"secretName": spec.nats.tls_secret}})
        mounts.append({"name": "nats-tls", "mountPath": NATS_TLS_DIR, "readOnly": True})
    if spec.model.pvc is not None:
        # NOTE: every pod that builds its config from the spec reads the checkpoint's
        # config.json (shape, split by cost); the gateway reads its tokenizer.json too.
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
    return volumes, mounts


def api_key_volumes(spec: WavePipelineSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The gateway's volumes and mounts of the tenants' ``apiKeySecret``s.

    Each Secret is mounted whole (no ``subPath``: the kubelet then updates the files when the
    Secret changes, and the gateway re-reads them), read-only, only its ``keys`` entry, mode 0440 (group: the pod's fsGroup).
    No other pod mounts them.
    """
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for tenant in spec.tenants:
        if not tenant.api_key_secret:
            continue
        name = f"api-keys-{tenant.name}"[:63].rstrip("-")
        volumes.append(
            {
                "name": name,
                "secret": {
                    "secretName": tenant.api_key_secret,
                    "items": [{"key": API_KEYS_ENTRY, "path": API_KEYS_ENTRY}],
                    "defaultMode": 0o440,  # owner root, group fsGroup (the pod's user)
                },
            }
        )
        mounts.append(
            {"name": name, "mountPath": f"{API_KEYS_DIR}/{tenant.name}", "readOnly": True}
        )
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


def pod_spec_common(spec: WavePipelineSpec) -> dict[str, Any]:
    pod: dict[str, Any] = {"securityContext": dict(POD_SECURITY_CONTEXT)}
    if spec.service_account_name:
        pod["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    return pod
