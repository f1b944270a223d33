"""The spec's ``decode`` section: where whole completions decode (vLLM servers with WavePP's KV
connector as ``kv_consumer``). Either an existing Service (``service``) or a pool the operator
renders (``pool``); without the section the gateway serves prefill only (``max_tokens`` 1).

The gateway's decode endpoint is :func:`decode_urls`; the stages then serve KV transfers on
``HANDOFF_PORT`` (``wavepp.api.pod``) and the stages' NetworkPolicy lets exactly the decode pods
(the pool's, or those ``service.podSelector`` names) reach that port.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from wavepp.api.spec.base import WireModel
from wavepp.api.spec.errors import SpecError
from wavepp.api.spec.parts import StabilizationWindows, Toleration

DECODE_PORT = 8000
"""The HTTP port of a rendered decode pod (vLLM's OpenAI server) and of its Service."""

MAX_DECODE_REPLICAS = 256
"""The most decode pods one pool may ask for."""

MAX_DECODE_DRAIN_S = 3600
"""Bound of ``decode.pool.drainSeconds``."""

DECODE_METRICS: dict[str, str] = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
}
"""``decode.pool.autoscaling.metric`` -> the vLLM gauge it reads (one series per engine of a
decode pod: requests in the engine's running batch, and admitted but not yet scheduled)."""

_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
_DNS_LABEL = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"


class DecodeServiceRef(WireModel):
    """An existing Service of vLLM decode servers started with WavePP's connector
    (``wavepp.api.vllm_decode``), in the pipeline's namespace."""

    name: str = Field(pattern=_DNS_LABEL, description="The Service's name (a DNS-1035 label).")
    port: int = Field(ge=1, le=65535, description="Its HTTP port (vLLM's OpenAI API).")
    pod_selector: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Labels of the decode pods behind it (a matchLabels): the stages' NetworkPolicy "
            "lets exactly these pods reach the KV transfer port. Required while "
            "networkPolicy.enabled."
        ),
    )


class DecodeResources(WireModel):
    """Resources of each rendered decode pod (requests = limits)."""

    gpus: int = Field(
        1,
        ge=0,
        le=64,
        description="GPUs of each decode pod; 0: vLLM's CPU build (its CPU settings are added).",
    )
    gpu_resource_name: str = Field("nvidia.com/gpu", min_length=1)
    cpu: str | None = Field(None, pattern=_QUANTITY, description="CPU request and limit.")
    memory: str | None = Field(None, pattern=_QUANTITY, description="Memory request and limit.")
    shared_memory: str = Field("1Gi", pattern=_QUANTITY, description="Size of /dev/shm.")


