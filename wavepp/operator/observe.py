"""Reading what a WavePipeline's children say: pods, stage phases, one view per replica.

Pure: objects (dicts, as listed by label ``wavepp.dev/pipeline``) in, facts out. The operator's
memory of a replica lives in annotations on its StatefulSet (table in ``reconcile.py``); a
:class:`ReplicaView` reads them beside the replica's pods and admission Deployment.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from wavepp.api.spec import CONFIG_EXIT_CODE, WavePipelineSpec
from wavepp.operator.naming import (
    ANNOTATION_SPEC_HASH,
    LABEL_COMPONENT,
    LABEL_REPLICA,
    LABEL_SPEC_HASH,
    POD_INDEX_LABEL,
)

ANNOTATION_DRAIN = "wavepp.dev/drain"
ANNOTATION_RESTARTS = "wavepp.dev/restarts"
ANNOTATION_DEGRADED = "wavepp.dev/degraded"
ANNOTATION_MEMBERS = "wavepp.dev/members"
ANNOTATION_FORMING = "wavepp.dev/forming-since"
DRAIN_GRACE_S = 30.0
CONFIG_ERROR = "config error: "  # prefix of a degraded message: a process refused its config

DrainReason = Literal["rollout", "failure", "scale-down"]


@dataclass
class Observed:
    """Children of one pipeline as listed by label ``wavepp.dev/pipeline``."""

    statefulsets: list[dict[str, Any]] = field(default_factory=list)
    deployments: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)
    configmaps: list[dict[str, Any]] = field(default_factory=list)
    hpas: list[dict[str, Any]] = field(default_factory=list)
    services: list[dict[str, Any]] = field(default_factory=list)
    pdbs: list[dict[str, Any]] = field(default_factory=list)
    network_policies: list[dict[str, Any]] = field(default_factory=list)
    pod_groups: list[dict[str, Any]] = field(default_factory=list)
    inference_pools: list[dict[str, Any]] = field(default_factory=list)

    def index(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(kind, name) -> object, for every listed child (pods excluded)."""
        return {
            (kind, meta_of(obj).get("name", "")): obj
            for kind, attr in LISTED_KINDS.items()
            if kind != "Pod"
            for obj in getattr(self, attr)
        }


LISTED_KINDS: dict[str, str] = {
    "StatefulSet": "statefulsets",
    "Deployment": "deployments",
    "Service": "services",
    "ConfigMap": "configmaps",
    "HorizontalPodAutoscaler": "hpas",
    "PodDisruptionBudget": "pdbs",
    "NetworkPolicy": "network_policies",
    "Pod": "pods",
    "PodGroup": "pod_groups",
    "InferencePool": "inference_pools",
}
"""Every kind of child the operator lists -> the :class:`Observed` field that holds them."""


# ---- reading pods -------------------------------------------------------------------------


def meta_of(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("metadata") or {}


def labels_of(obj: dict[str, Any]) -> dict[str, str]:
    return meta_of(obj).get("labels") or {}


def annotations_of(obj: dict[str, Any]) -> dict[str, str]:
    return meta_of(obj).get("annotations") or {}


def is_terminating(obj: dict[str, Any]) -> bool:
    return bool(meta_of(obj).get("deletionTimestamp"))


def _condition(pod: dict[str, Any], type_: str) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == type_ and c.get("status") == "True" for c in conditions)


