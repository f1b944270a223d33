"""Manifest builders of the decode pool (pure; re-exported by ``builders``): the Deployment
``{p}-decode`` of vLLM decode pods, its Service and, with ``decode.pool.autoscaling``, its
HorizontalPodAutoscaler, rendered for ``spec.decode.pool``.

Each decode pod runs the command line of ``wavepp.api.vllm_decode`` (the one ``wavepp up
--decode vllm`` runs): vLLM's OpenAI server on ``0.0.0.0:DECODE_PORT`` with WavePP's connector
as ``kv_consumer``, on the pipeline's checkpoint (``model.path``, the model's PVC mounted
read-only), in the stages' dtype. It holds no WavePP secret: a handoff's token is minted by the
stages and travels in each decode request's ``kv_transfer_params``. The gateway reaches the
pods through the Service (``wavepp.api.spec.decode_urls``); the NetworkPolicies
(``builders.build_network_policies``) let only the gateway reach them and only them reach the
stages' KV transfer port.

Scale-down drains: a decode pod being removed first leaves the Service's endpoints (it is
terminating) while its preStop hook waits :data:`DECODE_DEREGISTER_S` and it keeps serving, so
that every node's Service proxy stops sending it new connections (the gateway opens one
connection per decode request, so none is pinned to it); then SIGTERM makes vLLM stop taking
requests and finish those it holds for up to ``decode.pool.drainSeconds``
(``--shutdown-timeout``); ``terminationGracePeriodSeconds`` covers both plus
:data:`DECODE_TEARDOWN_S`.
"""

from __future__ import annotations

from typing import Any

from wavepp.api.spec import DECODE_METRICS, DECODE_PORT, WavePipelineSpec, decode_service_name
from wavepp.api.vllm_decode import (
    CPU_KV_CACHE_ENV,
    CPU_KV_CACHE_GIB,
    vllm_decode_args,
    vllm_tracing,
)
from wavepp.operator.containers import CONTAINER_SECURITY_CONTEXT, pod_spec_common
from wavepp.operator.naming import (
    PipelineRef,
    base_labels,
    child_metadata,
    pod_selector,
)

DECODE_STARTUP_S = 1800
"""Seconds a decode pod may take to load the checkpoint before its startup probe fails."""

_PROBE_PERIOD_S = 10

DECODE_DEREGISTER_S = 15
"""Seconds a terminating decode pod keeps serving before SIGTERM (its preStop hook): the time
for its removal from the Service's endpoints to reach every node's proxy (an assumption, not
measured here: Service proxies apply EndpointSlice changes within seconds)."""

DECODE_TEARDOWN_S = 30
"""Seconds the grace period leaves after the drain for vLLM to stop its engine and exit."""

DECODE_METRIC_NAMES: dict[str, str] = {
    metric: vllm_name.replace(":", "_") for metric, vllm_name in DECODE_METRICS.items()
}
"""``decode.pool.autoscaling.metric`` -> the Pods metric the HPA asks for: vLLM's gauge with
``:`` as ``_`` (the chart's prometheus-adapter rule serves it under that name)."""


def decode_pod_selector(ref: PipelineRef, spec: WavePipelineSpec) -> dict[str, Any] | None:
    """The matchLabels of the pipeline's decode pods: the rendered pool's, or the referenced
    Service's ``podSelector``; None without a decode section (or a reference without one)."""
    decode = spec.decode
    if decode is None:
        return None
    if decode.pool is not None:
        return pod_selector(ref.name, "decode")
    assert decode.service is not None, "DecodeSpec holds a service or a pool"
    return dict(decode.service.pod_selector) or None


def decode_command(spec: WavePipelineSpec) -> list[str]:
    """A decode pod's command: the pool's ``python`` + ``vllm_decode_args`` + ``args``.

    The model directory is ``model.path`` (the resolved spec fills it from the PVC), the dtype
    the stages' (``model.dtype``; the resolved spec fills it), CPU settings when the pool asks
    for no GPU, ``--shutdown-timeout`` = ``drainSeconds`` (on SIGTERM vLLM finishes the
    requests it holds for that long instead of aborting them), and with ``telemetry.otlpEndpoint``
    the options that export vLLM's request spans there (``vllm_decode.vllm_tracing``: the
    gateway's ``traceparent`` then joins them to the request's trace; the image needs the
    OpenTelemetry SDK). The checkpoint is taken to hold its tokenizer
    (``--skip-tokenizer-init`` in ``args`` otherwise).

    Raises:
        ValueError: no decode pool, or no model directory (an unresolved spec).
    """
    pool = spec.decode.pool if spec.decode is not None else None
    if pool is None:
        raise ValueError("decode_command: the spec has no decode.pool")
    if not spec.model.path:
        raise ValueError("decode_command: model.path is unset (resolve the spec first)")
    on_cpu = pool.resources.gpus == 0
    dtype = spec.model.dtype or ("float32" if spec.gpus_per_stage() == 0 else "bfloat16")
    return [
        pool.python,
        *vllm_decode_args(
            model_dir=spec.model.path,
            model_name=spec.model.name,
            host="0.0.0.0",
            port=DECODE_PORT,
            dtype=dtype,
            max_model_len=pool.max_model_len,
            on_cpu=on_cpu,
            has_tokenizer=True,
        ),
        "--shutdown-timeout",
        str(pool.drain_seconds),
        *_tracing(spec)[0],
        *pool.args,
    ]


def _tracing(spec: WavePipelineSpec) -> tuple[list[str], dict[str, str]]:
    return vllm_tracing(spec.telemetry.exporter(), spec.telemetry.otlp_endpoint or "")