class DecodeAutoscalingSpec(StabilizationWindows):
    """A HorizontalPodAutoscaler on the decode Deployment, on a per-pod vLLM gauge averaged
    over the pool's pods."""

    min_replicas: int = Field(1, ge=1, le=MAX_DECODE_REPLICAS, description="Fewest decode pods.")
    max_replicas: int = Field(ge=1, le=MAX_DECODE_REPLICAS, description="Most decode pods.")
    metric: Literal["running", "waiting"] = Field(
        "running",
        description=(
            "running: requests in each pod's running batch (vllm:num_requests_running); "
            "waiting: requests queued in each pod (vllm:num_requests_waiting). Served to the "
            "HPA as the Pods metric vllm_num_requests_running / vllm_num_requests_waiting by "
            "the chart's prometheus-adapter rule."
        ),
    )
    target: float = Field(
        ge=0.001,
        le=100000,
        description="The metric's average per decode pod the HPA holds (requests per pod).",
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> DecodeAutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise SpecError(
                "decode.pool.autoscaling.minReplicas",
                f"{self.min_replicas} > maxReplicas={self.max_replicas}",
            )
        return self


class DecodePoolSpec(WireModel):
    """vLLM decode pods the operator renders (a Deployment ``{name}-decode`` and its Service):
    each runs ``wavepp.api.vllm_decode``'s command line on the pipeline's checkpoint."""

    replicas: int | None = Field(
        None,
        ge=0,
        le=MAX_DECODE_REPLICAS,
        description=("Decode pods; default 1. Not with autoscaling (the HPA sets the count then)."),
    )
    autoscaling: DecodeAutoscalingSpec | None = None
    drain_seconds: int = Field(
        600,
        ge=1,
        le=MAX_DECODE_DRAIN_S,
        alias="drainSeconds",
        description=(
            "How long a decode pod that is scaled down or replaced keeps decoding the "
            "requests it holds (vLLM's --shutdown-timeout, after the pod has left the "
            "Service's endpoints); requests still running then are aborted."
        ),
    )
    image: str = Field(
        min_length=1,
        description=(
            "A vLLM image in which wavepp is importable (WavePP's connector runs inside vLLM)."
        ),
    )
    python: str = Field("python3", min_length=1, description="The image's Python with vLLM.")
    resources: DecodeResources = Field(default_factory=DecodeResources)
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="vLLM's --max-model-len; default: the model's maximum position.",
    )
    args: list[str] = Field(
        default_factory=list,
        max_length=64,
        description=(
            "Extra vLLM options appended to the command line (e.g. --tensor-parallel-size 2; "
            "--skip-tokenizer-init for a checkpoint without tokenizer files)."
        ),
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Of decode pods.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Of decode pods.")

    @model_validator(mode="after")
    def _owned_settings(self) -> DecodePoolSpec:
        if any(a == "--shutdown-timeout" or a.startswith("--shutdown-timeout=") for a in self.args):
            raise SpecError(
                "decode.pool.args",
                "--shutdown-timeout is set from decode.pool.drainSeconds "
                f"(1 to {MAX_DECODE_DRAIN_S}); drop it from args",
            )
        if self.autoscaling is not None and self.replicas is not None:
            raise SpecError(
                "decode.pool.replicas",
                "with decode.pool.autoscaling the HPA sets the decode pods' count "
                f"(minReplicas={self.autoscaling.min_replicas} to "
                f"maxReplicas={self.autoscaling.max_replicas}); drop replicas",
            )
        return self

    @property
    def fixed_replicas(self) -> int | None:
        """The decode pods' count the operator sets: ``replicas`` (default 1); None with
        ``autoscaling`` (the HPA owns the count)."""
        if self.autoscaling is not None:
            return None
        return 1 if self.replicas is None else self.replicas


class DecodeSpec(WireModel):
    """Where the pipeline's whole completions decode: exactly one of ``service`` and ``pool``."""

    service: DecodeServiceRef | None = None
    pool: DecodePoolSpec | None = None

    @model_validator(mode="after")
    def _one_source(self) -> DecodeSpec:
        if (self.service is None) == (self.pool is None):
            raise SpecError(
                "decode",
                "give exactly one of decode.service (an existing Service of vLLM decode "
                "servers) and decode.pool (decode pods the operator renders)",
            )
        return self


def decode_service_name(pipeline: str) -> str:
    """The Service (and Deployment) of a rendered decode pool: ``{pipeline}-decode``."""
    return f"{pipeline}-decode"


def decode_urls(decode: DecodeSpec | None, *, pipeline: str, namespace: str) -> list[str]:
    """The gateway's ``decode_urls``: the Service of ``decode`` (the rendered pool's,
    :data:`DECODE_PORT`, or the referenced one) as ``http://NAME.NAMESPACE.svc:PORT``; none
    without a decode section."""
    if decode is None:
        return []
    if decode.service is not None:
        return [f"http://{decode.service.name}.{namespace}.svc:{decode.service.port}"]
    return [f"http://{decode_service_name(pipeline)}.{namespace}.svc:{DECODE_PORT}"]


def check_decode(spec: Any) -> None:
    """Cross-field checks of ``spec.decode`` (a WavePipelineSpec); raises :class:`SpecError`
    naming the field.

    - a pool needs the checkpoint on disk (``model.path`` or ``model.pvc``): vLLM loads it;
    - the emulated engine computes no KV, so it has nothing to hand to a decode server;
    - with ``networkPolicy.enabled`` a referenced Service needs ``podSelector``: the stages'
      policy must name the pods that may pull KV.
    """
    decode = spec.decode
    if decode is None:
        return
    if spec.engine == "emulated":
        raise SpecError(
            "decode",
            "the emulated engine computes no KV to hand to a decode server; use engine torch",
        )
    if decode.pool is not None and spec.model.path is None and spec.model.pvc is None:
        raise SpecError(
            "decode.pool",
            "vLLM loads the checkpoint: set model.path or model.pvc (random weights have no files)",
        )
    if decode.service is not None and spec.network_policy.enabled:
        if not decode.service.pod_selector:
            raise SpecError(
                "decode.service.podSelector",
                "required with networkPolicy.enabled: the labels of the decode pods the "
                "stages' NetworkPolicy lets reach the KV transfer port",
            )
