"""The spec walk: every field of the WavePipeline spec is honoured or refused, never ignored.

The walk visits every field of :class:`wavepp.api.spec.WavePipelineSpec` (nested models, list
items, and the keys of the free-form ``engineOptions`` and ``model.config`` that the runtime
reads). :data:`FIELDS` says, for each, where it is honoured and/or how it is refused:

- honoured: changing the field (from :data:`BASE`, with the entry's context) changes what its
  reader produces: ``runtime`` (the RuntimeConfigs of every replica, the processes' telemetry
  settings and the gateway's config, exactly what ``wavepp stage|admission|gateway`` build from
  spec.json), ``operator`` (the children the operator renders, the spec ConfigMap and the spec
  hash left out, so spec.json carrying the value does not count), or ``lifecycle`` (the phases
  the operator's planner reports through a scripted life of a replica: a pod NotReady, crashes
  spaced in time, a replica that never forms), or ``up`` (the tenant policies ``wavepp up``
  gives its gateway: ``apiKeysFile`` is ``wavepp up``'s only);
- refused: the spec check (the operator's and ``wavepp up``'s) answers with an issue on that
  field's path.

A field missing from the table, a table entry no field has, a change its reader does not see, or
a refusal that names another field fails the test. ``python tests/operator/test_spec_walk.py``
prints the listing.
"""

from __future__ import annotations

# ruff: noqa: E501 - the table reads best one field a line
import atexit
import copy
import dataclasses
import datetime as dt
import functools
import json
import re
import shutil
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from test_operator_reconcile import World  # noqa: E402 - the planner's test world

from wavepp.api.spec import (
    ENGINE_OPTIONS,
    MODEL_CONFIG_EXTRA,
    WavePipelineSpec,
    check_spec,
)
from wavepp.launch.gateway import gateway_config_from_spec
from wavepp.launch.replica import telemetry_from_spec
from wavepp.launch.runtime_config import runtime_configs_from_spec
from wavepp.operator.reconcile import Apply, Create, Defaults, Observed, plan

DEFAULTS = Defaults(image="img:1", nats_url="nats://n:4222")
BASE: dict[str, Any] = {
    "model": {"name": "tiny-llama"},
    "stages": 2,
    "replicas": 1,
    "resources": {"gpusPerStage": 0},
}
EMULATED = {"engine": "emulated", "model": {"name": "tiny-llama"}}
CKPT, CKPT2 = "@checkpoint-1@", "@checkpoint-2@"  # two tiny-llama-sized checkpoints, made once


@functools.cache
def _checkpoints() -> dict[str, str]:
    """Two Hugging Face checkpoints of 8 Llama layers (tiny-llama's count), built on first use
    (the runtime reads a spec's model.path: config.json, the split by cost)."""
    from wavepp.bench.checkpoints import save_random_checkpoint

    root = Path(tempfile.mkdtemp(prefix="spec-walk-"))
    atexit.register(shutil.rmtree, root, True)
    save_random_checkpoint("llama", root / "a", num_layers=8, vocab_size=256)
    shutil.copytree(root / "a", root / "b")
    return {CKPT: str(root / "a"), CKPT2: str(root / "b")}


def _with_checkpoints(value: Any) -> Any:
    """``value`` with the checkpoint placeholders replaced by real directories."""
    if isinstance(value, dict):
        return {k: _with_checkpoints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_checkpoints(v) for v in value]
    if value in (CKPT, CKPT2):
        return _checkpoints()[value]
    return value


GPU = {"resources": {"gpusPerStage": 1}}


@dataclass(frozen=True)
class Entry:
    """How one field is treated: honoured by ``reader`` (``where`` in the code), refused with
    ``refusal`` (a change and a text the issue's message contains), or both."""

    reader: str | None = None  # runtime | operator | lifecycle | up (wavepp up only)
    where: str = ""
    change: dict[str, Any] | None = None
    context: dict[str, Any] | None = None  # applied to both sides
    refusal: tuple[dict[str, Any], str] | None = None


R, O, L = "runtime", "operator", "lifecycle"  # noqa: E741 - the table's column
FS = "launch.runtime_config.runtime_configs_from_spec"
BLD = "operator.builders"
GW = "launch.gateway.gateway_config_from_spec"


def _tenant(**fields: Any) -> dict[str, Any]:
    """A spec patch with one tenant ``a`` (``fields`` over its name)."""
    return {"tenants": [{"name": "a"} | fields]}


