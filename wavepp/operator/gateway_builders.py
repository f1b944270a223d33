"""Manifest builders of the gateway's Deployment and PodDisruptionBudget (pure; re-exported by
``builders``): the pipeline's prefill API, run as ``GATEWAY_REPLICAS`` pods so that an eviction,
a node drain or a rollout never leaves the pipeline's Service without a ready gateway.
"""

from __future__ import annotations

from typing import Any

from wavepp.api.spec import WavePipelineSpec
from wavepp.operator import natscreds
from wavepp.operator.containers import (
    HTTP_PORT,
    POOL_DIR,
    api_key_volumes,
    config_volumes,
    pod_container,
    pod_spec_common,
)
from wavepp.operator.naming import (
    ANNOTATION_SPEC_HASH,
    LABEL_SPEC_HASH,
    PipelineRef,
    base_labels,
    child_metadata,
    gateway_name,
    pod_selector,
    pool_configmap_name,
)

GATEWAY_REPLICAS = 2
"""Gateway pods per pipeline: one is ready while at least one replica admits (its /readyz), so
with two a node drain, an eviction or a rollout never leaves the pipeline's Service empty."""


def build_gateway_deployment(ref: PipelineRef, spec: WavePipelineSpec, hash_: str) -> dict:
    """The gateway (prefill API, tenants): routes to the admitting replicas of ``pool.json``.

    ``GATEWAY_REPLICAS`` pods (they share nothing but NATS: each waits for its own requests'
    results), preferably on different nodes; a rollout starts the new pod before it stops an old
    one (maxUnavailable 0), and :func:`build_gateway_pdb` keeps one through voluntary evictions.
    """
    volumes, mounts = config_volumes(spec, ref, hash_, "gateway")
    volumes.append({"name": "pool", "configMap": {"name": pool_configmap_name(ref.name)}})
    mounts.append({"name": "pool", "mountPath": POOL_DIR, "readOnly": True})
    key_volumes, key_mounts = api_key_volumes(spec)
    volumes += key_volumes
    mounts += key_mounts
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(
            ref, gateway_name(ref.name), "gateway", annotations={ANNOTATION_SPEC_HASH: hash_}
        ),
        "spec": {
            "replicas": GATEWAY_REPLICAS,
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "selector": {"matchLabels": pod_selector(ref.name, "gateway")},
            "template": {
                "metadata": {
                    "labels": base_labels(ref.name, "gateway") | {LABEL_SPEC_HASH: hash_},
                    **natscreds.gateway_template_annotations(ref, spec),
                },
                "spec": pod_spec_common(spec)
                | {
                    "containers": [pod_container("gateway", spec, ref, None, ports, {}, mounts)],
                    "volumes": volumes,
                    # it holds the tenants' keys and needs no Kubernetes API: no token
                    "automountServiceAccountToken": False,
                    "affinity": {
                        "podAntiAffinity": {
                            "preferredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "weight": 100,
                                    "podAffinityTerm": {
                                        "topologyKey": "kubernetes.io/hostname",
                                        "labelSelector": {
                                            "matchLabels": pod_selector(ref.name, "gateway")
                                        },
                                    },
                                }
                            ]
                        }
                    },
                },
            },
        },
    }


def build_gateway_pdb(ref: PipelineRef) -> dict[str, Any]:
    """PodDisruptionBudget ``{p}-gateway``: a voluntary eviction (a node drain) leaves at least
    one gateway pod (minAvailable 1 of ``GATEWAY_REPLICAS``); an unready one may always go."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(ref, gateway_name(ref.name), "gateway"),
        "spec": {
            "minAvailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": pod_selector(ref.name, "gateway")},
        },
    }
