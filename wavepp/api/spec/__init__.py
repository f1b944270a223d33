"""WavePipeline spec and status: the one model behind the CRD, the operator and ``wavepp up``.

The custom resource ``WavePipeline`` (group ``wavepp.dev``, version ``v1alpha1``) has
``spec: WavePipelineSpec`` and ``status: WavePipelineStatus``. The CRD in ``crds/`` is generated
from these classes (``python -m wavepp.operator.crdgen``); a test fails when the two drift.
``wavepp up --config FILE`` reads the same ``WavePipelineSpec`` from JSON or YAML.

Field names: Python attributes are snake_case, the wire format (CRD, JSON, YAML) is camelCase as
Kubernetes objects are; both are accepted on input, camelCase is written. A few wire names differ
from the attribute so that counts and units are named (``stages`` <-> ``num_stages``,
``windowSeconds`` <-> ``window_s``).

Validation happens in three places, each catching what it can:

1. the CRD's openAPIV3Schema (types, enums, minimums, a few CEL rules): the API server rejects;
2. :class:`WavePipelineSpec` itself (cross-field checks that need the layer count, e.g. a
   partition that does not sum to the model's layers): :class:`SpecError` names the field;
3. :meth:`WavePipelineSpec.resolved`: defaults that come from the operator (image, NATS URL).

:func:`check_spec` runs 2 and 3 and returns every problem as a :class:`SpecIssue` with the field
path (``spec.layerPartition``), which the operator writes into the pipeline's conditions.

The package: ``models`` (the spec models, the layer split), ``base`` (:class:`SpecError`, the
wire base class), ``checks`` (what the engines honour), ``sections`` (pod overlay, topology,
NetworkPolicies), ``status`` (the status models), ``loading`` (:func:`load_spec_file`, :func:`check_spec`, :class:`SpecIssue`).
Import from ``wavepp.api.spec``.
"""

from wavepp.api.spec.checks import EMULATED_MODELS, ENGINE_OPTIONS, MODEL_CONFIG_EXTRA
from wavepp.api.spec.loading import SpecIssue, check_spec, load_spec_file
from wavepp.api.spec.models import (
    API_GROUP,
    API_VERSION,
    KIND,
    MODEL_PRESET_NUM_LAYERS,
    PLURAL,
    AutoscalingSpec,
    CacheSpec,
    ModelConfigSpec,
    ModelSpec,
    NatsSpec,
    PVCSource,
    ResourcesSpec,
    RestartBudgetSpec,
    RolloutSpec,
    SchedulerSpec,
    SpecError,
    TelemetrySpec,
    TenantSpec,
    Toleration,
    WavePipelineSpec,
    split_layers,
)
from wavepp.api.spec.sections import (
    InferencePoolSpec,
    NetworkPolicySpec,
    PodTemplateOverlay,
    TopologySpec,
)
from wavepp.api.spec.status import (
    CONFIG_EXIT_CODE,
    Condition,
    ReplicaStatus,
    StageStatus,
    WavePipelineStatus,
)

__all__ = [
    "API_GROUP",
    "CONFIG_EXIT_CODE",
    "API_VERSION",
    "KIND",
    "EMULATED_MODELS",
    "ENGINE_OPTIONS",
    "MODEL_CONFIG_EXTRA",
    "MODEL_PRESET_NUM_LAYERS",
    "PLURAL",
    "AutoscalingSpec",
    "CacheSpec",
    "Condition",
    "ModelConfigSpec",
    "ModelSpec",
    "InferencePoolSpec",
    "NatsSpec",
    "NetworkPolicySpec",
    "PodTemplateOverlay",
    "PVCSource",
    "ReplicaStatus",
    "ResourcesSpec",
    "RestartBudgetSpec",
    "RolloutSpec",
    "SchedulerSpec",
    "SpecError",
    "SpecIssue",
    "StageStatus",
    "TelemetrySpec",
    "TenantSpec",
    "Toleration",
    "TopologySpec",
    "WavePipelineSpec",
    "WavePipelineStatus",
    "check_spec",
    "load_spec_file",
    "split_layers",
]