FIELDS: dict[str, Entry] = {
    "model.name": Entry(
        R, f"{FS}: ModelConfig preset, hash-chain seed", {"model": {"name": "small-llama"}}
    ),
    "model.path": Entry(
        R,
        f"{FS} -> RuntimeConfig.model_dir (shape from its config.json, split by cost) -> "
        "stage.build.build_engine",
        {"model": {"name": "tiny-llama", "path": CKPT}},
        refusal=(EMULATED | {"model": {"name": "tiny-llama", "path": "/w"}}, "loads no weights"),
    ),
    "model.pvc.claimName": Entry(
        O,
        f"{BLD}.build_stage_statefulset: volume",
        {"model": {"name": "tiny-llama", "pvc": {"claimName": "w2"}}},
        context={"model": {"name": "tiny-llama", "pvc": {"claimName": "w"}}},
    ),
    "model.pvc.subPath": Entry(
        O,
        f"{BLD}.build_stage_statefulset: mount subPath",
        {"model": {"name": "tiny-llama", "pvc": {"claimName": "w", "subPath": "x"}}},
        context={"model": {"name": "tiny-llama", "pvc": {"claimName": "w"}}},
    ),
    "model.pvc.mountPath": Entry(
        R,
        f"{FS}: model_dir = mountPath when path unset; and the mount",
        {"model": {"name": "tiny-llama", "pvc": {"claimName": "w", "mountPath": CKPT2}}},
        context={"model": {"name": "tiny-llama", "pvc": {"claimName": "w", "mountPath": CKPT}}},
    ),
    "model.config.numLayers": Entry(
        R,
        f"{FS}: ModelConfig.num_layers",
        {"model": {"name": "tiny-llama", "config": {"numLayers": 6}}},
    ),
    "model.config.hiddenSize": Entry(
        R, f"{FS}: ModelConfig", {"model": {"name": "tiny-llama", "config": {"hiddenSize": 256}}}
    ),
    "model.config.intermediateSize": Entry(
        R,
        f"{FS}: ModelConfig",
        {"model": {"name": "tiny-llama", "config": {"intermediateSize": 512}}},
    ),
    "model.config.numHeads": Entry(
        R, f"{FS}: ModelConfig", {"model": {"name": "tiny-llama", "config": {"numHeads": 8}}}
    ),
    "model.config.numKvHeads": Entry(
        R, f"{FS}: ModelConfig", {"model": {"name": "tiny-llama", "config": {"numKvHeads": 4}}}
    ),
    "model.config.headDim": Entry(
        R, f"{FS}: ModelConfig", {"model": {"name": "tiny-llama", "config": {"headDim": 16}}}
    ),
    "model.config.vocabSize": Entry(
        R, f"{FS}: ModelConfig", {"model": {"name": "tiny-llama", "config": {"vocabSize": 2048}}}
    ),
    "model.config.ropeTheta": Entry(
        R,
        f"{FS}: ModelConfig.rope_theta",
        {"model": {"name": "tiny-llama", "config": {"ropeTheta": 5e5}}},
    ),
    "model.config.rmsNormEps": Entry(
        R,
        f"{FS}: ModelConfig.rms_norm_eps",
        {"model": {"name": "tiny-llama", "config": {"rmsNormEps": 1e-6}}},
    ),
    "model.config.maxPosition": Entry(
        R,
        f"{FS}: ModelConfig.max_position",
        {"model": {"name": "tiny-llama", "config": {"maxPosition": 4096}}},
    ),
    "model.config.<other>": Entry(
        refusal=(
            {"model": {"name": "tiny-llama", "config": {"ropeScaling": 2}}},
            "not a model setting",
        )
    ),
    "model.dtype": Entry(
        R,
        f"{FS}: ModelConfig.dtype (default bf16 on CUDA)",
        {"model": {"name": "tiny-llama", "dtype": "float16"}},
        context=GPU,
        refusal=({"model": {"name": "tiny-llama", "dtype": "bfloat16"}}, "needs a GPU"),
    ),
    "engine": Entry(
        R,
        f"{FS}: RuntimeConfig.engine",
        EMULATED,
        refusal=({"engine": "tensorrt_llm"}, "'torch' or 'emulated'"),
    ),
    "engineOptions.kvBlocks": Entry(R, f"{FS}: num_kv_blocks", {"engineOptions": {"kvBlocks": 64}}),
    "engineOptions.maxInflight": Entry(
        R, f"{FS}: max_inflight", {"engineOptions": {"maxInflight": 3}}
    ),
    "engineOptions.returnMicrobatches": Entry(
        R,
        f"{FS}: return_microbatches",
        {"engineOptions": {"returnMicrobatches": 0}},
        refusal=({"engineOptions": {"returnMicrobatches": -1}}, "must be in [0, 1024]"),
    ),
    "engineOptions.leaseSeconds": Entry(
        R, f"{FS}: lease_s", {"engineOptions": {"leaseSeconds": 5}}
    ),
    "engineOptions.maxBlocksPerOwner": Entry(
        R,
        f"{FS}: max_blocks_per_owner",
        {"engineOptions": {"maxBlocksPerOwner": 8}},
        refusal=({"engineOptions": {"maxBlocksPerOwner": 0}}, "must be in [1, 2147483647]"),
    ),
    "engineOptions.torchThreads": Entry(
        R, f"{FS}: torch_threads", {"engineOptions": {"torchThreads": 2}}
    ),
    "engineOptions.torchCompile": Entry(
        R,
        f"{FS}: torch_compile",
        {"engineOptions": {"torchCompile": True}},
        refusal=({"engineOptions": {"torchCompile": "yes"}}, "must be true or false"),
    ),
    "engineOptions.packWeights": Entry(
        R,
        f"{FS}: pack_weights",
        {"engineOptions": {"packWeights": False}},
        refusal=({"engineOptions": {"packWeights": 0}}, "must be true or false"),
    ),
    "engineOptions.pinCores": Entry(
        R,
        f"{FS}: pin_cores (wavepp up's launcher gives each stage its --cores; the operator "
        "refuses it: Degraded naming spec.engineOptions.pinCores)",
        {"engineOptions": {"pinCores": True}},
        refusal=({"engineOptions": {"pinCores": 1}}, "must be true or false"),
    ),
    "engineOptions.seed": Entry(
        R,
        f"{FS}: ModelConfig.seed",
        {"engineOptions": {"seed": 3}},
        refusal=(EMULATED | {"engineOptions": {"seed": 3}}, "not read by engine 'emulated'"),
    ),
    "engineOptions.timeScale": Entry(
        R,
        f"{FS}: time_scale",
        EMULATED | {"engineOptions": {"timeScale": 0.5}},
        context=EMULATED,
        refusal=({"engineOptions": {"timeScale": 2}}, "not read by engine 'torch'"),
    ),
    "engineOptions.emulate": Entry(
        R,
        f"{FS}: cost_model",
        EMULATED | {"engineOptions": {"emulate": "glm-5.2", "kvBlocks": 64}},
        context=EMULATED | {"engineOptions": {"kvBlocks": 64}},
        refusal=(EMULATED | {"engineOptions": {"emulate": "gpt-9"}}, "has no cost model"),
    ),
    "engineOptions.<other>": Entry(refusal=({"engineOptions": {"device": "cuda"}}, "gpusPerStage")),
    "stages": Entry(R, f"{FS}: num_stages; {BLD}: StatefulSet replicas", {"stages": 4}),
    "layerPartition": Entry(R, f"{FS}: partition", {"layerPartition": [3, 5]}),
    "tensorParallelSize": Entry(
        R,
        f"{FS}: tensor_parallel_size (stage.tp_launch: one process per device)",
        {"tensorParallelSize": 2},
        refusal=(EMULATED | {"tensorParallelSize": 2}, "torch engine only"),
    ),
    "replicas": Entry(
        R, f"{FS}: one config per replica; operator: one StatefulSet each", {"replicas": 2}
    ),
    "image": Entry(O, f"{BLD}: container image", {"image": "img:2"}),
    "imagePullPolicy": Entry(O, f"{BLD}.containers.pod_container", {"imagePullPolicy": "Always"}),
    "imagePullSecrets": Entry(O, f"{BLD}.containers.pod_spec_common", {"imagePullSecrets": ["r"]}),
    "serviceAccountName": Entry(
        O, f"{BLD}.containers.pod_spec_common", {"serviceAccountName": "sa"}
    ),
    "resources.gpusPerStage": Entry(
        R,
        f"{FS}: device cuda; {BLD}: GPU request",
        GPU,
        refusal=({"resources": {"gpusPerStage": 2}}, "one GPU per tensor-parallel process"),
    ),
    "resources.gpuResourceName": Entry(
        O,
        "operator.resources.stage_resources",
        {"resources": {"gpusPerStage": 1, "gpuResourceName": "amd.com/gpu"}},
        context=GPU,
    ),
    "resources.cpu": Entry(
        O, "operator.resources.stage_resources", {"resources": {"gpusPerStage": 0, "cpu": "2"}}
    ),
    "resources.memory": Entry(
        O, "operator.resources.stage_resources", {"resources": {"gpusPerStage": 0, "memory": "1Gi"}}
    ),
    "resources.sharedMemory": Entry(
        O,
        f"{BLD}.build_stage_statefulset: /dev/shm",
        {"resources": {"gpusPerStage": 0, "sharedMemory": "2Gi"}},
    ),
    "nodeSelector": Entry(O, f"{BLD}.build_stage_statefulset", {"nodeSelector": {"a": "b"}}),
    "tolerations[].key": Entry(
        O, f"{BLD}.build_stage_statefulset", {"tolerations": [{"key": "k"}]}
    ),
    "tolerations[].operator": Entry(
        O, f"{BLD}.build_stage_statefulset", {"tolerations": [{"operator": "Exists"}]}
    ),
    "tolerations[].value": Entry(
        O,
        f"{BLD}.build_stage_statefulset",
        {"tolerations": [{"key": "k", "value": "v"}]},
        context={"tolerations": [{"key": "k"}]},
    ),
    "tolerations[].effect": Entry(
        O,
        f"{BLD}.build_stage_statefulset",
        {"tolerations": [{"key": "k", "effect": "NoSchedule"}]},
        context={"tolerations": [{"key": "k"}]},
    ),
    "tolerations[].tolerationSeconds": Entry(
        O,
        f"{BLD}.build_stage_statefulset",
        {"tolerations": [{"key": "k", "tolerationSeconds": 5}]},
        context={"tolerations": [{"key": "k"}]},
    ),
    "affinity": Entry(O, f"{BLD}._replica_affinity", {"affinity": {"nodeAffinity": {}}}),
    "topologySpreadConstraints": Entry(
        O,
        f"{BLD}._topology_spread",
        {
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "h", "whenUnsatisfiable": "ScheduleAnyway"}
            ]
        },
    ),
    "cache.blockSize": Entry(R, f"{FS}: block_size", {"cache": {"blockSize": 32}}),
    "cache.memoryPerStageBytes": Entry(
        R, f"{FS}: num_kv_blocks", {"cache": {"memoryPerStageBytes": 1 << 20}}
    ),
    "cache.hostMemoryGiB": Entry(
        R,
        f"{FS} -> launch.capacity: num_host_kv_blocks; operator.resources.stage_resources: memory request",
        {"cache": {"hostMemoryGiB": 1}},
        refusal=({"cache": {"hostMemoryGiB": 4096}}, "less than or equal to 1024"),
    ),
    "scheduler.mode": Entry(R, f"{FS}: mode", {"scheduler": {"mode": "sync"}}),
    "scheduler.chunkPolicy": Entry(
        R, f"{FS}: chunk_policy", {"scheduler": {"chunkPolicy": "static"}}
    ),
    "scheduler.chunkTokens": Entry(R, f"{FS}: chunk_tokens", {"scheduler": {"chunkTokens": 1024}}),
    "nats.url": Entry(
        O, f"{BLD}.containers.container_args: --nats-url", {"nats": {"url": "nats://other:4222"}}
    ),
    "nats.credentialsSecret": Entry(
        O, f"{BLD}.containers: --nats-creds and its volume", {"nats": {"credentialsSecret": "c"}}
    ),
    "nats.tlsSecret": Entry(
        O, f"{BLD}.containers: --nats-tls-* and its volume", {"nats": {"tlsSecret": "t"}}
    ),
    "nats.tlsClientCert": Entry(
        O,
        f"{BLD}.containers.container_args: --nats-tls-cert/key",
        {"nats": {"tlsSecret": "t", "tlsClientCert": False}},
        context={"nats": {"tlsSecret": "t"}},
    ),
    "tenants[].name": Entry(
        R, f"{GW}: TenantPolicy", {"tenants": [{"name": "b"}]}, context=_tenant()
    ),
    "tenants[].cacheSalt": Entry(R, f"{GW}: cache_salt", _tenant(cacheSalt="s"), context=_tenant()),
    "tenants[].weight": Entry(R, f"{GW}: weight", _tenant(weight=3), context=_tenant()),
    "tenants[].priority": Entry(
        R, f"{GW}: TenantPolicy.priority", _tenant(priority=2), context=_tenant()
    ),
    "tenants[].maxConcurrency": Entry(
        R, f"{GW}: TenantPolicy.max_concurrency", _tenant(maxConcurrency=3), context=_tenant()
    ),
    "tenants[].maxQueued": Entry(
        R, f"{GW}: TenantPolicy.max_queued", _tenant(maxQueued=5), context=_tenant()
    ),
    "tenants[].tokensPerSecond": Entry(
        R, f"{GW}: TenantPolicy.tokens_per_s", _tenant(tokensPerSecond=100.0), context=_tenant()
    ),
    "tenants[].burstTokens": Entry(
        R,
        f"{GW}: TenantPolicy.burst_tokens",
        _tenant(tokensPerSecond=100.0, burstTokens=500),
        context=_tenant(tokensPerSecond=100.0),
    ),
    "tenants[].apiKeySecret": Entry(
        O,
        f"{BLD}.containers: the gateway's key volume (and api_keys_file at its mount)",
        _tenant(apiKeySecret="keys-a"),
        context=_tenant(),
    ),
    "tenants[].apiKeysFile": Entry(
        "up",
        "launch.up.plan_up: policy_from_spec(api_keys_file=the spec's folder / file); the operator "
        "refuses it (Degraded naming spec.tenants.apiKeysFile)",
        _tenant(apiKeysFile="a.keys"),
        context=_tenant(),
    ),
    "autoscaling.minReplicas": Entry(
        O,
        f"{BLD}.build_hpa",
        {"autoscaling": {"minReplicas": 2, "maxReplicas": 3, "target": 80}},
        context={"autoscaling": {"maxReplicas": 3, "target": 80}},
    ),
    "autoscaling.maxReplicas": Entry(
        O,
        f"{BLD}.build_hpa",
        {"autoscaling": {"maxReplicas": 4, "target": 80}},
        context={"autoscaling": {"maxReplicas": 3, "target": 80}},
    ),
    "autoscaling.metric": Entry(
        O,
        f"{BLD}.build_hpa: backlog (External, the gateway's series) or cpu (Resource)",
        {"autoscaling": {"maxReplicas": 3, "target": 80, "metric": "cpu"}},
        refusal=(
            {"autoscaling": {"maxReplicas": 3, "target": 1, "metric": "wave_fill"}},
            "'backlog' or 'cpu'",
        ),
    ),
    "autoscaling.scaleUpStabilizationSeconds": Entry(
        O,
        f"{BLD}.build_hpa: behavior.scaleUp",
        {"autoscaling": {"maxReplicas": 3, "target": 80, "scaleUpStabilizationSeconds": 0}},
        context={"autoscaling": {"maxReplicas": 3, "target": 80}},
    ),
    "autoscaling.scaleDownStabilizationSeconds": Entry(
        O,
        f"{BLD}.build_hpa: behavior.scaleDown",
        {"autoscaling": {"maxReplicas": 3, "target": 80, "scaleDownStabilizationSeconds": 60}},
        context={"autoscaling": {"maxReplicas": 3, "target": 80}},
    ),
    "autoscaling.target": Entry(
        O,
        f"{BLD}.build_hpa",
        {"autoscaling": {"maxReplicas": 3, "target": 60}},
        context={"autoscaling": {"maxReplicas": 3, "target": 80}},
    ),
    "telemetry.otlpEndpoint": Entry(
        R,
        "launch.replica.telemetry_from_spec; containers env",
        {"telemetry": {"otlpEndpoint": "http://o:4317"}},
    ),
    "telemetry.samplingRatio": Entry(
        R,
        "launch.replica.telemetry_from_spec; containers env",
        {"telemetry": {"samplingRatio": 0.5}},
    ),
    "telemetry.metricsPort": Entry(
        R,
        "launch.replica.telemetry_from_spec; admission's metrics port",
        {"telemetry": {"metricsPort": 9500}},
    ),
    "restartBudget.maxRestarts": Entry(
        L, "operator.reconcile.plan: Degraded past it", {"restartBudget": {"maxRestarts": 1}}
    ),
    "restartBudget.formingTimeoutSeconds": Entry(
        L,
        "observe.ReplicaView.lost; the startup probe",
        {"restartBudget": {"formingTimeoutSeconds": 900}},
    ),
    "restartBudget.notReadySeconds": Entry(
        L, "observe.pod_disruption", {"restartBudget": {"notReadySeconds": 200}}
    ),
    "restartBudget.windowSeconds": Entry(
        L,
        "observe.replica_views: restarts counted",
        {"restartBudget": {"windowSeconds": 30000}},
        refusal=({"restartBudget": {"windowSeconds": 600}}, "re-form forever"),
    ),
    "rollout.drainTimeoutSeconds": Entry(
        O,
        f"{BLD}.build_admission_deployment: grace period",
        {"rollout": {"drainTimeoutSeconds": 5}},
    ),
    "podTemplate.priorityClassName": Entry(
        O, f"{BLD}.build_stage_statefulset", {"podTemplate": {"priorityClassName": "p"}}
    ),
    "podTemplate.schedulerName": Entry(
        O, f"{BLD}.build_stage_statefulset", {"podTemplate": {"schedulerName": "s"}}
    ),
    "podTemplate.runtimeClassName": Entry(
        O, f"{BLD}.build_stage_statefulset", {"podTemplate": {"runtimeClassName": "nvidia"}}
    ),
    "podTemplate.env": Entry(
        O, f"{BLD}.containers._env", {"podTemplate": {"env": [{"name": "X", "value": "1"}]}}
    ),
    "podTemplate.envFrom": Entry(
        O,
        f"{BLD}.containers.pod_container",
        {"podTemplate": {"envFrom": [{"secretRef": {"name": "s"}}]}},
    ),
    "topology.replicaDomainKey": Entry(
        O, f"{BLD}._replica_affinity", {"topology": {"replicaDomainKey": "h"}}
    ),
    "topology.spreadReplicasKey": Entry(
        O, f"{BLD}._replica_affinity", {"topology": {"spreadReplicasKey": "z"}}
    ),
    "topology.podGroup": Entry(O, f"{BLD}.build_pod_group", {"topology": {"podGroup": True}}),
    "networkPolicy.enabled": Entry(
        O, f"{BLD}.build_network_policies", {"networkPolicy": {"enabled": False}}
    ),
    "inferencePool.enabled": Entry(
        O,
        f"{BLD}.build_inference_pool",
        {"inferencePool": {"enabled": True, "endpointPicker": "epp"}},
    ),
    "inferencePool.endpointPicker": Entry(
        O,
        f"{BLD}.build_inference_pool: endpointPickerRef.name",
        {"inferencePool": {"enabled": True, "endpointPicker": "epp2"}},
        context={"inferencePool": {"enabled": True, "endpointPicker": "epp"}},
        refusal=({"inferencePool": {"enabled": True}}, "required with inferencePool.enabled"),
    ),
    "inferencePool.endpointPickerPort": Entry(
        O,
        f"{BLD}.build_inference_pool: endpointPickerRef.port",
        {"inferencePool": {"enabled": True, "endpointPicker": "epp", "endpointPickerPort": 9003}},
        context={"inferencePool": {"enabled": True, "endpointPicker": "epp"}},
    ),
    "inferencePool.failureMode": Entry(
        O,
        f"{BLD}.build_inference_pool: endpointPickerRef.failureMode",
        {"inferencePool": {"enabled": True, "endpointPicker": "epp", "failureMode": "FailOpen"}},
        context={"inferencePool": {"enabled": True, "endpointPicker": "epp"}},
    ),
    "networkPolicy.gatewayFrom": Entry(
        O,
        f"{BLD}.build_network_policies",
        {"networkPolicy": {"gatewayFrom": [{"namespaceSelector": {}}]}},
    ),
}


