"""The WavePipeline spec models: ``WavePipelineSpec`` and its parts, and the layer split.

Field names: Python attributes are snake_case, the wire format (CRD, JSON, YAML) is camelCase as
Kubernetes objects are; both are accepted on input, camelCase is written. Engine checks live in
``checks`` and ``engine_options``, the placement and network sections in ``sections``. A few wire
names differ from the attribute so that counts and units are named (``stages`` <-> ``num_stages``,
``windowSeconds`` <-> ``window_s``). Cross-field checks raise :class:`SpecError` naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from wavepp.api.spec.base import WireModel
from wavepp.api.spec.checks import check_engine
from wavepp.api.spec.engine_options import check_engine_options
from wavepp.api.spec.errors import SpecError
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

MODEL_PRESET_NUM_LAYERS: dict[str, int] = {
    "tiny-llama": 8,
    "small-llama": 8,
    "glm-5.2": 78,
    "minimax-m2.7": 62,
    "kimi-k3": 93,
    "deepseek-v3.2": 61,
}
"""Decoder layers of the models a spec may name without ``model.config.numLayers``.

NOTE: tiny-llama and small-llama are the torch engine's presets
(``wavepp.runtime.model_config.PRESETS``; api may not import runtime, a test checks the
two agree). The others are ``num_hidden_layers`` of the paper's models, without MTP layers
(shared/models.md, architecture table), used with the emulated engine.
"""

MAX_REPLICAS = 256
"""Bound of ``spec.replicas`` (and ``autoscaling.maxReplicas``): pipeline copies in one pool."""
MAX_TENANTS = 1024
"""Bound of ``spec.tenants``: tenants one gateway serves."""

_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class PVCSource(WireModel):
    """A PersistentVolumeClaim that holds the model weights, mounted into every stage pod."""

    claim_name: str = Field(min_length=1, description="Name of the PVC (same namespace).")
    sub_path: str | None = Field(None, description="Directory inside the volume to mount.")
    mount_path: str = Field("/models", description="Where the volume appears in the container.")


class ModelConfigSpec(WireModel):
    """Model shape; unknown keys pass through to the engine (e.g. ``ropeTheta``)."""

    model_config = ConfigDict(extra="allow")

    num_layers: int | None = Field(None, ge=1, description="Decoder layers of the model.")
    hidden_size: int | None = Field(None, ge=1)
    intermediate_size: int | None = Field(None, ge=1)
    num_heads: int | None = Field(None, ge=1, description="Query heads.")
    num_kv_heads: int | None = Field(None, ge=1, description="Key/value heads (GQA).")
    head_dim: int | None = Field(None, ge=1)
    vocab_size: int | None = Field(None, ge=1)


class ModelSpec(WireModel):
    """Which model the pipeline serves and where its weights are."""

    name: str = Field(
        min_length=1,
        description=(
            "Model id: a preset (tiny-llama, small-llama, glm-5.2, ...) or any name when "
            "config.numLayers is given. Also seeds the block-hash chain."
        ),
    )
    path: str | None = Field(
        None,
        description=(
            "Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json) as "
            "the pods see it; default: the PVC's mountPath. Shape from its config.json (a "
            "disagreeing model.config field is refused), layers split by cost without "
            "layerPartition. Without path and pvc: seeded random Llama weights. Refused for "
            "the emulated engine."
        ),
    )
    pvc: PVCSource | None = None
    config: ModelConfigSpec | None = None
    dtype: Literal["float32", "float16", "bfloat16"] | None = Field(
        None,
        description=(
            "Compute dtype of the torch engine. Default: bfloat16 when the stages get GPUs, "
            "float32 on the CPU (the only dtype the CPU path computes in; others are refused "
            "there). The emulated engine computes nothing: leave it unset."
        ),
    )

    def num_layers(self) -> int | None:
        """Layer count from ``config.numLayers``, else from the preset table; None if unknown."""
        if self.config is not None and self.config.num_layers is not None:
            return self.config.num_layers
        return MODEL_PRESET_NUM_LAYERS.get(self.name)


class ResourcesSpec(WireModel):
    """Per stage pod resources."""

    gpus_per_stage: int | None = Field(
        None,
        ge=0,
        description=(
            "GPUs requested by each stage pod (default: tensorParallelSize for torch, 0 for "
            "emulated); torch: 0 or tensorParallelSize. > 0: the stage computes on CUDA, one "
            "GPU per tensor-parallel process, and refuses to start without them; 0: on the CPU."
        ),
    )
    gpu_resource_name: str = Field("nvidia.com/gpu", min_length=1)
    cpu: str | None = Field(None, pattern=_QUANTITY, description="CPU request and limit.")
    memory: str | None = Field(None, pattern=_QUANTITY, description="Memory request and limit.")
    shared_memory: str = Field(
        "1Gi", pattern=_QUANTITY, description="Size of /dev/shm (NCCL and gloo use it)."
    )


class Toleration(WireModel):
    """A Kubernetes toleration (core/v1 Toleration)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class CacheSpec(WireModel):
    """KV cache geometry."""

    block_size: int = Field(16, ge=1, le=4096, description="Tokens per KV block.")
    memory_per_stage_bytes: int | None = Field(
        None, ge=1, description="KV cache memory of each stage in bytes (default: engine's)."
    )


