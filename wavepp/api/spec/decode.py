"""The spec's ``decode`` section: where whole completions decode (vLLM servers with WavePP's KV
connector as ``kv_consumer``). Either an existing Service (``service``) or a pool the operator
renders (``pool``); without the section the gateway serves prefill only (``max_tokens`` 1).

The gateway's decode endpoint is :func:`decode_urls`; the stages then serve KV transfers on
``HANDOFF_PORT`` (``wavepp.api.pod``) and the stages' NetworkPolicy lets exactly the decode pods
(the pool's, or those ``service.podSelector`` names) reach that port.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from wavepp.api.spec.base import WireModel
from wavepp.api.spec.errors import SpecError
from wavepp.api.spec.parts import Toleration

__all__ = [
    "DECODE_PORT",
    "MAX_DECODE_REPLICAS",
    "DecodePoolSpec",
    "DecodeResources",
    "DecodeServiceRef",
    "DecodeSpec",
    "decode_service_name",
    "decode_urls",
]

DECODE_PORT = 8000
"""The HTTP port of a rendered decode pod (vLLM's OpenAI server) and of its Service."""

MAX_DECODE_REPLICAS = 256
"""The most decode pods one pool may ask for."""

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


class DecodePoolSpec(WireModel):
    """vLLM decode pods the operator renders (a Deployment ``{name}-decode`` and its Service):
    each runs ``wavepp.api.vllm_decode``'s command line on the pipeline's checkpoint."""

    replicas: int = Field(1, ge=0, le=MAX_DECODE_REPLICAS, description="Decode pods.")
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
