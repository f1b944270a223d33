"""Pure reconciliation of one WavePipeline: (object, observed children, clock) -> (actions, status).

handlers.py lists the children, calls :func:`plan`, executes the actions in order and writes the
status. Nothing here does I/O, so every rule below is unit-tested without a cluster.

Each replica i is one StatefulSet ``{p}-r{i}`` (S stage pods) plus one admission Deployment.
The operator's memory of a replica lives in annotations on its StatefulSet, next to the thing it
describes (they survive operator restarts and vanish with the replica):

| annotation               | value                                  | meaning                        |
| ------------------------ | -------------------------------------- | ------------------------------ |
| wavepp.dev/spec-hash     | 10 hex                                 | spec the replica runs          |
| wavepp.dev/drain         | {"reason": r, "since": epoch s}        | admission scaled to 0 (leaving)|
| wavepp.dev/restarts      | [epoch s, ...]                         | re-formations (budget window)  |
| wavepp.dev/degraded      | message                                | stopped by the restart budget  |

Replica lifecycle::

    create --> Forming --(all stages warm, admission ready)--> Serving
    Serving --(stage pod failed)--> drain(failure) + delete stage pods --> Forming
    Forming/Serving --(failures > budget in window)--> Degraded (0 pods) --(spec change)--> new
    Serving, outdated --(no other replica in transition)--> drain(rollout)
        --(admission pod gone, or drain timeout)--> replaced on the new spec --> Forming
    beyond spec.replicas --> drain(scale-down) --(drained)--> deleted

A replica leaves the pool by scaling its admission controller to 0: the pod gets SIGTERM, stops
admitting, lets admitted requests finish (terminationGracePeriodSeconds = drain timeout) and
exits; the replica is replaced only once that pod is gone (or the timeout plus a grace of
:data:`DRAIN_GRACE_S` passed, for a pod stuck on a lost node).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from wavepp.api.spec import (
    ReplicaStatus,
    SpecIssue,
    StageStatus,
    WavePipelineSpec,
    check_spec,
)
from wavepp.operator import builders as b

ANNOTATION_DRAIN = "wavepp.dev/drain"
ANNOTATION_RESTARTS = "wavepp.dev/restarts"
ANNOTATION_DEGRADED = "wavepp.dev/degraded"
ANNOTATION_WAVE_FILL = "wavepp.dev/wave-fill"  # written on its pod by the admission controller
DRAIN_GRACE_S = 30.0

DrainReason = Literal["rollout", "failure", "scale-down"]


# ---- actions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Apply:
    """Server-side apply of ``manifest`` (created when absent; fields the operator owns follow it)."""

    manifest: dict[str, Any]


@dataclass(frozen=True)
class Create:
    """Create ``manifest`` if absent; never patch it (immutable objects)."""

    manifest: dict[str, Any]


@dataclass(frozen=True)
class Patch:
    """Merge-patch an existing object."""

    kind: str
    name: str
    patch: dict[str, Any]


@dataclass(frozen=True)
class Delete:
    """Delete an object (background propagation)."""

    kind: str
    name: str


Action = Apply | Create | Patch | Delete


@dataclass
class Observed:
    """Children of one pipeline as listed by label ``wavepp.dev/pipeline``."""

    statefulsets: list[dict[str, Any]] = field(default_factory=list)
    deployments: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)
    configmaps: list[dict[str, Any]] = field(default_factory=list)
    hpas: list[dict[str, Any]] = field(default_factory=list)
    services: list[dict[str, Any]] = field(default_factory=list)

    def index(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(kind, name) -> object, for every listed child (pods excluded)."""
        kinds = (
            ("StatefulSet", self.statefulsets),
            ("Deployment", self.deployments),
            ("ConfigMap", self.configmaps),
            ("HorizontalPodAutoscaler", self.hpas),
            ("Service", self.services),
        )
        return {(kind, _meta(obj).get("name", "")): obj for kind, objs in kinds for obj in objs}


@dataclass(frozen=True)
class Defaults:
    """Operator-wide defaults for what a spec leaves out."""

    image: str | None = None
    nats_url: str | None = None
    otlp_endpoint: str | None = None


@dataclass
class Plan:
    """What to do, the status to write, and when to look again at the latest."""

    actions: list[Action]
    status: dict[str, Any]
    requeue_after_s: float | None = None
    issues: list[SpecIssue] = field(default_factory=list)


# ---- reading pods -------------------------------------------------------------------------


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("metadata") or {}


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return _meta(obj).get("labels") or {}