def pod_failure(pod: dict[str, Any]) -> str | None:
    """Why a stage pod counts as failed, or None.

    Failed: pod phase Failed; a container that restarted and is not running again (crash
    loop back-off, or terminated); a container that terminated with a non-zero exit code. A
    container the kubelet restarted that runs again is no failure: the stage rejoins its
    replica's group in place (``wavepp.runtime.stage.rendezvous``), the other pods stay.
    """
    name = meta_of(pod).get("name", "?")
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return f"pod {name} failed ({status.get('reason') or 'phase Failed'})"
    for cs in status.get("containerStatuses") or []:
        restarts = int(cs.get("restartCount") or 0)
        if restarts > 0 and "running" not in (cs.get("state") or {}):
            last = (cs.get("lastState") or {}).get("terminated") or {}
            return (
                f"pod {name}: container {cs.get('name')} restarted {restarts}x "
                f"(last exit code {last.get('exitCode', '?')}, {last.get('reason') or 'no reason'})"
            )
        terminated = (cs.get("state") or {}).get("terminated")
        if terminated and int(terminated.get("exitCode") or 0) != 0:
            return f"pod {name}: container {cs.get('name')} exited {terminated.get('exitCode')}"
    return None


def gateway_pod_ready(pod: dict[str, Any]) -> bool:
    """A live gateway (or decode) pod whose readiness probe passes."""
    return not is_terminating(pod) and _condition(pod, "Ready") and not pod_failure(pod)


