"""The KV handoff's cost model: what each stage hands to a decode instance, and how long its
network link takes to move it. Pure: no I/O, no torch, no clock (times are arguments).

**Bytes.** A prefill stage r holds the KV of its layers [f, l) for the whole prompt (the agreed
cached prefix and the computed rest); a decode instance needs every layer's KV once, so stage r
sends, for a request of P prompt tokens::

    bytes_r(P) = P * kv_token_r + state_r

    kv_token_r = sum over layers i in [f, l) of kv_bytes_per_token_i, bytes per token:
        GQA / MHA        2 * K * d_h * b          K and V of K KV heads of d_h elements
        MLA              (kv_lora + d_rope) * b   the compressed latent and the rope key
        + DSA indexer    d_I + 4                  the FP8 index key and its fp32 scale, in the
                                                  layers that run the indexer (the decode's
                                                  sparse attention picks its top-k keys with
                                                  them, so they travel)
        linear attention 0                        (KDA: no per-token KV)
    state_r = sum over layers of state_bytes_per_request_i, bytes once per request:
        KDA              H * d_k * d_v * 4 + 3 * H * d_k * (conv - 1) * 2
                         (fp32 recurrent state and the short-convolution tails of q, k, v)

with b the KV cache's bytes per element (BF16: 2). The per-layer figures are the catalogue's
``LayerCost.kv_bytes_per_token`` and ``LayerCost.state_bytes_per_request``
(``planning.published``; formulas and sources: docs/model-costs.md, "KV bytes per token").

**Tensor parallelism.** A stage of t GPUs sends ``kv_token_r`` per token over t NICs: GQA heads
are split over min(t, K) GPUs and each GPU sends its own heads; MLA's latent is replicated on
every GPU (vLLM's MLA backends: one KV head per rank), so the t GPUs split the tokens and no
byte travels twice. The stage's link is t times one GPU's.

**Link.** One FIFO link per stage (``HandoffLink``) of ``bytes_per_s`` = t x the per-GPU rate
and a fixed ``latency_s`` per transfer. Transfer k of n_k bytes, ready at s_k (its micro-batch
ended on the stage), is served after the one before it::

    start_k  = max(s_k, end_{k-1})
    end_k    = start_k + n_k / bytes_per_s      the NIC is busy until then
    landed_k = end_k + latency_s                the bytes are in the decode instance's memory

The latency does not occupy the NIC (transfers are pipelined); the decode side's ingress is
assumed not to be the bottleneck (a decode pool as wide as the prefill stages, one receiving
NIC per sending one).

**H200 figures** (``H200_RDMA``): an HGX H200 node has one 400 Gb/s NIC per GPU (NVIDIA HGX AI
Factory reference architecture for H100, H200 and B200: "2-8-9-400 ... 8 GPUs, 9 NICs at
400 Gb/s bandwidth per GPU", ConnectX / BlueField-3 SuperNICs on a rail-optimised RDMA fabric;
https://docs.nvidia.com/reference-architectures/hgx-ai-factory-h100-h200-b200/abstract.md).
400 Gb/s is 50 GB/s of line rate; the achieved fraction 0.9 (45 GB/s) and the 10 us per
transfer (one RDMA read or write of a chunk's blocks plus its completion notice) are
assumptions, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wavepp.api.layer_split import split_layers
from wavepp.runtime.planning.published import get_model
from wavepp.runtime.planning.shapes import ModelShape


@dataclass(frozen=True)
class LinkSpec:
    """One GPU's network link to the decode side.

    Attributes:
        name: what it is, in words (labels output).
        gbps_per_gpu: line rate per GPU, gigabits per second (1e9 bit/s), > 0.
        efficiency: achieved fraction of the line rate, in (0, 1].
        latency_s: fixed seconds per transfer, >= 0 (not occupying the link).

    Raises:
        ValueError: a field outside its range, naming it.
    """

    name: str
    gbps_per_gpu: float
    efficiency: float = 0.9
    latency_s: float = 10e-6

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gbps_per_gpu) and self.gbps_per_gpu > 0):
            raise ValueError(f"LinkSpec.gbps_per_gpu={self.gbps_per_gpu!r}: must be finite, > 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"LinkSpec.efficiency={self.efficiency!r}: must be in (0, 1]")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"LinkSpec.latency_s={self.latency_s!r}: must be finite, >= 0")

    @property
    def bytes_per_s_per_gpu(self) -> float:
        """Achieved bytes per second of one GPU's link: gbps_per_gpu * 1e9 / 8 * efficiency."""
        return self.gbps_per_gpu * 1e9 / 8 * self.efficiency


H200_RDMA = LinkSpec("400 Gb/s RDMA per GPU (HGX H200)", gbps_per_gpu=400.0)
"""One 400 Gb/s NIC per H200 at 0.9 of line rate, 10 us per transfer (module docstring)."""