def _annotations(obj: dict[str, Any]) -> dict[str, str]:
    return _meta(obj).get("annotations") or {}


def _is_terminating(obj: dict[str, Any]) -> bool:
    return bool(_meta(obj).get("deletionTimestamp"))


def _condition(pod: dict[str, Any], type_: str) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == type_ and c.get("status") == "True" for c in conditions)


def pod_failure(pod: dict[str, Any]) -> str | None:
    """Why a stage pod counts as failed, or None.

    Failed: pod phase Failed; a container that restarted (the kubelet restarts a crashed
    container in place, which a torch.distributed group does not survive); a container that
    terminated with a non-zero exit code.
    """
    name = _meta(pod).get("name", "?")
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return f"pod {name} failed ({status.get('reason') or 'phase Failed'})"
    for cs in status.get("containerStatuses") or []:
        restarts = int(cs.get("restartCount") or 0)
        if restarts > 0:
            last = (cs.get("lastState") or {}).get("terminated") or {}
            return (
                f"pod {name}: container {cs.get('name')} restarted {restarts}x "
                f"(last exit code {last.get('exitCode', '?')}, {last.get('reason') or 'no reason'})"
            )
        terminated = (cs.get("state") or {}).get("terminated")
        if terminated and int(terminated.get("exitCode") or 0) != 0:
            return f"pod {name}: container {cs.get('name')} exited {terminated.get('exitCode')}"
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
    index = _labels(pod).get(b.POD_INDEX_LABEL)
    if index is None:
        index = _meta(pod).get("name", "").rsplit("-", 1)[-1]
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

    @property
    def num_stages(self) -> int:
        """Stages of the spec the replica runs."""
        return len(self.ranges)

    def current_pods(self) -> dict[int, dict[str, Any]]:
        """Stage pods created from the replica's current template."""
        return {
            rank: pod
            for rank, pod in self.stage_pods.items()
            if _labels(pod).get(b.LABEL_SPEC_HASH) == self.hash
        }

    def stale_pods(self) -> list[dict[str, Any]]:
        """Live stage pods of another template: they must be restarted (re-form)."""
        return [
            p for p in self.stage_pods.values() if _labels(p).get(b.LABEL_SPEC_HASH) != self.hash
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
            not _is_terminating(p)
            and _labels(p).get(b.LABEL_SPEC_HASH) == self.hash
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

    def drained(self, now: float, drain_timeout_s: float) -> bool:
        """The admission pod is gone (or stuck past timeout + grace): nothing admitted remains."""
        if not self.admission_pods:
            return True
        since = float((self.drain or {}).get("since", now))
        return now - since >= drain_timeout_s + DRAIN_GRACE_S

    def wave_fill(self) -> float | None:
        """Wave fill the admission controller reported on its pod, or None."""
        for pod in self.admission_pods:
            try:
                return float(_annotations(pod)[ANNOTATION_WAVE_FILL])
            except (KeyError, ValueError):
                continue
        return None


def _json_annotation(obj: dict[str, Any] | None, key: str, default: Any) -> Any:
    if obj is None:
        return default
    try:
        return json.loads(_annotations(obj)[key])
    except (KeyError, ValueError):
        return default


def _spec_ranges(configmaps: list[dict[str, Any]]) -> dict[str, list[tuple[int, int]]]:
    """Layer ranges of every spec ConfigMap, by spec hash (what old replicas run)."""
    ranges = {}
    for cm in configmaps:
        hash_ = _labels(cm).get(b.LABEL_SPEC_HASH)
        if not hash_:
            continue
        try:
            spec = WavePipelineSpec.model_validate_json((cm.get("data") or {})["spec.json"])
            ranges[hash_] = spec.stage_layer_ranges()
        except (KeyError, ValueError):
            continue
    return ranges


def _views(
    pipeline: str,
    observed: Observed,
    current_hash: str,
    current_ranges: list[tuple[int, int]],
    window_s: float,
    now: float,
) -> dict[int, ReplicaView]:
    def replica_of(obj: dict[str, Any]) -> int | None:
        try:
            return int(_labels(obj)[b.LABEL_REPLICA])
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
        if index is None or _labels(sts).get(b.LABEL_COMPONENT) != "stage":
            continue
        v = view(index)
        v.sts = sts
        v.hash = _annotations(sts).get(b.ANNOTATION_SPEC_HASH)
        v.drain = _json_annotation(sts, ANNOTATION_DRAIN, None)
        v.restarts = [
            float(t) for t in _json_annotation(sts, ANNOTATION_RESTARTS, []) if now - t < window_s
        ]
        v.degraded = _annotations(sts).get(ANNOTATION_DEGRADED)
        v.ranges = ranges_by_hash.get(v.hash or "", current_ranges)
        if v.hash == current_hash:
            v.ranges = current_ranges
    for dep in observed.deployments:
        index = replica_of(dep)
        if index is not None and _labels(dep).get(b.LABEL_COMPONENT) == "admission":
            view(index).admission = dep
    for pod in observed.pods:
        index = replica_of(pod)
        if index is None:
            continue
        component = _labels(pod).get(b.LABEL_COMPONENT)
        if component == "admission":
            view(index).admission_pods.append(pod)
        elif component == "stage" and not _is_terminating(pod):
            rank = _rank(pod)
            if rank is not None:
                view(index).stage_pods[rank] = pod
    for v in views.values():
        if not v.ranges:
            v.ranges = current_ranges
    return {i: v for i, v in views.items() if v.sts is not None}


# ---- the plan -----------------------------------------------------------------------------


def _iso(now: float) -> str:
    return dt.datetime.fromtimestamp(now, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition_entry(
    type_: str,
    status: bool,
    reason: str,
    message: str,
    previous: list[dict[str, Any]],
    now: float,
    generation: int | None,
) -> dict[str, Any]:
    """A condition; lastTransitionTime is kept from ``previous`` while the status holds."""
    status_text = "True" if status else "False"
    since = _iso(now)
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
    generation = _meta(body).get("generation")
    message = "; ".join(str(i) for i in issues)
    return {
        "observedGeneration": generation,
        "phase": "Invalid",
        "conditions": [
            _condition_entry("Ready", False, "InvalidSpec", message, previous, now, generation),
            _condition_entry(
                "Progressing", False, "InvalidSpec", message, previous, now, generation
            ),
            _condition_entry("Degraded", True, "InvalidSpec", message, previous, now, generation),
        ],
    }


def plan(body: dict[str, Any], observed: Observed, now: float, defaults: Defaults) -> Plan:
    """Decide what to change so the children move one safe step towards the spec.

    Args:
        body: the WavePipeline object (metadata.uid required; status read for condition times).
        observed: its children, listed by label.
        now: wall clock, epoch seconds (drain and restart-window timing).
        defaults: operator defaults for image, NATS URL and OTLP endpoint.

    Returns:
        A :class:`Plan`; for an invalid spec no actions and a status that names the fields.
    """
    spec, issues = check_spec(
        body.get("spec"),
        default_image=defaults.image,
        default_nats_url=defaults.nats_url,
        default_otlp_endpoint=defaults.otlp_endpoint,
    )
    if spec is None:
        return Plan(actions=[], status=invalid_status(body, issues, now), issues=issues)

    ref = b.PipelineRef.from_body(body)
    current_hash = b.spec_hash(spec)
    ranges = spec.stage_layer_ranges()
    budget = spec.restart_budget
    drain_timeout_s = spec.rollout.drain_timeout_s
    views = _views(ref.name, observed, current_hash, ranges, budget.window_s, now)
    desired = set(range(spec.num_replicas))
    actions: list[Action] = []
    requeue: list[float] = []
    notes: dict[int, tuple[str, str]] = {}  # replica -> (reason, message) for its status

    def sts_annotations(index: int, **values: Any) -> Patch:
        """Patch the replica's memory (drain=, restarts=, degraded=; None removes)."""
        keys = {
            "drain": ANNOTATION_DRAIN,
            "restarts": ANNOTATION_RESTARTS,
            "degraded": ANNOTATION_DEGRADED,
        }
        encoded = {
            keys[k]: None if v is None else v if isinstance(v, str) else json.dumps(v)
            for k, v in values.items()
        }
        return Patch(
            "StatefulSet",
            b.statefulset_name(ref.name, index),
            {"metadata": {"annotations": encoded}},
        )

    def admission_replicas(v: ReplicaView, count: int) -> list[Action]:
        if v.admission is None or (v.admission.get("spec") or {}).get("replicas") == count:
            return []
        return [
            Patch("Deployment", b.admission_name(ref.name, v.index), {"spec": {"replicas": count}})
        ]

    def start_drain(v: ReplicaView, reason: DrainReason) -> list[Action]:
        v.drain = {"reason": reason, "since": now}
        requeue.append(drain_timeout_s + DRAIN_GRACE_S)
        return [sts_annotations(v.index, drain=v.drain), *admission_replicas(v, 0)]

    def replica_children(index: int, *, stopped: bool, admission_running: bool) -> list[Action]:
        return [
            Apply(b.build_stage_service(ref, index)),
            Apply(b.build_stage_statefulset(ref, spec, current_hash, index, stopped=stopped)),
            Apply(
                b.build_admission_deployment(
                    ref, spec, current_hash, index, running=admission_running
                )
            ),
            Apply(b.build_admission_service(ref, index)),
        ]

    def delete_pods(pods: list[dict[str, Any]]) -> list[Action]:
        return [Delete("Pod", _meta(p)["name"]) for p in pods]

    def replace(v: ReplicaView) -> list[Action]:
        """Put replica v on the current spec: new template, fresh memory, stages re-formed."""
        out: list[Action] = [sts_annotations(v.index, drain=None, restarts=None, degraded=None)]
        out += replica_children(v.index, stopped=False, admission_running=True)
        out += delete_pods(list(v.stage_pods.values()))
        return out

    # The spec ConfigMap first: every pod created below mounts it.
    if not any(_labels(cm).get(b.LABEL_SPEC_HASH) == current_hash for cm in observed.configmaps):
        actions.append(Create(b.build_spec_configmap(ref, spec, current_hash)))

    # Snapshot of who serves now, before any decision below changes the views.
    serving = {i for i, v in views.items() if v.admitting()}
    outdated_serving: list[int] = []

    for index in sorted(desired | set(views)):
        v = views.get(index)
        if v is None:  # a new replica
            actions += replica_children(index, stopped=False, admission_running=True)
            continue
        if index not in desired:  # scale-down: leave the pool, then go
            if v.drain is None or v.drain.get("reason") != "scale-down":
                actions += start_drain(v, "scale-down")
            elif v.drained(now, drain_timeout_s):
                actions += [
                    Delete("StatefulSet", b.statefulset_name(ref.name, index)),
                    Delete("Service", b.statefulset_name(ref.name, index)),
                    Delete("Deployment", b.admission_name(ref.name, index)),
                    Delete("Service", b.admission_name(ref.name, index)),
                ]
            else:
                actions += admission_replicas(v, 0)
            continue
        if v.hash != current_hash:  # outdated: rolled below, one at a time
            if v.drain is not None and v.drain.get("reason") == "rollout":
                if v.drained(now, drain_timeout_s):
                    actions += replace(v)
                    v.drain = None
                    notes[index] = ("Replaced", f"replaced on spec {current_hash}")
                else:
                    actions += admission_replicas(v, 0)
                    requeue.append(float(v.drain["since"]) + drain_timeout_s + DRAIN_GRACE_S - now)
            elif index not in serving:
                actions += replace(v)  # serves nothing: no drain needed
                notes[index] = ("Replaced", f"replaced on spec {current_hash}")
            else:
                outdated_serving.append(index)
            continue
        # Up to date.
        if v.degraded is not None:
            actions += replica_children(index, stopped=True, admission_running=False)
            actions += delete_pods(list(v.stage_pods.values()))
            continue
        failure = v.failure()
        if failure is not None:
            v.restarts = [*v.restarts, now]
            if len(v.restarts) > budget.max_restarts:
                v.degraded = (
                    f"{len(v.restarts)} re-formations within {budget.window_s:g} s exceed "
                    f"restartBudget.maxRestarts={budget.max_restarts}; last: {failure}"
                )
                actions.append(
                    sts_annotations(index, restarts=v.restarts, degraded=v.degraded, drain=None)
                )
                actions += replica_children(index, stopped=True, admission_running=False)
                actions += delete_pods(list(v.stage_pods.values()))
                v.drain = None
            else:
                v.drain = {"reason": "failure", "since": now}
                actions.append(sts_annotations(index, restarts=v.restarts, drain=v.drain))
                actions += replica_children(index, stopped=False, admission_running=False)
                actions += delete_pods(list(v.stage_pods.values()))
                notes[index] = ("StageFailed", f"re-forming: {failure}")
                requeue.append(drain_timeout_s + DRAIN_GRACE_S)
            continue
        if v.drain is not None:
            if v.drained(now, drain_timeout_s):
                actions.append(sts_annotations(index, drain=None))
                v.drain = None
            else:
                requeue.append(float(v.drain["since"]) + drain_timeout_s + DRAIN_GRACE_S - now)
        actions += replica_children(index, stopped=False, admission_running=v.drain is None)
        actions += delete_pods(v.stale_pods())

    # Rolling update: drain one serving outdated replica at a time, and only while every other
    # desired replica serves (or is stopped by its budget): capacity drops by one at most.
    in_transition = [
        i
        for i in desired
        if i not in serving
        and not (i in views and views[i].degraded is not None and views[i].hash == current_hash)
    ]
    if outdated_serving and not in_transition:
        first = min(outdated_serving)
        actions += start_drain(views[first], "rollout")
        serving.discard(first)
    for index in outdated_serving:
        if index in serving and index != min(outdated_serving):
            notes.setdefault(index, ("WaitingToRoll", "waits for the replicas before it"))

    # Pipeline-wide children.
    pool = [
        b.PoolEntry(
            i,
            views[i].hash if i in views else current_hash,
            i in serving and views[i].drain is None,
        )
        for i in sorted(desired | set(views))
    ]
    actions.append(Apply(b.build_pool_configmap(ref, pool)))
    actions.append(Apply(b.build_gateway_deployment(ref, spec, current_hash)))
    actions.append(Apply(b.build_gateway_service(ref)))
    hpa = b.build_hpa(ref, spec)
    if hpa is not None:
        actions.append(Apply(hpa))
    elif observed.hpas:
        actions.append(Delete("HorizontalPodAutoscaler", ref.name))
    in_use = {current_hash} | {v.hash for v in views.values() if v.hash}
    for cm in observed.configmaps:
        hash_ = _labels(cm).get(b.LABEL_SPEC_HASH)
        if hash_ and hash_ not in in_use:
            actions.append(Delete("ConfigMap", _meta(cm)["name"]))
    # Leftovers of a replica whose StatefulSet is gone (a scale-down interrupted half-way).
    kept = desired | set(views)
    for kind, objs in (("Deployment", observed.deployments), ("Service", observed.services)):
        for obj in objs:
            replica = _labels(obj).get(b.LABEL_REPLICA)
            if replica is not None and replica.isdigit() and int(replica) not in kept:
                actions.append(Delete(kind, _meta(obj)["name"]))

    status = _status(body, spec, views, desired, serving, current_hash, notes, now)
    due = [max(0.5, t) for t in requeue]
    return Plan(actions=actions, status=status, requeue_after_s=min(due) if due else None)


def _status(
    body: dict[str, Any],
    spec: WavePipelineSpec,
    views: dict[int, ReplicaView],
    desired: set[int],
    serving: set[int],
    current_hash: str,
    notes: dict[int, tuple[str, str]],
    now: float,
) -> dict[str, Any]:
    """The observed state, with the drains this plan starts or ends already applied."""
    ref = b.PipelineRef.from_body(body)
    previous = (body.get("status") or {}).get("conditions") or []
    generation = _meta(body).get("generation")
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
                    pod=_meta(pod).get("name") if pod else b.stage_pod_name(ref.name, index, rank),
                    phase=stage_phase(pod, admitting=admitting, stopped=v.degraded is not None),  # type: ignore[arg-type]
                )
            )
        reason, message = notes.get(index, (None, None))
        if v.degraded is not None:
            phase, reason, message = "Degraded", "RestartBudgetExceeded", v.degraded
        elif v.drain is not None:
            phase = "Draining"
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
                wave_fill=v.wave_fill(),
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
        degraded_cond = (
            True,
            "RestartBudgetExceeded",
            "; ".join(f"replica {r.replica}: {r.message}" for r in degraded),
        )
    else:
        degraded_cond = (False, "AsExpected", "no replica is stopped")

    conditions = [
        _condition_entry("Ready", *ready_cond, previous, now, generation),
        _condition_entry("Progressing", *progressing, previous, now, generation),
        _condition_entry("Degraded", *degraded_cond, previous, now, generation),
    ]
    if degraded:
        phase = "Degraded"
    elif ready_cond[0]:
        phase = "Ready"
    elif progressing[0]:
        phase = "Progressing"
    else:
        phase = "Pending"
    fills = [r.wave_fill for r in replicas if r.admitting and r.wave_fill is not None]
    return {
        "observedGeneration": generation,
        "phase": phase,
        "replicas": len(views),
        "readyReplicas": len(ready),
        "updatedReplicas": len(updated),
        "selector": b.stage_selector(ref.name),
        "specHash": current_hash,
        "waveFill": round(sum(fills) / len(fills), 4) if fills else None,
        "stages": [s.model_dump(by_alias=True, exclude_none=True) for s in stages],
        "replicaStatuses": [r.model_dump(by_alias=True, exclude_none=True) for r in replicas],
        "conditions": conditions,
    }
