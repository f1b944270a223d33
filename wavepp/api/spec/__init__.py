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

The package: ``models`` (``WavePipelineSpec``, its cross-field checks; the layer split is
``wavepp.api.layer_split``'s),
``parts`` (the section models: model, resources, cache, scheduler, NATS, tenants, autoscaling,
telemetry, restart budget, rollout; the bounds ``MAX_REPLICAS``, ``MAX_TENANTS`` and
``MAX_HOST_MEMORY_GIB_PER_GPU``), ``errors`` (:class:`SpecError`), ``base`` (the wire base class),
``engine_options`` (the free-form ``engineOptions``' keys, types and bounds), ``checks`` (what
the engines honour: which engine reads which option, emulated models, TP, dtype per device),
``decode`` (the ``decode`` section: a decode Service or pool, the gateway's decode URLs),
``sections`` (pod overlay, topology, NetworkPolicies, InferencePool), ``status`` (the status
models, ``CONFIG_EXIT_CODE``), ``loading`` (:func:`load_spec_file`, :func:`check_spec`,
:class:`SpecIssue`; every failure one line naming the field, infinities and NaN refused
anywhere). Import from ``wavepp.api.spec``.
"""

from wavepp.api.spec.checks import EMULATED_MODELS, ENGINE_OPTIONS, MODEL_CONFIG_EXTRA
from wavepp.api.spec.decode import (
    DECODE_METRICS,
    DECODE_PORT,
    decode_service_name,
    decode_urls,
)
from wavepp.api.spec.loading import (
    SpecFileError,
    SpecIssue,
    check_spec,
    load_spec_file,
    read_spec_mapping,
)
from wavepp.api.spec.models import (
    API_GROUP,
    API_VERSION,
    KIND,
    PLURAL,
    SpecError,
    WavePipelineSpec,
)
from wavepp.api.spec.parts import (
    MAX_HOST_MEMORY_GIB_PER_GPU,
    MAX_REPLICAS,
    MAX_TENANTS,
    MODEL_PRESET_NUM_LAYERS,
    TenantSpec,
)
from wavepp.api.spec.status import (
    CONFIG_EXIT_CODE,
    ReplicaStatus,
    StageStatus,
    WavePipelineStatus,
)

__all__ = [
    "API_GROUP",
    "DECODE_METRICS",
    "DECODE_PORT",
    "decode_service_name",
    "decode_urls",
    "CONFIG_EXIT_CODE",
    "API_VERSION",
    "KIND",
    "MAX_HOST_MEMORY_GIB_PER_GPU",
    "MAX_REPLICAS",
    "MAX_TENANTS",
    "EMULATED_MODELS",
    "ENGINE_OPTIONS",
    "MODEL_CONFIG_EXTRA",
    "MODEL_PRESET_NUM_LAYERS",
    "PLURAL",
    "ReplicaStatus",
    "SpecError",
    "SpecFileError",
    "SpecIssue",
    "StageStatus",
    "TenantSpec",
    "WavePipelineSpec",
    "WavePipelineStatus",
    "check_spec",
    "load_spec_file",
    "read_spec_mapping",
]
