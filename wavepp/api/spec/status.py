"""The WavePipeline status models: observed state, written by the operator only."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from wavepp.api.spec.base import WireModel

CONFIG_EXIT_CODE = 78
"""Exit code of a pipeline process (``wavepp stage|admission|gateway``) that refuses its
configuration (sysexits' EX_CONFIG); its last log lines, the container's termination message,
name the field. The operator stops the replica and reports the message under reason
``InvalidRuntimeConfig`` instead of re-forming it."""

StagePhase = Literal["pending", "scheduled", "formed", "warm", "serving", "failed", "stopped"]
ReplicaPhase = Literal["Pending", "Forming", "Serving", "Draining", "Degraded"]


class StageStatus(WireModel):
    """One stage of one replica.

    Phases, in order: pending (no pod, or not scheduled) -> scheduled (on a node, group not
    formed) -> formed (startup probe passed: torch.distributed group formed) -> warm (readiness
    probe passed: weights loaded, warmed up) -> serving (warm, and the replica admits requests).
    failed: the pod failed or its container restarted; stopped: the replica is stopped by its
    restart budget.
    """

    replica: int = Field(ge=0)
    rank: int = Field(ge=0)
    first_layer: int = Field(ge=0, description="First layer held (inclusive).")
    last_layer: int = Field(ge=1, description="Last layer held (exclusive).")
    pod: str | None = None
    phase: StagePhase


class ReplicaStatus(WireModel):
    """One pipeline replica (one StatefulSet, one admission controller)."""

    replica: int = Field(ge=0)
    phase: ReplicaPhase
    spec_hash: str | None = Field(None, description="Spec hash the replica runs.")
    admitting: bool = Field(False, description="In the pool: the gateway sends it requests.")
    num_restarts: int = Field(0, ge=0, description="Re-formations within the budget window.")
    reason: str | None = None
    message: str | None = None


class Condition(WireModel):
    """A standard Kubernetes condition (metav1.Condition fields)."""

    # DecodeReady: only with spec.decode (see wavepp.operator.status.decode_condition).
    type: Literal["Ready", "Progressing", "Degraded", "DecodeReady"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class WavePipelineStatus(WireModel):
    """Observed state, written by the operator only."""

    model_config = ConfigDict(extra="allow")

    observed_generation: int | None = None
    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "Invalid"] | None = None
    replicas: int = Field(0, ge=0, description="Replicas that exist (scale subresource).")
    ready_replicas: int = Field(0, ge=0, description="Replicas whose every stage serves.")
    updated_replicas: int = Field(0, ge=0, description="Replicas running the current spec.")
    selector: str | None = Field(None, description="Label selector of the stage pods (HPA).")
    spec_hash: str | None = None
    stages: list[StageStatus] = Field(default_factory=list)
    replica_statuses: list[ReplicaStatus] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list)