SVC = {"name": "d", "port": 8000, "podSelector": {"app": "d"}}
DB = "operator.decode_builders"
PVC_MODEL = {"model": {"name": "tiny-llama", "pvc": {"claimName": "w"}}}


def _service(**fields: Any) -> dict[str, Any]:
    """A spec patch with a decode Service reference (``SVC`` with ``fields`` over it)."""
    return {"decode": {"service": SVC | fields}}


def _pool(**fields: Any) -> dict[str, Any]:
    """A spec patch with a rendered decode pool (image v:1, ``fields`` over it) on a PVC."""
    return PVC_MODEL | {"decode": {"pool": {"image": "v:1"} | fields}}


def _pool_res(**fields: Any) -> dict[str, Any]:
    return _pool(resources=fields)


def _pool_tol(**fields: Any) -> dict[str, Any]:
    return _pool(tolerations=[{"key": "k"} | fields])


DECODE_FIELDS: dict[str, Entry] = {
    "decode.service.name": Entry(
        R,
        "api.spec.decode_urls -> GatewayConfig.decode_urls",
        _service(name="d2"),
        context=_service(),
        refusal=(_service(name="Bad_Name"), "should match pattern"),
    ),
    "decode.service.port": Entry(
        R,
        "api.spec.decode_urls -> GatewayConfig.decode_urls",
        _service(port=9000),
        context=_service(),
        refusal=(_service(port=0), "greater than or equal to 1"),
    ),
    "decode.service.podSelector": Entry(
        O,
        f"{BLD}.build_network_policies: the stages' KV transfer rule",
        _service(podSelector={"app": "e"}),
        context=_service(),
        refusal=(_service(podSelector={}), "required with networkPolicy.enabled"),
    ),
    "decode.pool.replicas": Entry(
        O, f"{DB}.build_decode_deployment", _pool(replicas=3), context=_pool()
    ),
    "decode.pool.image": Entry(
        O,
        f"{DB}.build_decode_deployment",
        _pool(image="v:2"),
        context=_pool(),
        refusal=(_pool(image=""), "at least 1 character"),
    ),
    "decode.pool.python": Entry(
        O, f"{DB}.decode_command", _pool(python="python3.12"), context=_pool()
    ),
    "decode.pool.maxModelLen": Entry(
        O, f"{DB}.decode_command", _pool(maxModelLen=2048), context=_pool()
    ),
    "decode.pool.args": Entry(
        O, f"{DB}.decode_command", _pool(args=["--seed", "1"]), context=_pool()
    ),
    "decode.pool.nodeSelector": Entry(
        O, f"{DB}.build_decode_deployment", _pool(nodeSelector={"a": "b"}), context=_pool()
    ),
    "decode.pool.resources.gpus": Entry(
        O, f"{DB}: resources, CPU settings", _pool_res(gpus=0), context=_pool()
    ),
    "decode.pool.resources.gpuResourceName": Entry(
        O, f"{DB}._resources", _pool_res(gpuResourceName="amd.com/gpu"), context=_pool()
    ),
    "decode.pool.resources.cpu": Entry(O, f"{DB}._resources", _pool_res(cpu="2"), context=_pool()),
    "decode.pool.resources.memory": Entry(
        O,
        f"{DB}._resources",
        _pool_res(memory="8Gi"),
        context=_pool(),
        refusal=(_pool_res(memory="lots"), "should match pattern"),
    ),
    "decode.pool.resources.sharedMemory": Entry(
        O, f"{DB}._volumes: /dev/shm", _pool_res(sharedMemory="2Gi"), context=_pool()
    ),
    "decode.pool.tolerations[].key": Entry(
        O, f"{DB}.build_decode_deployment", _pool_tol(), context=_pool()
    ),
    "decode.pool.tolerations[].operator": Entry(
        O, f"{DB}.build_decode_deployment", _pool_tol(operator="Exists"), context=_pool_tol()
    ),
    "decode.pool.tolerations[].value": Entry(
        O, f"{DB}.build_decode_deployment", _pool_tol(value="v"), context=_pool_tol()
    ),
    "decode.pool.tolerations[].effect": Entry(
        O, f"{DB}.build_decode_deployment", _pool_tol(effect="NoSchedule"), context=_pool_tol()
    ),
    "decode.pool.tolerations[].tolerationSeconds": Entry(
        O,
        f"{DB}.build_decode_deployment",
        _pool_tol(tolerationSeconds=5),
        context=_pool_tol(),
    ),
    "decode.pool.drainSeconds": Entry(
        O,
        f"{DB}.decode_command (--shutdown-timeout), build_decode_deployment (grace period)",
        _pool(drainSeconds=60),
        context=_pool(),
        refusal=(_pool(drainSeconds=0), "greater than or equal to 1"),
    ),
    "networkPolicy.scrapeFrom": Entry(
        O,
        f"{BLD}.build_network_policies: the decode pods' scrape rule",
        {"networkPolicy": {"scrapeFrom": []}},
        context=_pool(),
    ),
}
_AUTO = {"maxReplicas": 4, "target": 8}
for _key, _value in {
    "minReplicas": 2,
    "maxReplicas": 6,
    "metric": "waiting",
    "target": 4,
    "scaleUpStabilizationSeconds": 0,
    "scaleDownStabilizationSeconds": 60,
}.items():
    DECODE_FIELDS[f"decode.pool.autoscaling.{_key}"] = Entry(
        O,
        f"{DB}.build_decode_hpa",
        _pool(autoscaling=_AUTO | {_key: _value}),
        context=_pool(autoscaling=_AUTO),
    )
