"""The WavePipeline spec model: ``WavePipelineSpec`` and its cross-field checks.

Field names: Python attributes are snake_case, the wire format (CRD, JSON, YAML) is camelCase as
Kubernetes objects are; both are accepted on input, camelCase is written. The section models live
in ``parts``, engine checks in ``checks`` and ``engine_options``, the placement and network
sections in ``sections``. A few wire names differ from the attribute so that counts and units are
named (``stages`` <-> ``num_stages``, ``windowSeconds`` <-> ``window_s``). Cross-field checks
raise :class:`SpecError` naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from wavepp.api.layer_split import LayerSplitError, split_layers
from wavepp.api.spec.base import WireModel
from wavepp.api.spec.checks import check_engine
from wavepp.api.spec.decode import DecodeSpec, check_decode
from wavepp.api.spec.engine_options import check_engine_options
from wavepp.api.spec.errors import SpecError
from wavepp.api.spec.parts import (
    MAX_REPLICAS,
    MAX_TENANTS,
    MODEL_PRESET_NUM_LAYERS,
    AutoscalingSpec,
    CacheSpec,
    ModelConfigSpec,
    ModelSpec,
    NatsSpec,
    ResourcesSpec,
    RestartBudgetSpec,
    RolloutSpec,
    SchedulerSpec,
    TelemetrySpec,
    TenantSpec,
    Toleration,
)
from wavepp.api.spec.sections import (
    InferencePoolSpec,
    NetworkPolicySpec,
    PodTemplateOverlay,
    TopologySpec,
)

API_GROUP = "wavepp.dev"
API_VERSION = "v1alpha1"
KIND = "WavePipeline"
PLURAL = "wavepipelines"


class WavePipelineSpec(WireModel):
    """Desired state of a WavePipeline: a pool of ``replicas`` identical pipelines of ``stages``.

    Stage r holds a contiguous range of layers: ``layerPartition[r]`` layers, or by default a
    balanced split in which the first (layers mod stages) stages hold one more layer.
    """

    model: ModelSpec
    engine: Literal["torch", "emulated"] = "torch"
    engine_options: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Engine options: kvBlocks, maxInflight, leaseSeconds, maxBlocksPerOwner, "
            "torchThreads (both engines), seed (torch), timeScale and emulate (emulated); "
            "other keys are refused. The device comes from resources.gpusPerStage (CUDA when "
            "> 0)."
        ),
    )
    num_stages: int = Field(alias="stages", ge=1, le=64, description="Pipeline stages S.")
    layer_partition: list[Annotated[int, Field(ge=1)]] | None = Field(
        None,
        max_length=64,
        description="Layers per stage; length = stages, sum = the model's layers.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Tensor-parallel processes per stage (torch engine): each stage pod requests this "
            "many GPUs and starts one process per GPU (gloo on the CPU with gpusPerStage 0)."
        ),
    )
    num_replicas: int = Field(
        1,
        alias="replicas",
        ge=0,
        le=MAX_REPLICAS,
        description="Pipeline copies in the pool (scale subresource).",
    )
    image: str | None = Field(None, description="Container image; default: the operator's.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[str] = Field(default_factory=list)
    service_account_name: str | None = Field(None, description="For stage and admission pods.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = Field(None, description="core/v1 Affinity of stage pods.")
    topology_spread_constraints: list[dict[str, Any]] = Field(
        default_factory=list, description="core/v1 TopologySpreadConstraint list of stage pods."
    )
    cache: CacheSpec = Field(default_factory=CacheSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    nats: NatsSpec = Field(default_factory=NatsSpec)
    tenants: list[TenantSpec] = Field(default_factory=list, max_length=MAX_TENANTS)
    autoscaling: AutoscalingSpec | None = None
    telemetry: TelemetrySpec = Field(default_factory=TelemetrySpec)
    restart_budget: RestartBudgetSpec = Field(default_factory=RestartBudgetSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    pod_template: PodTemplateOverlay = Field(default_factory=PodTemplateOverlay)
    topology: TopologySpec = Field(default_factory=TopologySpec)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    inference_pool: InferencePoolSpec = Field(default_factory=InferencePoolSpec)
    decode: DecodeSpec | None = Field(
        None,
        description=(
            "Where whole completions decode: an existing Service of vLLM decode servers "
            "with WavePP's connector (service) or decode pods the operator renders (pool). "
            "Unset: the gateway serves prefill only (max_tokens 1)."
        ),
    )

    @model_validator(mode="after")
    def _check_layout(self) -> WavePipelineSpec:
        _check_cross_fields(self)
        return self

    # ---- derived views ------------------------------------------------------------------

    def num_layers(self) -> int:
        """Decoder layers of the model (``model.config.numLayers`` or the preset table).

        Raises:
            SpecError: neither is known.
        """
        num_layers = self.model.num_layers()
        if num_layers is None:
            hint = "" if not self.serves_checkpoint() else " (the operator cannot read the volume)"
            raise SpecError(
                "model.config.numLayers",
                f"layer count unknown: model.name={self.model.name!r} is not a preset "
                f"({', '.join(sorted(MODEL_PRESET_NUM_LAYERS))}); set model.config.numLayers"
                + hint,
            )
        return num_layers

    def serves_checkpoint(self) -> bool:
        """The torch engine serves a checkpoint (``model.path`` or the PVC): shape from its
        config.json, layers split by cost without ``layerPartition`` (``launch.runtime_config``)."""
        return self.engine == "torch" and (self.model.path or self.model.pvc) is not None

    def stage_layer_ranges(self) -> list[tuple[int, int]]:
        """``[(first, last), ...]`` per stage; stage r holds layers ``[first, last)``."""
        return _split(self.num_layers(), self.num_stages, self.layer_partition)

    def gpus_per_stage(self) -> int:
        """GPUs each stage pod requests (``resources.gpusPerStage``, else the TP size; 0 for
        the emulated engine, which computes nothing)."""
        if self.resources.gpus_per_stage is not None:
            return self.resources.gpus_per_stage
        return 0 if self.engine == "emulated" else self.tensor_parallel_size

    def resolved(
        self,
        *,
        default_image: str | None = None,
        default_nats_url: str | None = None,
        default_otlp_endpoint: str | None = None,
    ) -> WavePipelineSpec:
        """A copy with every default filled in: what the pipeline's processes read.

        Fills ``model.config.numLayers``, ``layerPartition`` (not for a checkpoint: its
        processes split by cost, see :meth:`serves_checkpoint`), ``model.path`` (from the PVC),
        ``model.dtype`` (torch: bfloat16 on GPUs, float32 on the CPU), ``resources.gpusPerStage``, and the image, NATS URL and OTLP endpoint from the given
        defaults when the spec leaves them out.

        Args:
            default_image: image when ``spec.image`` is unset (the operator's default).
            default_nats_url: NATS URL when ``spec.nats.url`` is unset.
            default_otlp_endpoint: OTLP endpoint when ``spec.telemetry.otlpEndpoint`` is unset.

        Returns:
            A new, validated :class:`WavePipelineSpec`; ``self`` is unchanged.

        Raises:
            SpecError: the layer count is unknown, or no image / NATS URL is given anywhere.
        """
        ranges = self.stage_layer_ranges()
        image = self.image or default_image
        if not image:
            raise SpecError("image", "no image: set spec.image or the operator's default image")
        nats_url = self.nats.url or default_nats_url
        if not nats_url:
            raise SpecError("nats.url", "no NATS URL: set spec.nats.url or the operator default")
        model_config = (self.model.config or ModelConfigSpec()).model_copy(
            update={"num_layers": self.num_layers()}
        )
        dtype = self.model.dtype
        if dtype is None and self.engine == "torch":
            dtype = "bfloat16" if self.gpus_per_stage() > 0 else "float32"
        model_path = self.model.path
        if model_path is None and self.model.pvc is not None:
            model_path = self.model.pvc.mount_path
        return self.model_copy(
            deep=True,
            update={
                "image": image,
                "layer_partition": (
                    self.layer_partition
                    if self.serves_checkpoint()
                    else [last - first for first, last in ranges]
                ),
                "model": self.model.model_copy(
                    update={"config": model_config, "path": model_path, "dtype": dtype}
                ),
                "resources": self.resources.model_copy(
                    update={"gpus_per_stage": self.gpus_per_stage()}
                ),
                "nats": self.nats.model_copy(update={"url": nats_url}),
                "telemetry": self.telemetry.model_copy(
                    update={"otlp_endpoint": self.telemetry.otlp_endpoint or default_otlp_endpoint}
                ),
            },
        )

    def to_wire(self) -> dict[str, Any]:
        """JSON-ready dict with camelCase keys and without unset optional fields."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def _split(
    num_layers: int, num_stages: int, layer_partition: list[int] | None
) -> list[tuple[int, int]]:
    """:func:`~wavepp.api.layer_split.split_layers`, its refusal as a :class:`SpecError`."""
    try:
        return split_layers(num_layers, num_stages, layer_partition)
    except LayerSplitError as exc:
        raise SpecError(exc.field, exc.message) from None