def pod_config_error(pod: dict[str, Any]) -> str | None:
    """The termination message of a container that exited ``CONFIG_EXIT_CODE`` (it refused its
    configuration; the message names the field), now or last time, else None."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (cs.get("state") or {}, cs.get("lastState") or {}):
            terminated = state.get("terminated") or {}
            if int(terminated.get("exitCode") or 0) == CONFIG_EXIT_CODE:
                message = " ".join(str(terminated.get("message") or "").split())
                name = meta_of(pod).get("name", "?")
                return f"pod {name}: {message or f'exit code {CONFIG_EXIT_CODE}'}"[-1000:]
    return None


def _condition_entry(pod: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def _epoch(timestamp: str | None) -> float | None:
    if not timestamp:
        return None
    try:
        return dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def pod_disruption(pod: dict[str, Any], now: float, not_ready_s: float) -> str | None:
    """Why a formed stage pod counts as lost although it has not failed, or None.

    Lost: the pod is marked for disruption (condition ``DisruptionTarget``: eviction,
    preemption, a node taint), or it passed its startup probe and has been NotReady for
    ``not_ready_s`` or longer (its compute loop died, or its node went NotReady: the node
    controller turns its pods' Ready condition False).
    """
    name = meta_of(pod).get("name", "?")
    target = _condition_entry(pod, "DisruptionTarget")
    if target is not None and target.get("status") == "True":
        return f"pod {name} is being disrupted ({target.get('reason') or 'DisruptionTarget'})"
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    ready = _condition_entry(pod, "Ready")
    if not statuses or not all(cs.get("started") for cs in statuses) or ready is None:
        return None
    since = _epoch(ready.get("lastTransitionTime"))
    if ready.get("status") != "True" and since is not None and now - since >= not_ready_s:
        detail = ready.get("reason") or ready.get("message") or "readiness probe failing"
        return f"pod {name} NotReady for {now - since:.0f} s >= {not_ready_s:g} s ({detail})"
    return None


def stage_phase(pod: dict[str, Any] | None, *, admitting: bool, stopped: bool) -> str:
    """The phase of one stage from its pod (see :class:`wavepp.api.spec.StageStatus`)."""
    if stopped:
        return "stopped"
    if pod is None:
        return "pending"
    if pod_failure(pod):
        return "failed"
    if _condition(pod, "Ready"):
        return "serving" if admitting else "warm"
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if statuses and all(cs.get("started") for cs in statuses):
        return "formed"
    if _condition(pod, "PodScheduled") or (pod.get("spec") or {}).get("nodeName"):
        return "scheduled"
    return "pending"


def _rank(pod: dict[str, Any]) -> int | None:
    index = labels_of(pod).get(POD_INDEX_LABEL)
    if index is None:
        index = meta_of(pod).get("name", "").rsplit("-", 1)[-1]
    try:
        return int(index)
    except ValueError:
        return None


# ---- one replica --------------------------------------------------------------------------


@dataclass
class ReplicaView:
    """Everything observed about replica ``index``, and what it means."""

    index: int
    sts: dict[str, Any] | None
    admission: dict[str, Any] | None
    stage_pods: dict[int, dict[str, Any]]  # rank -> live (not terminating) pod
    admission_pods: list[dict[str, Any]]  # all, terminating included
    hash: str | None
    drain: dict[str, Any] | None
    restarts: list[float]
    degraded: str | None
    ranges: list[tuple[int, int]]
    members: dict[int, str] | None = None  # rank -> pod uid of the formed group
    forming_since: float | None = None  # epoch s the replica started (re-)forming

    @property
    def num_stages(self) -> int:
        """Stages of the spec the replica runs."""
        return len(self.ranges)

    def current_pods(self) -> dict[int, dict[str, Any]]:
        """Stage pods created from the replica's current template."""
        return {
            rank: pod
            for rank, pod in self.stage_pods.items()
            if labels_of(pod).get(LABEL_SPEC_HASH) == self.hash
        }

    def stale_pods(self) -> list[dict[str, Any]]:
        """Live stage pods of another template: they must be restarted (re-form)."""
        return [
            p for p in self.stage_pods.values() if labels_of(p).get(LABEL_SPEC_HASH) != self.hash
        ]

    def stages_warm(self) -> bool:
        """Every rank has a pod of the current template that is Ready and not failed."""
        pods = self.current_pods()
        return self.num_stages > 0 and all(
            rank in pods and _condition(pods[rank], "Ready") and not pod_failure(pods[rank])
            for rank in range(self.num_stages)
        )

    def admission_ready(self) -> bool:
        """A live admission pod of the current template is Ready."""
        return any(
            not is_terminating(p)
            and labels_of(p).get(LABEL_SPEC_HASH) == self.hash
            and _condition(p, "Ready")
            for p in self.admission_pods
        )

    def admitting(self) -> bool:
        """In the pool: every stage warm, admission ready, not leaving, not stopped."""
        return (
            self.sts is not None
            and self.degraded is None
            and self.drain is None
            and self.stages_warm()
            and self.admission_ready()
        )

    def failure(self) -> str | None:
        """Why the first failed stage pod (lowest rank) failed, or None."""
        for rank in sorted(self.current_pods()):
            reason = pod_failure(self.current_pods()[rank])
            if reason:
                return reason
        return None

    def config_error(self) -> str | None:
        """A process of the replica (stage or admission) refused its configuration."""
        pods = [*self.current_pods().values(), *self.admission_pods]
        for pod in pods:
            if labels_of(pod).get(LABEL_SPEC_HASH) == self.hash:
                message = pod_config_error(pod)
                if message:
                    return message
        return None

    def current_members(self) -> dict[int, str] | None:
        """rank -> uid of the current pods once every rank has one, else None."""
        pods = self.current_pods()
        uids = {rank: meta_of(pods[rank]).get("uid") for rank in pods}
        if set(uids) != set(range(self.num_stages)) or not all(uids.values()):
            return None
        return {rank: str(uid) for rank, uid in uids.items()}

    def lost(self, now: float, not_ready_s: float, forming_timeout_s: float) -> str | None:
        """Why the replica's group is broken although no pod failed, or None: a member pod
        gone or recreated (another uid: evicted, preempted, its node lost), disrupted or
        NotReady past ``not_ready_s``, or the replica not formed within ``forming_timeout_s``."""
        pods = self.current_pods()
        for rank, uid in sorted((self.members or {}).items()):
            pod = pods.get(rank)
            name = f"{meta_of(self.sts or {}).get('name', '?')}-{rank}"
            if pod is None:
                return f"stage {rank}: pod {name} (uid {uid}) is gone"
            new_uid = meta_of(pod).get("uid")
            if new_uid and new_uid != uid:
                return f"stage {rank}: pod {name} was recreated (uid {uid} -> {new_uid})"
        for rank in sorted(pods):
            reason = pod_disruption(pods[rank], now, not_ready_s)
            if reason:
                return f"stage {rank}: {reason}"
        if (
            self.forming_since is not None
            and not self.stages_warm()
            and now - self.forming_since >= forming_timeout_s
        ):
            return (
                f"not formed within restartBudget.formingTimeoutSeconds={forming_timeout_s:g} s "
                f"(forming for {now - self.forming_since:.0f} s)"
            )
        return None

    def drained(self, now: float, drain_timeout_s: float) -> bool:
        """The admission pod is gone (or stuck past timeout + grace): nothing admitted remains."""
        if not self.admission_pods:
            return True
        since = float((self.drain or {}).get("since", now))
        return now - since >= drain_timeout_s + DRAIN_GRACE_S


def json_annotation(obj: dict[str, Any] | None, key: str, default: Any) -> Any:
    if obj is None:
        return default
    try:
        return json.loads(annotations_of(obj)[key])
    except (KeyError, ValueError):
        return default


def _spec_ranges(configmaps: list[dict[str, Any]]) -> dict[str, list[tuple[int, int]]]:
    """Layer ranges of every spec ConfigMap, by spec hash (what old replicas run)."""
    ranges = {}
    for cm in configmaps:
        hash_ = labels_of(cm).get(LABEL_SPEC_HASH)
        if not hash_:
            continue
        try:
            spec = WavePipelineSpec.model_validate_json((cm.get("data") or {})["spec.json"])
            ranges[hash_] = spec.stage_layer_ranges()
        except (KeyError, ValueError):
            continue
    return ranges


def replica_views(
    observed: Observed,
    current_hash: str,
    current_ranges: list[tuple[int, int]],
    window_s: float,
    now: float,
) -> dict[int, ReplicaView]:
    def replica_of(obj: dict[str, Any]) -> int | None:
        try:
            return int(labels_of(obj)[LABEL_REPLICA])
        except (KeyError, ValueError):
            return None

    ranges_by_hash = _spec_ranges(observed.configmaps)
    views: dict[int, ReplicaView] = {}

    def view(index: int) -> ReplicaView:
        if index not in views:
            views[index] = ReplicaView(index, None, None, {}, [], None, None, [], None, [])
        return views[index]

    for sts in observed.statefulsets:
        index = replica_of(sts)
        if index is None or labels_of(sts).get(LABEL_COMPONENT) != "stage":
            continue
        v = view(index)
        v.sts = sts
        v.hash = annotations_of(sts).get(ANNOTATION_SPEC_HASH)
        v.drain = json_annotation(sts, ANNOTATION_DRAIN, None)
        v.restarts = [
            float(t) for t in json_annotation(sts, ANNOTATION_RESTARTS, []) if now - t < window_s
        ]
        v.degraded = annotations_of(sts).get(ANNOTATION_DEGRADED)
        members = json_annotation(sts, ANNOTATION_MEMBERS, None)
        if isinstance(members, dict):
            v.members = {int(rank): str(uid) for rank, uid in members.items()}
        forming = json_annotation(sts, ANNOTATION_FORMING, None)
        v.forming_since = float(forming) if isinstance(forming, int | float) else None
        v.ranges = ranges_by_hash.get(v.hash or "", current_ranges)
        if v.hash == current_hash:
            v.ranges = current_ranges
    for dep in observed.deployments:
        index = replica_of(dep)
        if index is not None and labels_of(dep).get(LABEL_COMPONENT) == "admission":
            view(index).admission = dep
    for pod in observed.pods:
        index = replica_of(pod)
        if index is None:
            continue
        component = labels_of(pod).get(LABEL_COMPONENT)
        if component == "admission":
            view(index).admission_pods.append(pod)
        elif component == "stage" and not is_terminating(pod):
            rank = _rank(pod)
            if rank is not None:
                view(index).stage_pods[rank] = pod
    for v in views.values():
        if not v.ranges:
            v.ranges = current_ranges
    return {i: v for i, v in views.items() if v.sts is not None}