DECODE_FIELDS["decode.pool.autoscaling.minReplicas"] = dataclasses.replace(
    DECODE_FIELDS["decode.pool.autoscaling.minReplicas"],
    refusal=(
        _pool(autoscaling={"minReplicas": 5, "maxReplicas": 4, "target": 8}),
        "> maxReplicas=4",
    ),
)
DECODE_FIELDS["decode.pool.replicas"] = dataclasses.replace(
    DECODE_FIELDS["decode.pool.replicas"],
    refusal=(_pool(replicas=2, autoscaling=_AUTO), "the HPA sets the decode pods' count"),
)
FIELDS |= DECODE_FIELDS


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    found = [m for a in typing.get_args(annotation) for m in _models_in(a)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        found.append(annotation)
    return found


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list or any(
        typing.get_origin(a) is list for a in typing.get_args(annotation)
    )


def walk(model: type[BaseModel] = WavePipelineSpec, prefix: str = "") -> list[str]:
    """Every leaf field's camelCase path (``tolerations[].key``), plus the engineOptions and
    extra model.config keys the runtime reads and a ``<other>`` for each free-form map."""
    paths = []
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name)
        models = _models_in(field.annotation)
        if models:
            paths += walk(models[0], path + ("[]." if _is_list(field.annotation) else "."))
        elif path == "engineOptions":
            paths += [f"engineOptions.{k}" for k in ENGINE_OPTIONS] + ["engineOptions.<other>"]
        else:
            paths.append(path)
    if model.__name__ == "ModelConfigSpec":
        paths += [prefix + k for k in MODEL_CONFIG_EXTRA] + [prefix + "<other>"]
    return paths


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        out[key] = value
    return out