class SchedulerSpec(WireModel):
    """Admission and chunking policy."""

    mode: Literal["wave", "sync"] = Field(
        "wave", description="wave: WavePP (agreement off the critical path); sync: baseline."
    )
    chunk_policy: Literal["dynamic", "static"] | None = Field(
        None, description="dynamic: equal cost per micro-batch; static: chunkTokens each."
    )
    chunk_tokens: int = Field(8192, ge=1, description="Static chunk budget in tokens.")


class NatsSpec(WireModel):
    """NATS connection of the pipeline's processes."""

    url: str | None = Field(
        None, description="nats://host:port; default: the operator's --default-nats-url."
    )
    credentials_secret: str | None = Field(
        None, pattern=_DNS_LABEL, description="Secret with key 'creds' (a NATS .creds file)."
    )
    tls_secret: str | None = Field(
        None,
        pattern=_DNS_LABEL,
        description=(
            "Secret with 'ca.crt' (the CA that signed the NATS server's certificate) and, for "
            "mutual TLS, 'tls.crt' and 'tls.key' (the layout cert-manager writes). Set: every "
            "pipeline process connects over TLS and verifies the server."
        ),
    )
    tls_client_cert: bool = Field(
        True, description="With tlsSecret: present tls.crt/tls.key to the server (mutual TLS)."
    )


class TenantSpec(WireModel):
    """One tenant of the gateway: cache salt, share, limits, and its API keys.

    The gateway enforces every field (``wavepp.gateway.tenants``, ``wavepp.gateway.auth``). When
    any tenant has API keys, every request needs a key and is served as the key's tenant.
    """

    name: str = Field(pattern=_DNS_LABEL)
    cache_salt: str | None = Field(
        None, description="Seed of the tenant's block hashes; equal salts share cached blocks."
    )
    weight: int = Field(1, ge=1, description="Share of admissions under contention.")
    priority: int = Field(
        0,
        ge=-100,
        le=100,
        description=(
            "Strict priority between tenants: a waiting request of a higher-priority tenant is "
            "served before any of a lower one; equal priorities share by weight."
        ),
    )
    max_concurrency: int | None = Field(
        None, ge=1, description="Requests queued or running at once; past it 429."
    )
    max_queued: int | None = Field(
        None, ge=0, description="Requests waiting for a slot in the gateway; past it 429."
    )
    tokens_per_s: float | None = Field(
        None,
        gt=0,
        alias="tokensPerSecond",
        description="Prompt tokens per second (token bucket); past it 429 with Retry-After.",
    )
    burst_tokens: int | None = Field(
        None,
        ge=1,
        description="Token bucket size (default: one second's worth, at least one prompt).",
    )
    api_key_secret: str | None = Field(
        None,
        pattern=_DNS_LABEL,
        description=(
            "Secret whose 'keys' entry lists the tenant's API keys (one per line, "
            "'sha256:<hex>' or the key; optional 'not-after=<time>'); mounted into the gateway "
            "pod, re-read when it changes. Kubernetes only."
        ),
    )
    api_keys_file: str | None = Field(
        None,
        min_length=1,
        description=(
            "File with the tenant's API keys, same format as the Secret's 'keys'; relative to "
            "the spec file. wavepp up only (the operator refuses it: use apiKeySecret)."
        ),
    )

    @model_validator(mode="after")
    def _one_key_source(self) -> TenantSpec:
        if self.api_key_secret is not None and self.api_keys_file is not None:
            raise SpecError(
                "tenants.apiKeySecret",
                f"tenant {self.name!r}: give apiKeySecret (Kubernetes) or apiKeysFile "
                "(wavepp up), not both",
            )
        return self


class AutoscalingSpec(WireModel):
    """HorizontalPodAutoscaler on the pipeline's scale subresource."""

    min_replicas: int = Field(1, ge=1, le=MAX_REPLICAS)
    max_replicas: int = Field(ge=1, le=MAX_REPLICAS)
    metric: Literal["backlog", "cpu"] = Field(
        "backlog",
        description=(
            "backlog: the pool's requests queued or running in its gateway "
            "(wavepp_gateway_backlog_requests{pool}, an External metric served by the chart's "
            "prometheus-adapter rule), target = requests per replica. cpu: average utilisation "
            "in percent of the stage pods' CPU request."
        ),
    )
    target: float = Field(
        gt=0,
        description="backlog: requests per replica; cpu: average utilisation in percent.",
    )
    scale_up_window_s: int = Field(
        30,
        ge=0,
        le=3600,
        alias="scaleUpStabilizationSeconds",
        description="HPA scale-up stabilisation window (a burst does not add replicas at once).",
    )
    scale_down_window_s: int = Field(
        300,
        ge=0,
        le=3600,
        alias="scaleDownStabilizationSeconds",
        description="HPA scale-down stabilisation window (a lull does not remove replicas).",
    )