def _check_cross_fields(spec: WavePipelineSpec) -> None:
    """Checks that need several fields; raises :class:`SpecError` naming the first bad one."""
    num_layers = spec.model.num_layers()
    if num_layers is not None:
        _split(num_layers, spec.num_stages, spec.layer_partition)
    elif spec.layer_partition is not None and len(spec.layer_partition) != spec.num_stages:
        raise SpecError(
            "layerPartition",
            f"has {len(spec.layer_partition)} entries for stages={spec.num_stages}",
        )
    gpus = spec.resources.gpus_per_stage
    if gpus is not None and 0 < gpus < spec.tensor_parallel_size:
        raise SpecError(
            "resources.gpusPerStage",
            f"{gpus} GPUs cannot hold tensorParallelSize={spec.tensor_parallel_size}; "
            "use 0 (CPU) or >= tensorParallelSize",
        )
    if spec.model.path is not None and spec.model.pvc is not None:
        if not spec.model.path.startswith(spec.model.pvc.mount_path):
            raise SpecError(
                "model.path",
                f"{spec.model.path!r} is outside the PVC's mountPath {spec.model.pvc.mount_path!r}",
            )
    check_engine(spec)
    check_engine_options(spec.engine_options)
    check_decode(spec)
    budget = spec.restart_budget
    if budget.window_s is not None and budget.window_s < budget.least_window():
        raise SpecError(
            "restartBudget.windowSeconds",
            f"{budget.window_s:g} s is shorter than (maxRestarts + 1) x formingTimeoutSeconds = "
            f"{budget.least_window():g} s: a replica that hangs while forming would re-form "
            "forever without reaching Degraded; leave it unset or make it longer",
        )
    if spec.inference_pool.enabled and not spec.inference_pool.endpoint_picker:
        raise SpecError(
            "inferencePool.endpointPicker",
            "required with inferencePool.enabled: the Service of the cluster's endpoint picker",
        )
    names = [t.name for t in spec.tenants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SpecError("tenants", f"duplicate tenant names {duplicates}")
    secrets = [t.api_key_secret for t in spec.tenants if t.api_key_secret]
    shared = sorted({n for n in secrets if secrets.count(n) > 1})
    if shared:
        raise SpecError(
            "tenants.apiKeySecret",
            f"Secrets {shared} are named by more than one tenant; a key belongs to one tenant",
        )
    if spec.autoscaling is not None:
        if spec.autoscaling.min_replicas > spec.autoscaling.max_replicas:
            raise SpecError(
                "autoscaling.minReplicas",
                f"{spec.autoscaling.min_replicas} > maxReplicas={spec.autoscaling.max_replicas}",
            )