def _resolved(raw: dict[str, Any]) -> WavePipelineSpec:
    spec, issues = check_spec(raw, default_image=DEFAULTS.image, default_nats_url=DEFAULTS.nats_url)
    assert spec is not None, issues
    return spec


def read_runtime(raw: dict[str, Any]) -> str:
    spec = _resolved(_with_checkpoints(raw))
    configs = [
        c.model_dump(mode="json") for c in runtime_configs_from_spec(spec, pool="p", namespace="ns")
    ]
    gateway = gateway_config_from_spec(spec, {"pipeline": "p"}, namespace="ns").model_dump(
        mode="json"
    )
    telemetry = telemetry_from_spec(spec, {}).model_dump(mode="json")
    return json.dumps([configs, gateway, telemetry], sort_keys=True)


def read_operator(raw: dict[str, Any]) -> str:
    body = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": raw}
    result = plan(body, Observed(), 1_000_000.0, DEFAULTS)
    assert not result.issues, result.issues
    manifests = [
        a.manifest
        for a in result.actions
        if isinstance(a, Apply | Create)
        and not (a.manifest["kind"] == "ConfigMap" and "spec.json" in a.manifest.get("data", {}))
    ]
    text = json.dumps(manifests, sort_keys=True)
    return re.sub(r"\b[0-9a-f]{10}\b", "HASH", text)  # the spec hash (and names carrying it)


