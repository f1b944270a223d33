"""Pure manifest builders: valid Kubernetes objects, the container contract, the spec hash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from operator_support import kubernetes_validate

from wavepp import cli
from wavepp.api.cli_args import NatsArgs, admission_args, stage_args
from wavepp.api.spec import WavePipelineSpec, check_spec
from wavepp.operator import builders as b
from wavepp.operator.containers import HEALTH_PORT, HTTP_PORT, SPEC_FILE, container_args
from wavepp.operator.gateway_builders import (
    GATEWAY_REPLICAS,
    build_gateway_deployment,
    build_gateway_pdb,
)
from wavepp.operator.naming import (
    LABEL_COMPONENT,
    LABEL_PIPELINE,
    LABEL_REPLICA,
    PipelineRef,
    spec_hash,
)
from wavepp.operator.resources import host_tier_bytes
from wavepp.runtime.serving.processes import wavepp_command

REF = PipelineRef(name="big", namespace="llm", uid="0b4c-uid")


def _spec(**raw: Any) -> WavePipelineSpec:
    base: dict[str, Any] = {"model": {"name": "glm-5.2"}, "engine": "emulated", "stages": 4}
    spec, issues = check_spec(
        base | raw, default_image="img:1", default_nats_url="nats://nats:4222"
    )
    assert spec is not None, issues
    return spec


FULL = _spec(
    replicas=3,
    engine="torch",
    model={"name": "glm-5.2", "pvc": {"claimName": "glm", "subPath": "glm-5.2"}},
    resources={"cpu": "16", "memory": "256Gi", "sharedMemory": "32Gi"},
    nodeSelector={"nvidia.com/gpu.product": "H200"},
    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    affinity={
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}
                ]
            }
        }
    },
    topologySpreadConstraints=[
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
        }
    ],
    nats={"url": "nats://nats.infra:4222", "credentialsSecret": "nats-creds"},
    telemetry={"otlpEndpoint": "http://otel:4317", "samplingRatio": 0.05},
    imagePullSecrets=["regcred"],
    serviceAccountName="wavepp-stage",
    autoscaling={"minReplicas": 1, "maxReplicas": 4, "metric": "cpu", "target": 80},
    podTemplate={
        "priorityClassName": "llm-serving",
        "schedulerName": "scheduler-plugins-scheduler",
        "runtimeClassName": "nvidia",
        "env": [
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
        ],
        "envFrom": [{"secretRef": {"name": "stage-extra"}}],
    },
    topology={
        "replicaDomainKey": "nvidia.com/gpu.clique",
        "spreadReplicasKey": "topology.kubernetes.io/zone",
        "podGroup": True,
    },
    networkPolicy={"gatewayFrom": [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]},
)


def _all_children(spec: WavePipelineSpec) -> list[dict[str, Any]]:
    h = spec_hash(spec)
    objects = [
        b.build_spec_configmap(REF, spec, h),
        b.build_pool_configmap(REF, [b.PoolEntry(0, h, True), b.PoolEntry(1, h, False)]),
        build_gateway_deployment(REF, spec, h),
        b.build_gateway_service(REF),
        build_gateway_pdb(REF),
    ]
    for replica in range(2):
        objects += [
            b.build_stage_service(REF, replica),
            b.build_stage_statefulset(REF, spec, h, replica, stopped=replica == 1),
            b.build_admission_deployment(REF, spec, h, replica, running=replica == 0),
            b.build_admission_service(REF, replica),
            b.build_pdb(REF, spec, replica),
        ]
    objects += b.build_network_policies(REF, spec)
    hpa = b.build_hpa(REF, spec)
    return objects + ([hpa] if hpa else [])


def test_every_child_passes_kubernetes_validate_strict(tmp_path: Path) -> None:
    objects = _all_children(FULL) + _all_children(_spec(resources={"gpusPerStage": 0}))
    auto = {"minReplicas": 1, "maxReplicas": 2, "metric": "cpu", "target": 70.0}
    objects.append(b.build_hpa(REF, _spec(autoscaling=auto)))
    host = _spec(**HOST_TIER, resources={"gpusPerStage": 0})  # a memory request, no limit
    objects.append(b.build_stage_statefulset(REF, host, spec_hash(host), 0))
    rc, output = kubernetes_validate(objects, tmp_path)
    assert rc == 0, output


def test_children_are_owned_and_labelled() -> None:
    for obj in _all_children(FULL):
        meta = obj["metadata"]
        assert meta["namespace"] == "llm"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "wavepp.dev/v1alpha1",
                "kind": "WavePipeline",
                "name": "big",
                "uid": "0b4c-uid",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][LABEL_PIPELINE] == "big"


def _stage_container(sts: dict[str, Any]) -> dict[str, Any]:
    return sts["spec"]["template"]["spec"]["containers"][0]


def test_stage_statefulset_contract() -> None:
    h = spec_hash(FULL)
    sts = b.build_stage_statefulset(REF, FULL, h, 2)
    assert sts["metadata"]["name"] == "big-r2"
    assert sts["spec"]["replicas"] == 4  # one pod per stage; ordinal = rank
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert sts["spec"]["serviceName"] == "big-r2"
    container = _stage_container(sts)
    assert container["command"] == ["wavepp"]
    assert container["args"] == [
        "stage", "--config", "/etc/wavepp/spec.json", "--nats-url", "nats://nats.infra:4222",
        "--nats-creds", "/etc/wavepp-nats/creds", "--replica", "2", "--rank", "$(WAVEPP_RANK)",
        "--dist-url", "tcp://big-r2-0.big-r2:29500", "--health-port", "8081",
        "--metrics-port", "9400",
    ]  # fmt: skip
    # the stage serves its own /metrics there (wavepp.runtime.stage.metrics)
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in container["ports"]
    rank_env = container["env"][0]
    assert rank_env == {
        "name": "WAVEPP_RANK",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
    }
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel:4317"
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.05"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"  # torch: 1 by default
    assert container["startupProbe"]["httpGet"]["path"] == "/startupz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    pod = sts["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H200"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    # A spread constraint without a selector counts this pipeline's stage pods.
    assert pod["topologySpreadConstraints"][0]["labelSelector"] == {
        "matchLabels": {LABEL_PIPELINE: "big", LABEL_COMPONENT: "stage"}
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == f"big-spec-{h}"
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "glm", "readOnly": True}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model"]["subPath"] == "glm-5.2" and mounts["model"]["mountPath"] == "/models"
    assert b.build_stage_statefulset(REF, FULL, h, 2, stopped=True)["spec"]["replicas"] == 0


def test_cpu_stages_request_no_gpu() -> None:
    spec = _spec(resources={"gpusPerStage": 0})
    container = _stage_container(b.build_stage_statefulset(REF, spec, spec_hash(spec), 0))
    assert container["resources"] == {}


HOST_TIER: dict[str, Any] = {
    "engine": "torch",
    "model": {"name": "tiny-llama"},
    "stages": 2,
    "cache": {"hostMemoryGiB": 4},
}


@pytest.mark.parametrize(
    ("raw", "requests", "limits"),
    [
        # a torch stage (one GPU by default) holds its host tier, 4 GiB per GPU x 1 GPU: the
        # memory request and limit grow by it
        ({"resources": {"memory": "8Gi"}}, "12Gi", "12Gi"),
        ({"resources": {"memory": "1000M"}}, "5294967296", "5294967296"),  # 10^9 + 4 x 2^30
        # without resources.memory the tier alone is requested, no limit is set
        ({"resources": {"gpusPerStage": 0}}, "4Gi", None),
        ({"cache": {"hostMemoryGiB": 0.5}, "resources": {"gpusPerStage": 0}}, "512Mi", None),
        # no tier, or the emulated engine (it keeps no KV bytes): the spec's memory as it is
        ({"cache": {"hostMemoryGiB": 0}, "resources": {"memory": "8Gi"}}, "8Gi", "8Gi"),
        ({"engine": "emulated", "resources": {"memory": "8Gi"}}, "8Gi", "8Gi"),
    ],
)
def test_stage_pods_request_the_host_memory_their_tier_holds(
    raw: dict[str, Any], requests: str, limits: str | None
) -> None:
    spec = _spec(**(HOST_TIER | raw))
    resources = _stage_container(b.build_stage_statefulset(REF, spec, spec_hash(spec), 0))[
        "resources"
    ]
    assert resources["requests"]["memory"] == requests
    if limits is None:
        assert "memory" not in resources.get("limits", {})
    else:
        assert resources["limits"]["memory"] == limits
    if spec.cache.host_memory_gib and spec.engine == "torch":
        assert host_tier_bytes(spec) == spec.cache.host_memory_gib * 2**30


def test_admission_drains_within_the_rollout_timeout() -> None:
    spec = _spec(rollout={"drainTimeoutSeconds": 42.5})
    dep = b.build_admission_deployment(REF, spec, spec_hash(spec), 1, running=False)
    assert dep["spec"]["replicas"] == 0
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 43
    # the process drains (serves what its intake holds) 5 s less than its grace period
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"][-6:] == [
        "--replica", "1", "--health-port", "8080", "--drain-timeout-s", "37.5",
    ]  # fmt: skip
    short = _spec(rollout={"drainTimeoutSeconds": 3})
    args = b.build_admission_deployment(REF, short, spec_hash(short), 0, running=True)
    assert args["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "0"


def test_the_gateway_runs_two_pods_and_a_disruption_budget_keeps_one() -> None:
    """A scale-down, a drain or a rollout never takes the only gateway pod out of
    its Service (a gateway is ready while one replica admits)."""
    dep = build_gateway_deployment(REF, FULL, spec_hash(FULL))
    pdb = build_gateway_pdb(REF)
    assert dep["spec"]["replicas"] == GATEWAY_REPLICAS >= 2
    # a rollout starts the new pod before it stops an old one
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert pdb["metadata"]["name"] == "big-gateway"
    assert pdb["metadata"]["ownerReferences"] == dep["metadata"]["ownerReferences"]
    assert 1 <= pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]  # one may be evicted
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    selected = pdb["spec"]["selector"]["matchLabels"]
    assert selected.items() <= pod_labels.items()
    assert selected == dep["spec"]["selector"]["matchLabels"]
    # the PDB selects no admission or stage pod
    for other in (
        b.build_admission_deployment(REF, FULL, spec_hash(FULL), 0, running=True),
        b.build_stage_statefulset(REF, FULL, spec_hash(FULL), 0),
    ):
        assert not selected.items() <= other["spec"]["template"]["metadata"]["labels"].items()
    # spread over nodes when it can be (preferred: one node still runs both)
    (term,) = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == selected


def test_pool_configmap_lists_admitting_replicas() -> None:
    cm = b.build_pool_configmap(REF, [b.PoolEntry(1, "h1", False), b.PoolEntry(0, "h0", True)])
    pool = json.loads(cm["data"]["pool.json"])
    assert pool["replicas"] == [
        {"replica": 0, "specHash": "h0", "admitting": True,
         "admissionUrl": "http://big-r0-admission.llm.svc:8080"},
        {"replica": 1, "specHash": "h1", "admitting": False,
         "admissionUrl": "http://big-r1-admission.llm.svc:8080"},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "rolls"),
    [
        ({"scheduler": {"chunkTokens": 1024}}, True),
        ({"image": "img:2"}, True),
        ({"layerPartition": [21, 19, 19, 19]}, True),
        ({"layerPartition": [20, 20, 19, 19]}, False),  # spells out the default split
        ({"replicas": 7}, False),
        ({"autoscaling": {"minReplicas": 1, "maxReplicas": 9, "target": 50}}, False),
        ({"networkPolicy": {"enabled": False}}, False),
        ({"podTemplate": {"priorityClassName": "high"}}, True),
        ({"restartBudget": {"maxRestarts": 9}}, False),
        ({"rollout": {"drainTimeoutSeconds": 5}}, False),
    ],
)
def test_spec_hash_changes_only_with_what_replicas_run(change: dict[str, Any], rolls: bool) -> None:
    assert (spec_hash(_spec(**change)) != spec_hash(_spec())) is rolls


def test_hpa_targets_the_scale_subresource() -> None:
    hpa = b.build_hpa(REF, FULL)
    assert hpa is not None
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "wavepp.dev/v1alpha1", "kind": "WavePipeline", "name": "big",
    }  # fmt: skip
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 80},
            },
        }
    ]
    assert b.build_hpa(REF, _spec()) is None


def test_container_args_needs_a_replica_for_stages() -> None:
    with pytest.raises(ValueError, match="replica is required"):
        container_args("stage", FULL, REF)


def test_pod_template_overlay_and_replica_topology_reach_the_stage_pods() -> None:
    sts = b.build_stage_statefulset(REF, FULL, spec_hash(FULL), 1)
    pod = sts["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "llm-serving"
    assert pod["schedulerName"] == "scheduler-plugins-scheduler"
    assert pod["runtimeClassName"] == "nvidia"
    container = pod["containers"][0]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in (
        container["env"]
    )
    assert container["envFrom"] == [{"secretRef": {"name": "stage-extra"}}]
    # The replica's stages share one clique; replicas prefer different zones.
    (together,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together["topologyKey"] == "nvidia.com/gpu.clique"
    assert together["labelSelector"]["matchLabels"][LABEL_REPLICA] == "1"
    (apart,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert apart["podAffinityTerm"]["topologyKey"] == "topology.kubernetes.io/zone"
    assert apart["podAffinityTerm"]["labelSelector"]["matchExpressions"] == [
        {"key": LABEL_REPLICA, "operator": "NotIn", "values": ["1"]}
    ]
    assert "nodeAffinity" in pod["affinity"]  # spec.affinity kept
    # One PodGroup per replica, all stages or none.
    assert sts["spec"]["template"]["metadata"]["labels"][b.POD_GROUP_LABEL] == "big-r1"
    group = b.build_pod_group(REF, FULL, 1)
    assert group["metadata"]["name"] == "big-r1" and group["spec"]["minMember"] == 4
    # Without the settings, none of it.
    plain = b.build_stage_statefulset(REF, _spec(), spec_hash(_spec()), 1)["spec"]["template"]
    assert b.POD_GROUP_LABEL not in plain["metadata"]["labels"]
    assert not {"priorityClassName", "affinity", "runtimeClassName"} & set(plain["spec"])


def test_per_replica_pdb_and_network_policies() -> None:
    pdb = b.build_pdb(REF, FULL, 2)
    assert pdb["metadata"]["name"] == "big-r2"
    assert pdb["spec"]["minAvailable"] == 4
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["spec"]["selector"]["matchLabels"][LABEL_REPLICA] == "2"
    policies = {p["metadata"]["name"]: p["spec"] for p in b.build_network_policies(REF, FULL)}
    assert set(policies) == {"big-stage", "big-admission", "big-gateway"}
    stage = policies["big-stage"]["ingress"]
    assert stage[0] == {
        "from": [
            {"podSelector": {"matchLabels": {LABEL_PIPELINE: "big", LABEL_COMPONENT: "stage"}}}
        ]
    }
    assert stage[1] == {"ports": [{"protocol": "TCP", "port": HEALTH_PORT}]}
    admission = policies["big-admission"]["ingress"][0]
    assert admission["from"][0]["podSelector"]["matchLabels"][LABEL_COMPONENT] == "gateway"
    gateway = policies["big-gateway"]["ingress"][0]
    assert gateway["from"] == [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]
    assert b.build_network_policies(REF, _spec(networkPolicy={"enabled": False})) == []


def test_metrics_port_only_where_a_process_listens() -> None:
    h = spec_hash(FULL)

    def ports(obj: dict[str, Any]) -> set[str]:
        return {p["name"] for p in obj["spec"]["template"]["spec"]["containers"][0]["ports"]}

    assert "metrics" in ports(b.build_admission_deployment(REF, FULL, h, 0, running=True))
    assert "metrics" in ports(b.build_stage_statefulset(REF, FULL, h, 0))  # its own /metrics
    assert "metrics" not in ports(build_gateway_deployment(REF, FULL, h))


def test_inference_pool_over_the_gateway_pods_off_by_default() -> None:
    assert b.build_inference_pool(REF, FULL) is None
    spec = _spec(inferencePool={"enabled": True, "endpointPicker": "wavepp-epp"})
    pool = b.build_inference_pool(REF, spec)
    assert pool is not None and pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "big"
    gateway = build_gateway_deployment(REF, spec, spec_hash(spec))
    selected = pool["spec"]["selector"]["matchLabels"]
    assert selected.items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": HTTP_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "wavepp-epp", "port": {"number": 9002}, "failureMode": "FailClose",
    }  # fmt: skip


def test_the_pods_stage_args_and_the_local_stage_command_come_from_one_builder() -> None:
    """A stage pod's args and ``wavepp up``'s stage command line are both
    ``api.cli_args.stage_args``: for the same NATS settings and metrics port they carry the same
    flags with the same values, in the same order, and ``wavepp stage``'s parser reads both."""
    nats = NatsArgs(str(FULL.nats.url), creds="/etc/wavepp-nats/creds")
    metrics_port = FULL.telemetry.metrics_port
    pod = container_args("stage", FULL, REF, 2)
    local = wavepp_command(
        stage_args(
            nats,
            runtime_config="/run/rc.json",
            rank="3",
            dist_url="tcp://127.0.0.1:29500",
            metrics_port=metrics_port,
            metrics_host="127.0.0.1",
        )
    )
    assert pod == stage_args(
        nats,
        config=SPEC_FILE,
        replica=2,
        rank="$(WAVEPP_RANK)",
        dist_url="tcp://big-r2-0.big-r2:29500",
        health_port=HEALTH_PORT,
        metrics_port=metrics_port,
    )
    shared = ["--nats-url", "--nats-creds", "--rank", "--dist-url", "--metrics-port"]
    for args in (pod, local[3:]):
        assert [a for a in args if a in shared] == shared
    parsed_pod = cli.build_parser(["stage"]).parse_args(pod)
    parsed_local = cli.build_parser(["stage"]).parse_args(local[3:])
    for field in ("nats_url", "nats_creds", "metrics_port"):
        assert getattr(parsed_pod, field) == getattr(parsed_local, field), field


@pytest.mark.parametrize("builder", [stage_args, admission_args])
def test_a_process_takes_exactly_one_configuration_source(builder: Any) -> None:
    nats = NatsArgs("nats://n:4222")
    fields = {"rank": "0", "dist_url": "tcp://h:1"} if builder is stage_args else {"drain_s": 1.0}
    with pytest.raises(ValueError, match="exactly one of config"):
        builder(nats, **fields)
    with pytest.raises(ValueError, match="exactly one of config"):
        builder(nats, config="/s.json", runtime_config="/rc.json", **fields)