@dataclass(frozen=True)
class StageHandoffBytes:
    """What one stage hands over per request (module docstring's formulas).

    Attributes:
        rank: the stage r.
        layers: its [first, last) decoder layers.
        kv_bytes_per_token: kv_token_r, bytes per prompt token over the stage's layers (all
            its GPUs together).
        state_bytes_per_request: state_r, bytes once per request (recurrent state).
        num_gpus: t, GPUs (and NICs) of the stage.
    """

    rank: int
    layers: tuple[int, int]
    kv_bytes_per_token: float
    state_bytes_per_request: float
    num_gpus: int = 1


def stage_handoff_bytes(
    model: str | ModelShape, *, num_stages: int, num_gpus_per_stage: int = 1
) -> list[StageHandoffBytes]:
    """Each stage's handoff bytes for the balanced layer split (``split_layers``).

    Args:
        model: a name from ``catalogue.list_models()`` or a ModelShape.
        num_stages: S, in [1, num_layers].
        num_gpus_per_stage: t >= 1 (``planning.memory`` derives it for the emulated model).

    Returns:
        S entries, stage order; their kv_bytes_per_token sum to the model's.

    Raises:
        ValueError: unknown model, num_stages outside [1, num_layers], or t < 1.
    """
    spec = get_model(model)
    if num_gpus_per_stage < 1:
        raise ValueError(f"num_gpus_per_stage={num_gpus_per_stage}: must be >= 1")
    return [
        StageHandoffBytes(
            rank=rank,
            layers=(first, last),
            kv_bytes_per_token=sum(layer.kv_bytes_per_token for layer in spec.layers[first:last]),
            state_bytes_per_request=sum(
                layer.state_bytes_per_request for layer in spec.layers[first:last]
            ),
            num_gpus=num_gpus_per_stage,
        )
        for rank, (first, last) in enumerate(split_layers(spec.num_layers, num_stages))
    ]


@dataclass(frozen=True)
class Transfer:
    """One transfer on a stage's link (times in the caller's clock, seconds).

    Attributes:
        request_id: whose KV.
        num_bytes: bytes moved.
        ready_s: when its KV was complete on the stage (the micro-batch's end).
        start_s: when the link began it (>= ready_s).
        end_s: when the link finished sending it.
        landed_s: end_s + latency: the bytes are at the decode instance.
    """

    request_id: str
    num_bytes: float
    ready_s: float
    start_s: float
    end_s: float
    landed_s: float

    @property
    def queued_s(self) -> float:
        """Seconds it waited for the link (> 0 only when the link is the bottleneck)."""
        return self.start_s - self.ready_s


class HandoffLink:
    """One stage's FIFO link to the decode side (module docstring, "Link").

    Args:
        bytes_per_s: achieved bytes per second of the stage's link (t GPUs' together), > 0.
        latency_s: fixed seconds per transfer, >= 0.

    Raises:
        ValueError: a bad rate or latency, naming it.
    """

    def __init__(self, bytes_per_s: float, latency_s: float) -> None:
        if not (math.isfinite(bytes_per_s) and bytes_per_s > 0):
            raise ValueError(f"bytes_per_s={bytes_per_s!r}: must be finite, > 0")
        if not (math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"latency_s={latency_s!r}: must be finite, >= 0")
        self.bytes_per_s = float(bytes_per_s)
        self.latency_s = float(latency_s)
        self.busy_until_s = -math.inf
        self.num_bytes = 0.0
        self.busy_s = 0.0

    @classmethod
    def of(cls, spec: LinkSpec, num_gpus: int) -> HandoffLink:
        """The link of a stage of ``num_gpus`` GPUs, each with ``spec``'s link."""
        if num_gpus < 1:
            raise ValueError(f"num_gpus={num_gpus}: must be >= 1")
        return cls(spec.bytes_per_s_per_gpu * num_gpus, spec.latency_s)

    def send(self, request_id: str, num_bytes: float, ready_s: float) -> Transfer:
        """Queue ``num_bytes`` ready at ``ready_s``; calls must come in ``ready_s`` order.

        Raises:
            ValueError: num_bytes < 0.
        """
        if not num_bytes >= 0:
            raise ValueError(f"num_bytes={num_bytes!r}: must be >= 0")
        start_s = max(ready_s, self.busy_until_s)
        service_s = num_bytes / self.bytes_per_s
        end_s = start_s + service_s
        self.busy_until_s = end_s
        self.num_bytes += num_bytes
        self.busy_s += service_s
        return Transfer(request_id, num_bytes, ready_s, start_s, end_s, end_s + self.latency_s)


@dataclass(frozen=True)
class HandoffModel:
    """The handoff of a pipeline: every stage's link and bytes.

    Attributes:
        link: one GPU's link (each stage has ``num_gpus`` of them).
        stages: per stage, what it sends (``stage_handoff_bytes``), stage order.
    """

    link: LinkSpec
    stages: tuple[StageHandoffBytes, ...]

    def stage_link(self, rank: int) -> HandoffLink:
        """A fresh link for stage ``rank``: ``link`` times the stage's GPUs."""
        return HandoffLink.of(self.link, self.stages[rank].num_gpus)