def _iso(now: float) -> str:
    return dt.datetime.fromtimestamp(now, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_lifecycle(raw: dict[str, Any]) -> str:
    """The replica's (phase, reason) changes through a scripted life, with their times."""
    world = World(raw)
    trace: list[tuple[int, str, str]] = []

    def step(advance_s: float) -> None:
        world.step(advance_s)
        replica = world.body["status"]["replicaStatuses"][0]
        entry = (replica["phase"], replica.get("reason") or "")
        if not trace or trace[-1][1:] != entry:
            trace.append((round(world.now - 1_000_000.0), *entry))

    world.serve_all(1)
    # 1. One stage's readiness fails (its compute loop died): NotReady since now.
    pod = world.objects[("Pod", "p-r0-1")]
    pod["status"]["conditions"] = [
        {"type": "Ready", "status": "False", "lastTransitionTime": _iso(world.now)}
    ]
    for _ in range(40):
        step(10)
    # 2. Crashes spaced 4000 s apart, the replica re-forming and serving in between.
    for _ in range(5):
        world.stop_admission(0)
        step(100)
        world.run_pods(0)
        step(1)
        step(4000)
        if ("Pod", "p-r0-0") in world.objects:
            world.crash("p-r0-0")
        step(1)
    # 3. A replica that never forms: its pods start, none becomes Ready.
    world.body["spec"] = _merge(raw, {"image": "img:2"})  # a new spec: replaced, fresh budget
    step(1)
    for _ in range(40):
        world.run_pods(0, phase="formed")
        step(600)
    return json.dumps(trace)


def read_up(raw: dict[str, Any]) -> str:
    """The tenant policies ``wavepp up`` gives its gateway (``launch.up.plan_up``: key files relative
    to the spec's folder, here ``/spec``)."""
    from wavepp.gateway.tenants import policy_from_spec

    spec = _resolved(raw)
    policies = [
        policy_from_spec(
            t, api_keys_file=str(Path("/spec") / t.api_keys_file) if t.api_keys_file else None
        ).model_dump(mode="json")
        for t in spec.tenants
    ]
    return json.dumps(policies, sort_keys=True)


READERS = {
    "runtime": read_runtime,
    "operator": read_operator,
    "lifecycle": read_lifecycle,
    "up": read_up,
}


def test_every_field_is_in_the_table() -> None:
    fields = walk()
    assert sorted(set(fields) - set(FIELDS)) == [], "fields neither honoured nor refused"
    assert sorted(set(FIELDS) - set(fields)) == [], "table entries that are no field"


@pytest.mark.parametrize("path", sorted(FIELDS))
def test_field_is_honoured_or_refused(path: str) -> None:
    entry = FIELDS[path]
    assert entry.reader or entry.refusal, path
    if entry.reader is not None:
        assert entry.change is not None
        context = _merge(BASE, entry.context or {})
        read = READERS[entry.reader]
        assert read(_merge(context, entry.change)) != read(context), (
            f"{path}: changing it changes nothing the {entry.reader} reads"
        )
    if entry.refusal is not None:
        change, text = entry.refusal
        spec, issues = check_spec(
            _merge(BASE, change), default_image="i", default_nats_url="nats://n:4222"
        )
        field = "spec." + path.split(".<")[0].replace("[]", "[0]")
        assert spec is None
        assert any(
            (i.field == field or i.field.startswith(field + ".")) and text in i.message
            for i in issues
        ), (path, issues)


def listing() -> str:
    """The table as text: one line per field, where honoured and how refused."""
    lines = []
    for path in walk():
        entry = FIELDS[path]
        honoured = f"{entry.reader}: {entry.where}" if entry.reader else "-"
        refused = f"refused: {entry.refusal[1]!r}" if entry.refusal else ""
        lines.append(f"{path:40} {honoured} {refused}".rstrip())
    return "\n".join(lines)


if __name__ == "__main__":
    print(listing())
