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
|                          |                                        | or a config error              |
| wavepp.dev/members       | {rank: pod uid}                        | the pods the group formed with |
| wavepp.dev/forming-since | epoch s                                | (re-)forming started           |

Replica lifecycle::

    create --> Forming --(all stages warm, admission ready)--> Serving
    Serving --(stage pod failed)--> drain(failure) + delete stage pods --> Forming
    Forming/Serving --(a member pod gone or recreated with another uid, disrupted, NotReady
        past restartBudget.notReadySeconds; or not formed within formingTimeoutSeconds)
        --> the same as a failed stage pod
    Forming/Serving --(failures > budget in window)--> Degraded (0 pods) --(spec change)--> new
    any --(a pod exits CONFIG_EXIT_CODE: it refused its config)--> Degraded (0 pods,
        reason InvalidRuntimeConfig, the pod's message) --(spec change)--> new
    Serving, outdated --(no other replica in transition)--> drain(rollout)
        --(admission pod gone, or drain timeout)--> replaced on the new spec --> Forming
    beyond spec.replicas --> drain(scale-down) --(drained)--> deleted

A replica leaves the pool by scaling its admission controller to 0: the pod gets SIGTERM, stops
admitting, lets admitted requests finish (terminationGracePeriodSeconds = drain timeout) and
exits; the replica is replaced only once that pod is gone (or the timeout plus a grace of
:data:`DRAIN_GRACE_S` passed, for a pod stuck on a lost node).

Reading the children is ``observe.py``; the status and its conditions are ``status.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from wavepp.api.spec import SpecIssue, WavePipelineSpec, check_spec, decode_service_name
from wavepp.operator import builders as b
from wavepp.operator import natscreds
from wavepp.operator.decode_builders import (
    build_decode_deployment,
    build_decode_hpa,
    build_decode_service,
)
from wavepp.operator.gateway_builders import build_gateway_deployment, build_gateway_pdb
from wavepp.operator.naming import (
    LABEL_COMPONENT,
    LABEL_REPLICA,
    LABEL_SPEC_HASH,
    PipelineRef,
    admission_name,
    spec_hash,
    statefulset_name,
)
from wavepp.operator.observe import (
    ANNOTATION_DEGRADED,
    ANNOTATION_DRAIN,
    ANNOTATION_FORMING,
    ANNOTATION_MEMBERS,
    ANNOTATION_RESTARTS,
    CONFIG_ERROR,
    DRAIN_GRACE_S,
    DrainReason,
    Observed,
    ReplicaView,
    gateway_pod_ready,
    labels_of,
    meta_of,
    pod_config_error,
    replica_views,
)
from wavepp.operator.status import invalid_status, pipeline_status

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


@dataclass(frozen=True)
class Defaults:
    """Operator-wide defaults for what a spec leaves out."""

    image: str | None = None
    nats_url: str | None = None
    otlp_endpoint: str | None = None
    # The NATS account's seed: set, the operator renders each pipeline's component credentials
    # (``natscreds``) unless its spec names a ``nats.credentialsSecret``.
    nats_account_seed: str | None = None


@dataclass
class Plan:
    """What to do, the status to write, and when to look again at the latest."""

    actions: list[Action]
    status: dict[str, Any]
    requeue_after_s: float | None = None
    issues: list[SpecIssue] = field(default_factory=list)


def _apply_only(
    kind: str, rendered: list[dict[str, Any]], listed: list[dict[str, Any]]
) -> list[Action]:
    """Apply every ``rendered`` object of ``kind``, then delete each ``listed`` one of no
    rendered object's name (the spec no longer asks for it)."""
    names = {meta_of(o)["name"] for o in rendered}
    stale = [meta_of(o)["name"] for o in listed if meta_of(o)["name"] not in names]
    return [*(Apply(o) for o in rendered), *(Delete(kind, name) for name in stale)]


def _decode_pods(observed: Observed, name: str) -> tuple[int, int] | None:
    """The rendered decode pool's (Ready pods, desired pods): its pods (component ``decode``)
    whose readiness probe (vLLM's ``/health``) passes, and its Deployment ``name``'s replicas;
    None while that Deployment is not observed."""
    for dep in observed.deployments:
        if meta_of(dep)["name"] == name:
            ready = sum(
                1
                for p in observed.pods
                if labels_of(p).get(LABEL_COMPONENT) == "decode" and gateway_pod_ready(p)
            )
            return ready, int(dep["spec"].get("replicas", 1))
    return None


def _up_only_issues(spec: WavePipelineSpec) -> list[SpecIssue]:
    """The settings only ``wavepp up``'s local processes can honour, each one set an issue: a
    pod cannot read a file of the machine that applied the spec (``tenants[].apiKeysFile``),
    and a pod's stage is placed on cores by the kubelet, not by the spec
    (``engineOptions.pinCores``: integer CPU requests under the static CPU manager policy give
    a stage pod cores of its own)."""
    issues = []
    with_files = [t.name for t in spec.tenants if t.api_keys_file]
    if with_files:
        issues.append(
            SpecIssue(
                field="spec.tenants.apiKeysFile",
                message=f"tenants {with_files}: apiKeysFile is for wavepp up; use apiKeySecret",
            )
        )
    if spec.engine_options.get("pinCores"):
        issues.append(
            SpecIssue(
                field="spec.engineOptions.pinCores",
                message="pinCores is for wavepp up; in a pod the kubelet places the stage "
                "(integer resources.cpu and the static CPU manager policy give it cores of its own)",
            )
        )
    return issues


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
    if spec is not None:
        up_only = _up_only_issues(spec)
        if up_only:
            spec, issues = None, up_only
    if spec is None:
        return Plan(actions=[], status=invalid_status(body, issues, now), issues=issues)

    ref = PipelineRef.from_body(body)
    creds_secret: dict[str, Any] | None = None
    if defaults.nats_account_seed:
        spec = natscreds.with_rendered_creds(spec, ref)
        if natscreds.uses_rendered_creds(spec, ref):
            creds_secret = natscreds.build_nats_creds_secret(ref, spec, defaults.nats_account_seed)
    current_hash = spec_hash(spec)
    ranges = spec.stage_layer_ranges()
    budget = spec.restart_budget
    drain_timeout_s = spec.rollout.drain_timeout_s
    views = replica_views(observed, current_hash, ranges, budget.window(), now)
    desired = set(range(spec.num_replicas))
    actions: list[Action] = []
    requeue: list[float] = []
    notes: dict[int, tuple[str, str]] = {}  # replica -> (reason, message) for its status

    def sts_annotations(index: int, **values: Any) -> Patch:
        """Patch the replica's memory (drain=, restarts=, degraded=, members=, forming=;
        None removes)."""
        keys = {
            "drain": ANNOTATION_DRAIN,
            "restarts": ANNOTATION_RESTARTS,
            "degraded": ANNOTATION_DEGRADED,
            "members": ANNOTATION_MEMBERS,
            "forming": ANNOTATION_FORMING,
        }
        encoded = {
            keys[k]: None if v is None else v if isinstance(v, str) else json.dumps(v)
            for k, v in values.items()
        }
        return Patch(
            "StatefulSet",
            statefulset_name(ref.name, index),
            {"metadata": {"annotations": encoded}},
        )

    def admission_replicas(v: ReplicaView, count: int) -> list[Action]:
        if v.admission is None or (v.admission.get("spec") or {}).get("replicas") == count:
            return []
        return [
            Patch("Deployment", admission_name(ref.name, v.index), {"spec": {"replicas": count}})
        ]

    def start_drain(v: ReplicaView, reason: DrainReason) -> list[Action]:
        v.drain = {"reason": reason, "since": now}
        requeue.append(drain_timeout_s + DRAIN_GRACE_S)
        return [sts_annotations(v.index, drain=v.drain), *admission_replicas(v, 0)]

    def replica_children(index: int, *, stopped: bool, admission_running: bool) -> list[Action]:
        children = [
            Apply(b.build_stage_service(ref, index)),
            Apply(b.build_stage_statefulset(ref, spec, current_hash, index, stopped=stopped)),
            Apply(
                b.build_admission_deployment(
                    ref, spec, current_hash, index, running=admission_running
                )
            ),
            Apply(b.build_admission_service(ref, index)),
            Apply(b.build_pdb(ref, spec, index)),
        ]
        if spec.topology.pod_group:
            children.append(Apply(b.build_pod_group(ref, spec, index)))
        return children

    def delete_pods(pods: list[dict[str, Any]]) -> list[Action]:
        return [Delete("Pod", meta_of(p)["name"]) for p in pods]

    def replace(v: ReplicaView) -> list[Action]:
        """Put replica v on the current spec: new template, fresh memory, stages re-formed."""
        out: list[Action] = [
            sts_annotations(
                v.index, drain=None, restarts=None, degraded=None, members=None, forming=now
            )
        ]
        out += replica_children(v.index, stopped=False, admission_running=True)
        out += delete_pods(list(v.stage_pods.values()))
        return out

    # The credentials first (derived: unchanged specs apply nothing): pods below mount them.
    if creds_secret is not None:
        actions.append(Apply(creds_secret))
    # The spec ConfigMap first: every pod created below mounts it.
    if not any(labels_of(cm).get(LABEL_SPEC_HASH) == current_hash for cm in observed.configmaps):
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
                    Delete("StatefulSet", statefulset_name(ref.name, index)),
                    Delete("Service", statefulset_name(ref.name, index)),
                    Delete("Deployment", admission_name(ref.name, index)),
                    Delete("Service", admission_name(ref.name, index)),
                    Delete("PodDisruptionBudget", statefulset_name(ref.name, index)),
                ]
                if spec.topology.pod_group:
                    actions.append(Delete("PodGroup", statefulset_name(ref.name, index)))
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
        config_error = v.config_error()
        if config_error is not None:
            v.degraded = CONFIG_ERROR + config_error
            actions.append(sts_annotations(index, degraded=v.degraded, drain=None))
            actions += replica_children(index, stopped=True, admission_running=False)
            actions += delete_pods(list(v.stage_pods.values()))
            v.drain = None
            continue
        failure = v.failure() or v.lost(now, budget.not_ready_s, budget.forming_timeout_s)
        if failure is not None:
            v.restarts = [*v.restarts, now]
            if len(v.restarts) > budget.max_restarts:
                v.degraded = (
                    f"{len(v.restarts)} re-formations within {budget.window():g} s exceed "
                    f"restartBudget.maxRestarts={budget.max_restarts}; last: {failure}"
                )
                actions.append(
                    sts_annotations(
                        index,
                        restarts=v.restarts,
                        degraded=v.degraded,
                        drain=None,
                        members=None,
                        forming=None,
                    )
                )
                actions += replica_children(index, stopped=True, admission_running=False)
                actions += delete_pods(list(v.stage_pods.values()))
                v.drain = None
            else:
                v.drain = {"reason": "failure", "since": now, "message": failure}
                actions.append(
                    sts_annotations(
                        index, restarts=v.restarts, drain=v.drain, members=None, forming=now
                    )
                )
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
        # The group's members, once every rank has a pod: a later uid change is a lost member.
        # (Patched before the apply below, which then records the StatefulSet's new version.)
        memory: dict[str, Any] = {}
        members = v.current_members()
        if v.members is None and members is not None:
            memory["members"] = {str(rank): uid for rank, uid in members.items()}
        if v.admitting() and v.forming_since is not None:
            memory["forming"] = None
        elif not v.admitting() and v.forming_since is None:
            memory["forming"] = now
        if memory:
            actions.append(sts_annotations(index, **memory))
        actions += replica_children(index, stopped=False, admission_running=v.drain is None)
        actions += delete_pods(v.stale_pods())
        if not v.admitting():  # look again when the forming timeout or a NotReady bound ends
            due = (v.forming_since or now) + budget.forming_timeout_s - now
            requeue.extend([d for d in (due, budget.not_ready_s) if d > 0])

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
    actions.append(Apply(build_gateway_deployment(ref, spec, current_hash)))
    actions.append(Apply(b.build_gateway_service(ref)))
    actions.append(Apply(build_gateway_pdb(ref)))
    inference_pool = b.build_inference_pool(ref, spec)
    if inference_pool is not None:
        actions.append(Apply(inference_pool))
    decode_objects = [build_decode_deployment(ref, spec), build_decode_service(ref, spec)]
    actions += [Apply(obj) for obj in decode_objects if obj is not None]
    if decode_objects[0] is None:
        decode_name = decode_service_name(ref.name)
        for kind, objs in (("Deployment", observed.deployments), ("Service", observed.services)):
            if any(meta_of(o)["name"] == decode_name for o in objs):
                actions.append(Delete(kind, decode_name))
    policies = b.build_network_policies(ref, spec)
    actions += _apply_only("NetworkPolicy", policies, observed.network_policies)
    hpas = [h for h in (b.build_hpa(ref, spec), build_decode_hpa(ref, spec)) if h is not None]
    actions += _apply_only("HorizontalPodAutoscaler", hpas, observed.hpas)
    in_use = {current_hash} | {v.hash for v in views.values() if v.hash}
    for cm in observed.configmaps:
        hash_ = labels_of(cm).get(LABEL_SPEC_HASH)
        if hash_ and hash_ not in in_use:
            actions.append(Delete("ConfigMap", meta_of(cm)["name"]))
    # Leftovers of a replica whose StatefulSet is gone (a scale-down interrupted half-way).
    kept = desired | set(views)
    for kind, objs in (
        ("Deployment", observed.deployments),
        ("Service", observed.services),
        ("PodDisruptionBudget", observed.pdbs),
        ("PodGroup", observed.pod_groups),
    ):
        for obj in objs:
            replica = labels_of(obj).get(LABEL_REPLICA)
            if replica is not None and replica.isdigit() and int(replica) not in kept:
                actions.append(Delete(kind, meta_of(obj)["name"]))

    gateway_pods = [p for p in observed.pods if labels_of(p).get(LABEL_COMPONENT) == "gateway"]
    gateway_error = next(filter(None, (pod_config_error(p) for p in gateway_pods)), None)
    status = pipeline_status(
        body,
        spec,
        views,
        desired,
        serving,
        current_hash,
        notes,
        now,
        gateway_ready=any(gateway_pod_ready(p) for p in gateway_pods),
        gateway_error=gateway_error,
        decode_pods=_decode_pods(observed, decode_service_name(ref.name)),
    )
    due = [max(0.5, t) for t in requeue]
    return Plan(actions=actions, status=status, requeue_after_s=min(due) if due else None)
