"""Spec sections of the pods' placement and network: the stage pod-template overlay, the
per-replica topology, the NetworkPolicies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from wavepp.api.spec.base import WireModel


class PodTemplateOverlay(WireModel):
    """Settings laid over the stage pods' template (core/v1 PodSpec and Container fields)."""

    priority_class_name: str | None = Field(None, description="PodSpec.priorityClassName.")
    scheduler_name: str | None = Field(None, description="PodSpec.schedulerName.")
    runtime_class_name: str | None = Field(
        None, description="PodSpec.runtimeClassName (e.g. nvidia)."
    )
    env: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra core/v1 EnvVar entries of the stage container (valueFrom.secretKeyRef).",
    )
    env_from: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra core/v1 EnvFromSource entries of the stage container (secretRef).",
    )


class TopologySpec(WireModel):
    """Where a replica's stages run: together in one domain, replicas apart."""

    replica_domain_key: str | None = Field(
        None,
        min_length=1,
        description=(
            "Node label whose value every stage pod of one replica shares (required pod "
            "affinity), e.g. kubernetes.io/hostname (one host's NVLink) or a rack/clique label."
        ),
    )
    spread_replicas_key: str | None = Field(
        None,
        min_length=1,
        description=(
            "Node label by which replicas spread: a stage pod prefers domains without other "
            "replicas' stage pods (preferred pod anti-affinity)."
        ),
    )
    pod_group: bool = Field(
        False,
        description=(
            "One PodGroup (scheduling.x-k8s.io/v1alpha1, the scheduler-plugins coscheduling "
            "plugin) per replica with minMember = stages: a replica's stages are scheduled all "
            "or none. Needs that scheduler (podTemplate.schedulerName)."
        ),
    )


DEFAULT_SCRAPE_FROM: tuple[dict[str, Any], ...] = (
    {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    },
)
"""``networkPolicy.scrapeFrom``'s default: the Prometheus Operator's Prometheus pods (their
``app.kubernetes.io/name`` label), whatever their namespace."""


class NetworkPolicySpec(WireModel):
    """NetworkPolicies the operator creates for the pipeline's pods (ingress only)."""

    enabled: bool = Field(
        True,
        description=(
            "Stage pods take traffic only from the replica's stage pods (activations, "
            "rendezvous) and on the health and metrics ports; admission pods only from the "
            "pipeline's gateway (and Prometheus on the metrics port); the gateway only from "
            "gatewayFrom; decode pods only from the gateway and scrapeFrom."
        ),
    )
    gateway_from: list[dict[str, Any]] = Field(
        default_factory=list,
        description=(
            "core/v1 NetworkPolicyPeer list allowed to reach the gateway's HTTP port; empty: "
            "every pod of the pipeline's namespace."
        ),
    )
    scrape_from: list[dict[str, Any]] = Field(
        default_factory=lambda: [dict(peer) for peer in DEFAULT_SCRAPE_FROM],
        description=(
            "core/v1 NetworkPolicyPeer list allowed to reach a rendered decode pod's vLLM "
            "port, where vLLM serves /metrics next to its API (Prometheus, for the decode "
            "autoscaler's series); default: pods labelled app.kubernetes.io/name=prometheus "
            "(the Prometheus Operator's) in any namespace; empty: none."
        ),
    )


class InferencePoolSpec(WireModel):
    """An InferencePool (Gateway API Inference Extension, API group inference.networking.k8s.io,
    version v1) over the pipeline's gateway pods, so that an HTTPRoute can send traffic to WavePP
    through a cluster's inference gateway. Off by default; the endpoint picker (EPP) is the
    cluster's."""

    enabled: bool = Field(False, description="Render the InferencePool {name} (needs its CRD).")
    endpoint_picker: str | None = Field(
        None,
        min_length=1,
        description="Service name of the endpoint picker (EPP) extension; required when enabled.",
    )
    endpoint_picker_port: int = Field(9002, ge=1, le=65535, description="The EPP's gRPC port.")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose", description="What the gateway does when the EPP does not answer."
    )