def _resources(spec: WavePipelineSpec) -> dict[str, Any]:
    assert spec.decode is not None and spec.decode.pool is not None
    res = spec.decode.pool.resources
    amounts: dict[str, Any] = {}
    if res.cpu:
        amounts["cpu"] = res.cpu
    if res.memory:
        amounts["memory"] = res.memory
    if res.gpus > 0:
        amounts[res.gpu_resource_name] = str(res.gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _volumes(spec: WavePipelineSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    assert spec.decode is not None and spec.decode.pool is not None
    shm = spec.decode.pool.resources.shared_memory
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    pvc = spec.model.pvc
    if pvc is not None:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True},
            }
        )
        mount: dict[str, Any] = {"name": "model", "mountPath": pvc.mount_path, "readOnly": True}
        if pvc.sub_path:
            mount["subPath"] = pvc.sub_path
        mounts.append(mount)
    return volumes, mounts


def build_decode_deployment(ref: PipelineRef, spec: WavePipelineSpec) -> dict[str, Any] | None:
    """The Deployment ``{p}-decode`` of ``decode.pool.replicas`` vLLM decode pods (None
    without a pool). Restricted pod security as every pipeline pod (non-root, read-only root
    filesystem: vLLM writes only under /tmp, its ``HOME``); probes on vLLM's ``/health``, the
    startup probe allowing :data:`DECODE_STARTUP_S`; the drain of the module docstring
    (preStop, grace period). With ``autoscaling`` the manifest sets no ``replicas``: the HPA
    owns the count, and the operator's server-side apply leaves it alone."""
    pool = spec.decode.pool if spec.decode is not None else None
    if pool is None:
        return None
    name = decode_service_name(ref.name)
    volumes, mounts = _volumes(spec)
    env = [{"name": "HOME", "value": "/tmp"}]
    if pool.resources.gpus == 0:
        env.append({"name": CPU_KV_CACHE_ENV, "value": CPU_KV_CACHE_GIB})
    env += [{"name": k, "value": v} for k, v in sorted(_tracing(spec)[1].items())]

    def health(period_s: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": period_s,
            "failureThreshold": failures,
        }

    container: dict[str, Any] = {
        "name": "decode",
        "image": pool.image,
        "command": decode_command(spec),
        "env": env,
        "ports": [{"name": "http", "containerPort": DECODE_PORT, "protocol": "TCP"}],
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "startupProbe": health(_PROBE_PERIOD_S, DECODE_STARTUP_S // _PROBE_PERIOD_S),
        "readinessProbe": health(5, 3),
        "livenessProbe": health(10, 6),
        # keep serving until the endpoint removal reached every proxy, then SIGTERM (drain)
        "lifecycle": {
            "preStop": {
                "exec": {
                    "command": [
                        pool.python,
                        "-c",
                        f"import time; time.sleep({DECODE_DEREGISTER_S})",
                    ]
                }
            }
        },
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod: dict[str, Any] = pod_spec_common(spec) | {
        "containers": [container],
        "volumes": volumes,
        "automountServiceAccountToken": False,  # it needs no Kubernetes API
        "terminationGracePeriodSeconds": DECODE_DEREGISTER_S
        + pool.drain_seconds
        + DECODE_TEARDOWN_S,
    }
    pod.pop("serviceAccountName", None)  # spec.serviceAccountName is the stages' and admission's
    if pool.node_selector:
        pod["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in pool.tolerations
        ]
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": pod_selector(ref.name, "decode")},
        "template": {"metadata": {"labels": base_labels(ref.name, "decode")}, "spec": pod},
    }
    if pool.fixed_replicas is not None:
        deployment_spec = {"replicas": pool.fixed_replicas} | deployment_spec
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(ref, name, "decode"),
        "spec": deployment_spec,
    }


def build_decode_service(ref: PipelineRef, spec: WavePipelineSpec) -> dict[str, Any] | None:
    """The ClusterIP Service ``{p}-decode`` on :data:`DECODE_PORT` over the pool's pods (None
    without a pool): the gateway's decode endpoint."""
    if spec.decode is None or spec.decode.pool is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(ref, decode_service_name(ref.name), "decode"),
        "spec": {
            "selector": pod_selector(ref.name, "decode"),
            "ports": [{"name": "http", "port": DECODE_PORT, "targetPort": "http"}],
        },
    }


def _quantity(value: float) -> str:
    """``value`` as a Kubernetes quantity in plain decimal (no exponent), to milli-units."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def build_decode_hpa(ref: PipelineRef, spec: WavePipelineSpec) -> dict[str, Any] | None:
    """autoscaling/v2 HPA ``{p}-decode`` on the decode Deployment, or None without
    ``decode.pool.autoscaling``.

    A Pods metric (:data:`DECODE_METRIC_NAMES`: each decode pod's vLLM gauge, which the chart's
    prometheus-adapter rule serves per pod), ``target`` = its average over the pool's pods
    (the HPA's desired count is ceil(pods x average / target)); stabilisation windows as
    ``behavior``. Scale-down removes pods the way the module docstring says (they drain).
    """
    pool = spec.decode.pool if spec.decode is not None else None
    if pool is None or pool.autoscaling is None:
        return None
    auto = pool.autoscaling
    name = decode_service_name(ref.name)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(ref, name, "autoscaler"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": DECODE_METRIC_NAMES[auto.metric]},
                        "target": {"type": "AverageValue", "averageValue": _quantity(auto.target)},
                    },
                }
            ],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": auto.scale_up_window_s},
                "scaleDown": {"stabilizationWindowSeconds": auto.scale_down_window_s},
            },
        },
    }
