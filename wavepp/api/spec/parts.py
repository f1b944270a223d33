"""The WavePipeline spec's section models: ``spec.model``, ``resources``, ``tolerations``,
``cache``, ``scheduler``, ``nats``, ``tenants``, ``autoscaling``, ``telemetry``,
``restartBudget``, ``rollout``; the model presets' layer counts and the bounds ``MAX_REPLICAS``
and ``MAX_TENANTS``.

``WavePipelineSpec`` (``models``) holds one of each; its cross-field checks (those that need
more than one section) live there. Each model here checks only its own fields and raises
:class:`SpecError` naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from wavepp.api.spec.base import WireModel
from wavepp.api.spec.errors import SpecError

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
(docs/model-costs.md, architecture table), used with the emulated engine.
"""

MAX_REPLICAS = 256
"""Bound of ``spec.replicas`` (and ``autoscaling.maxReplicas``): pipeline copies in one pool."""
MAX_TENANTS = 1024
"""Bound of ``spec.tenants``: tenants one gateway serves."""
MAX_HOST_MEMORY_GIB_PER_GPU = 1024
"""Bound of ``cache.hostMemoryGiB`` (and ``--host-memory-gib``): the most host memory per GPU a
node can have, 8 TiB of DRAM (32 x 256 GiB DIMMs, the largest HGX H200 8-GPU servers) over 8
GPUs."""

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
    host_memory_gib: float = Field(
        0,
        alias="hostMemoryGiB",
        ge=0,
        le=MAX_HOST_MEMORY_GIB_PER_GPU,
        description=(
            "Host memory per GPU, GiB, for each stage's host KV tier (blocks evicted from the "
            "device pool, loaded back when reused); 0: no tier. A torch stage pod's memory "
            "request (and limit, if set) grows by it. Needs tensorParallelSize 1."
        ),
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


class StabilizationWindows(WireModel):
    """A HorizontalPodAutoscaler's stabilisation windows, seconds in [0, 3600]; the
    autoscaling sections of the pipeline and of its decode pool share them."""

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


class AutoscalingSpec(StabilizationWindows):
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


class TelemetrySpec(WireModel):
    """OpenTelemetry export."""

    otlp_endpoint: str | None = Field(
        None, description="OTLP endpoint; default: the operator's --default-otlp-endpoint."
    )
    sampling_ratio: float = Field(0.1, ge=0, le=1, description="Trace sampling ratio.")
    metrics_port: int = Field(9400, ge=1, le=65535, description="Prometheus port of each pod.")

    def exporter(self) -> Literal["otlp-http", "otlp-grpc", "none"]:
        """The span exporter ``otlpEndpoint`` implies: OTLP over HTTP when the endpoint is on
        port 4318 or ends in ``/v1/traces``, gRPC otherwise; ``none`` without an endpoint."""
        endpoint = self.otlp_endpoint or ""
        if not endpoint:
            return "none"
        is_http = ":4318" in endpoint or endpoint.rstrip("/").endswith("/v1/traces")
        return "otlp-http" if is_http else "otlp-grpc"


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
