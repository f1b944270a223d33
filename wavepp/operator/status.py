"""The WavePipeline's status: phase, per-replica and per-stage states, conditions.

Pure: the planner (``reconcile.plan``) hands over what it observed and decided; the status says
it, with the drains that plan starts or ends already applied. A condition keeps its
``lastTransitionTime`` while its status holds.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from wavepp.api.spec import ReplicaStatus, SpecIssue, StageStatus, WavePipelineSpec
from wavepp.operator.naming import PipelineRef, stage_pod_name, stage_selector
from wavepp.operator.observe import CONFIG_ERROR, ReplicaView, meta_of, stage_phase


def iso_time(now: float) -> str:
    return dt.datetime.fromtimestamp(now, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition_entry(
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    previous: list[dict[str, Any]],
    now: float,
    generation: int | None,
) -> dict[str, Any]:
    """A condition (``status`` None: Unknown); lastTransitionTime is kept from ``previous``
    while the status holds."""
    status_text = "Unknown" if status is None else "True" if status else "False"
    since = iso_time(now)
    for old in previous:
        if old.get("type") == type_ and old.get("status") == status_text:
            since = old.get("lastTransitionTime") or since
    entry = {
        "type": type_,
        "status": status_text,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }
    if generation is not None:
        entry["observedGeneration"] = generation
    return entry


def invalid_status(body: dict[str, Any], issues: list[SpecIssue], now: float) -> dict[str, Any]:
    """Status for a spec the operator cannot run: conditions name the fields; children kept."""
    previous = (body.get("status") or {}).get("conditions") or []
    generation = meta_of(body).get("generation")
    message = "; ".join(str(i) for i in issues)
    return {
        "observedGeneration": generation,
        "phase": "Invalid",
        "conditions": [
            condition_entry("Ready", False, "InvalidSpec", message, previous, now, generation),
            condition_entry(
                "Progressing", False, "InvalidSpec", message, previous, now, generation
            ),
            condition_entry("Degraded", True, "InvalidSpec", message, previous, now, generation),
        ],
    }


def pipeline_status(
    body: dict[str, Any],
    spec: WavePipelineSpec,
    views: dict[int, ReplicaView],
    desired: set[int],
    serving: set[int],
    current_hash: str,
    notes: dict[int, tuple[str, str]],
    now: float,
    *,
    gateway_ready: bool,
    gateway_error: str | None = None,
    decode_pods: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The observed state, with the drains this plan starts or ends already applied.

    With ``spec.decode`` a ``DecodeReady`` condition (:func:`decode_condition`; ``decode_pods``
    = the rendered decode pool's (Ready, desired) pods, None when its Deployment is not
    observed)
    says whether whole completions can decode; Ready stays the prefill side's (a pipeline
    without a ready decode pod still serves ``max_tokens`` 1).

    Ready needs every desired replica serving (each stage's pod Ready: its compute loop alive)
    and a Ready gateway pod; a replica stopped by a config error is Degraded with reason
    ``InvalidRuntimeConfig`` and the process's message (it names the field); so is the
    pipeline when its gateway exited with a config error (``gateway_error``).
    """
    ref = PipelineRef.from_body(body)
    previous = (body.get("status") or {}).get("conditions") or []
    generation = meta_of(body).get("generation")
    stages: list[StageStatus] = []
    replicas: list[ReplicaStatus] = []
    for index in sorted(desired | set(views)):
        v = views.get(index)
        if v is None:
            ranges = spec.stage_layer_ranges()
            for rank, (first, last) in enumerate(ranges):
                stages.append(
                    StageStatus(
                        replica=index,
                        rank=rank,
                        first_layer=first,
                        last_layer=last,
                        phase="pending",
                    )
                )
            replicas.append(
                ReplicaStatus(
                    replica=index, phase="Pending", spec_hash=current_hash, reason="Creating"
                )
            )
            continue
        admitting = index in serving and v.drain is None
        pods = v.current_pods()
        for rank, (first, last) in enumerate(v.ranges):
            pod = pods.get(rank)
            stages.append(
                StageStatus(
                    replica=index,
                    rank=rank,
                    first_layer=first,
                    last_layer=last,
                    pod=meta_of(pod).get("name") if pod else stage_pod_name(ref.name, index, rank),
                    phase=stage_phase(pod, admitting=admitting, stopped=v.degraded is not None),  # type: ignore[arg-type]
                )
            )
        reason, message = notes.get(index, (None, None))
        if v.degraded is not None and v.degraded.startswith(CONFIG_ERROR):
            phase, reason, message = "Degraded", "InvalidRuntimeConfig", v.degraded
        elif v.degraded is not None:
            phase, reason, message = "Degraded", "RestartBudgetExceeded", v.degraded
        elif v.drain is not None:
            phase = "Draining"
            message = message or v.drain.get("message")
            reason = (
                reason
                or {
                    "rollout": "RollingUpdate",
                    "failure": "StageFailed",
                    "scale-down": "ScalingDown",
                }[v.drain.get("reason", "rollout")]
            )
        elif admitting:
            phase = "Serving"
        elif not pods:
            phase = "Pending"
        else:
            phase = "Forming"
        replicas.append(
            ReplicaStatus(
                replica=index,
                phase=phase,  # type: ignore[arg-type]
                spec_hash=v.hash,
                admitting=admitting,
                num_restarts=len(v.restarts),
                reason=reason,
                message=message,
            )
        )

    num_desired = spec.num_replicas
    ready = sorted(i for i in desired if i in serving and views[i].drain is None)
    updated = [i for i, v in views.items() if v.hash == current_hash]
    outdated = [i for i in desired if i in views and views[i].hash != current_hash]
    leaving = [i for i in views if i not in desired]
    degraded = [r for r in replicas if r.phase == "Degraded"]
    reforming = [i for i, v in views.items() if v.drain and v.drain.get("reason") == "failure"]
    not_serving = [i for i in sorted(desired) if i not in ready]

    def describe(index: int) -> str:
        phases = [s for s in stages if s.replica == index and s.phase not in ("serving", "warm")]
        detail = ", ".join(f"stage {s.rank} {s.phase}" for s in phases) or "admission not ready"
        return f"replica {index}: {detail}"

    if num_desired == 0:
        ready_cond = (False, "ScaledToZero", "spec.replicas is 0")
    elif not not_serving and not gateway_ready:
        ready_cond = (
            False,
            "GatewayNotReady",
            f"{len(ready)}/{num_desired} replicas serve, but no gateway pod is Ready",
        )
    elif not not_serving:
        ready_cond = (True, "AllReplicasServing", f"{len(ready)}/{num_desired} replicas serve")
    else:
        ready_cond = (
            False,
            "ReplicasNotServing",
            f"{len(ready)}/{num_desired} replicas serve; "
            + "; ".join(describe(i) for i in not_serving),
        )
    if outdated:
        progressing = (
            True,
            "RollingUpdate",
            f"{num_desired - len(outdated)}/{num_desired} replicas on spec {current_hash}",
        )
    elif leaving:
        progressing = (True, "ScalingDown", f"replicas {leaving} leave the pool")
    elif reforming:
        progressing = (True, "Reforming", f"replicas {reforming} re-form after a stage failure")
    elif any(i not in ready and not any(r.replica == i for r in degraded) for i in desired):
        progressing = (True, "Forming", f"{len(ready)}/{num_desired} replicas serve")
    else:
        progressing = (False, "Complete", f"{len(ready)}/{num_desired} replicas serve")
    if degraded:
        reasons = {r.reason for r in degraded}
        degraded_cond = (
            True,
            "InvalidRuntimeConfig"
            if "InvalidRuntimeConfig" in reasons
            else "RestartBudgetExceeded",
            "; ".join(f"replica {r.replica}: {r.message}" for r in degraded),
        )
    else:
        degraded_cond = (False, "AsExpected", "no replica is stopped")
    if gateway_error is not None:
        degraded_cond = (True, "InvalidRuntimeConfig", f"gateway: {gateway_error}")

    conditions = [
        condition_entry("Ready", *ready_cond, previous, now, generation),
        condition_entry("Progressing", *progressing, previous, now, generation),
        condition_entry("Degraded", *degraded_cond, previous, now, generation),
    ]
    decode = decode_condition(spec, decode_pods)
    if decode is not None:
        conditions.append(condition_entry("DecodeReady", *decode, previous, now, generation))
    if degraded or gateway_error is not None:
        phase = "Degraded"
    elif ready_cond[0]:
        phase = "Ready"
    elif progressing[0]:
        phase = "Progressing"
    else:
        phase = "Pending"
    return {
        "observedGeneration": generation,
        "phase": phase,
        "replicas": len(views),
        "readyReplicas": len(ready),
        "updatedReplicas": len(updated),
        "selector": stage_selector(ref.name),
        "specHash": current_hash,
        "stages": [s.model_dump(by_alias=True, exclude_none=True) for s in stages],
        "replicaStatuses": [r.model_dump(by_alias=True, exclude_none=True) for r in replicas],
        "conditions": conditions,
    }