class TelemetrySpec(WireModel):
    """OpenTelemetry export."""

    otlp_endpoint: str | None = Field(
        None, description="OTLP endpoint; default: the operator's --default-otlp-endpoint."
    )
    sampling_ratio: float = Field(0.1, ge=0, le=1, description="Trace sampling ratio.")
    metrics_port: int = Field(9400, ge=1, le=65535, description="Prometheus port of each pod.")


class RestartBudgetSpec(WireModel):
    """How many re-formations a replica may need before the operator stops it."""

    max_restarts: int = Field(3, ge=0, description="Re-formations allowed within the window.")
    forming_timeout_s: float = Field(
        1800.0,
        ge=1,
        le=86400,
        alias="formingTimeoutSeconds",
        description=(
            "A replica whose stages are not all Ready this long after it was created or last "
            "re-formed counts as failed (a hang while forming); also the stage pods' startup "
            "probe budget (seconds)."
        ),
    )
    not_ready_s: float = Field(
        60.0,
        ge=1,
        alias="notReadySeconds",
        description=(
            "A formed stage pod that stays NotReady this long (its compute loop died, or its "
            "node went NotReady) counts as failed: the replica re-forms (seconds)."
        ),
    )
    window_s: float | None = Field(
        None,
        gt=0,
        alias="windowSeconds",
        description=(
            "Window in seconds. Default: (maxRestarts + 1) x formingTimeoutSeconds, the least "
            "in which maxRestarts + 1 hangs while forming fit (a shorter one is refused)."
        ),
    )

    def window(self) -> float:
        """The budget window in seconds: ``windowSeconds``, else the least that counts hangs."""
        return self.window_s if self.window_s is not None else self.least_window()

    def least_window(self) -> float:
        """(maxRestarts + 1) x formingTimeoutSeconds: the shortest window in which the
        re-formations of a replica that hangs while forming exceed the budget."""
        return (self.max_restarts + 1) * self.forming_timeout_s


class RolloutSpec(WireModel):
    """Replacement of replicas on spec changes and scale-down."""

    drain_timeout_s: float = Field(
        60.0,
        ge=0,
        alias="drainTimeoutSeconds",
        description=(
            "Grace period of a leaving replica's admission controller (seconds): admitted "
            "requests finish within it, then the replica is replaced."
        ),
    )


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
            "Engine options: kvBlocks, maxInflight, leaseSeconds, torchThreads (both engines), "
            "seed (torch), timeScale and emulate (emulated); other keys are refused. The "
            "device comes from resources.gpusPerStage (CUDA when > 0)."
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
        config.json, layers split by cost without ``layerPartition`` (``from_spec``)."""
        return self.engine == "torch" and (self.model.path or self.model.pvc) is not None

    def stage_layer_ranges(self) -> list[tuple[int, int]]:
        """``[(first, last), ...]`` per stage; stage r holds layers ``[first, last)``."""
        return split_layers(self.num_layers(), self.num_stages, self.layer_partition)

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


def split_layers(
    num_layers: int, num_stages: int, layer_partition: list[int] | None = None
) -> list[tuple[int, int]]:
    """Split ``num_layers`` into contiguous per-stage ranges (same rule as the runtime).

    Args:
        num_layers: decoder layers of the model (>= num_stages).
        num_stages: stages S (>= 1).
        layer_partition: optional layers per stage (length S, each >= 1, sum num_layers).

    Returns:
        ``[(first, last), ...]`` of length S; the balanced split gives the first
        ``num_layers % S`` stages one more layer.

    Raises:
        SpecError: naming ``stages`` or ``layerPartition``.
    """
    if num_stages > num_layers:
        raise SpecError(
            "stages",
            f"stages={num_stages} exceeds the model's {num_layers} layers; every stage needs "
            f"at least one layer: use stages <= {num_layers}",
        )
    if layer_partition is None:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if r < extra else 0) for r in range(num_stages)]
    else:
        counts = list(layer_partition)
        if len(counts) != num_stages:
            raise SpecError(
                "layerPartition",
                f"has {len(counts)} entries for stages={num_stages}; give one count per stage",
            )
        if any(c < 1 for c in counts):
            raise SpecError("layerPartition", f"{counts}: every stage needs >= 1 layer")
        if sum(counts) != num_layers:
            raise SpecError(
                "layerPartition",
                f"{counts} sums to {sum(counts)} layers; the model has {num_layers}",
            )
    ranges = []
    first = 0
    for count in counts:
        ranges.append((first, first + count))
        first += count
    return ranges


def _check_cross_fields(spec: WavePipelineSpec) -> None:
    """Checks that need several fields; raises :class:`SpecError` naming the first bad one."""
    num_layers = spec.model.num_layers()
    if num_layers is not None:
        split_layers(num_layers, spec.num_stages, spec.layer_partition)
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