def decode_condition(
    spec: WavePipelineSpec, decode_pods: tuple[int, int] | None
) -> tuple[bool | None, str, str] | None:
    """``DecodeReady`` (status, reason, message); None without ``spec.decode``.

    A rendered pool: True (``DecodePodsReady``) while at least one of its pods is Ready (vLLM's
    ``/health`` answers), else False (``NoDecodePodReady``, ``DecodeScaledToZero`` at 0 pods,
    ``DecodeNotCreated`` before its Deployment is observed). A referenced Service: Unknown
    (``ExternalService``): the operator does not watch pods it did not create.
    """
    if spec.decode is None:
        return None
    if spec.decode.service is not None:
        name = spec.decode.service.name
        return None, "ExternalService", f"decode.service {name}: its pods are not watched"
    assert spec.decode.pool is not None, "DecodeSpec holds a service or a pool"
    if decode_pods is None:
        return False, "DecodeNotCreated", "the decode Deployment is not observed yet"
    ready, desired = decode_pods
    if spec.decode.pool.fixed_replicas == 0:
        return False, "DecodeScaledToZero", "decode.pool.replicas is 0"
    message = f"{ready}/{desired} decode pods Ready"
    return (True, "DecodePodsReady", message) if ready > 0 else (False, "NoDecodePodReady", message)


def apply_failed_status(
    body: dict[str, Any], status: dict[str, Any], refused: str, now: float
) -> dict[str, Any]:
    """``status`` with the API server's refusal of a child in its conditions: Degraded True
    and Progressing False, reason ``ApplyFailed``, the message naming the object and the server's
    words (a 422 names the invalid field). Ready keeps what the observed children say."""
    previous = (body.get("status") or {}).get("conditions") or []
    generation = meta_of(body).get("generation")
    conditions = [
        c
        for c in status.get("conditions") or []
        if c.get("type") not in ("Degraded", "Progressing")
    ]
    message = f"the API server refused {refused}"
    conditions += [
        condition_entry("Progressing", False, "ApplyFailed", message, previous, now, generation),
        condition_entry("Degraded", True, "ApplyFailed", message, previous, now, generation),
    ]
    return {**status, "phase": "Degraded", "conditions": conditions}
